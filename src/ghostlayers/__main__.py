"""``python -m ghostlayers``: the command line."""

from ghostlayers.cli import app

app(prog_name="ghostlayers")

"""Pruning and repairing: held-out choices (choices), the pipeline (pipeline), the guard, healing (heal) and the
checks of a run's settings (checks)."""

"""Other libraries' lines kept off the terminal: lm-eval, transformers, datasets, PEFT and accelerate log
warnings about how they were called (a model object passed to lm-eval, metric defaults, loading notes) that say
nothing about the user's run. A normal run shows only ghostlayers' own lines, progress bars and errors; ``--verbose``
shows theirs too. Light on purpose: the command line sets this before the libraries are imported."""

from __future__ import annotations

import logging
import os
import warnings

OTHERS = ("lm_eval", "transformers", "datasets", "peft", "accelerate", "huggingface_hub", "torch")
ENVIRONMENT = {"TRANSFORMERS_VERBOSITY": "error", "DATASETS_VERBOSITY": "error", "LMEVAL_LOG_LEVEL": "ERROR"}


def quiet_others(verbose: bool = False) -> None:
    """Below an error, the other libraries' log records and warnings go nowhere, unless ``verbose``."""
    if verbose:
        return
    for name, value in ENVIRONMENT.items():  # read by each library when it sets up its own logging
        os.environ.setdefault(name, value)
    for name in OTHERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in OTHERS:
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")

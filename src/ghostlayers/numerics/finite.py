"""The finiteness check made where numbers are born (calibration statistics, operators, loaded weights)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ghostlayers.errors import GhostLayersError


def check_finite(values: Mapping[str, Tensor | None], where: str, cause: str) -> None:
    """Stop with a message naming ``where`` and the likely ``cause`` when any value is NaN or infinite."""
    bad = [name for name, value in values.items() if value is not None and not bool(torch.isfinite(value).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise GhostLayersError(f"{where}: {shown} hold NaN or infinite values. {cause}")

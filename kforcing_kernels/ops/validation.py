"""Argument checks shared by the ops, so that every op refuses the same input with the same message."""

from __future__ import annotations

import math
import numbers
from typing import Optional


def check_scale(scale) -> Optional[float]:
    """``scale`` as a float (None passes): a positive finite real number, numpy scalars included; else ValueError."""
    if scale is None:
        return None
    # numbers.Real takes numpy floats too; a bool is a number by accident, not a scale.
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)) or float(scale) <= 0:
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    return float(scale)

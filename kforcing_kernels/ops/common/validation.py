"""Argument checks shared by the ops, so that every op refuses the same input with the same message."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

# The dtypes the attention ops (window_attention, paged_attention) take.
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, rank: int, dtypes: tuple, shape: str = "") -> None:
    """ValueError naming ``name`` unless ``t`` is a tensor of rank ``rank`` with a dtype in ``dtypes`` (``shape``:
    the expected shape's letters for the message, e.g. ``" [B, H, L, D]"``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}{shape}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")


def check_scale(scale) -> Optional[float]:
    """``scale`` as a float (None passes): a positive finite real number, numpy scalars included; else ValueError."""
    if scale is None:
        return None
    # numbers.Real takes numpy floats too; a bool is a number by accident, not a scale. Comparisons, not
    # math.isfinite: under torch.compile(dynamic=True) a float argument is a SymFloat, which dynamo can
    # compare (a guard) but not pass to math.isfinite. NaN fails both comparisons.
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat)):
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    value = float(scale)
    if not (value > 0 and value < math.inf):
        if isinstance(scale, torch.SymFloat) or torch.compiler.is_compiling():  # dynamo cannot format a SymFloat
            raise ValueError("scale: expected a positive finite number or None, got a value outside (0, inf)")
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    return value

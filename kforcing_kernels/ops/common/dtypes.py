"""Dtypes the ops share: what an op accumulates in and returns its log-sum-exp in."""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / LSE dtype for inputs of ``dtype``: fp64 stays fp64, all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32

"""Triton backend of the sampler (``triton_kernels.py``): the C++ algorithm on CUDA tensors.

Compiled on CUDA, or in Triton's interpreter on CPU tensors under ``TRITON_INTERPRET=1`` (set before
triton is first imported). Rows without a distribution are refused before the kernels run, with the
reference's check.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .reference import check_rows

_KERNELS = "kforcing_kernels.ops.sampling.triton_kernels"


def available() -> Optional[str]:
    try:
        kernels = importlib.import_module(_KERNELS)
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    return kernels.available()


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    check_rows(logits, tau)
    return importlib.import_module(_KERNELS).inverse_cdf_sample(logits, z, tau)


def noise_inversion(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    check_rows(logits, tau)
    return importlib.import_module(_KERNELS).noise_inversion(logits, tokens, tau, u)

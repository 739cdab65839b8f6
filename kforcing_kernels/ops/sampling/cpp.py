"""C++ backend of the sampler (``kforcing_kernels._C``, csrc/kf_isa_impl.h): float64 math, CPU tensors.

One pass over each row computes per-block (max, sum of exp), then a walk over the block totals and
one block; the ``[..., V]`` cumulative sum is never stored. The kernels refuse rows without a
distribution in the same pass. Absent (with the reason) when the extension is not built.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import _extension


def available() -> Optional[str]:
    return _extension.reason()


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return _extension.require().inverse_cdf_sample(logits, z, tau)


def noise_inversion(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _extension.require().noise_inversion(logits, tokens, tau, u)

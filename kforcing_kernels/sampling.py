"""Inverse-CDF sampling with temperature (the push-forward sampler) and its inverse.

Convention (DESIGN.md §5): ``token = min{v : F(v) > z}`` where F is the cumulative
sum of ``softmax(logits / tau)`` over the vocabulary, clamped to ``V - 1`` so that
rounding in the cumulative sum never yields an out-of-range id.

This module holds the torch reference implementation; faster fused versions
(C++ for CPU, Triton for CUDA) plug in behind the same functions.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Temperature = Union[float, torch.Tensor]


def _check(logits: torch.Tensor, other: torch.Tensor, other_name: str, temperature: Temperature) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() < 1:
        raise ValueError(f"logits: expected a floating tensor [..., V], got {getattr(logits, 'shape', type(logits))}")
    if other.shape != logits.shape[:-1]:
        raise ValueError(f"{other_name}: expected shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(other.shape)}")
    tau = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if tau.dim() and tau.shape != logits.shape[:-1]:
        raise ValueError(f"temperature: expected a scalar or shape {tuple(logits.shape[:-1])}, got {tuple(tau.shape)}")
    if not bool((tau > 0).all()):
        raise ValueError("temperature: expected values > 0")
    return tau


def _cdf(logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    scaled = logits.to(torch.float32) / (tau[..., None] if tau.dim() else tau)
    return torch.softmax(scaled, -1).cumsum(-1)


def inverse_cdf_sample_reference(logits: torch.Tensor, z: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """softmax + cumsum + searchsorted; materialises the [..., V] CDF."""
    tau = _check(logits, z, "z", temperature)
    cdf = _cdf(logits, tau)
    ids = torch.searchsorted(cdf, z.to(cdf.dtype)[..., None].contiguous(), right=True)[..., 0]
    return ids.clamp_(max=logits.shape[-1] - 1)


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """Token ids ``[...]`` (int64) with ``token = min{v : F(v) > z}`` of ``softmax(logits / tau)``.

    Args:
        logits: ``[..., V]`` float.
        z: ``[...]`` uniform noise in [0, 1).
        temperature: scalar or ``[...]``, > 0.
    """
    return inverse_cdf_sample_reference(logits, z, temperature)


def noise_inversion(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature = 1.0, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """z uniform inside each token's CDF bin ``[F(t-1), F(t))`` (the PTP baseline).

    Sampling that z with :func:`inverse_cdf_sample` gives ``tokens`` back
    (up to bins of zero width, which hold no probability mass).
    """
    tau = _check(logits, tokens, "tokens", temperature)
    cdf = _cdf(logits, tau)
    t = tokens.long()[..., None]
    upper = cdf.gather(-1, t)[..., 0]
    lower = torch.where(t[..., 0] > 0, cdf.gather(-1, (t - 1).clamp(min=0))[..., 0], torch.zeros_like(upper))
    u = torch.rand(tokens.shape, generator=generator, device=logits.device if generator is None else generator.device)
    z = lower + u.to(lower.device) * (upper - lower)
    # Stay strictly below the bin's upper edge so the round trip lands in the bin.
    return torch.minimum(z, torch.nextafter(upper, torch.zeros_like(upper))).clamp(min=0.0)

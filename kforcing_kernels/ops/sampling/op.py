"""Inverse-CDF sampling with temperature (the push-forward sampler) and its inverse.

Convention (docs/DESIGN.md §5): ``token = min{v : F(v) > z}`` where F is the cumulative
sum of ``softmax(logits / tau)`` over the vocabulary, clamped to ``V - 1`` so that
rounding in the cumulative sum never yields an out-of-range id.

Implementations, picked by device (:func:`sampler_backend` says which one runs):

* ``cpp`` (CPU, ``kforcing_kernels._C``): float64 math, one pass over each row
  computing per-block (max, sum of exp), then a walk over the block totals and one
  block; the [..., V] cumulative sum is never stored.
* ``triton`` (CUDA): the same algorithm as a Triton kernel
  (``kforcing_kernels.ops.sampling.triton_kernels``).
* ``reference``: softmax + cumsum + searchsorted in torch, float64. The fallback
  when neither of the above is available.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ... import _extension

Temperature = Union[float, torch.Tensor]


def _check(logits: torch.Tensor, other: torch.Tensor, other_name: str, temperature: Temperature) -> torch.Tensor:
    """Validates the arguments, identically for every backend; returns the temperature as a tensor.

    ``other`` is ``z`` (floating, every value in [0, 1)) or ``tokens`` (integer ids in
    [0, V)). Rows without a distribution are refused by :func:`_check_rows` (the
    cpp kernels check those themselves, in the same pass that samples).
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() < 1:
        raise ValueError(f"logits: expected a floating tensor [..., V], got {getattr(logits, 'shape', type(logits))}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not isinstance(other, torch.Tensor):
        raise ValueError(f"{other_name}: expected a tensor of shape {tuple(logits.shape[:-1])}, got {type(other).__name__}")
    if other.shape != logits.shape[:-1]:
        raise ValueError(f"{other_name}: expected shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(other.shape)}")
    if other.device != logits.device:
        raise ValueError(f"{other_name}: expected device {logits.device} (logits'), got {other.device}")
    if other_name == "z":
        if not other.dtype.is_floating_point:
            raise ValueError(f"z: expected a floating dtype, got {other.dtype}")
        outside = ~((other >= 0) & (other < 1))  # NaN is outside too
        if bool(outside.any()):
            raise ValueError(f"z: expected values in [0, 1), got {other[outside].flatten()[0].item()}")
    else:
        if other.dtype.is_floating_point or other.dtype.is_complex or other.dtype == torch.bool:
            raise ValueError(f"{other_name}: expected an integer dtype, got {other.dtype}")
        outside = (other < 0) | (other >= logits.shape[-1])
        if bool(outside.any()):
            raise ValueError(f"{other_name}: expected ids in [0, {logits.shape[-1]}), got {other[outside].flatten()[0].item()}")
    if isinstance(temperature, torch.Tensor):
        tau = temperature.to(logits.device)
    else:
        tau = torch.tensor(float(temperature), dtype=torch.float64, device=logits.device)
    if tau.dim() and tau.shape != logits.shape[:-1]:
        raise ValueError(f"temperature: expected a scalar or shape {tuple(logits.shape[:-1])}, got {tuple(tau.shape)}")
    if not bool(((tau > 0) & torch.isfinite(tau)).all()):
        raise ValueError("temperature: expected finite values > 0")
    return tau


def _check_rows(logits: torch.Tensor, tau: torch.Tensor) -> None:
    """Refuses rows without a distribution, as the cpp kernels do: max(logits / tau) must be finite.

    That one reduction catches a row of all -inf (max -inf), any +inf or a finite logit
    that overflows when divided by tau (max +inf) and any NaN (max propagates NaN);
    dividing the max by tau > 0 equals the max of the divided row.
    """
    if not logits.numel():
        return
    top = logits.amax(-1).to(torch.float64) / tau.to(torch.float64)
    bad = ~torch.isfinite(top.reshape(-1))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"logits: expected every row to define a distribution, row {row} has no finite maximum or a non-finite "
            "sum (all -inf, +inf or NaN)"
        )


def _cdf(logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """float64 [..., V] cumulative sum of softmax(logits / tau)."""
    scaled = logits.to(torch.float64) / (tau[..., None] if tau.dim() else tau).to(torch.float64)
    return torch.softmax(scaled, -1).cumsum(-1)


def _triton_sampler():
    try:
        from . import triton_kernels as sampler_triton
    except ImportError:
        return None
    return sampler_triton if sampler_triton.available() is None else None


def sampler_backend(device: Union[str, torch.device] = "cpu") -> str:
    """Which implementation :func:`inverse_cdf_sample` uses on ``device``: ``cpp``, ``triton`` or ``reference``."""
    device = torch.device(device)
    if device.type == "cpu" and _extension.load() is not None:
        return "cpp"
    if device.type == "cuda" and _triton_sampler() is not None:
        return "triton"
    return "reference"


def inverse_cdf_sample_reference(logits: torch.Tensor, z: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """softmax + cumsum + searchsorted in float64; materialises the [..., V] CDF.

    z is compared with ``z * F(V-1)`` rather than with 1 - so that a total that rounds
    below 1 cannot send z just below 1 to an impossible (-inf) last token.
    """
    tau = _check(logits, z, "z", temperature)
    _check_rows(logits, tau)
    cdf = _cdf(logits, tau)
    target = z.to(cdf.dtype)[..., None] * cdf[..., -1:]
    ids = torch.searchsorted(cdf, target.contiguous(), right=True)[..., 0]
    return ids.clamp_(max=logits.shape[-1] - 1)


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """Token ids ``[...]`` (int64) with ``token = min{v : F(v) > z}`` of ``softmax(logits / tau)``.

    Args:
        logits: ``[..., V]`` float.
        z: ``[...]`` uniform noise in [0, 1).
        temperature: scalar or ``[...]``, > 0.

    On CPU and CUDA the fused samplers compute in float64 without storing the CDF.
    Every backend refuses the same inputs with ValueError: z outside [0, 1) (or
    NaN) and a row without a distribution (all ``-inf``, any ``+inf`` or NaN).
    """
    tau = _check(logits, z, "z", temperature)
    backend = sampler_backend(logits.device)
    if backend == "cpp":
        return _extension.load().inverse_cdf_sample(logits, z, tau)
    if backend == "triton":
        _check_rows(logits, tau)
        return _triton_sampler().inverse_cdf_sample(logits, z, tau)
    return inverse_cdf_sample_reference(logits, z, temperature)


def noise_inversion_reference(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature = 1.0, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Torch version of :func:`noise_inversion` (float64, materialises the CDF)."""
    tau = _check(logits, tokens, "tokens", temperature)
    _check_rows(logits, tau)
    cdf = _cdf(logits, tau)
    t = tokens.long()[..., None]
    upper = cdf.gather(-1, t)[..., 0]
    lower = torch.where(t[..., 0] > 0, cdf.gather(-1, (t - 1).clamp(min=0))[..., 0], torch.zeros_like(upper))
    total = cdf[..., -1]
    u = _uniform(tokens, logits.device, generator).to(torch.float64)
    z = ((lower + u * (upper - lower)) / total).to(torch.float32)
    z = torch.minimum(z, torch.tensor(1.0, device=z.device).nextafter(torch.tensor(0.0, device=z.device)))
    # Nudge by float32 ulps until z * total lands in [lower, upper), as the sampler compares.
    for _ in range(4):
        z = torch.where((z.double() * total >= upper) & (z > 0), z.nextafter(torch.zeros_like(z)), z)
    for _ in range(4):
        z = torch.where(z.double() * total < lower, z.nextafter(torch.ones_like(z)), z)
    return z


def _uniform(tokens: torch.Tensor, device: torch.device, generator: Optional[torch.Generator]) -> torch.Tensor:
    u = torch.rand(tokens.shape, generator=generator, device=device if generator is None else generator.device)
    return u.to(device)


def noise_inversion(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature = 1.0, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """z uniform inside each token's CDF bin ``[F(t-1), F(t))`` (the PTP baseline), float32 ``[...]``.

    Args:
        logits: ``[..., V]`` float.
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature: scalar or ``[...]``, > 0.
        generator: the source of the uniform position inside the bin.

    Sampling that z with :func:`inverse_cdf_sample` gives ``tokens`` back (up to
    bins too narrow to hold a float32, which carry almost no probability mass).
    """
    tau = _check(logits, tokens, "tokens", temperature)
    backend = sampler_backend(logits.device)
    if backend == "reference":
        return noise_inversion_reference(logits, tokens, temperature, generator)
    u = _uniform(tokens, logits.device, generator)
    if backend == "cpp":
        return _extension.load().noise_inversion(logits, tokens, tau, u)
    _check_rows(logits, tau)
    return _triton_sampler().noise_inversion(logits, tokens, tau, u)


__all__ = [
    "inverse_cdf_sample", "inverse_cdf_sample_reference", "noise_inversion", "noise_inversion_reference", "sampler_backend",
]

"""Inverse-CDF sampling with temperature (the push-forward sampler) and its inverse.

Convention (docs/DESIGN.md §5): ``token = min{v : F(v) > z}`` where F is the cumulative
sum of ``softmax(logits / tau)`` over the vocabulary, clamped to ``V - 1`` so that
rounding in the cumulative sum never yields an out-of-range id.

Backends, on the shared registry (:func:`sampler_backend` says which one runs on a device):

* ``cpp`` (CPU, ``kforcing_kernels._C``): float64 math, one pass over each row
  computing per-block (max, sum of exp), then a walk over the block totals and one
  block; the [..., V] cumulative sum is never stored.
* ``triton`` (CUDA): the same algorithm as a Triton kernel (``triton_kernels.py``).
* ``reference``: softmax + cumsum + searchsorted in torch, float64 (``reference.py``).
  The fallback when neither of the above is available, and the oracle.

This module validates the arguments identically for every backend and draws the
noise inversion's uniform; the backends compute.
"""

from __future__ import annotations

from numbers import Real
from typing import Optional, Union

import torch

from ...types import Temperature
from ..common.registry import BackendSpec, OpRegistry
from . import reference

_HERE = "kforcing_kernels.ops.sampling"
REGISTRY = OpRegistry(
    "sampling",
    (
        BackendSpec("reference", f"{_HERE}.reference", ("*",), "softmax + cumsum + searchsorted, float64: the oracle"),
        BackendSpec("cpp", f"{_HERE}.cpp", ("cpu",), "the fused C++ sampler of kforcing_kernels._C"),
        BackendSpec("triton", f"{_HERE}.triton", ("cuda",), "the fused Triton sampler"),
    ),
    preference={"cpu": ("cpp",), "cuda": ("triton",)},
    fallback="reference",
)


def _check(logits: torch.Tensor, other: torch.Tensor, other_name: str, temperature: Temperature) -> torch.Tensor:
    """Validates the arguments, identically for every backend; returns the temperature as a tensor.

    ``other`` is ``z`` (floating, every value in [0, 1)) or ``tokens`` (integer ids in
    [0, V)). Rows without a distribution are refused by each backend (``reference.check_rows``; the
    cpp kernels check those themselves, in the same pass that samples).
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() < 1:
        raise ValueError(f"logits: expected a floating tensor [..., V], got {getattr(logits, 'shape', type(logits))}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not isinstance(other, torch.Tensor):
        raise ValueError(
            f"{other_name}: expected a tensor of shape {tuple(logits.shape[:-1])}, got {type(other).__name__}"
        )
    if other.shape != logits.shape[:-1]:
        raise ValueError(
            f"{other_name}: expected shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(other.shape)}"
        )
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
            raise ValueError(
                f"{other_name}: expected ids in [0, {logits.shape[-1]}), got {other[outside].flatten()[0].item()}"
            )
    if isinstance(temperature, torch.Tensor):
        if temperature.dtype == torch.bool or temperature.is_complex():
            raise ValueError(f"temperature: expected a real tensor, got {temperature.dtype}")
        # integer tensors are real temperatures too (as generation's checks take them)
        tau = temperature.to(logits.device, None if temperature.dtype.is_floating_point else torch.float64)
    elif isinstance(temperature, Real) and not isinstance(temperature, bool):
        tau = torch.tensor(float(temperature), dtype=torch.float64, device=logits.device)
    else:  # a string or a bool would convert silently ("1" -> 1.0, True -> 1.0)
        raise ValueError(f"temperature: expected a number or a real tensor, got {type(temperature).__name__}")
    if tau.dim() and tau.shape != logits.shape[:-1]:
        raise ValueError(f"temperature: expected a scalar or shape {tuple(logits.shape[:-1])}, got {tuple(tau.shape)}")
    if not bool(((tau > 0) & torch.isfinite(tau)).all()):
        raise ValueError("temperature: expected finite values > 0")
    return tau


def sampler_backend(device: Union[str, torch.device] = "cpu") -> str:
    """Which implementation :func:`inverse_cdf_sample` uses on ``device``: ``cpp``, ``triton`` or ``reference``."""
    return REGISTRY.default(torch.device(device))


def inverse_cdf_sample_reference(logits: torch.Tensor, z: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """softmax + cumsum + searchsorted in float64 (the ``reference`` backend); materialises the [..., V] CDF."""
    return reference.inverse_cdf_sample(logits, z, _check(logits, z, "z", temperature))


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
    return REGISTRY.get(sampler_backend(logits.device)).inverse_cdf_sample(logits, z, tau)


def inverse_cdf_sample_unchecked(
    logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor, backend: str
) -> torch.Tensor:
    """:func:`inverse_cdf_sample` for a static decode step: no argument check and no host sync.

    The caller guarantees z in [0, 1) of shape ``logits.shape[:-1]``, ``tau`` a tensor (scalar or that shape)
    on the logits' device with finite values > 0, and rows with a distribution; ``backend`` a resolved name
    (:func:`sampler_backend`). The triton backend skips its row check (a host sync); the cpp kernels still
    check their rows. Same bits as :func:`inverse_cdf_sample` (the same kernels). Under ``torch.compile`` the
    call is the custom op ``kforcing_kernels::inverse_cdf_sample`` (opaque to the graph, fullgraph-safe).
    """
    if torch.compiler.is_compiling():
        return torch.ops.kforcing_kernels.inverse_cdf_sample(logits, z, tau, backend)
    return _sample_unchecked(logits, z, tau, backend)


def _sample_unchecked(logits, z, tau, backend):
    if backend == "triton":
        import importlib

        return importlib.import_module(f"{_HERE}.triton_kernels").inverse_cdf_sample(logits, z, tau)
    return REGISTRY.get(backend).inverse_cdf_sample(logits, z, tau)  # reference: its row check syncs (CPU oracle)


@torch.library.custom_op("kforcing_kernels::inverse_cdf_sample", mutates_args=())
def _inverse_cdf_sample_op(logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor, backend: str) -> torch.Tensor:
    return _sample_unchecked(logits.contiguous(), z.contiguous(), tau.contiguous(), backend).contiguous()


@_inverse_cdf_sample_op.register_fake
def _(logits, z, tau, backend):
    return z.new_empty(z.shape, dtype=torch.int64)


def noise_inversion_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: Temperature = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Torch version of :func:`noise_inversion` (float64, materialises the CDF: the ``reference`` backend)."""
    tau = _check(logits, tokens, "tokens", temperature)
    return reference.noise_inversion(logits, tokens, tau, _uniform(tokens, logits.device, generator))


def _uniform(tokens: torch.Tensor, device: torch.device, generator: Optional[torch.Generator]) -> torch.Tensor:
    u = torch.rand(tokens.shape, generator=generator, device=device if generator is None else generator.device)
    return u.to(device)


def noise_inversion(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: Temperature = 1.0,
    generator: Optional[torch.Generator] = None,
    u: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """z uniform inside each token's CDF bin ``[F(t-1), F(t))`` (the PTP baseline), float32 ``[...]``.

    Args:
        logits: ``[..., V]`` float.
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature: scalar or ``[...]``, > 0.
        generator: the source of the uniform position inside the bin.
        u: the positions inside the bins themselves, float32 ``[...]`` in [0, 1) (``generator`` unused): a caller
            that inverts rows chunk by chunk draws them once for all rows, so the chunks change no draw.

    Sampling that z with :func:`inverse_cdf_sample` gives ``tokens`` back (up to
    bins too narrow to hold a float32, which carry almost no probability mass).
    z is always in ``[0, 1)``: a token at the top of the CDF whose bin is narrower
    than the last float32 ulp below 1 (probability below about 6e-8) holds no such z
    and gets the largest float32 below 1, which samples an earlier token.
    """
    tau = _check(logits, tokens, "tokens", temperature)
    if u is None:
        u = _uniform(tokens, logits.device, generator)
    elif (
        not isinstance(u, torch.Tensor)
        or u.shape != tokens.shape
        or u.dtype != torch.float32
        or u.device != logits.device
    ):
        raise ValueError(
            f"u: expected float32 {tuple(tokens.shape)} on {logits.device}, got "
            f"{getattr(u, 'dtype', type(u))} {tuple(getattr(u, 'shape', ()))}"
        )
    return REGISTRY.get(sampler_backend(logits.device)).noise_inversion(logits, tokens, tau, u)


__all__ = [
    "inverse_cdf_sample",
    "inverse_cdf_sample_reference",
    "inverse_cdf_sample_unchecked",
    "noise_inversion",
    "noise_inversion_reference",
    "sampler_backend",
]

"""The backends of ``window_attention``, declared on the shared registry (``ops/common/registry.py``).

Every backend is a module implementing :class:`Backend`; the op treats them all alike
(``reference`` included). A backend that is not built or cannot import is reported
absent with its reason; it is never faked.

Non-finite values are each backend's own business (the op does not scan K/V). On CPU,
``reference``, ``composite`` and ``cpp`` guarantee that a NaN/inf in K or V at a key a
row does not see never changes that row, forward or backward: ``cpp`` in its kernels
(masked keys never enter a product), ``reference`` (any device) and ``composite`` (CPU)
by computing with ``masked_keys`` when K or V holds such a value. ``triton`` (and
``composite``'s fused CUDA kernels, and ``flex``) behave like FlashAttention: keep K/V finite there.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Protocol

import torch

from ... import env
from ..common.registry import BackendSpec, OpRegistry


class Backend(Protocol):
    """What ``window_attention`` needs of a backend (a module with these functions)."""

    def available(self) -> Optional[str]:
        """None when usable here, else why not (not built, no device, ...)."""

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether inputs of this dtype and head dim run here (the default choice skips it otherwise)."""

    def forward(self, q, k, v, layout, scale: float):
        """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] contiguous -> (out [B, H, Lq, D] contiguous, lse [B, H, Lq])."""

    def backward(self, dout, q, k, v, out, lse, layout, scale: float):
        """Gradients (dq, dk, dv), contiguous and shaped like (q, k, v)."""

    # Optional: eager_ops(q, k, v, layout) -> (module, forward name, backward name), the functions plain eager calls
    # with inputs like these run once ``window_attention`` has validated them (it caches them per input signature,
    # op.py _eager_entry): the backend's own input checks run in eager_ops, once, not per call (triton/__init__.py).


_HERE = "kforcing_kernels.ops.window_attention"
REGISTRY = OpRegistry(
    "window_attention",
    (
        BackendSpec("reference", f"{_HERE}.reference", ("*",), "dense mask + attention math: the oracle, O(k^2)"),
        BackendSpec("composite", f"{_HERE}.composite", ("*",), "standard attention calls merged by log-sum-exp"),
        BackendSpec("cpp", f"{_HERE}.cpp", ("cpu",), "the compiled CPU kernels of kforcing_kernels._C"),
        BackendSpec(
            "triton", f"{_HERE}.triton", ("cuda",), "fused Triton kernels (CPU tensors only in the interpreter)"
        ),
        BackendSpec(
            "flex",
            f"{_HERE}.flex",
            ("cuda", "cpu"),
            "compiled FlexAttention over the analytic BlockMask (CPU: eager forward only)",
        ),
    ),
    preference={"cuda": ("triton", "composite"), "cpu": ("cpp", "composite")},
    fallback="composite",
    override=env.backend_override,
    override_name="KFORCING_BACKEND",
)
BACKENDS = REGISTRY.names


def backends_available() -> dict[str, Optional[str]]:
    """``{backend: None if usable here, else the reason it is absent}``; what a usable backend cannot do
    (``flex``: no backward on CPU tensors) is in :func:`backend_limits`."""
    return REGISTRY.available()


def backend_limits() -> dict[str, str]:
    """``{backend: what it cannot do}`` for usable backends with a limit, e.g. ``flex``: no backward on CPU tensors
    (FlexAttention has none there; its CPU forward runs, a backward through it raises naming the backend)."""
    return REGISTRY.limits()


def get_backend(name: str) -> ModuleType:
    return REGISTRY.get(name)


def default_backend(device: torch.device, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None) -> str:
    """The fastest available backend for inputs on ``device`` (override with KFORCING_BACKEND).

    With ``dtype``/``head_dim`` given, backends that cannot take them (e.g. triton
    on fp32 CUDA tensors) are skipped in favour of the next one.
    """
    return REGISTRY.default(device, dtype, head_dim)

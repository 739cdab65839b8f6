"""Backend registry for prefix-window attention.

Every backend is a module implementing :class:`Backend`; the op treats them all alike
(``reference`` included). A backend that is not built or cannot import is reported
absent with its reason; it is never faked.

Non-finite values are each backend's own business (the op does not scan K/V). On CPU,
``reference``, ``composite`` and ``cpp`` guarantee that a NaN/inf in K or V at a key a
row does not see never changes that row, forward or backward: ``cpp`` in its kernels
(masked keys never enter a product), ``reference`` (any device) and ``composite`` (CPU)
by computing with ``masked_keys`` when K or V holds such a value. ``triton`` (and
``composite``'s fused CUDA kernels) behave like FlashAttention: keep K/V finite there.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional, Protocol

import torch


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

_MODULES = {
    "reference": "kforcing_kernels.ops.window_attention.reference",
    "composite": "kforcing_kernels.ops.window_attention.composite",
    "cpp": "kforcing_kernels.ops.window_attention.cpp",
    "triton": "kforcing_kernels.ops.window_attention.triton",
}
BACKENDS = tuple(_MODULES)


def _load(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as exc:  # not built / dependency missing
        return None, f"cannot import {_MODULES[name]}: {exc}"
    return module, module.available()


def backends_available() -> dict[str, Optional[str]]:
    """``{backend: None if usable here, else the reason it is absent}``."""
    return {name: _load(name)[1] for name in BACKENDS}


def get_backend(name: str) -> ModuleType:
    if name not in _MODULES:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {name!r}")
    module, reason = _load(name)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} is not available: {reason}")
    return module


def default_backend(device: torch.device, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None) -> str:
    """The fastest available backend for inputs on ``device`` (override with KFORCING_BACKEND).

    With ``dtype``/``head_dim`` given, backends that cannot take them (e.g. triton
    on fp32 CUDA tensors) are skipped in favour of the next one.
    """
    forced = os.environ.get("KFORCING_BACKEND")
    if forced:
        return forced
    preference = ("triton", "composite") if device.type == "cuda" else ("cpp", "composite")
    for name in preference:
        module, reason = _load(name)
        if reason is not None:
            continue
        # A backend can be present yet slower than the next one here (see cpp.preferred).
        if not getattr(module, "preferred", lambda: True)():
            continue
        if dtype is not None and head_dim is not None and not module.supports(dtype, head_dim):
            continue
        return name
    return "composite"

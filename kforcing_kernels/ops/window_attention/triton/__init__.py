"""Triton backend: fused prefix-window kernels run over analytic tile plans.

Runs compiled on CUDA tensors (float16 / bfloat16), or in Triton's interpreter
on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was first
imported (float32 / float16; the Triton 3.9 interpreter's ``tl.dot`` is wrong
for bfloat16, so that combination is refused). This module imports triton only
when asked (``available``, ``kernels``), so the backend reports its absence.

    __init__.py       the backend: available/supports/forward/backward, kernels() (launch.py)
    plan.py           tile shapes (Tiles), the tile plan of a layout (or of a row subset, QueryRowsLayout), its device
    copies configs.py        tile sets, per-kernel (warps, stages) tables, the tile set and autotune choices
    launch.py         autotuned launchers: attention_forward / attention_backward
    direct.py         steady-state launches of the cached compiled kernel (no autotuner, no JIT binding)
    jit_common.py     @triton.jit helpers shared by the kernels, their argument roles
    jit_forward.py    @triton.jit forward kernels (slot steps, tile products)
    jit_backward.py   @triton.jit backward kernels (delta, slot steps, dQ, dK/dV)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

from .... import env
from ....layouts import WindowLayout
from ...common import triton_env

_KERNELS = "kforcing_kernels.ops.window_attention.triton.launch"


def available() -> Optional[str]:
    """None when the kernels can run here, else the reason (``ops/common/triton_env.py``, shared with paged)."""
    return triton_env.available()


def kernels() -> ModuleType:
    """The launcher module, launch.py (kernels compiled, or interpreted under TRITON_INTERPRET=1)."""
    module = importlib.import_module(_KERNELS)
    if module.interpreting() != triton_env.interpret_requested():
        raise RuntimeError(
            f"{_KERNELS} was built with TRITON_INTERPRET={'1' if module.interpreting() else 'unset'} but it is now "
            f"{env.triton_interpret_value()!r}; set the variable before triton is first imported"
        )
    return module


def _allowed_dtypes() -> tuple[tuple[torch.dtype, ...], str]:
    if triton_env.interpret_requested():
        return (
            torch.float32,
            torch.float16,
        ), "under TRITON_INTERPRET=1 (the Triton 3.9 interpreter's tl.dot is wrong for bfloat16)"
    return (torch.float16, torch.bfloat16), "on CUDA (use backend='composite' for other dtypes)"


HEAD_DIMS = (32, 64, 128)  # the head dims the kernels take (the registry's default choice reads it)


def supports(dtype: torch.dtype, head_dim: Optional[int]) -> bool:
    """Whether inputs of this dtype and head dim run here (the default choice skips us otherwise)."""
    return dtype in _allowed_dtypes()[0] and head_dim in HEAD_DIMS


def _check(q: torch.Tensor) -> None:
    allowed, why = _allowed_dtypes()
    if q.dtype not in allowed:
        raise ValueError(f"q: the triton backend takes dtype in {allowed} {why}, got {q.dtype}")


def forward(q, k, v, layout: WindowLayout, scale: float):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> (out [B, H, Lq, D] q.dtype, lse [B, H, Lq] fp32, natural log)."""
    _check(q)
    return kernels().attention_forward(q, k, v, layout, scale)


def backward(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    """Gradients (dq, dk, dv) like (q, k, v), from the forward's ``out`` and ``lse``."""
    _check(q)
    return kernels().attention_backward(dout, q, k, v, out, lse, layout, scale)


def eager_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout):
    """``(module, forward name, backward name)`` for eager calls like these that ``window_attention`` has validated
    and keeps in its cache (op._eager_entry, keyed by everything the checks here and in launch.py read: dtype,
    shapes, devices, strides, the layout, TRITON_INTERPRET): the checks run here once, the launchers then skip
    them (launch.forward_checked / backward_checked)."""
    _check(q)
    module = kernels()
    module.check_inputs(q, k, v, layout)
    return module, "forward_checked", "backward_checked"

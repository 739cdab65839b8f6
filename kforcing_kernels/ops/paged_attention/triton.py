"""Triton backend: ``triton_kernels._paged_fwd_kernel``.

Compiled on CUDA tensors (float16 / bfloat16 / float32), or in Triton's interpreter
on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was first imported
(float32 / float16: the interpreter's ``tl.dot`` is wrong for bfloat16, so that is refused).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ..common import triton_env

_KERNELS = "kforcing_kernels.ops.paged_attention.triton_kernels"


def available() -> Optional[str]:
    """Same conditions as the window-attention triton backend (one copy of the rules: ``ops/common/triton_env.py``)."""
    return triton_env.available()


def forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float):
    on_cpu = q.device.type == "cpu"
    if on_cpu != triton_env.interpret_requested():
        raise ValueError(
            f"q: backend 'triton' takes CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), got device {q.device}"
        )
    allowed = (torch.float32, torch.float16) if on_cpu else (torch.float16, torch.bfloat16, torch.float32)
    if q.dtype not in allowed:
        raise ValueError(f"q: backend 'triton' takes dtype in {allowed} here, got {q.dtype}")
    kernels = importlib.import_module(_KERNELS)
    return kernels.paged_forward(
        q.contiguous(),
        k_new.contiguous(),
        v_new.contiguous(),
        k_pages.contiguous(),
        v_pages.contiguous(),
        block_table.contiguous(),
        context_lens.to(q.device),
        scale,
    )

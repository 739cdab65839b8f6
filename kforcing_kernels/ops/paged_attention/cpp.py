"""C++ backend: ``kforcing_kernels._C.paged_attention_forward`` (csrc/paged_attention.cpp).

Per (batch, head) it walks the request's pages in place with an online softmax in
fp32 (fp64 for fp64 inputs), parallel over B*H; each (b, h) is computed by one
thread in a fixed order, so results do not depend on the thread count. CPU only;
absent (with the reason) when the extension is not built or predates this op.
"""

from __future__ import annotations

from typing import Optional

from ... import _extension


def available() -> Optional[str]:
    reason = _extension.reason()
    if reason is not None:
        return reason
    if not hasattr(_extension.load(), "paged_attention_forward"):
        return (
            "kforcing_kernels._C was built without paged_attention_forward "
            "(rebuild: python setup.py build_ext --inplace)"
        )
    return None


def forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float):
    """CPU tensors; context_lens int64 [B] on CPU."""
    if q.device.type != "cpu":
        raise ValueError(f"q: backend 'cpp' takes CPU tensors, got device {q.device}")
    return _extension.require().paged_attention_forward(
        q.contiguous(),
        k_new.contiguous(),
        v_new.contiguous(),
        k_pages.contiguous(),
        v_pages.contiguous(),
        block_table.contiguous(),
        context_lens.contiguous(),
        float(scale),
    )

"""Triton kernel for decode attention over a paged KV cache (vLLM / FlashInfer layout).

One program per (request, query head): the window's W rows (padded to BLOCK_M)
walk the request's context in tiles of BLOCK_N tokens, each token's page looked
up in the block table (so any page size works and pages are read in place), then
the window's own keys (causal). Online softmax in base 2 with fp32 accumulators.
Under ``TRITON_INTERPRET=1`` it runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 32  # context tokens per tile (tools/aot_report compiles this kernel with it)


def interpreting() -> bool:
    return not isinstance(tl.zeros, triton.runtime.JITFunction)


@triton.jit
def _paged_fwd_kernel(
    Q,
    KNew,
    VNew,
    KPages,
    VPages,
    Table,
    Lens,
    Out,
    qk_scale,  # softmax scale * log2(e)
    H,
    HKV: tl.constexpr,
    W,
    D: tl.constexpr,
    PAGE,
    MAX_PAGES,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    hk = h // (H // HKV)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < W
    dim_ok = dims < D
    q = tl.load(
        Q + ((b * H + h) * W + rows[:, None]) * D + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    length = tl.load(Lens + b)
    for t0 in range(0, length, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < length
        page = tl.load(Table + b * MAX_PAGES + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        off = ((page * PAGE + tok % PAGE) * HKV + hk) * D  # [BLOCK_N]: the token's row in the pool
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(KPages + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VPages + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    # The window: slot i sees slots 0..i (BLOCK_M >= W, so one tile).
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < W
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    base = (b * HKV + hk) * W
    k = tl.load(KNew + (base + cols[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(VNew + (base + cols[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
    s = tl.where((cols[None, :] <= rows[:, None]) & col_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    l_sum = tl.where(row_ok, l_sum, 1.0)
    out = acc / l_sum[:, None]
    tl.store(
        Out + ((b * H + h) * W + rows[:, None]) * D + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float) -> torch.Tensor:
    """Contiguous inputs as in ``paged_attention``; context_lens int64 [B] on q's device."""
    b, h, w, d = q.shape
    out = torch.empty_like(q)
    block_m = max(16, triton.next_power_of_2(w))
    block_d = max(16, triton.next_power_of_2(d))
    _paged_fwd_kernel[(b * h,)](
        q,
        k_new,
        v_new,
        k_pages,
        v_pages,
        block_table.to(torch.int32),
        context_lens.to(torch.int32),
        out,
        float(scale) * LOG2E,
        h,
        k_new.shape[1],
        w,
        d,
        k_pages.shape[1],
        block_table.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    return out

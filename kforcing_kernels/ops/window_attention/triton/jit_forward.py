"""The forward kernels (``@triton.jit`` source only; launched by ``launch.py``).

* ``_window_softmax`` (small windows only): the intra-window part of a block of rows,
  w slot steps, inside ``_fwd_kernel``'s window tiles (no launch of its own).
* ``_fwd_kernel``: one program per (batch x head, query tile); window rows start from their
  intra-window part. Per interval of the plan it walks key tiles of BLOCK_N; only tiles
  outside the plan's full range are masked.

FlashAttention-2 style: online softmax in base 2 with fp32 accumulators; the
natural-log LSE is saved for the backward, which recomputes probabilities.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _finish, _row_interval, _sees, jit_kernel


@triton.jit
def _window_softmax(
    Q,
    K,
    V,
    WindowKeys,
    RowIv,
    Counters,
    q_head,
    kv_head,
    rows,
    ok,
    slot0,
    iv_base,
    window_size,
    n_iv,
    stride_qm,
    stride_kn,
    qk_scale,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """The intra-window part of query ``rows`` (BLOCK of them, any windows): ``(out, lse2)`` over the
    ``window_size`` slots from each row's ``slot0`` in WindowKeys, out normalised (fp32), lse in log2
    units (-inf for a row that sees no slot). Step i gathers slot i of every row's own window: a
    row-wise dot, no tensor-core product."""
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + q_head + rows[:, None] * stride_qm + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for i in range(0, window_size):
        key_i = tl.load(WindowKeys + slot0 + i, mask=ok, other=-1)
        visible = _sees(RowIv, iv_base, rows, ok, key_i, n_iv)
        at_i = kv_head + key_i.to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
        k_i = tl.load(K + at_i, mask=visible[:, None], other=0.0)
        v_i = tl.load(V + at_i, mask=visible[:, None], other=0.0)
        s_i = tl.where(visible, tl.sum(q * k_i.to(tl.float32), 1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, s_i)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p_i = tl.exp2(s_i - m_sub)
        l_i = l_i * alpha + p_i
        acc = acc * alpha[:, None] + p_i[:, None] * v_i.to(tl.float32)
        m_i = m_new
        if INSTRUMENT:
            tl.atomic_add(Counters + 1, 1)
    inv_l, lse2 = _finish(m_i, l_i)
    return acc * inv_l[:, None], lse2


@jit_kernel
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,  # q/out [B, H, Lq, D], k/v [B, Hkv, Lk, D], lse [B, H, Lq] fp32 natural log
    QueryTiles,
    Bounds,
    Order,
    RowIv,
    WindowKeys,
    RowSlot0,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    bounds_bstride,
    iv_bstride,
    n_heads,
    kv_group,
    n_keys,
    n_ctx,
    query_offset,
    n_intervals,
    n_iv,
    window_size,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    kvh = h // kv_group
    tile = tl.load(Order + tl.program_id(1))
    q_start = tl.load(QueryTiles + tile * 3)
    q_len = tl.load(QueryTiles + tile * 3 + 1)
    seeded = tl.load(QueryTiles + tile * 3 + 2)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_start + offs_m
    ok = offs_m < q_len
    iv_base = b * iv_bstride
    q_off = b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
    kv_tile0 = b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    k_tile0 = K + kv_tile0
    v_tile0 = V + kv_tile0

    if seeded != 0:  # start from the intra-window part (each row's window from RowSlot0): normalised out, l = 1
        slot0 = tl.load(RowSlot0 + rows + query_offset - n_ctx, mask=ok, other=0)
        acc, m_i = _window_softmax(
            Q,
            K,
            V,
            WindowKeys,
            RowIv,
            Counters,
            b * stride_qb + h * stride_qh,
            b * stride_kb + kvh * stride_kh,
            rows,
            ok,
            slot0,
            iv_base,
            window_size,
            n_iv,
            stride_qm,
            stride_kn,
            qk_scale,
            BLOCK_M,
            HEAD_DIM,
            INSTRUMENT,
        )
        l_i = tl.where(ok, 1.0, 0.0)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    bounds = Bounds + b * bounds_bstride + tile * n_intervals * 4
    for interval in range(0, n_intervals):
        key_start = tl.load(bounds + interval * 4)
        n_tiles = tl.load(bounds + interval * 4 + 1)
        full_begin = tl.load(bounds + interval * 4 + 2)
        full_end = tl.load(bounds + interval * 4 + 3)
        lo, hi = _row_interval(RowIv, iv_base, rows, ok, interval, n_iv)
        for t in range(0, n_tiles):
            start = key_start + t * BLOCK_N
            keys = start + offs_n
            in_range = (keys < n_keys)[:, None]
            k = tl.load(k_tile0 + start * stride_kn, mask=in_range, other=0.0)
            v = tl.load(v_tile0 + start * stride_kn, mask=in_range, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            if (t < full_begin) | (t >= full_end):  # boundary tile: apply the row intervals
                s = tl.where((keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so no inf - inf appears.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            if INSTRUMENT:
                tl.atomic_add(Counters, 1)

    inv_l, lse2 = _finish(m_i, l_i)
    tl.store(Out + q_off, (acc * inv_l[:, None]).to(Out.dtype.element_ty), mask=ok[:, None])
    tl.store(Lse + b * stride_lb + h * stride_lh + rows, lse2 * 0.6931471805599453, mask=ok)

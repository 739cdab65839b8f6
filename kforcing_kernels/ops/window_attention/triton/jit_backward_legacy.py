"""The first generation of the dQ and dK/dV kernels (``@triton.jit`` source only), kept selectable.

``KFORCING_TRITON_KERNELS=legacy`` launches these instead of ``jit_backward.py``'s
pipelined kernels, so one GPU run can measure old against new (``bench/gpu/triton_gpu.py``).

* ``_dq_legacy_kernel``: the forward's walk, one key loop per interval with the mask as a
  runtime branch inside it.
* ``_dkdv_legacy_kernel``: one program per (batch x kv head, key tile) over the transposed plan
  (the query tiles that see the key tile), stepping through each tile ``BLOCK_M_STEP`` rows at a
  time with an inner loop over the GQA group: only that innermost loop is software-pipelined
  (compiled for sm_90a its trip count is the group size, 1 for multi-head attention).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _lse2_for_grad, _row_interval, jit_kernel


@jit_kernel
def _dq_legacy_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, DQPart,
    QueryTiles, Bounds, Order, RowIv, Counters,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh, stride_pb, stride_ph,
    bounds_bstride, iv_bstride,
    n_heads, kv_group, n_keys, n_ctx, query_offset, n_intervals, n_iv, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, INSTRUMENT: tl.constexpr,
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
    do = tl.load(DOut + q_off, mask=ok[:, None], other=0.0)
    lse2 = _lse2_for_grad(tl.load(Lse + b * stride_lb + h * stride_lh + rows, mask=ok, other=0.0))
    delta = tl.load(Delta + b * stride_lb + h * stride_lh + rows, mask=ok, other=0.0)
    kv_tile0 = b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    k_tile0 = K + kv_tile0
    v_tile0 = V + kv_tile0

    if seeded != 0:
        wrow = rows + query_offset - n_ctx
        dq = tl.load(DQPart + b * stride_pb + h * stride_ph + wrow[:, None] * HEAD_DIM + offs_d[None, :],
                     mask=ok[:, None], other=0.0)
    else:
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

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
            p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
            if (t < full_begin) | (t >= full_end):
                p = tl.where((keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]), p, 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
            if INSTRUMENT:
                tl.atomic_add(Counters + 2, 1)

    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _dkdv_legacy_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base, q_start, q_len, interval,
               full, kvh, kv_group, stride_qh, stride_qm, stride_lh, n_iv, qk_scale, BLOCK_M_STEP: tl.constexpr):
    """dK/dV of one key block from query rows [q_start, q_start + min(q_len, BLOCK_M_STEP)) of every head of kvh's group."""
    offs_m = tl.arange(0, BLOCK_M_STEP)
    ok = offs_m < q_len
    lo, hi = _row_interval(RowIv, iv_base, q_start + offs_m, ok, interval, n_iv)
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        q_off = q_tile0 + h * stride_qh + q_start * stride_qm
        q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
        do = tl.load(DOut + q_off, mask=ok[:, None], other=0.0)
        l_off = l_tile0 + h * stride_lh + q_start
        # Padding rows: lse = inf makes p = 0 there, also on full entries.
        lse2 = _lse2_for_grad(tl.load(Lse + l_off, mask=ok, other=float("inf")))
        delta = tl.load(Delta + l_off, mask=ok, other=0.0)
        p = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M_STEP]
        if full == 0:
            p = tl.where((cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :]), p, 0.0)
        dv += tl.dot(p.to(do.dtype), do)
        ds = p * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds.to(q.dtype), q)
    return dk, dv


@jit_kernel
def _dkdv_legacy_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    QueryTiles, KeyTiles, KeyPtr, KeyEntries, KeyOrder, RowIv, Counters,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh,
    keyptr_bstride, iv_bstride,
    n_kv_heads, kv_group, n_iv, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_M_STEP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    # One program owns BLOCK_N keys and walks the plan's entries (query tile, interval) that see
    # them; each BLOCK_M-row query tile is read in steps of BLOCK_M_STEP rows, so the key block
    # (the reuse factor of every q/dO byte read) is not bounded by the query tile's registers.
    pid_bh = tl.program_id(0).to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_kv_heads
    kvh = pid_bh % n_kv_heads
    ktile = tl.load(KeyOrder + tl.program_id(1))
    k_start = tl.load(KeyTiles + ktile * 2)
    k_len = tl.load(KeyTiles + ktile * 2 + 1)

    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M_STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    iv_base = b * iv_bstride
    cols = k_start + offs_n
    col_ok = offs_n < k_len
    kv_off = b * stride_kb + kvh * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(K + kv_off, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_tile0 = b * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :]
    l_tile0 = b * stride_lb + offs_m

    e_begin = tl.load(KeyPtr + b * keyptr_bstride + ktile)
    e_end = tl.load(KeyPtr + b * keyptr_bstride + ktile + 1)
    for e in range(e_begin, e_end):
        qtile = tl.load(KeyEntries + e * 3)
        interval = tl.load(KeyEntries + e * 3 + 1)
        full = tl.load(KeyEntries + e * 3 + 2)
        q_start = tl.load(QueryTiles + qtile * 3)
        q_len = tl.load(QueryTiles + qtile * 3 + 1)
        if BLOCK_M_STEP == BLOCK_M:  # one step: no loop (it would change the register allocation)
            dk, dv = _dkdv_legacy_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base, q_start,
                                q_len, interval, full, kvh, kv_group, stride_qh, stride_qm, stride_lh, n_iv, qk_scale,
                                BLOCK_M_STEP)
        else:
            for r0 in range(0, q_len, BLOCK_M_STEP):
                dk, dv = _dkdv_legacy_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base,
                                    q_start + r0, q_len - r0, interval, full, kvh, kv_group, stride_qh, stride_qm,
                                    stride_lh, n_iv, qk_scale, BLOCK_M_STEP)
        if INSTRUMENT:
            tl.atomic_add(Counters + 4, kv_group)

    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


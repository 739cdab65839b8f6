"""The backward kernels (``@triton.jit`` source only; launched by ``launch.py``), in launch order.

* ``_delta_kernel``: ``delta = rowsum(dO * O)``.
* ``_window_dq``, ``_slot_dkdv_program`` (small windows only): the intra-window part of dQ
  for a block of rows, and per (batch x kv head, block of windows) the window keys' dK/dV
  (complete: only their own window sees them), in slot steps.
* ``_dq_program``: the forward's walk, accumulating dQ, then the window rows' intra-window part.
  Per interval three key loops, masked / full / masked (``plan.bounds``' full run in the middle),
  so the full tiles carry no mask arithmetic and each loop is software-pipelined on its own.
* ``_dkdv_program``: one program per (batch x kv head, key tile) over one flattened list of
  query-row steps that see the key tile (``steps.py``), full steps first: two flat loops
  over (step, head of the GQA group) that Triton pipelines, each step's table entry read one
  item ahead so that the next steps' q/dO loads are in flight during the math. dK/dV need no atomics.
* ``_bwd_kernel``: dK/dV, dQ and the window keys' dK/dV in one launch, programs split by id
  (FlexAttention's backward does the same for dQ and dK/dV).

Until 0.4 (commit 6f25b35) ``KFORCING_TRITON_KERNELS=split|legacy`` launched the slot, dQ and dK/dV
work apart (and the first-generation dQ / dK/dV kernels); the H200 run measured them slower or tied
(BENCHMARKS.md, "H200: the variants removed"), so they were removed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _lse2_for_grad, _row_interval, _sees, _slot_block, jit_kernel

# Columns per piece of the window dQ's row dot products in dQ programs of at least WINDOW_DQ_PIECES_FROM
# elements (the wide set's 128 rows x D=128): whole rows of q, k, dO and v beside such a dQ accumulator
# spill 16-48 bytes on sm_90a; 32-column pieces compile clean. Smaller programs take whole rows.
WINDOW_DQ_COLUMNS = tl.constexpr(32)
WINDOW_DQ_PIECES_FROM = tl.constexpr(128 * 128)


@jit_kernel
def _delta_kernel(Out, DOut, Delta, n_rows, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta[r] = sum_d dO[r, d] * O[r, d] over the flattened contiguous [B*H*Lq] rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_rows
    o = tl.load(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DOut + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(Delta + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _window_dq(
    Q,
    K,
    V,
    DOut,
    WindowKeys,
    RowIv,
    Counters,
    dq,
    q_row,
    lse2,
    delta,
    kv_head,
    rows,
    ok,
    slot0,
    iv_base,
    window_size,
    n_iv,
    stride_kn,
    qk_scale,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COLUMNS: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """``dq`` + the unscaled dQ of query ``rows`` (BLOCK of them, row offsets ``q_row`` into Q and dO, any
    windows) over the key slots of their own window, ``window_size`` slot steps from each row's ``slot0``
    in WindowKeys. q and dO are re-read each step (from cache) rather than held; the row dot products
    take COLUMNS columns at a time (a divisor of HEAD_DIM): with whole rows of q, k, dO and v live
    beside ``dq``, a 128-row x D=128 dQ program spills."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, COLUMNS)
    for i in range(0, window_size):
        key_i = tl.load(WindowKeys + slot0 + i, mask=ok, other=-1)
        visible = _sees(RowIv, iv_base, rows, ok, key_i, n_iv)
        kv_row = kv_head + key_i.to(tl.int64) * stride_kn
        if COLUMNS == HEAD_DIM:
            # Loads stay in their storage dtype, converted where used (fewer live registers).
            at_k = kv_row[:, None] + offs_d[None, :]
            k_i = tl.load(K + at_k, mask=visible[:, None], other=0.0)
            q_i = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=visible[:, None], other=0.0)
            s_i = tl.sum(q_i.to(tl.float32) * k_i.to(tl.float32), 1)
            v_i = tl.load(V + at_k, mask=visible[:, None], other=0.0)
            do_i = tl.load(DOut + q_row[:, None] + offs_d[None, :], mask=visible[:, None], other=0.0)
            dp_i = tl.sum(do_i.to(tl.float32) * v_i.to(tl.float32), 1)
        else:
            s_i = tl.zeros([BLOCK], dtype=tl.float32)
            dp_i = tl.zeros([BLOCK], dtype=tl.float32)
            for c in tl.static_range(0, HEAD_DIM, COLUMNS):
                at_q = q_row[:, None] + (c + offs_c)[None, :]
                at_k = kv_row[:, None] + (c + offs_c)[None, :]
                q_c = tl.load(Q + at_q, mask=visible[:, None], other=0.0)
                k_c = tl.load(K + at_k, mask=visible[:, None], other=0.0)
                s_i += tl.sum(q_c.to(tl.float32) * k_c.to(tl.float32), 1)
                do_c = tl.load(DOut + at_q, mask=visible[:, None], other=0.0)
                v_c = tl.load(V + at_k, mask=visible[:, None], other=0.0)
                dp_i += tl.sum(do_c.to(tl.float32) * v_c.to(tl.float32), 1)
            k_i = tl.load(K + kv_row[:, None] + offs_d[None, :], mask=visible[:, None], other=0.0)
        p_i = tl.where(visible, tl.exp2(s_i * qk_scale - lse2), 0.0)
        dq += (p_i * (dp_i - delta))[:, None] * k_i.to(tl.float32)
        if INSTRUMENT:
            tl.atomic_add(Counters + 3, 1)
    return dq


@triton.jit
def _slot_dkdv_program(
    pid_bkv,
    block,
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    RowIv,
    WindowKeys,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    n_kv_heads,
    kv_group,
    num_windows,
    window_size,
    query_offset,
    windows_per_block,
    iv_bstride,
    n_iv,
    qk_scale,
    sm_scale,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """dK/dV of the window keys of slot block ``block`` of (batch x kv head) ``pid_bkv``, complete: only
    their own window sees them, so the query slots of that window that see them, summed over the group."""
    pid_bkv = pid_bkv.to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bkv // n_kv_heads
    kvh = pid_bkv % n_kv_heads
    ok, slot0, key = _slot_block(block, windows_per_block, num_windows, window_size, WindowKeys, BLOCK_T)
    iv_base = b * iv_bstride
    offs_d = tl.arange(0, HEAD_DIM)
    kv_own = b * stride_kb + kvh * stride_kh + key.to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
    k_t = tl.load(K + kv_own, mask=ok[:, None], other=0.0).to(tl.float32)
    v_t = tl.load(V + kv_own, mask=ok[:, None], other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_T, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_T, HEAD_DIM], dtype=tl.float32)
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        q_head = b * stride_qb + h * stride_qh + offs_d[None, :]
        l_head = b * stride_lb + h * stride_lh
        for i in range(0, window_size):
            key_i = tl.load(WindowKeys + slot0 + i, mask=ok, other=-1)
            row_i = key_i.to(tl.int64) - query_offset
            visible = _sees(RowIv, iv_base, row_i, ok & (key_i >= 0), key, n_iv)
            q_i = tl.load(Q + q_head + row_i[:, None] * stride_qm, mask=visible[:, None], other=0.0).to(tl.float32)
            do_i = tl.load(DOut + q_head + row_i[:, None] * stride_qm, mask=visible[:, None], other=0.0).to(tl.float32)
            lse2_i = _lse2_for_grad(tl.load(Lse + l_head + row_i, mask=visible, other=0.0))
            delta_i = tl.load(Delta + l_head + row_i, mask=visible, other=0.0)
            p_i = tl.where(visible, tl.exp2(tl.sum(k_t * q_i, 1) * qk_scale - lse2_i), 0.0)
            dv += p_i[:, None] * do_i
            dk += (p_i * (tl.sum(v_t * do_i, 1) - delta_i))[:, None] * q_i
            if INSTRUMENT:
                tl.atomic_add(Counters + 3, 1)
    tl.store(DK + kv_own, (dk * sm_scale).to(DK.dtype.element_ty), mask=ok[:, None])
    tl.store(DV + kv_own, dv.to(DV.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _dq_key_tiles(
    K,
    V,
    q,
    do,
    lse2,
    delta,
    dq,
    kv_tile0,
    key_start,
    t_begin,
    t_end,
    lo,
    hi,
    n_keys,
    stride_kn,
    qk_scale,
    Counters,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """dQ += the key tiles ``[t_begin, t_end)`` of one interval (BLOCK_N keys each from ``key_start``).

    Full tiles (``MASKED`` False) lie inside every row's interval and so inside the keys: no load
    mask and no mask arithmetic."""
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(t_begin, t_end):
        start = key_start + t * BLOCK_N
        keys = start + offs_n
        if MASKED:
            in_range = (keys < n_keys)[:, None]
            k = tl.load(K + kv_tile0 + start * stride_kn, mask=in_range, other=0.0)
            v = tl.load(V + kv_tile0 + start * stride_kn, mask=in_range, other=0.0)
        else:
            k = tl.load(K + kv_tile0 + start * stride_kn)
            v = tl.load(V + kv_tile0 + start * stride_kn)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where((keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        if INSTRUMENT:
            tl.atomic_add(Counters + 2, 1)
    return dq


@triton.jit
def _dq_program(
    pid_bh,
    tile_rank,
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
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
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """dQ of query tile ``Order[tile_rank]`` of (batch x head) ``pid_bh``; window rows add their
    intra-window part last."""
    pid_bh = pid_bh.to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    kvh = h // kv_group
    tile = tl.load(Order + tile_rank)
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
    # Padding rows: do = 0 and delta = 0 make ds = 0 there whatever p is.
    lse2 = _lse2_for_grad(tl.load(Lse + b * stride_lb + h * stride_lh + rows, mask=ok, other=0.0))
    delta = tl.load(Delta + b * stride_lb + h * stride_lh + rows, mask=ok, other=0.0)
    kv_tile0 = b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
    do = tl.load(DOut + q_off, mask=ok[:, None], other=0.0)

    bounds = Bounds + b * bounds_bstride + tile * n_intervals * 4
    for interval in range(0, n_intervals):
        key_start = tl.load(bounds + interval * 4)
        n_tiles = tl.load(bounds + interval * 4 + 1)
        full_begin = tl.load(bounds + interval * 4 + 2)
        full_end = tl.load(bounds + interval * 4 + 3)
        lo, hi = _row_interval(RowIv, iv_base, rows, ok, interval, n_iv)
        # Key tiles in ascending order, as one masked loop would visit them (same sums, same bits).
        dq = _dq_key_tiles(
            K,
            V,
            q,
            do,
            lse2,
            delta,
            dq,
            kv_tile0,
            key_start,
            0,
            full_begin,
            lo,
            hi,
            n_keys,
            stride_kn,
            qk_scale,
            Counters,
            BLOCK_N,
            True,
            INSTRUMENT,
        )
        dq = _dq_key_tiles(
            K,
            V,
            q,
            do,
            lse2,
            delta,
            dq,
            kv_tile0,
            key_start,
            full_begin,
            full_end,
            lo,
            hi,
            n_keys,
            stride_kn,
            qk_scale,
            Counters,
            BLOCK_N,
            False,
            INSTRUMENT,
        )
        dq = _dq_key_tiles(
            K,
            V,
            q,
            do,
            lse2,
            delta,
            dq,
            kv_tile0,
            key_start,
            full_end,
            n_tiles,
            lo,
            hi,
            n_keys,
            stride_kn,
            qk_scale,
            Counters,
            BLOCK_N,
            True,
            INSTRUMENT,
        )
    if seeded != 0:  # the intra-window part last: with q and dO (re-read there) no longer live, it fits
        slot0 = tl.load(RowSlot0 + rows + query_offset - n_ctx, mask=ok, other=0)
        dq = _window_dq(
            Q,
            K,
            V,
            DOut,
            WindowKeys,
            RowIv,
            Counters,
            dq,
            b * stride_qb + h * stride_qh + rows * stride_qm,
            lse2,
            delta,
            b * stride_kb + kvh * stride_kh,
            rows,
            ok,
            slot0,
            iv_base,
            window_size,
            n_iv,
            stride_kn,
            qk_scale,
            BLOCK_M,
            HEAD_DIM,
            WINDOW_DQ_COLUMNS if BLOCK_M * HEAD_DIM >= WINDOW_DQ_PIECES_FROM else HEAD_DIM,
            INSTRUMENT,
        )

    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _step_entry(StepEntries, i, i_end, kv_group, MASKED: tl.constexpr):
    """(row start, rows, interval) of item ``i``'s step (``i // kv_group``); zeros when ``i >= i_end``
    (the prefetch one past the last item; the interval is 0 unless ``MASKED``: full steps never read it)."""
    entry = StepEntries + (i // kv_group) * 3
    valid = i < i_end
    row0 = tl.load(entry, mask=valid, other=0)
    n_rows = tl.load(entry + 1, mask=valid, other=0)
    interval = tl.load(entry + 2, mask=valid, other=0) if MASKED else 0
    return row0, n_rows, interval


@triton.jit
def _dkdv_steps(
    Q,
    DOut,
    Lse,
    Delta,
    RowIv,
    StepEntries,
    Counters,
    k,
    v,
    dk,
    dv,
    cols,
    i_begin,
    i_end,
    head0,
    q_batch,
    l_batch,
    iv_base,
    kv_group,
    stride_qh,
    stride_qm,
    stride_lh,
    n_iv,
    qk_scale,
    BLOCK_M_STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """dK/dV of one key block += the flattened (step, head) items ``[i_begin, i_end)``: item i is
    query-row step ``i // kv_group`` of ``StepEntries`` (row start, rows, interval) for head
    ``head0 + i % kv_group``. One loop with no inner loop, so Triton pipelines its loads.

    The step's table entry is a loop-carried value read one item ahead, so the q/dO addresses of item
    i do not depend on a load of iteration i and Triton's pipeliner can issue item i+1's q/dO (and
    i+2's) while item i computes. Read in the same iteration (the loop up to 0.4, commit 6f25b35,
    ``KFORCING_TRITON_PREFETCH=0``), the sm_90a loop opened with ``async_wait {num = 0}``: every copy
    drained, q/dO requested only after the previous item's math (tools/ttgir.py reports it); the
    H200 measured the prefetching loop 1-2% faster at N=8192."""
    offs_m = tl.arange(0, BLOCK_M_STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    next_row0, next_n_rows, next_interval = _step_entry(StepEntries, i_begin, i_end, kv_group, MASKED)
    for i in range(i_begin, i_end):
        e = i // kv_group
        head = head0 + (i - e * kv_group)
        row0, n_rows, interval = next_row0, next_n_rows, next_interval
        rows = row0 + offs_m
        ok = offs_m < n_rows
        q_off = q_batch + head * stride_qh + rows[:, None] * stride_qm + offs_d[None, :]
        q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
        do = tl.load(DOut + q_off, mask=ok[:, None], other=0.0)
        l_off = l_batch + head * stride_lh + rows
        # Padding rows: lse = inf makes p = 0 there, also in full steps.
        lse2 = _lse2_for_grad(tl.load(Lse + l_off, mask=ok, other=float("inf")))
        delta = tl.load(Delta + l_off, mask=ok, other=0.0)
        p = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M_STEP]
        if MASKED:
            lo, hi = _row_interval(RowIv, iv_base, rows, ok, interval, n_iv)
            p = tl.where((cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :]), p, 0.0)
        dv += tl.dot(p.to(do.dtype), do)
        ds = p * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds.to(q.dtype), q)
        # After the math: read at the top of the body, several configs spill under Triton 3.6.
        next_row0, next_n_rows, next_interval = _step_entry(StepEntries, i + 1, i_end, kv_group, MASKED)
        if INSTRUMENT:
            tl.atomic_add(Counters + 4, 1)
    return dk, dv


@triton.jit
def _dkdv_program(
    pid_bh,
    tile_rank,
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    KeyTiles,
    StepPtr,
    StepEntries,
    StepOrder,
    RowIv,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    stepptr_bstride,
    iv_bstride,
    n_kv_heads,
    kv_group,
    n_iv,
    qk_scale,
    sm_scale,
    BLOCK_M_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """dK/dV of key tile ``StepOrder[tile_rank]`` of (batch x kv head) ``pid_bh``: BLOCK_N keys, whose
    steps StepPtr gives as [begin, first masked, end)."""
    pid_bh = pid_bh.to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_kv_heads
    kvh = pid_bh % n_kv_heads
    ktile = tl.load(StepOrder + tile_rank)
    k_start = tl.load(KeyTiles + ktile * 2)
    k_len = tl.load(KeyTiles + ktile * 2 + 1)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols = k_start + offs_n
    col_ok = offs_n < k_len
    kv_off = b * stride_kb + kvh * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(K + kv_off, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    ptr = StepPtr + b * stepptr_bstride + ktile * 3
    begin = tl.load(ptr) * kv_group
    first_masked = tl.load(ptr + 1) * kv_group
    end = tl.load(ptr + 2) * kv_group
    head0 = kvh * kv_group
    q_batch = b * stride_qb
    l_batch = b * stride_lb
    iv_base = b * iv_bstride
    dk, dv = _dkdv_steps(
        Q,
        DOut,
        Lse,
        Delta,
        RowIv,
        StepEntries,
        Counters,
        k,
        v,
        dk,
        dv,
        cols,
        begin,
        first_masked,
        head0,
        q_batch,
        l_batch,
        iv_base,
        kv_group,
        stride_qh,
        stride_qm,
        stride_lh,
        n_iv,
        qk_scale,
        BLOCK_M_STEP,
        HEAD_DIM,
        False,
        INSTRUMENT,
    )
    dk, dv = _dkdv_steps(
        Q,
        DOut,
        Lse,
        Delta,
        RowIv,
        StepEntries,
        Counters,
        k,
        v,
        dk,
        dv,
        cols,
        first_masked,
        end,
        head0,
        q_batch,
        l_batch,
        iv_base,
        kv_group,
        stride_qh,
        stride_qm,
        stride_lh,
        n_iv,
        qk_scale,
        BLOCK_M_STEP,
        HEAD_DIM,
        True,
        INSTRUMENT,
    )

    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@jit_kernel
def _bwd_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DK,
    DV,
    QueryTiles,
    Bounds,
    Order,
    KeyTiles,
    StepPtr,
    StepEntries,
    StepOrder,
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
    stepptr_bstride,
    iv_bstride,
    n_heads,
    n_kv_heads,
    kv_group,
    n_keys,
    n_ctx,
    query_offset,
    n_intervals,
    n_iv,
    num_windows,
    window_size,
    windows_per_block,
    n_bh,
    n_bkv,
    n_dkdv_programs,
    n_dq_programs,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M_STEP: tl.constexpr,
    BLOCK_N_DKDV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    """The whole backward after ``delta`` in one launch (1-D grid), programs split by id: the first
    ``n_dkdv_programs`` = ``n_bkv`` x key tiles are dK/dV programs (the larger share of the work, so
    they start first), the next ``n_dq_programs`` = ``n_bh`` x query tiles dQ programs (window rows
    add their intra-window part inline), the rest ``n_bkv`` x slot blocks the window keys' dK/dV
    (slot mode only); each kind in its own longest-first order with (batch x head) fastest. One
    launch instead of three saves their host time; the register allocation is the largest kind's."""
    pid = tl.program_id(0)
    if pid < n_dkdv_programs:
        _dkdv_program(
            pid % n_bkv,
            pid // n_bkv,
            Q,
            K,
            V,
            DOut,
            Lse,
            Delta,
            DK,
            DV,
            KeyTiles,
            StepPtr,
            StepEntries,
            StepOrder,
            RowIv,
            Counters,
            stride_qb,
            stride_qh,
            stride_qm,
            stride_kb,
            stride_kh,
            stride_kn,
            stride_lb,
            stride_lh,
            stepptr_bstride,
            iv_bstride,
            n_kv_heads,
            kv_group,
            n_iv,
            qk_scale,
            sm_scale,
            BLOCK_M_STEP,
            BLOCK_N_DKDV,
            HEAD_DIM,
            INSTRUMENT,
        )
    elif pid < n_dkdv_programs + n_dq_programs:
        p = pid - n_dkdv_programs
        _dq_program(
            p % n_bh,
            p // n_bh,
            Q,
            K,
            V,
            DOut,
            Lse,
            Delta,
            DQ,
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
            sm_scale,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            INSTRUMENT,
        )
    else:
        p = pid - n_dkdv_programs - n_dq_programs
        _slot_dkdv_program(
            p % n_bkv,
            p // n_bkv,
            Q,
            K,
            V,
            DOut,
            Lse,
            Delta,
            DK,
            DV,
            RowIv,
            WindowKeys,
            Counters,
            stride_qb,
            stride_qh,
            stride_qm,
            stride_kb,
            stride_kh,
            stride_kn,
            stride_lb,
            stride_lh,
            n_kv_heads,
            kv_group,
            num_windows,
            window_size,
            query_offset,
            windows_per_block,
            iv_bstride,
            n_iv,
            qk_scale,
            sm_scale,
            BLOCK_T,
            HEAD_DIM,
            INSTRUMENT,
        )

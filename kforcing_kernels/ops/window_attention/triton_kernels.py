"""Fused Triton kernels for prefix-window attention: forward and backward.

FlashAttention-2 style: online softmax in base 2 with fp32 accumulators, the
natural-log LSE saved for the backward, which recomputes probabilities. Which
tile products run is decided by :mod:`tile_plan` (a reduction of the layout's
row intervals); boundary tiles are masked with the same row intervals, read from
a tensor, and window slots are located through the layout's slot-to-key table, so
both storage orders (position-major, and the stream-major DoubleForward storage
``[ctx | Future-1 | Future-2]``) are read in place and no kernel re-derives the mask.

Kernels (launch order):

* ``_slot_fwd_kernel`` (small windows only): the intra-window part, one block of
  whole windows per program, w slot steps; writes a partial ``(out, lse)``.
* ``_fwd_kernel``: one program per (batch x head, query tile), seeded with the
  slot kernel's partial for window rows. Per interval of the plan it walks key
  tiles of BLOCK_N; only tiles outside the plan's full range are masked.
* ``_delta_kernel``: ``delta = rowsum(dO * O)``.
* ``_slot_bwd_kernel`` (small windows only): per (batch x kv head, block of
  windows): the window keys' dK/dV (complete: only their own window sees them)
  and the intra-window part of dQ.
* ``_dq_kernel``: the forward's walk, accumulating dQ on top of the slot part.
* ``_dkdv_kernel``: one program per (batch x kv head, key tile) over the
  transposed plan (the query tiles that see the key tile) for every query head
  of its GQA group, so dK/dV need no atomics.

Launchers take contiguous ``[B, H, L, D]`` tensors. Under ``TRITON_INTERPRET=1``
the kernels run in Triton's interpreter on CPU tensors with a fixed config; on
a GPU each kernel is autotuned over its entries in ``KERNEL_CONFIGS``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from ...layouts import WindowLayout
from .tile_plan import DEFAULT_TILES, TilePlan, Tiles, tile_plan

SUPPORTED_HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634


# Argument roles (the AOT report builds kernel signatures from these).
IO_POINTERS = ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")  # in the inputs' dtype
FP32_POINTERS = ("Lse", "OPart", "LsePart", "Delta", "DQPart")  # other pointers are int32 plan tensors
FLOAT_ARGS = ("qk_scale", "sm_scale")
# Strides of q/k/v/dout are multiples of the head dim (>= 32), so Triton may assume 16-divisibility.
ALIGNED_STRIDES = ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn")


def _kernel(fn):
    """``triton.jit`` specialising only pointers and the aligned strides: layout sizes (which
    may be 1 or multiples of 16) would otherwise fork new variants at run time that the AOT
    report never compiled."""
    shape_args = [name for name in inspect.signature(fn).parameters
                  if name[0].islower() and name not in ALIGNED_STRIDES and name not in FLOAT_ARGS]
    return triton.jit(do_not_specialize=shape_args)(fn)


def interpreting() -> bool:
    """True when the kernels of this module were built for Triton's interpreter."""
    return not isinstance(_fwd_kernel, triton.runtime.JITFunction)


# ====================================================================== what a row sees
#
# The kernels never re-derive the mask. RowIv is the layout's row intervals (int32
# [B', Lq, n_iv, 2], WindowLayout.row_intervals()): row r sees keys [lo, hi) of each of
# its n_iv intervals (0: context part, 1..S: its own window's streams). WindowKeys
# (int32 [M * w], -1 past a short last window) is the key of each window slot, so the
# slot kernels read both storage orders in place without a storage formula.


@triton.jit
def _row_interval(RowIv, iv_base, rows, ok, interval, n_iv):
    """Interval ``interval`` of query ``rows``: ``(lo, hi)``, ``[0, 0)`` outside ``ok``."""
    ptr = RowIv + iv_base + rows.to(tl.int64) * (n_iv * 2) + interval * 2
    return tl.load(ptr, mask=ok, other=0), tl.load(ptr + 1, mask=ok, other=0)


@triton.jit
def _sees(RowIv, iv_base, rows, ok, key, n_iv):
    """Whether each of ``rows`` sees its ``key`` through its own-window intervals 1..n_iv-1."""
    seen = key != key  # all False
    for j in range(1, n_iv):
        lo, hi = _row_interval(RowIv, iv_base, rows, ok, j, n_iv)
        seen = seen | ((lo <= key) & (key < hi))
    return seen & ok


@triton.jit
def _slot_block(block, windows_per_block, num_windows, window_size, WindowKeys, BLOCK_T: tl.constexpr):
    """Tokens of slot block ``block`` (whole windows, window-major): (ok, index of the window's
    slot 0 in WindowKeys, own key)."""
    t = tl.arange(0, BLOCK_T)
    m = block * windows_per_block + t // window_size
    in_block = (t < windows_per_block * window_size) & (m < num_windows)
    slot0 = m * window_size
    key = tl.load(WindowKeys + slot0 + t % window_size, mask=in_block, other=-1)
    return key >= 0, slot0, key


@triton.jit
def _finish(m_i, l_i):
    """(1 / l, LSE in log2 units) of an online softmax; a row that saw no key gets (0, -inf)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    return tl.where(seen, 1.0 / l_safe, 0.0), tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _lse2_for_grad(lse):
    """LSE (natural log) -> log2 units for p = 2^(s - lse2); -inf (no key seen) -> +inf so p = 0."""
    lse2 = lse * 1.4426950408889634
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


# ====================================================================== forward


@_kernel
def _slot_fwd_kernel(
    Q, K, V, OPart, LsePart,  # q [B, H, Lq, D], k/v [B, Hkv, Lk, D]; partial out [B, H, Nw, D] fp32, lse [B, H, Nw] (log2)
    RowIv, WindowKeys, Counters,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_pb, stride_ph, stride_lb, stride_lh,
    n_heads, kv_group, n_ctx, num_windows, window_size, query_offset, windows_per_block, iv_bstride, n_iv, qk_scale,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, INSTRUMENT: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    kvh = h // kv_group
    ok, slot0, key = _slot_block(tl.program_id(1), windows_per_block, num_windows, window_size, WindowKeys, BLOCK_T)
    iv_base = b * iv_bstride
    offs_d = tl.arange(0, HEAD_DIM)
    rows = key.to(tl.int64) - query_offset
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    kv_head = b * stride_kb + kvh * stride_kh + offs_d[None, :]
    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, HEAD_DIM], dtype=tl.float32)
    for i in range(0, window_size):
        key_i = tl.load(WindowKeys + slot0 + i, mask=ok, other=-1)
        visible = _sees(RowIv, iv_base, rows, ok, key_i, n_iv)
        at_i = kv_head + key_i.to(tl.int64)[:, None] * stride_kn
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
    wrow = key.to(tl.int64) - n_ctx
    tl.store(OPart + b * stride_pb + h * stride_ph + wrow[:, None] * HEAD_DIM + offs_d[None, :],
             acc * inv_l[:, None], mask=ok[:, None])
    tl.store(LsePart + b * stride_lb + h * stride_lh + wrow, lse2, mask=ok)


@_kernel
def _fwd_kernel(
    Q, K, V, Out, Lse,  # q/out [B, H, Lq, D], k/v [B, Hkv, Lk, D], lse [B, H, Lq] fp32 natural log
    OPart, LsePart,  # the slot kernel's partial for window rows (read by seeded tiles)
    QueryTiles, Bounds, Order, RowIv, Counters,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh, stride_pb, stride_ph,
    stride_wb, stride_wh, bounds_bstride, iv_bstride,
    n_heads, kv_group, n_keys, n_ctx, query_offset, n_intervals, n_iv, qk_scale,
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
    kv_tile0 = b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    k_tile0 = K + kv_tile0
    v_tile0 = V + kv_tile0

    if seeded != 0:  # start from the intra-window partial: normalised out, l = 1
        wrow = rows + query_offset - n_ctx
        acc = tl.load(OPart + b * stride_pb + h * stride_ph + wrow[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=ok[:, None], other=0.0)
        m_i = tl.load(LsePart + b * stride_wb + h * stride_wh + wrow, mask=ok, other=float("-inf"))
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


# ====================================================================== backward


@_kernel
def _delta_kernel(Out, DOut, Delta, n_rows, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta[r] = sum_d dO[r, d] * O[r, d] over the flattened contiguous [B*H*Lq] rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_rows
    o = tl.load(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DOut + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(Delta + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@_kernel
def _slot_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DQPart, DK, DV,  # dq partial [B, H, Nw, D] fp32 (unscaled); dk/dv of window keys
    RowIv, WindowKeys, Counters,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh, stride_pb, stride_ph,
    n_kv_heads, kv_group, n_ctx, num_windows, window_size, query_offset, windows_per_block, iv_bstride, n_iv,
    qk_scale, sm_scale,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, INSTRUMENT: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # batch/head offsets can exceed int32
    b = pid_bh // n_kv_heads
    kvh = pid_bh % n_kv_heads
    ok, slot0, key = _slot_block(tl.program_id(1), windows_per_block, num_windows, window_size, WindowKeys, BLOCK_T)
    iv_base = b * iv_bstride
    offs_d = tl.arange(0, HEAD_DIM)
    key64 = key.to(tl.int64)
    kv_head = b * stride_kb + kvh * stride_kh + offs_d[None, :]
    kv_own = kv_head + key64[:, None] * stride_kn
    rows = key64 - query_offset

    # Phase 1, the block's tokens as queries: dQ over the key slots of their window, per query head.
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        q_head = b * stride_qb + h * stride_qh
        l_head = b * stride_lb + h * stride_lh
        q_t = tl.load(Q + q_head + rows[:, None] * stride_qm + offs_d[None, :], mask=ok[:, None], other=0.0)
        do_t = tl.load(DOut + q_head + rows[:, None] * stride_qm + offs_d[None, :], mask=ok[:, None], other=0.0)
        q_t = q_t.to(tl.float32)
        do_t = do_t.to(tl.float32)
        lse2_t = _lse2_for_grad(tl.load(Lse + l_head + rows, mask=ok, other=0.0))
        delta_t = tl.load(Delta + l_head + rows, mask=ok, other=0.0)
        dq = tl.zeros([BLOCK_T, HEAD_DIM], dtype=tl.float32)
        for i in range(0, window_size):
            key_i = tl.load(WindowKeys + slot0 + i, mask=ok, other=-1)
            visible = _sees(RowIv, iv_base, rows, ok, key_i, n_iv)
            at_i = kv_head + key_i.to(tl.int64)[:, None] * stride_kn
            k_i = tl.load(K + at_i, mask=visible[:, None], other=0.0).to(tl.float32)
            v_i = tl.load(V + at_i, mask=visible[:, None], other=0.0)
            p_i = tl.where(visible, tl.exp2(tl.sum(q_t * k_i, 1) * qk_scale - lse2_t), 0.0)
            ds_i = p_i * (tl.sum(do_t * v_i.to(tl.float32), 1) - delta_t)
            dq += ds_i[:, None] * k_i
            if INSTRUMENT:
                tl.atomic_add(Counters + 3, 1)
        tl.store(DQPart + b * stride_pb + h * stride_ph + (key64 - n_ctx)[:, None] * HEAD_DIM + offs_d[None, :], dq,
                 mask=ok[:, None])

    # Phase 2, the block's tokens as keys: dK/dV over the query slots of their window that see
    # them (only their own window can), summed over the group.
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


@_kernel
def _dq_kernel(
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
def _dkdv_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base, q_start, q_len, interval,
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


@_kernel
def _dkdv_kernel(
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
            dk, dv = _dkdv_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base, q_start,
                                q_len, interval, full, kvh, kv_group, stride_qh, stride_qm, stride_lh, n_iv, qk_scale,
                                BLOCK_M_STEP)
        else:
            for r0 in range(0, q_len, BLOCK_M_STEP):
                dk, dv = _dkdv_step(Q, DOut, Lse, Delta, RowIv, k, v, dk, dv, cols, q_tile0, l_tile0, iv_base,
                                    q_start + r0, q_len - r0, interval, full, kvh, kv_group, stride_qh, stride_qm,
                                    stride_lh, n_iv, qk_scale, BLOCK_M_STEP)
        if INSTRUMENT:
            tl.atomic_add(Counters + 4, kv_group)

    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


# ====================================================================== configs + autotune

KERNELS = {
    "fwd": _fwd_kernel, "slot_fwd": _slot_fwd_kernel, "delta": _delta_kernel, "slot_bwd": _slot_bwd_kernel,
    "dq": _dq_kernel, "dkdv": _dkdv_kernel,
}
# Tile sets (tile shapes are part of the plan, so they are chosen by `tile_set_for`, not by the autotuner):
# "base" runs everywhere; "wide" is the H100-class D=128 set: FlexAttention's H100 forward tiles (128 query
# rows x 64 keys) for the forward and dQ; each dK/dV program owns 128 keys and steps through the query
# tiles 16 rows at a time (q and dO are re-read once per key tile: 4x less traffic than the earlier 32-key
# programs; on an H100, single N=8192 k=4 fwd+bwd 141 -> 202 TFLOP/s, bench/triton_gpu.py --wide-dkdv).
# It is used on sm_90+ once a head has >= WIDE_MIN_ROWS query rows (below that, 128-row tiles leave SMs
# idle at B*H = 16: Lq = 1024 gives 128 programs for 132 SMs). Its windows of 5..16 slots take tile
# products instead of slot steps: at w = 8 and 16 (single / double k=8, N=8192) in-tile beat slot steps
# on an H100, fwd 424 vs 356 and 414 vs 311 TFLOP/s, fwd+bwd 150 vs 138 and 146 vs 127 (--slot-window-max 0).
TILE_SETS: dict[str, dict[int, Tiles]] = {
    "base": {32: DEFAULT_TILES, 64: DEFAULT_TILES, 128: Tiles(64, 64, 64, 32)},
    "wide": {128: Tiles(128, 64, 128, 32, block_m_dkdv=16, slot_window_max=4)},
}
TILES_BY_HEAD_DIM = TILE_SETS["base"]
WIDE_MIN_ROWS = 2048
# Lowest compute capability (major) each set runs on, forced or not: the AOT report checks a set only
# for targets at or above it (the wide dQ kernel spills on sm_80 under Triton 3.6).
TILE_SET_MIN_CAPABILITY = {"base": 0, "wide": 9}
# (num_warps, num_stages) per kernel and (tile set, head dim): every entry compiles with 0 spill bytes
# and within shared memory on sm_80 and sm_90a ("wide": sm_90a only) in fp16 and bf16 under both ends of
# the supported Triton range, 3.6.0 and 3.9.0 (`make aot-check`; README "Triton AOT resources"). Pruned
# by that measurement: under 3.6, fwd D=128 4 warps, dq D=64 2-3 stages, dkdv D=32 (4, 2), slot_bwd
# D=32 4 warps and every base dkdv D=128 config but (8, 1) spill; wide dkdv (128 keys, 16-row steps) compiles
# clean at (8, 1) and (8, 2). The first entry of each list is the
# default (`aot_report --defaults`, the CI test) and what runs without timing (KFORCING_TRITON_AUTOTUNE=0,
# or by default under torch.distributed); H100-class entries (8 warps, 3 stages) lead the D=128 lists.
_SLOT_FWD = {32: [(4, 1), (8, 1)], 64: [(4, 1), (8, 1)], 128: [(8, 1), (4, 1)]}
_SLOT_BWD = {32: [(8, 1)], 64: [(8, 1)], 128: [(8, 1)]}
_DELTA = {32: [(4, 1), (8, 1)], 64: [(4, 1), (8, 1)], 128: [(4, 1), (8, 1)]}
KERNEL_CONFIGS: dict[str, dict[tuple[str, int], list[tuple[int, int]]]] = {
    "fwd": {("base", 32): [(4, 3), (8, 2), (8, 3)], ("base", 64): [(4, 2), (4, 3), (8, 2), (8, 3)],
            ("base", 128): [(8, 3), (8, 2), (8, 1)], ("wide", 128): [(8, 3), (8, 2), (8, 1)]},
    "dq": {("base", 32): [(4, 2), (4, 3), (8, 2)], ("base", 64): [(4, 1), (8, 1)],
           ("base", 128): [(8, 3), (8, 2), (8, 1)], ("wide", 128): [(8, 3), (8, 2), (8, 1)]},
    "dkdv": {("base", 32): [(4, 3), (8, 1), (8, 2)], ("base", 64): [(4, 2), (8, 2), (4, 1), (4, 3)],
             ("base", 128): [(8, 1)], ("wide", 128): [(8, 2), (8, 1)]},
    # The slot and delta kernels do not read block_m/block_n: the same lists under every tile set.
    "slot_fwd": {(s, d): _SLOT_FWD[d] for s, by_d in TILE_SETS.items() for d in by_d},
    "slot_bwd": {(s, d): _SLOT_BWD[d] for s, by_d in TILE_SETS.items() for d in by_d},
    "delta": {(s, d): _DELTA[d] for s, by_d in TILE_SETS.items() for d in by_d},
}
# Candidates the AOT report compiles to prune the table above (`aot_report --all`).
CANDIDATE_CONFIGS = [(4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3)]
DELTA_BLOCK = 64
GPU_DTYPES = (torch.float16, torch.bfloat16)
# Length buckets of the autotune key: next power of two of the query rows, clamped to this range.
BUCKET_MIN, BUCKET_MAX = 1024, 16384


def length_bucket(rows: int) -> int:
    """Autotune bucket of ``rows`` query rows per head: the next power of two in [BUCKET_MIN, BUCKET_MAX]."""
    return min(BUCKET_MAX, max(BUCKET_MIN, 1 << max(0, int(rows) - 1).bit_length()))


def autotune_enabled() -> bool:
    """Whether launches benchmark their config list (else the first entry runs: deterministic).

    KFORCING_TRITON_AUTOTUNE=1 / 0 forces it. Unset: on, except under an initialised torch.distributed
    group of more than one rank, where per-rank timing noise could pick different configs (and so
    different rounding) on different ranks; there the first entry runs everywhere.
    """
    forced = os.environ.get("KFORCING_TRITON_AUTOTUNE")
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"KFORCING_TRITON_AUTOTUNE: expected '0' or '1', got {forced!r}")
        return forced == "1"
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _tuned_kernel(kernel_name: str, key: tuple):
    """One autotuner per (kernel, tile set, head dim, length bucket, mode, autotune on/off). Triton adds
    the tensors' dtypes to its own key, so each autotuner times its configs once per dtype."""
    tile_set, head_dim = key[0], key[1]
    configs = KERNEL_CONFIGS[kernel_name][(tile_set, head_dim)]
    if not autotune_enabled():
        configs = configs[:1]
    return triton.autotune([triton.Config({}, num_warps=w, num_stages=s) for w, s in configs],
                           key=["HEAD_DIM"])(KERNELS[kernel_name])


_tuned_lock = threading.Lock()
_tuned: dict[tuple, object] = {}


def _launch(kernel_name: str, grid: tuple, tune_key: tuple, *args, **kwargs) -> None:
    """Launch under the interpreter with a fixed config, on a GPU through the autotuner for ``tune_key``
    = (tile set, head dim, length bucket, mode); the caller holds the device guard."""
    if grid[0] * grid[1] == 0:
        return
    if grid[1] > 65535:  # CUDA's limit on grid dimension y
        raise ValueError(f"q: too long for the triton backend: {grid[1]} tiles of one kind, at most 65535")
    if interpreting():
        KERNELS[kernel_name][grid](*args, **kwargs, num_warps=4, num_stages=1)
        return
    key = (kernel_name, *tune_key, autotune_enabled())
    with _tuned_lock:
        tuned = _tuned.get(key)
        if tuned is None:
            tuned = _tuned[key] = _tuned_kernel(kernel_name, tune_key)
    tuned[grid](*args, **kwargs)


# ====================================================================== launchers


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: the triton backend supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")


_device_plans: dict[tuple, dict] = {}
_device_plans_lock = threading.Lock()


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _plan_tensors(plan: TilePlan, layout: WindowLayout, device: torch.device) -> dict:
    """The plan, the layout's row intervals and slot-to-key table as int32 tensors on ``device`` (cached).

    Cached per (device, current stream): each copy is made and used on one stream, so the caching
    allocator never hands its memory to another stream while a kernel there may still read it.
    Call under the device guard of ``device``.
    """
    key = (plan.layout_key, plan.tiles, str(device), _stream_id(device))
    with _device_plans_lock:
        cached = _device_plans.get(key)
    if cached is not None:
        return cached
    row_iv = layout.row_intervals_int32

    def dev(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1) if x.numel() else torch.zeros(4, dtype=torch.int32)
        return x.to(device=device, dtype=torch.int32).contiguous()

    tensors = dict(
        query_tiles=dev(plan.query_tiles), bounds=dev(plan.bounds), order=dev(plan.order),
        key_tiles=dev(plan.key_tiles), key_ptr=dev(plan.key_ptr), key_entries=dev(plan.key_entries),
        key_order=dev(plan.key_order), row_iv=dev(row_iv), window_keys=dev(layout.window_token_keys),
        bounds_bstride=plan.bounds[0].numel() if plan.bounds.shape[0] > 1 else 0,
        keyptr_bstride=plan.key_ptr.shape[1] if plan.key_ptr.shape[0] > 1 else 0,
        iv_bstride=row_iv[0].numel() if row_iv.shape[0] > 1 else 0, n_iv=row_iv.shape[2],
    )
    with _device_plans_lock:
        if len(_device_plans) >= 64:
            _device_plans.clear()
        _device_plans[key] = tensors
    return tensors


# Counter slots of an instrumented run (int32 [5]), per (batch, query head) summed over the grid.
COUNTER_NAMES = ("fwd_tiles", "fwd_slot_steps", "dq_tiles", "bwd_slot_steps", "dkdv_tiles")


_no_counters: dict[str, torch.Tensor] = {}


def _counters(device, counters: Optional[torch.Tensor]) -> torch.Tensor:
    if counters is None:  # a valid pointer the uninstrumented kernels never touch (never freed)
        if str(device) not in _no_counters:
            _no_counters[str(device)] = torch.zeros(1, dtype=torch.int32, device=device)
        return _no_counters[str(device)]
    if counters.dtype != torch.int32 or counters.numel() != len(COUNTER_NAMES):
        raise ValueError(f"counters: expected int32 [{len(COUNTER_NAMES)}], got {counters.dtype} {tuple(counters.shape)}")
    return counters


# Offsets inside one (batch, head) slice are int32 in the kernels (only the batch/head offset is int64).
# That is safe because the 65535-tile grid limit caps a head at 65535 * 128 rows of <= 128 elements,
# 2^30 < 2^31 elements; this check keeps the bound explicit should the tiles or the limit change.
INT32_LIMIT = 2**31


def _check_shapes(q, k, layout: WindowLayout, *others: torch.Tensor) -> None:
    check_head_dim(q.shape[-1])
    if (q.shape[2], k.shape[2]) != (layout.n_queries, layout.n_keys):
        raise ValueError(f"q, k: expected lengths ({layout.n_queries}, {layout.n_keys}) from the layout, "
                         f"got ({q.shape[2]}, {k.shape[2]})")
    if layout.batch_size not in (None, q.shape[0]):
        raise ValueError(f"layout: expected per-batch ranges for batch {q.shape[0]}, got {layout.batch_size}")
    for name, t in zip(("k", "v", "dout", "out", "lse"), (k, *others)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} like q, got {t.device}")
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] * t.stride(2) >= INT32_LIMIT:
            raise ValueError(f"{name}: one head spans {t.shape[2] * t.stride(2)} elements; the triton backend "
                             f"indexes within a head in int32 (< 2^31)")


_capabilities: dict[int, tuple[int, int]] = {}


def _capability(device: Optional[torch.device]) -> tuple[int, int]:
    """Compute capability of a CUDA ``device`` ((0, 0) for anything else)."""
    if device is None or device.type != "cuda":
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


def tile_set_for(head_dim: int, rows: int = 0, device: Optional[torch.device] = None) -> str:
    """Name of the tile set for ``rows`` query rows per head of ``head_dim`` on ``device``.

    KFORCING_TRITON_TILES=base|wide forces a set where it applies (head dims it has no tiles for, and
    CUDA devices below its TILE_SET_MIN_CAPABILITY, keep "base").
    """
    check_head_dim(head_dim)
    forced = os.environ.get("KFORCING_TRITON_TILES")
    if forced and forced not in TILE_SETS:
        raise ValueError(f"KFORCING_TRITON_TILES: expected one of {sorted(TILE_SETS)}, got {forced!r}")
    cuda = device is not None and device.type == "cuda"

    def fits(name: str) -> bool:  # the interpreter (CPU) runs any set
        return head_dim in TILE_SETS[name] and (not cuda or _capability(device)[0] >= TILE_SET_MIN_CAPABILITY[name])

    if forced:
        return forced if fits(forced) else "base"
    return "wide" if rows >= WIDE_MIN_ROWS and cuda and fits("wide") else "base"


def tiles_for(head_dim: int, rows: int = 0, device: Optional[torch.device] = None) -> Tiles:
    """The tiles the dispatcher uses for ``rows`` query rows per head of ``head_dim`` on ``device``."""
    return TILE_SETS[tile_set_for(head_dim, rows, device)][head_dim]


def _resolve_tiles(tiles: Optional[Tiles], q: torch.Tensor) -> tuple[Tiles, str]:
    """(tiles, tile set name). Explicit tiles outside every set tune over the base set's configs."""
    d = q.shape[-1]
    if tiles is None:
        name = tile_set_for(d, q.shape[2], q.device)
        return TILE_SETS[name][d], name
    return tiles, next((n for n, by_d in TILE_SETS.items() if by_d.get(d) == tiles), "base")


def _tune_key(tile_set: str, q: torch.Tensor, plan: TilePlan) -> tuple:
    """What changes the best config: tile set, head dim, length bucket, mode (slot or tile intra part,
    causal or full intra). Triton's autotuner adds the dtypes itself."""
    mode = ("slot" if plan.intra_blocks else "tile") + ("-causal" if plan.geometry.causal else "-full")
    return (tile_set, q.shape[-1], length_bucket(q.shape[2]), mode)


def _device_guard(t: torch.Tensor):
    """Launch on ``t``'s device: Triton launches on the current device and its current stream."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def attention_forward(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    layout: WindowLayout,
    scale: float,
    *,
    tiles: Optional[Tiles] = None,  # default: tiles_for(D, Lq, q.device)
    counters: Optional[torch.Tensor] = None,  # int32 [5]: count executed products (interpreter tests)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused forward: ``(out [B, H, Lq, D] in q.dtype, lse [B, H, Lq] fp32, natural log)``.

    Runs on q's device (any ``cuda:i``) and that device's current stream."""
    _check_shapes(q, k, layout, v)
    with _device_guard(q):
        return _forward(q, k, v, layout, scale, tiles, counters)


def _forward(q, k, v, layout, scale, tiles, counters):
    bsz, n_heads, lq, d = q.shape
    tiles, tile_set = _resolve_tiles(tiles, q)
    plan = tile_plan(layout, tiles)
    g = plan.geometry
    key = _tune_key(tile_set, q, plan)
    pt = _plan_tensors(plan, layout, q.device)
    counters = _counters(q.device, counters)
    instrument = counters.numel() > 1
    kv_group = n_heads // k.shape[1]
    q_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))

    n_window_rows = lq - (g.n_ctx - g.query_offset)
    o_part = q.new_empty(bsz, n_heads, n_window_rows if plan.intra_blocks else 0, d, dtype=torch.float32)
    lse_part = q.new_empty(bsz, n_heads, o_part.shape[2], dtype=torch.float32)
    _launch(
        "slot_fwd", (bsz * n_heads, plan.intra_blocks), key,
        q, k, v, o_part, lse_part, pt["row_iv"], pt["window_keys"], counters,
        *q_strides, o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
        n_heads, kv_group, g.n_ctx, g.num_windows, g.window_size, g.query_offset, plan.windows_per_block,
        pt["iv_bstride"], pt["n_iv"], scale * LOG2E,
        BLOCK_T=tiles.block_t, HEAD_DIM=d, INSTRUMENT=instrument,
    )
    out = torch.empty_like(q)
    lse = torch.empty(bsz, n_heads, lq, dtype=torch.float32, device=q.device)
    _launch(
        "fwd", (bsz * n_heads, plan.num_query_tiles), key,
        q, k, v, out, lse, o_part, lse_part,
        pt["query_tiles"], pt["bounds"], pt["order"], pt["row_iv"], counters,
        *q_strides, lse.stride(0), lse.stride(1), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        lse_part.stride(1), pt["bounds_bstride"], pt["iv_bstride"],
        n_heads, kv_group, g.n_keys, g.n_ctx, g.query_offset, g.n_intervals, pt["n_iv"], scale * LOG2E,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HEAD_DIM=d, INSTRUMENT=instrument,
    )
    return out, lse


def attention_backward(
    dout: torch.Tensor,  # [B, H, Lq, D]
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    out: torch.Tensor,  # [B, H, Lq, D]
    lse: torch.Tensor,  # [B, H, Lq] fp32, natural log
    layout: WindowLayout,
    scale: float,
    *,
    tiles: Optional[Tiles] = None,  # default: tiles_for(D, Lq, q.device), as in the forward
    counters: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: ``(dq, dk, dv)`` shaped and typed like ``q, k, v``, on q's device and stream."""
    _check_shapes(q, k, layout, v, dout, out, lse)
    with _device_guard(q):
        return _backward(dout, q, k, v, out, lse, layout, scale, tiles, counters)


def _backward(dout, q, k, v, out, lse, layout, scale, tiles, counters):
    bsz, n_heads, lq, d = q.shape
    n_kv = k.shape[1]
    tiles, tile_set = _resolve_tiles(tiles, q)
    plan = tile_plan(layout, tiles)
    g = plan.geometry
    key = _tune_key(tile_set, q, plan)
    pt = _plan_tensors(plan, layout, q.device)
    counters = _counters(q.device, counters)
    instrument = counters.numel() > 1
    lse = lse.to(torch.float32).contiguous()
    kv_group = n_heads // n_kv
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), lse.stride(0),
               lse.stride(1))

    delta = torch.empty(bsz, n_heads, lq, dtype=torch.float32, device=q.device)
    n_rows = bsz * n_heads * lq
    _launch("delta", (triton.cdiv(n_rows, DELTA_BLOCK), 1), key, out, dout, delta, n_rows, BLOCK_M=DELTA_BLOCK,
            HEAD_DIM=d)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    n_window_rows = lq - (g.n_ctx - g.query_offset)
    dq_part = q.new_empty(bsz, n_heads, n_window_rows if plan.intra_blocks else 0, d, dtype=torch.float32)
    _launch(
        "slot_bwd", (bsz * n_kv, plan.intra_blocks), key,
        q, k, v, dout, lse, delta, dq_part, dk, dv, pt["row_iv"], pt["window_keys"], counters,
        *strides, dq_part.stride(0), dq_part.stride(1),
        n_kv, kv_group, g.n_ctx, g.num_windows, g.window_size, g.query_offset, plan.windows_per_block,
        pt["iv_bstride"], pt["n_iv"], scale * LOG2E, scale,
        BLOCK_T=tiles.block_t, HEAD_DIM=d, INSTRUMENT=instrument,
    )
    dq = torch.empty_like(q)
    _launch(
        "dq", (bsz * n_heads, plan.num_query_tiles), key,
        q, k, v, dout, lse, delta, dq, dq_part,
        pt["query_tiles"], pt["bounds"], pt["order"], pt["row_iv"], counters,
        *strides, dq_part.stride(0), dq_part.stride(1), pt["bounds_bstride"], pt["iv_bstride"],
        n_heads, kv_group, g.n_keys, g.n_ctx, g.query_offset, g.n_intervals, pt["n_iv"], scale * LOG2E, scale,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HEAD_DIM=d, INSTRUMENT=instrument,
    )
    _launch(
        "dkdv", (bsz * n_kv, plan.num_key_tiles), key,
        q, k, v, dout, lse, delta, dk, dv,
        pt["query_tiles"], pt["key_tiles"], pt["key_ptr"], pt["key_entries"], pt["key_order"], pt["row_iv"], counters,
        *strides, pt["keyptr_bstride"], pt["iv_bstride"],
        n_kv, kv_group, pt["n_iv"], scale * LOG2E, scale,
        BLOCK_M=tiles.block_m, BLOCK_M_STEP=tiles.dkdv_step_rows, BLOCK_N=tiles.block_n_dkdv, HEAD_DIM=d,
        INSTRUMENT=instrument,
    )
    return dq, dk, dv


__all__ = [
    "attention_forward", "attention_backward", "interpreting", "check_head_dim", "tiles_for", "tile_set_for",
    "length_bucket", "autotune_enabled", "SUPPORTED_HEAD_DIMS", "KERNELS", "KERNEL_CONFIGS", "IO_POINTERS",
    "FP32_POINTERS", "FLOAT_ARGS", "ALIGNED_STRIDES", "CANDIDATE_CONFIGS", "TILE_SETS", "TILES_BY_HEAD_DIM",
    "COUNTER_NAMES", "GPU_DTYPES",
]

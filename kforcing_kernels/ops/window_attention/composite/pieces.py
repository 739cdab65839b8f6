"""The composite backend's pieces: storage order, window -> prefix chunks, intra-window products.

Each piece is one or a few standard attention calls (``cuda.py``'s ``attend`` / ``attend_backward``:
fused kernels on CUDA, ``lse_attention`` elsewhere) returning its rows' ``(out, lse)``; the entry
points (``__init__.py``) merge them by log-sum-exp. What a row sees comes from
``layout.row_intervals()`` only; the window-major regrouping of those intervals and the intra-window
visibility are derived once per layout (``layout.derived``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ....layouts import WindowLayout
from ...common.dtypes import acc_dtype
from .cuda import attend, attend_backward  # fused kernels on CUDA, lse_attention elsewhere

# Query rows per masked call in the general prefix path: bounds the staircase
# padding a chunk carries (~ rows/2 keys per row) against per-call overhead.
CHUNK_ROWS = 256
# Windows at least this large use fused causal calls for their intra tile.
FOLD_WINDOW_MIN = 32


# ---------------------------------------------------------------------- storage order


def to_windows(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """[B, H, Nw, *] window rows in storage order -> [B, H, M, w, *] position-major (short last window zero-padded)."""
    b, h, n = x.shape[:3]
    tail = x.shape[3:]
    m, w, st, s = layout.num_windows, layout.window_size, layout.n_streams, layout.slots_per_stream
    if st > 1:
        return x.view(b, h, st, m, s, *tail).transpose(2, 3).reshape(b, h, m, w, *tail)
    pad = m * w - n
    if pad:
        x = torch.cat([x, x.new_zeros(b, h, pad, *tail)], 2)
    return x.reshape(b, h, m, w, *tail)


def from_windows(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Inverse of :func:`to_windows`."""
    b, h, m, w = x.shape[:4]
    tail = x.shape[4:]
    st, s = layout.n_streams, layout.slots_per_stream
    if st > 1:
        return x.view(b, h, m, st, s, *tail).transpose(2, 3).reshape(b, h, m * w, *tail)
    return x.reshape(b, h, m * w, *tail)[:, :, : layout.n_window_tokens]


def _slot_major(x: torch.Tensor) -> torch.Tensor:
    """[B, H, M, w, *] -> [B, H*w, M, *]: slot i of every window becomes head h*w + i."""
    b, h, m, w = x.shape[:4]
    return x.transpose(2, 3).reshape(b, h * w, m, *x.shape[4:])


def _from_slot_major(x: torch.Tensor, h: int) -> torch.Tensor:
    b, hw, m = x.shape[:3]
    return x.view(b, h, hw // h, m, *x.shape[3:]).transpose(2, 3)


def is_staircase(layout: WindowLayout) -> bool:
    """Window t sees context [0, t+1) (K-Forcing Single/DoubleForward): slot-major causal applies."""
    m = layout.num_windows
    return (
        layout.batch_size is None
        and 0 < m <= layout.n_ctx
        and layout.last_window_size == layout.window_size
        and not layout.has_blank_slots
        and not layout.has_sliding_context
        and not bool(layout.prefix_lo.any())
        and torch.equal(layout.prefix_hi, torch.arange(1, m + 1))
    )


# ---------------------------------------------------------------------- prefix pieces


def _window_row_intervals(layout: WindowLayout) -> torch.Tensor:
    """int64 [B', M, w, 1 + S, 2]: the window rows' intervals, position-major (padding rows empty)."""
    return layout.derived("composite.window_row_intervals", lambda: _build_window_row_intervals(layout))


def _build_window_row_intervals(layout: WindowLayout) -> torch.Tensor:
    iv = layout.row_intervals()[:, layout.n_queries - layout.n_window_tokens :]
    nb, n, j = iv.shape[0], iv.shape[1], iv.shape[2]
    m, w, st, s = layout.num_windows, layout.window_size, layout.n_streams, layout.slots_per_stream
    if st > 1:
        return iv.view(nb, st, m, s, j, 2).transpose(1, 2).reshape(nb, m, w, j, 2)
    return torch.cat([iv, iv.new_zeros(nb, m * w - n, j, 2)], 1).view(nb, m, w, j, 2)


def _interval_chunks(lo: torch.Tensor, hi: torch.Tensor, rows_per_chunk: int):
    """Yield ``(r0, r1, klo, khi, allowed or None)`` over chunks of rows with some visible key.

    lo/hi: int64 [B', R], one interval per row. ``allowed`` is bool [B', 1, r1-r0, khi-klo],
    None when every row of the chunk sees exactly ``[klo, khi)``.
    """
    for r0 in range(0, lo.shape[1], rows_per_chunk):
        r1 = min(lo.shape[1], r0 + rows_per_chunk)
        lo_c, hi_c = lo[:, r0:r1], hi[:, r0:r1]
        nonempty = hi_c > lo_c
        if not bool(nonempty.any()):
            continue
        klo, khi = int(lo_c[nonempty].min()), int(hi_c[nonempty].max())
        if bool((lo_c == klo).all()) and bool((hi_c == khi).all()):
            yield r0, r1, klo, khi, None
            continue
        cols = torch.arange(klo, khi)
        yield r0, r1, klo, khi, ((lo_c[..., None] <= cols) & (cols < hi_c[..., None]))[:, None]


def _prefix_chunks(layout: WindowLayout):
    """Yield (m0, m1, klo, khi, allowed or None) per chunk of windows with a non-empty key span."""
    w = layout.window_size
    iv = _window_row_intervals(layout)[..., 0, :].flatten(1, 2)  # [B', M*w, 2]
    for r0, r1, klo, khi, allowed in _interval_chunks(iv[..., 0], iv[..., 1], max(1, CHUNK_ROWS // w) * w):
        yield r0 // w, r1 // w, klo, khi, allowed


def context_chunks(layout: WindowLayout):
    """Context rows of a layout whose context is not plain causal (documents, blocks)."""
    iv = layout.row_intervals()[:, : layout.n_ctx, 0]  # [B', C, 2]
    return _interval_chunks(iv[..., 0], iv[..., 1], CHUNK_ROWS)


def _rows(x: torch.Tensor, m0: int, m1: int) -> torch.Tensor:
    # [B, H, M, w, *] -> rows of windows m0..m1 as [B, H, (m1-m0)*w, *]
    b, h, _, w = x.shape[:4]
    return x[:, :, m0:m1].reshape(b, h, (m1 - m0) * w, *x.shape[4:])


def prefix_forward(qw, k, v, layout, scale):
    """Window -> context attention: (out [B, H, M, w, D], lse [B, H, M, w])."""
    b, h, m, w, d = qw.shape
    if is_staircase(layout):
        o, lse_p = attend(_slot_major(qw), k[:, :, :m], v[:, :, :m], causal=True, scale=scale)
        return _from_slot_major(o, h), _from_slot_major(lse_p, h)
    out = qw.new_zeros(b, h, m, w, d)
    lse = torch.full((b, h, m, w), float("-inf"), dtype=acc_dtype(qw.dtype), device=qw.device)
    for m0, m1, klo, khi, allowed in _prefix_chunks(layout):
        allowed = None if allowed is None else allowed.to(qw.device)
        o, lse_p = attend(
            _rows(qw, m0, m1), k[:, :, klo:khi], v[:, :, klo:khi], causal=False, scale=scale, allowed=allowed
        )
        out[:, :, m0:m1] = o.view(b, h, m1 - m0, w, d)
        lse[:, :, m0:m1] = lse_p.view(b, h, m1 - m0, w)
    return out, lse


def prefix_backward(dow, qw, ow, lw, k, v, layout, scale):
    """Gradients of the prefix piece: (dq [B, H, M, w, D], dk_ctx, dv_ctx [B, Hkv, C, D])."""
    b, h, m, w, d = qw.shape
    dk = torch.zeros(k.shape[0], k.shape[1], layout.n_ctx, d, dtype=acc_dtype(k.dtype), device=k.device)
    dv = torch.zeros_like(dk)
    if is_staircase(layout):
        dq, dk_p, dv_p = attend_backward(
            _slot_major(dow),
            _slot_major(qw),
            k[:, :, :m],
            v[:, :, :m],
            _slot_major(ow),
            _slot_major(lw),
            causal=True,
            scale=scale,
        )
        dk[:, :, :m] += dk_p
        dv[:, :, :m] += dv_p
        return _from_slot_major(dq, h), dk, dv
    dq = torch.zeros_like(qw, dtype=acc_dtype(qw.dtype))  # pieces sum in fp32, one rounding at the end
    for m0, m1, klo, khi, allowed in _prefix_chunks(layout):
        allowed = None if allowed is None else allowed.to(qw.device)
        dq_c, dk_c, dv_c = attend_backward(
            _rows(dow, m0, m1),
            _rows(qw, m0, m1),
            k[:, :, klo:khi],
            v[:, :, klo:khi],
            _rows(ow, m0, m1),
            _rows(lw, m0, m1),
            causal=False,
            scale=scale,
            allowed=allowed,
        )
        dq[:, :, m0:m1] = dq_c.view(b, h, m1 - m0, w, d)
        dk[:, :, klo:khi] += dk_c
        dv[:, :, klo:khi] += dv_c
    return dq, dk, dv


# ---------------------------------------------------------------------- intra-window pieces


def _intra_visible(layout: WindowLayout, device) -> torch.Tensor:
    """bool [B', 1, M, w, w]: slot i of window m sees slot j of the same window (padding slots hidden)."""
    device = str(device)
    return layout.derived(("composite.intra_visible", device), lambda: _build_intra_visible(layout, device))


def _build_intra_visible(layout: WindowLayout, device: str) -> torch.Tensor:
    iv = _window_row_intervals(layout)[..., 1:, :]  # [B', M, w, S, 2]
    keys = layout.window_token_keys  # [M, w], -1 for padding
    keys = keys[None, :, None, None, :]  # [1, M, 1, 1, w]
    seen = (iv[..., 0, None] <= keys) & (keys < iv[..., 1, None]) & (keys >= 0)  # [B', M, w, S, w]
    return seen.any(3)[:, None].to(device)


def _use_fold(layout: WindowLayout) -> bool:
    return layout.window_size >= FOLD_WINDOW_MIN


def _fold(x: torch.Tensor) -> torch.Tensor:
    # [B, H, M, w, *] -> [B*M, H, w, *]: one small attention problem per window.
    b, h, m, w = x.shape[:4]
    return x.transpose(1, 2).reshape(b * m, h, w, *x.shape[4:])


def _unfold(x: torch.Tensor, b: int) -> torch.Tensor:
    bm, h, w = x.shape[:3]
    return x.view(b, bm // b, h, w, *x.shape[3:]).transpose(1, 2)


def _plain_windows(layout: WindowLayout) -> bool:
    """Every window whole and live, so a fused call's own causal / no mask is exact."""
    return layout.last_window_size == layout.window_size and not layout.has_blank_slots


def _fold_mask(layout: WindowLayout, b: int, device) -> Optional[torch.Tensor]:
    if _plain_windows(layout):
        return None
    w = layout.window_size
    vis = _intra_visible(layout, device)[:, 0]  # [B', M, w, w]
    return vis.expand(b, -1, -1, -1).reshape(-1, 1, w, w)


def _loop_per_head(x: torch.Tensor) -> bool:
    """On CPU, one bmm per (batch, head): a batched 5-D matmul may pick different kernels for
    different batch sizes, and we promise the same bits for a sequence alone or in a batch.
    It is also faster once a head holds a few hundred window rows (no copies of the strided
    window slices). Elsewhere one batched matmul."""
    return x.device.type == "cpu"


def _window_mm(x: torch.Tensor, y: torch.Tensor, group: int) -> torch.Tensor:
    """Per-window products: x [B, H, M, w, a] @ y [B, Hy, M, a, c] -> [B, H, M, w, c]; head h uses y's head
    h // group."""
    b, h, m, w = x.shape[:4]
    c = y.shape[-1]
    if _loop_per_head(x):
        out = x.new_empty(b, h, m, w, c)
        for bi in range(b):
            for hi in range(h):
                torch.bmm(x[bi, hi], y[bi, hi // group], out=out[bi, hi])
        return out
    return torch.matmul(x.view(b, y.shape[1], group, m, w, -1), y.unsqueeze(2)).view(b, h, m, w, c)


def _window_mm_t_sum(x: torch.Tensor, y: torch.Tensor, group: int) -> torch.Tensor:
    """x [B, H, M, w, w]^T @ y [B, H, M, w, c], summed over each group of query heads -> [B, H/group, M, w, c]."""
    b, h, m, w = x.shape[:4]
    c = y.shape[-1]
    if _loop_per_head(x):
        out = y.new_zeros(b, h // group, m, w, c)
        for bi in range(b):
            for hi in range(h):
                out[bi, hi // group].baddbmm_(x[bi, hi].transpose(1, 2), y[bi, hi])
        return out
    return torch.matmul(x.transpose(-1, -2), y).view(b, h // group, group, m, w, c).sum(2)


def _scores(qw, kw, scale, layout):
    # qw [B, H, M, w, D], kw [B, Hkv, M, w, D] -> masked scores [B, H, M, w, w] in the accumulation dtype.
    ct = acc_dtype(qw.dtype)
    s = _window_mm(qw.to(ct), kw.to(ct).transpose(-1, -2), qw.shape[1] // kw.shape[1]).mul_(scale)
    return s.masked_fill_(~_intra_visible(layout, qw.device), float("-inf"))


def intra_forward(qw, kw, vw, layout, scale):
    """Window -> own-window attention (the intra-window tiles): qw/kw/vw [B, H(kv), M, w, D] position-major ->
    (out [B, H, M, w, D] q.dtype, lse [B, H, M, w]); a blank slot sees nothing (out 0, lse -inf)."""
    b = qw.shape[0]
    if _use_fold(layout):
        causal = layout.intra == "causal" and _plain_windows(layout)
        o, lse_i = attend(
            _fold(qw), _fold(kw), _fold(vw), causal=causal, scale=scale, allowed=_fold_mask(layout, b, qw.device)
        )
        return _unfold(o, b), _unfold(lse_i, b)
    s = _scores(qw, kw, scale, layout)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(row_max > float("-inf"), row_max, 0.0)  # a blank slot sees nothing
    p = s.sub_(row_max).exp_()
    denom = p.sum(-1, keepdim=True)
    o = _window_mm(p, vw.to(p.dtype), qw.shape[1] // vw.shape[1]).div_(denom.clamp(min=torch.finfo(p.dtype).tiny))
    return o.to(qw.dtype), (row_max + denom.log()).squeeze(-1)


def intra_backward(dow, qw, kw, vw, ow, lw, layout, scale):
    """Gradients of the intra-window piece given the merged ``ow``/``lw``: (dq, dk, dv) like (qw, kw, vw)."""
    b = qw.shape[0]
    if _use_fold(layout):
        causal = layout.intra == "causal" and _plain_windows(layout)
        dq, dk, dv = attend_backward(
            _fold(dow),
            _fold(qw),
            _fold(kw),
            _fold(vw),
            _fold(ow),
            _fold(lw),
            causal=causal,
            scale=scale,
            allowed=_fold_mask(layout, b, qw.device),
        )
        return _unfold(dq, b), _unfold(dk, b), _unfold(dv, b)
    ct = acc_dtype(qw.dtype)
    group = qw.shape[1] // kw.shape[1]
    p = _scores(qw, kw, scale, layout).sub_(lw.to(ct).unsqueeze(-1)).exp_()
    do = dow.to(ct)
    delta = (do * ow.to(ct)).sum(-1, keepdim=True)
    ds = _window_mm(do, vw.to(ct).transpose(-1, -2), group).sub_(delta).mul_(p).mul_(scale)
    dq = _window_mm(ds, kw.to(ct), group)
    return dq, _window_mm_t_sum(ds, qw.to(ct), group), _window_mm_t_sum(p, do, group)

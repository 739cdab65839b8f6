"""``window_attention`` on a :class:`~kforcing_kernels.layouts.QueryRowsLayout` (some rows of a layout).

The backends' kernels plan their tiles from a ``WindowLayout``'s geometry (context tiles, windows
packed per tile), which an arbitrary row subset does not have. This path reads only the row
intervals: query rows are taken in chunks, each chunk attends over the key span its rows' intervals
cover, with the chunk's dense mask (a ``CHUNK_ROWS x span`` bool tensor) and the portable attention
math of ``lse_attention`` (fp32 accumulation, fp64 for fp64). Memory is bounded by the chunk, work
by the chunk's key span (about the rows' attended pairs for the staircase-shaped layouts), not by
``Lq x Lk``. Any device; GQA as in ``window_attention``. Context parallelism runs each rank's
rows through it (``kforcing_kernels.parallel``).
"""

from __future__ import annotations

import torch

from ...layouts.query_rows import QueryRowsLayout
from .lse_attention import acc_dtype, attend, attend_backward

CHUNK_ROWS = 128


def _chunks(layout: QueryRowsLayout, device):
    """Yield ``(rows slice, key lo, key hi, allowed bool [B'|1, 1, r, hi - lo] or None when nothing is seen)``."""
    iv = layout._row_intervals  # [B', R, J, 2]
    for r0 in range(0, layout.n_queries, CHUNK_ROWS):
        rows = slice(r0, min(layout.n_queries, r0 + CHUNK_ROWS))
        part = iv[:, rows]
        seen = part[..., 1] > part[..., 0]
        if not bool(seen.any()):
            yield rows, 0, 0, None
            continue
        lo = int(torch.where(seen, part[..., 0], layout.n_keys).min())
        hi = int(torch.where(seen, part[..., 1], 0).max())
        cols = torch.arange(lo, hi)
        mask = torch.zeros(part.shape[0], part.shape[1], hi - lo, dtype=torch.bool)
        for j in range(part.shape[2]):
            mask |= (part[:, :, j, 0, None] <= cols) & (cols < part[:, :, j, 1, None])
        yield rows, lo, hi, mask[:, None].to(device)


def forward(q, k, v, layout: QueryRowsLayout, scale: float):
    """q [B, H, R, D], k/v [B, Hkv, Lk, D] -> (out [B, H, R, D] q.dtype, lse [B, H, R] acc dtype; -inf where a row sees nothing)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for rows, lo, hi, allowed in _chunks(layout, q.device):
        if allowed is None:
            continue
        o, l = attend(q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], causal=False, scale=scale, allowed=allowed,
                      force_math=True)
        out[:, :, rows], lse[:, :, rows] = o, l
    return out, lse


def backward(dout, q, k, v, out, lse, layout: QueryRowsLayout, scale: float):
    """``(dq, dk, dv)`` shaped like ``(q, k, v)`` from the forward's ``out`` and ``lse``."""
    ct = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv = torch.zeros(v.shape, dtype=ct, device=v.device)
    for rows, lo, hi, allowed in _chunks(layout, q.device):
        if allowed is None:
            continue
        gq, gk, gv = attend_backward(dout[:, :, rows], q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, rows],
                                     lse[:, :, rows], causal=False, scale=scale, allowed=allowed, force_math=True,
                                     acc_grads=True)
        dq[:, :, rows] = gq
        dk[:, :, lo:hi] += gk
        dv[:, :, lo:hi] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class QueryRowsAttention(torch.autograd.Function):
    """Differentiable ``(out, lse)`` of :func:`forward` (lse not differentiated)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: QueryRowsLayout, scale: float):
        out, lse = forward(q, k, v, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward(dout.contiguous(), q, k, v, out, lse, ctx.layout, ctx.scale), None, None)

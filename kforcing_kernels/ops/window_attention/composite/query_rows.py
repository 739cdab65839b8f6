"""The ``composite`` backend on a :class:`~kforcing_kernels.layouts.QueryRowsLayout` (some rows of a layout).

A row subset (a context-parallel rank's rows, an EAGLE-3 step's rows) has no window geometry of
its own to regroup, so the composite backend plans it from the subset's row intervals, as the C++
kernels do: rows are grouped as in ``layouts.intervals.subset_query_tiles`` (the parent's query tiles
restricted to the subset, :data:`GROUP_ROWS` rows a group, context and window rows never mixed), and
each group runs one masked attention call per interval (context part, each window stream) over the
key span that interval covers for the group's rows. The pieces are merged by log-sum-exp; backward
gives each piece the merged ``out``/``lse`` (``lse_attention``'s contract). Work is the groups'
spans, which for the staircase layouts is within a group's spread of the rows' attended pairs, not
``R x Lk``.

Calls go to the composite backend's fused kernels (``cuda.py`` on CUDA, torch's flash CPU
kernel on CPU). A NaN/inf in K or V takes ``masked_keys`` on CPU (as the composite backend on a full
layout): a masked key never reaches a row. Same values as the full layout's rows up to rounding; no
bitwise promise across subsets (the ``cpp`` backend makes that one).
"""

from __future__ import annotations

import torch

from ....layouts.intervals import subset_query_tiles
from ....layouts.query_rows import QueryRowsLayout
from ...common.dtypes import acc_dtype
from .. import masked_keys
from .cuda import attend, attend_backward

# Rows per attention call: groups of the subset's query tiles up to this size (fewer, larger calls
# than the C++ kernels' 64-row tiles; a group's masked area beyond its rows' pairs grows with it).
GROUP_ROWS = 128


def _build_pieces(layout: QueryRowsLayout) -> list:
    """``[(rows int64 [r] (subset indices), key lo, key hi, allowed bool [B', 1, r, hi - lo])]``: one per
    group and interval whose rows see some key through that interval."""
    order_t, begin_t = subset_query_tiles(layout.parent, layout.rows, GROUP_ROWS)
    order, begin = order_t.to(torch.int64), begin_t.tolist()
    iv = layout.row_intervals(copy=False)  # [B', R, J, 2]
    pieces = []
    for t in range(len(begin) - 1):
        group = order[begin[t] : begin[t + 1]]
        for j in range(iv.shape[2]):
            part = iv[:, group, j]  # [B', r, 2]
            seen = part[..., 1] > part[..., 0]
            rows_seeing = seen.any(0)
            if not bool(rows_seeing.any()):
                continue
            rows, part, seen = group[rows_seeing], part[:, rows_seeing], seen[:, rows_seeing]
            lo = int(torch.where(seen, part[..., 0], layout.n_keys).min())
            hi = int(torch.where(seen, part[..., 1], 0).max())
            cols = torch.arange(lo, hi)
            allowed = (part[..., 0, None] <= cols) & (cols < part[..., 1, None])  # [B', r, span]
            pieces.append((rows, lo, hi, allowed[:, None]))
    return pieces


def _pieces(layout: QueryRowsLayout, device: torch.device) -> list:
    cpu = layout.derived(("composite.query_rows_pieces", GROUP_ROWS), lambda: _build_pieces(layout))
    if device.type == "cpu":
        return cpu
    return layout.derived(
        ("composite.query_rows_pieces", GROUP_ROWS, str(device)),
        lambda: [(rows.to(device), lo, hi, allowed.to(device)) for rows, lo, hi, allowed in cpu],
    )


def forward(q, k, v, layout: QueryRowsLayout, scale: float):
    """q [B, H, R, D], k/v [B, Hkv, Lk, D] -> (out [B, H, R, D] q.dtype, lse [B, H, R] acc dtype; -inf where a row
    sees nothing)."""
    if masked_keys.needed(k, v):
        return masked_keys.forward(q, k, v, layout, scale)
    ct = acc_dtype(q.dtype)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=ct, device=q.device)
    parts = []
    for rows, lo, hi, allowed in _pieces(layout, q.device):
        o, lse_p = attend(q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], causal=False, scale=scale, allowed=allowed)
        parts.append((rows, o, lse_p))
        lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lse_p)
    out = torch.zeros(q.shape, dtype=ct, device=q.device)
    finite = torch.where(lse > float("-inf"), lse, 0.0)
    for rows, o, lse_p in parts:  # each piece weighted by its share of the row's softmax mass
        out[:, :, rows] += torch.exp(lse_p - finite[:, :, rows])[..., None] * o.to(ct)
    return out.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, layout: QueryRowsLayout, scale: float):
    """``(dq, dk, dv)`` shaped like ``(q, k, v)`` from the forward's ``out`` and ``lse``."""
    if masked_keys.needed(k, v):
        return masked_keys.backward(dout, q, k, v, layout, scale)
    ct = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv = torch.zeros(v.shape, dtype=ct, device=v.device)
    lse = torch.where(lse > float("-inf"), lse, float("inf"))  # a row that sees nothing: every p = 0
    for rows, lo, hi, allowed in _pieces(layout, q.device):
        gq, gk, gv = attend_backward(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            out[:, :, rows],
            lse[:, :, rows],
            causal=False,
            scale=scale,
            allowed=allowed,
        )
        dq.index_add_(2, rows, gq.to(ct))
        dk[:, :, lo:hi] += gk.to(ct)
        dv[:, :, lo:hi] += gv.to(ct)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

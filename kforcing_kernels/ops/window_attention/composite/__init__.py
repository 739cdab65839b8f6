"""Composite backend: prefix-window attention as a few standard attention calls.

The mask splits into three kinds of pieces (docs/DESIGN.md §2):

* context rows: one causal call over the C context queries (queries="all"), or,
  for packed documents / block-causal contexts, masked calls over chunks of rows;
* window -> prefix rectangles: all windows batched. For the K-Forcing staircase
  (window t sees context [0, t+1)) we regroup window queries *slot-major*: slot i
  of windows 0..M-1 is a length-M sequence whose row t sees keys [0, t+1), i.e.
  plain causal attention, so the w slots become w extra query heads of one causal
  call (GQA lets them share the context K/V). Any other layout is cut into chunks
  of consecutive windows, each one masked call over its key span;
* intra-window tiles: batched over windows (einsum for small windows, a causal
  call per window folded into the batch for large ones).

Window rows are merged by log-sum-exp. Backward reuses the merged output and LSE:
each piece's backward gets them, so no autograd runs through the merge. On CUDA each
call runs in a fused kernel that returns the LSE (cuda.py: flash-attn varlen,
torch's flash / memory-efficient SDPA kernels), elsewhere in lse_attention's paths.

What each row sees comes from ``layout.row_intervals()`` only (interval 0 for the
context and prefix pieces, intervals 1..S for the intra-window piece). A row that
sees no key gets out 0 and LSE -inf, and no gradient.

    __init__.py  the backend: available/supports/forward/backward, per-element CPU runs, the merge
    pieces.py    storage order, prefix chunks (staircase or masked), intra-window products
    cuda.py      fused CUDA kernels for each call (flash-attn, SDPA flash / efficient), with fallback
    query_rows.py  a row subset (QueryRowsLayout): per-interval calls over groups of its rows
    ../lse_attention.py  the portable attention-with-LSE path (shared with reference, masked_keys)
"""

from __future__ import annotations

from typing import Optional

import torch

from ....layouts import QueryRowsLayout, WindowLayout
from ...common.dtypes import acc_dtype
from .. import masked_keys
from . import query_rows
from .cuda import attend, attend_backward  # fused kernels on CUDA, lse_attention elsewhere
from .pieces import (
    context_chunks,
    from_windows,
    intra_backward,
    intra_forward,
    prefix_backward,
    prefix_forward,
    to_windows,
)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Every dtype the op accepts and any head dim."""
    return True


def available() -> Optional[str]:
    return None


# ---------------------------------------------------------------------- entry points


def _per_element(fn, tensors, layout: WindowLayout, *args):
    """On CPU, run ``fn`` once per batch element on fresh contiguous copies and concatenate.

    BLAS and the fused CPU attention kernels may take different code paths for different
    batch sizes and memory alignments; one element at a time, on freshly allocated
    tensors, a sequence gets the same bits alone or in any batch (docs/DESIGN.md §3).
    """
    if layout.batch_size == 1:  # per-batch ranges of one element: that element's layout, so the same pieces
        layout = _element_layout(layout, 0)  # as inside a batch (a one-document row is a staircase there)
    if tensors[0].device.type != "cpu" or tensors[0].shape[0] <= 1:
        return fn(*tensors, layout, *args)
    parts = [
        fn(*(t[b : b + 1].contiguous() for t in tensors), _element_layout(layout, b), *args)
        for b in range(tensors[0].shape[0])
    ]
    return tuple(torch.cat(outs, 0) for outs in zip(*parts))


def _element_layout(layout: WindowLayout, b: int) -> WindowLayout:
    """Batch element ``b``'s layout; per-batch layouts derive all of theirs once (each keeps its own pieces)."""
    n = layout.batch_size
    if n is None:
        return layout
    return layout.derived("composite.batch_elements", lambda: tuple(layout.batch_element(i) for i in range(n)))[b]


def forward(q, k, v, layout: WindowLayout, scale: float):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> (out [B, H, Lq, D], lse [B, H, Lq] fp32, fp64 for fp64 inputs).

    On CPU a NaN/inf in K or V takes ``masked_keys`` (its products touch only the keys a row
    sees), so it never reaches a row that does not see it; on CUDA the fused kernels are
    FlashAttention-like (keep K/V finite)."""
    if isinstance(layout, QueryRowsLayout):  # a row subset: planned from its rows' intervals
        return query_rows.forward(q, k, v, layout, scale)
    if masked_keys.needed(k, v):
        return masked_keys.forward(q, k, v, layout, scale)
    return _per_element(_forward, (q, k, v), layout, scale)


def backward(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    """Gradients (dq, dk, dv) given the forward's final ``out`` and ``lse`` (non-finite K/V: see ``forward``)."""
    if isinstance(layout, QueryRowsLayout):
        return query_rows.backward(dout, q, k, v, out, lse, layout, scale)
    if masked_keys.needed(k, v):
        return masked_keys.backward(dout, q, k, v, layout, scale)
    return _per_element(_backward, (dout, q, k, v, out, lse), layout, scale)


def _forward(q, k, v, layout: WindowLayout, scale: float):
    c, nw = layout.n_ctx, layout.n_window_tokens
    out = torch.empty_like(q)
    ct = acc_dtype(q.dtype)
    lse = torch.empty(q.shape[:3], dtype=ct, device=q.device)
    if layout.queries == "all" and c:
        if layout.has_default_context:
            out[:, :, :c], lse[:, :, :c] = attend(q[:, :, :c], k[:, :, :c], v[:, :, :c], causal=True, scale=scale)
        else:
            out[:, :, :c] = 0
            lse[:, :, :c] = float("-inf")
            for r0, r1, klo, khi, allowed in context_chunks(layout):
                allowed = None if allowed is None else allowed.to(q.device)
                out[:, :, r0:r1], lse[:, :, r0:r1] = attend(
                    q[:, :, r0:r1], k[:, :, klo:khi], v[:, :, klo:khi], causal=False, scale=scale, allowed=allowed
                )
    if nw:
        qw = to_windows(q[:, :, -nw:], layout)
        o_i, l_i = intra_forward(qw, to_windows(k[:, :, c:], layout), to_windows(v[:, :, c:], layout), layout, scale)
        o_p, l_p = prefix_forward(qw, k, v, layout, scale)
        lse_w = torch.logaddexp(l_p, l_i)
        # exp(l_p - lse_w) == sigmoid(l_p - l_i): one fused lerp pass; an empty prefix (l_p = -inf) gives o_i,
        # and a blank row (both -inf) keeps o_i = 0.
        weight = torch.where(lse_w > float("-inf"), torch.sigmoid(l_p - l_i), 0.0)
        o = torch.lerp(o_i.to(ct), o_p.to(ct), weight[..., None])
        out[:, :, -nw:] = from_windows(o.to(q.dtype), layout)
        lse[:, :, -nw:] = from_windows(lse_w, layout)
    return out, lse


def _backward(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    c, nw = layout.n_ctx, layout.n_window_tokens
    dq = torch.empty_like(q)
    ct = acc_dtype(q.dtype)
    dk_ctx = torch.zeros(k.shape[0], k.shape[1], c, k.shape[3], dtype=ct, device=k.device)
    dv_ctx = torch.zeros_like(dk_ctx)
    # Rows that saw no key (LSE -inf): +inf makes every probability exp(s - lse) zero.
    lse = torch.where(lse > float("-inf"), lse, float("inf"))
    if layout.queries == "all" and c:
        if layout.has_default_context:
            dq[:, :, :c], dk_c, dv_c = attend_backward(
                dout[:, :, :c],
                q[:, :, :c],
                k[:, :, :c],
                v[:, :, :c],
                out[:, :, :c],
                lse[:, :, :c],
                causal=True,
                scale=scale,
            )
            dk_ctx += dk_c
            dv_ctx += dv_c
        else:
            dq[:, :, :c] = 0
            for r0, r1, klo, khi, allowed in context_chunks(layout):
                allowed = None if allowed is None else allowed.to(q.device)
                dq[:, :, r0:r1], dk_c, dv_c = attend_backward(
                    dout[:, :, r0:r1],
                    q[:, :, r0:r1],
                    k[:, :, klo:khi],
                    v[:, :, klo:khi],
                    out[:, :, r0:r1],
                    lse[:, :, r0:r1],
                    causal=False,
                    scale=scale,
                    allowed=allowed,
                )
                dk_ctx[:, :, klo:khi] += dk_c
                dv_ctx[:, :, klo:khi] += dv_c
    dk_win = dv_win = k.new_zeros(k.shape[0], k.shape[1], 0, k.shape[3])
    if nw:
        win = lambda x: to_windows(x[:, :, -nw:], layout)  # noqa: E731
        qw, dow, ow, lw = win(q), win(dout), win(out), win(lse)
        kw, vw = to_windows(k[:, :, c:], layout), to_windows(v[:, :, c:], layout)
        dq_i, dk_i, dv_i = intra_backward(dow, qw, kw, vw, ow, lw, layout, scale)
        dq_p, dk_p, dv_p = prefix_backward(dow, qw, ow, lw, k, v, layout, scale)
        dq[:, :, -nw:] = from_windows((dq_i.to(ct) + dq_p.to(ct)).to(q.dtype), layout)
        dk_ctx += dk_p
        dv_ctx += dv_p
        dk_win, dv_win = from_windows(dk_i, layout), from_windows(dv_i, layout)
    dk = torch.cat([dk_ctx.to(k.dtype), dk_win.to(k.dtype)], 2)
    dv = torch.cat([dv_ctx.to(v.dtype), dv_win.to(v.dtype)], 2)
    return dq, dk, dv

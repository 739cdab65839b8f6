"""Attention that non-finite values at masked keys cannot reach (a helper of the Python backends).

A dense or tiled kernel computes ``P @ V`` over whole tiles: a key a row cannot see gets
``p = 0``, but ``0 * inf`` is NaN, so ``V = inf`` (or ``K = NaN`` in a dot product) at a
masked key would still reach that row. ``reference`` (any device) and ``composite`` (CPU)
compute with this module when K or V holds a non-finite value: every product is formed
from masked copies of K and V, so a row only ever touches the keys it sees (also in the
backward: no NaN through ``where``). It is the math of the reference, chunked over query
rows: slow, and only taken when such values exist. The ``cpp`` kernels keep masked keys
out of their products themselves (csrc/kf_isa_impl.h) and never come here.
"""

from __future__ import annotations

from typing import Union

import torch

from ...layouts import QueryRowsLayout, WindowLayout
from ..common.dtypes import acc_dtype

_ROW_CHUNK = 64


def has_nonfinite(*tensors: torch.Tensor) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def needed(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a CPU backend must take this path: CPU tensors and a NaN/inf in K or V."""
    return k.device.type == "cpu" and has_nonfinite(k, v)


def _chunks(q, k, v, layout: Union[WindowLayout, QueryRowsLayout], scale: float):
    """Yield per chunk of query rows: (rows, seen [B', 1, r, Lk], masked K [B, H, r, Lk, D], masked V,
    p [B, H, r, Lk], lse [B, H, r])."""
    ct = acc_dtype(q.dtype)
    mask = layout.dense_mask().to(q.device)
    mask = mask[None] if mask.dim() == 2 else mask  # [B', Lq, Lk]
    g = q.shape[1] // k.shape[1]
    kf = k.to(ct).repeat_interleave(g, 1)[:, :, None]  # [B, H, 1, Lk, D]
    vf = v.to(ct).repeat_interleave(g, 1)[:, :, None]
    for r0 in range(0, q.shape[2], _ROW_CHUNK):
        rows = slice(r0, min(q.shape[2], r0 + _ROW_CHUNK))
        seen = mask[:, None, rows, :, None]  # [B', 1, r, Lk, 1]
        k_seen = torch.where(seen, kf, 0.0)  # a row's products only ever touch the keys it sees
        v_seen = torch.where(seen, vf, 0.0)
        s = (q[:, :, rows, None].to(ct) * k_seen).sum(-1) * scale  # [B, H, r, Lk]
        s = torch.where(seen[..., 0], s, float("-inf"))
        lse = torch.logsumexp(s, -1)  # -inf for a row that sees nothing
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        yield rows, seen[..., 0], k_seen, v_seen, p, lse


def forward(q, k, v, layout: Union[WindowLayout, QueryRowsLayout], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, Lq, D] q.dtype, lse [B, H, Lq])``; a row sees only its own keys' values."""
    outs, lses = [], []
    for _, _, _, v_seen, p, lse in _chunks(q, k, v, layout, scale):
        outs.append((p[..., None] * v_seen).sum(-2))
        lses.append(lse)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def backward(dout, q, k, v, layout: Union[WindowLayout, QueryRowsLayout], scale: float):
    """``(dq, dk, dv)`` of :func:`forward`, written out (products again only over seen keys)."""
    ct = acc_dtype(q.dtype)
    b, h, _, d = q.shape
    hkv = k.shape[1]
    dq = torch.empty(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(b, h, k.shape[2], d, dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    for rows, seen, k_seen, v_seen, p, _ in _chunks(q, k, v, layout, scale):
        do = dout[:, :, rows].to(ct)
        out = (p[..., None] * v_seen).sum(-2)
        dp = (do[:, :, :, None] * v_seen).sum(-1)  # [B, H, r, Lk]
        # where(), not p * (...): a row whose output is NaN/inf must not spread it to keys it does not see.
        ds = torch.where(seen, p * (dp - (do * out).sum(-1, keepdim=True)), 0.0)
        dq[:, :, rows] = (ds[..., None] * k_seen).sum(-2) * scale
        dk += torch.einsum("bhrj,bhrd->bhjd", ds, q[:, :, rows].to(ct)) * scale
        dv += torch.einsum("bhrj,bhrd->bhjd", p, do)
    group = lambda t: t.view(b, hkv, h // hkv, *t.shape[2:]).sum(2)  # noqa: E731
    return dq.to(q.dtype), group(dk).to(k.dtype), group(dv).to(v.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale):
        out, lse = forward(q, k, v, layout, scale)
        ctx.save_for_backward(q, k, v)
        ctx.layout, ctx.scale = layout, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*backward(dout, *ctx.saved_tensors, ctx.layout, ctx.scale), None, None)


def attention(q, k, v, layout: WindowLayout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`forward` (the eager reference path)."""
    return _Attention.apply(q, k, v, layout, scale)

"""Standard attention calls that also return the log-sum-exp, with their backward.

The composite backend is built from these: each piece of a prefix-window mask is
one standard (causal, unmasked or masked) attention call, and pieces are merged
by log-sum-exp. Backward of a piece is called with the *merged* output and LSE:
softmax probabilities then come out already normalised over all pieces, and
``delta = rowsum(dO * O)`` is the merged one, so per-piece gradients add up.

On CPU the forward is PyTorch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``),
which returns the LSE and supports GQA. Its backward is not used: on CPUs with AMX (Sapphire Rapids,
torch 2.13) its dq and dK come out with other bits for another thread count (1 vs 2 threads: dK differs
from 270 rows on, dq from 1024), which breaks the backends' promise of bits independent of the thread
count (python_tests/ops/window_attention/test_determinism.py). The CPU backward is
:func:`_attend_tiled_backward` instead: the flash backward's work, cut the same way whatever the thread
count. Query rows go in tiles of
``_TILE_ROWS`` rows (a query head group's rows stacked, GQA folded into the rows of one matmul), each
tile only over the keys it can see (a causal tile stops at its last row, a masked one at the span of its
visible keys: no work on the masked triangle), and dK/dV add the tiles' products in tile order. The
partition depends on the shapes and the mask only, and each product is one fixed-shape matmul, so the
bits do not depend on how many threads run it; its speed is the flash backward's (the foundation
benchmark: BENCHMARKS.md). ``force_math`` (the ``reference`` backend, the oracle) keeps the plain
query-chunked matmul path, written independently of the tiles.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common.dtypes import acc_dtype

# Rows processed at once by the portable path; bounds the fp32 score buffer.
_MATH_ROW_CHUNK = 1024
# Query rows of one tile of the CPU backward, all heads of a GQA group together (so a tile's matmuls have
# _TILE_ROWS rows): a tile's fp32 scores (_TILE_ROWS x keys) stay in cache. Measured on the foundation
# benchmark's shapes (lse_attention's module docstring): 256 rows run the flash backward's speed.
_TILE_ROWS = 256


def _use_flash_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype))


def attend(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    *,
    causal: bool,
    scale: float,
    allowed: Optional[torch.Tensor] = None,  # bool [B or 1, 1, Lq, Lk]; True = visible
    force_math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention returning ``(out [B, H, Lq, D] in q.dtype, lse [B, H, Lq] in acc_dtype)``.

    ``causal`` is top-left aligned (query i sees keys 0..i). Rows that see no key
    get ``out = 0`` and ``lse = -inf``.
    """
    if _use_flash_cpu(q) and not force_math:
        mask = None if allowed is None else _additive_mask(allowed, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        if allowed is not None:
            empty = ~allowed.any(-1)  # [B|1, 1, Lq]
            if bool(empty.any()):
                lse = lse.masked_fill(empty, float("-inf"))
                out = out.masked_fill(empty[..., None], 0.0)
        return out, lse
    return _attend_math(q, k, v, causal=causal, scale=scale, allowed=allowed)


def attend_backward(
    dout: torch.Tensor,  # [B, H, Lq, D]
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,  # merged output over all pieces
    lse: torch.Tensor,  # [B, H, Lq] acc_dtype, merged over all pieces
    *,
    causal: bool,
    scale: float,
    allowed: Optional[torch.Tensor] = None,
    force_math: bool = False,
    acc_grads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one piece given the merged ``out``/``lse``: ``(dq, dk, dv)`` like q, k, v.

    ``acc_grads``: they come back in the accumulation dtype instead, for a caller that sums pieces
    (each rounding to bf16 would add up over the pieces). On CPU the tiled backward (bits independent
    of the thread count, module docstring); ``force_math`` or another device: the plain matmul path."""
    if q.device.type == "cpu" and not force_math:
        return _attend_tiled_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, allowed=allowed, acc_grads=acc_grads
        )
    return _attend_math_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, allowed=allowed, acc_grads=acc_grads
    )


# ---------------------------------------------------------------------- portable path


def _visible(q_rows: slice, lk: int, causal: bool, allowed: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    vis = None
    if causal:
        rows = torch.arange(q_rows.start, q_rows.stop, device=device)
        vis = (torch.arange(lk, device=device)[None, :] <= rows[:, None])[None, None]
    if allowed is not None:
        a = allowed[:, :, q_rows]
        vis = a if vis is None else (vis & a)
    return vis


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, H, L, D] -> [B, Hkv, g, L, D] so that query head h uses kv head h // g.
    b, h, length, d = x.shape
    return x.view(b, h // groups, groups, length, d)


def _attend_math(q, k, v, *, causal, scale, allowed):
    b, h, lq, d = q.shape
    g = h // k.shape[1]
    ct = acc_dtype(q.dtype)
    kf, vf = k.to(ct)[:, :, None], v.to(ct)[:, :, None]  # [B, Hkv, 1, Lk, D]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, lq, dtype=ct, device=q.device)
    for r0 in range(0, lq, _MATH_ROW_CHUNK):
        rows = slice(r0, min(lq, r0 + _MATH_ROW_CHUNK))
        qc = _grouped(q[:, :, rows], g).to(ct)
        s = (qc @ kf.transpose(-1, -2)) * scale  # [B, Hkv, g, r, Lk]
        vis = _visible(rows, k.shape[2], causal, allowed, q.device)
        if vis is not None:
            s = s.masked_fill(~vis[:, :, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = (p @ vf) / denom.clamp(min=torch.finfo(ct).tiny)
        out[:, :, rows] = o.reshape(b, h, -1, d).to(q.dtype)
        lse[:, :, rows] = (m + torch.log(denom)).reshape(b, h, -1)
    return out, lse


def _attend_math_backward(dout, q, k, v, out, lse, *, causal, scale, allowed, acc_grads=False):
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    ct = acc_dtype(q.dtype)
    kf, vf = k.to(ct)[:, :, None], v.to(ct)[:, :, None]
    dq = torch.empty_like(q, dtype=ct if acc_grads else q.dtype)
    dk = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv = torch.zeros(v.shape, dtype=ct, device=v.device)
    for r0 in range(0, lq, _MATH_ROW_CHUNK):
        rows = slice(r0, min(lq, r0 + _MATH_ROW_CHUNK))
        qc = _grouped(q[:, :, rows], g).to(ct)
        doc = _grouped(dout[:, :, rows], g).to(ct)
        oc = _grouped(out[:, :, rows], g).to(ct)
        lc = lse[:, :, rows].view(b, hkv, g, -1, 1).to(ct)
        s = (qc @ kf.transpose(-1, -2)) * scale
        p = torch.exp(s - lc)
        vis = _visible(rows, k.shape[2], causal, allowed, q.device)
        if vis is not None:
            p = p.masked_fill(~vis[:, :, None], 0.0)
        delta = (doc * oc).sum(-1, keepdim=True)
        dp = doc @ vf.transpose(-1, -2)
        ds = p * (dp - delta)
        dq[:, :, rows] = ((ds @ kf) * scale).reshape(b, h, -1, d).to(dq.dtype)
        dk += ((ds.transpose(-1, -2) @ qc) * scale).sum(2)
        dv += (p.transpose(-1, -2) @ doc).sum(2)
    if acc_grads:
        return dq, dk, dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------- tiled CPU backward


def _tile_span(r0: int, r1: int, lk: int, causal: bool, allowed: Optional[torch.Tensor]) -> tuple[int, int]:
    """``[klo, khi)``: the keys rows ``[r0, r1)`` can see (causal: up to the last row; a mask: its visible
    columns' span, over the whole batch). Empty (``klo >= khi``) when no row of the tile sees a key."""
    klo, khi = 0, min(lk, r1) if causal else lk
    if allowed is not None:
        cols = allowed[:, :, r0:r1, :khi].any(2).flatten(0, 1).any(0).nonzero()
        if cols.numel() == 0:
            return 0, 0
        klo, khi = int(cols[0]), int(cols[-1]) + 1
    return klo, khi


def _tile_rows(x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """[B, Hkv, g, L, *] -> rows ``[r0, r1)`` of a K/V head's g query heads stacked: [B * Hkv, g * (r1 - r0), *]."""
    b, hkv, g = x.shape[:3]
    return x[:, :, :, r0:r1].reshape(b * hkv, g * (r1 - r0), -1)


def _attend_tiled_backward(dout, q, k, v, out, lse, *, causal, scale, allowed, acc_grads=False):
    """The CPU backward (module docstring): tiles of query rows, each over the keys it sees.

    Per tile (rows ``[r0, r1)`` of the ``g`` query heads sharing a K/V head, stacked into ``g * r`` rows):
    ``P = exp(Q K^T scale - lse)`` over the tile's keys, masked; ``dS = P (dO V^T - delta)``;
    ``dQ = dS K scale``, ``dK += dS^T Q scale``, ``dV += P^T dO``, the tiles added in order."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    ct = acc_dtype(q.dtype)
    rows = max(1, _TILE_ROWS // g)  # query rows per head in a tile
    kf = k.to(ct).reshape(b * hkv, lk, d)
    vf = v.to(ct).reshape(b * hkv, lk, d)
    qg, dog = q.reshape(b, hkv, g, lq, d), dout.reshape(b, hkv, g, lq, d)
    delta = (dout.to(ct) * out.to(ct)).sum(-1).reshape(b, hkv, g, lq)  # rowsum(dO * O), the merged one
    lse_g = lse.to(ct).reshape(b, hkv, g, lq)
    dq = torch.zeros(b, hkv, g, lq, d, dtype=ct if acc_grads else q.dtype, device=q.device)
    dk = torch.zeros(b * hkv, lk, d, dtype=ct, device=k.device)
    dv = torch.zeros_like(dk)
    for r0 in range(0, lq, rows):
        r1 = min(lq, r0 + rows)
        klo, khi = _tile_span(r0, r1, lk, causal, allowed)
        if klo >= khi:  # no row of the tile sees a key: no gradient
            continue
        r, span = r1 - r0, khi - klo
        qc, doc = _tile_rows(qg, r0, r1).to(ct), _tile_rows(dog, r0, r1).to(ct)
        kc, vc = kf[:, klo:khi], vf[:, klo:khi]
        # P [B * Hkv, g * r, span]
        p = torch.bmm(qc, kc.transpose(1, 2)).mul_(scale).sub_(_tile_rows(lse_g[..., None], r0, r1)).exp_()
        if allowed is not None:
            vis = allowed[:, :, r0:r1, klo:khi]
            if causal:
                vis = vis & (torch.arange(klo, khi, device=q.device) <= torch.arange(r0, r1, device=q.device)[:, None])
            p.view(b, hkv, g, r, span).masked_fill_(~vis[:, :, None], 0.0)
        elif causal and khi > r0:  # only the diagonal block holds keys past a row: mask it alone
            hidden = torch.arange(r0, khi, device=q.device) > torch.arange(r0, r1, device=q.device)[:, None]
            p.view(b * hkv, g, r, span)[..., r0 - klo :].masked_fill_(hidden, 0.0)
        ds = torch.bmm(doc, vc.transpose(1, 2)).sub_(_tile_rows(delta[..., None], r0, r1)).mul_(p)
        dq[:, :, :, r0:r1] = torch.bmm(ds, kc).mul_(scale).view(b, hkv, g, r, d)
        dk[:, klo:khi] += torch.bmm(ds.transpose(1, 2), qc).mul_(scale)
        dv[:, klo:khi] += torch.bmm(p.transpose(1, 2), doc)
    dq, dk, dv = dq.view(b, h, lq, d), dk.view(k.shape), dv.view(v.shape)
    if acc_grads:
        return dq, dk, dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)

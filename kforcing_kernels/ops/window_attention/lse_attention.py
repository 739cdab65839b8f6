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
count (python_tests/ops/window_attention/test_determinism.py). The backward is the portable matmul path (fp32 math,
query-chunked), as elsewhere: thread-invariant, and ~5x slower than the flash backward on CPU (the
default CPU backend is the C++ extension, not this one).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common.dtypes import acc_dtype

# Rows processed at once by the portable path; bounds the fp32 score buffer.
_MATH_ROW_CHUNK = 1024


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
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
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

    ``acc_grads``: the portable path returns them in the accumulation dtype instead, for a
    caller that sums pieces (each rounding to bf16 would add up over the pieces). ``force_math`` is
    accepted as :func:`attend` takes it: the backward always runs the portable path."""
    # Not torch's flash CPU backward: its bits depend on the thread count on some CPUs (module docstring).
    return _attend_math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, allowed=allowed,
                                 acc_grads=acc_grads)


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

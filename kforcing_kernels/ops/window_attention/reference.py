"""Reference backend: the layout's dense mask handed to SDPA. The oracle; O((C + Mw)^2)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...layouts import WindowLayout
from .lse_attention import acc_dtype


def available() -> Optional[str]:
    return None


def attention(q, k, v, layout: WindowLayout, scale: float, *, with_lse: bool = True):
    """Differentiable ``(out [B, H, Lq, D], lse [B, H, Lq] (fp32, fp64 for fp64) or None)`` through plain torch ops."""
    mask = layout.dense_mask().to(q.device)
    if mask.dim() == 3:
        mask = mask[:, None]  # per-batch ranges: [B, 1, Lq, Lk]
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if not with_lse:
        return out, None
    g = q.shape[1] // k.shape[1]
    ct = acc_dtype(q.dtype)
    s = (q.to(ct) @ k.to(ct).repeat_interleave(g, 1).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
    return out, lse

"""Reference backend: the layout's dense mask and plain attention math. The oracle; O((C + Mw)^2).

``forward``/``backward`` (the backend protocol, what ``window_attention`` runs) use the
portable fp32/fp64 math of ``lse_attention`` with the dense mask; ``attention`` is the
same result through ``F.scaled_dot_product_attention`` and autograd, an independent
path the tests use as an oracle.

Non-finite values: when K or V holds a NaN/inf (on any device), ``forward``/``backward``
compute with ``masked_keys`` instead, whose products only touch the keys a row sees, so
such a value at a key a row does not see never reaches that row (``lse_attention`` would
form ``0 * inf`` in ``P @ V``). Finite inputs take the dense path unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...layouts import WindowLayout
from ..common.dtypes import acc_dtype
from . import masked_keys
from .lse_attention import attend, attend_backward


def available() -> Optional[str]:
    return None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return True


def _allowed(layout: WindowLayout, device: torch.device) -> torch.Tensor:
    """bool [B or 1, 1, Lq, Lk]: the layout's dense mask, shaped for ``attend``."""
    mask = layout.dense_mask().to(device)
    return mask[:, None] if mask.dim() == 3 else mask[None, None]


def forward(q, k, v, layout: WindowLayout, scale: float):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> (out [B, H, Lq, D], lse [B, H, Lq] fp32, fp64 for fp64)."""
    if masked_keys.has_nonfinite(k, v):
        return masked_keys.forward(q, k, v, layout, scale)
    return attend(q, k, v, causal=False, scale=scale, allowed=_allowed(layout, q.device), force_math=True)


def backward(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    """Gradients (dq, dk, dv) from the forward's ``out`` and ``lse``."""
    if masked_keys.has_nonfinite(k, v):
        return masked_keys.backward(dout, q, k, v, layout, scale)
    return attend_backward(
        dout, q, k, v, out, lse, causal=False, scale=scale, allowed=_allowed(layout, q.device), force_math=True
    )


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

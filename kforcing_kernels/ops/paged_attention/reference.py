"""Reference backend: gather each request's pages into a contiguous cache, then dense masked attention.

The oracle for the other backends: it copies the whole cache (O(L) per call) and
builds the mask explicitly, computed in float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def available() -> Optional[str]:
    return None


def gather_cache(pages: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """pages ``[P, S, Hkv, D]`` -> contiguous ``[B, Hkv, L_max, D]``; positions ``>= len_b`` of request b are zero."""
    _, s, hkv, d = pages.shape
    b = block_table.shape[0]
    l_max = int(context_lens.max()) if b else 0
    out = pages.new_zeros(b, hkv, l_max, d)
    for i in range(b):
        n = int(context_lens[i])
        if n == 0:
            continue
        ids = block_table[i, : math.ceil(n / s)].long()
        out[i, :, :n] = pages[ids].reshape(-1, hkv, d)[:n].transpose(0, 1)
    return out


def forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float) -> torch.Tensor:
    """See :func:`kforcing_kernels.ops.paged_attention.paged_attention`; context_lens int64 on CPU."""
    b, h, w, d = q.shape
    hkv = k_new.shape[1]
    k_ctx = gather_cache(k_pages, block_table, context_lens)
    v_ctx = gather_cache(v_pages, block_table, context_lens)
    l_max = k_ctx.shape[2]
    keys = torch.cat([k_ctx, k_new], 2).double().repeat_interleave(h // hkv, 1)  # [B, H, L_max + W, D]
    vals = torch.cat([v_ctx, v_new], 2).double().repeat_interleave(h // hkv, 1)
    # Row i of request b sees context [0, len_b) and window slots 0..i.
    col = torch.arange(l_max + w)
    row = torch.arange(w)
    ctx_ok = col[None, None, :] < context_lens[:, None, None]  # [B, 1, Lk]
    win_ok = (col[None, :] >= l_max) & (col[None, :] - l_max <= row[:, None])  # [W, Lk]
    allowed = ((ctx_ok & (col < l_max)) | win_ok[None]).to(q.device)  # [B, W, Lk]
    s = (q.double() @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(s, -1) @ vals  # every row sees at least its own slot; unseen cache slots were never gathered
    return out.to(q.dtype)

"""Composite backend: torch ops over chunks of pages, merged with an online softmax.

The cache is read in place, a chunk of page columns of the block table at a time
(``CHUNK_TOKENS`` keys per request): each chunk's pages are picked out of the pool
with one index (a copy of that chunk only, never of the whole cache), scored
against all query rows of the batch in fp32 (fp64 for fp64 inputs), and folded
into running (max, normaliser, accumulator) rows. The window's own keys (causal)
start the fold, so every row is finite from the start.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..common.dtypes import acc_dtype

# Context keys per request scored at once: bounds the fp32 score / K/V chunk buffers.
CHUNK_TOKENS = 512


def available() -> Optional[str]:
    return None


def forward(
    q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float, static: bool = False
) -> torch.Tensor:
    """See :func:`kforcing_kernels.ops.paged_attention.paged_attention`; context_lens int64 on CPU.

    ``static``: context_lens may sit on q's device and every column of ``block_table`` is read (masked past each
    length), so the work has a fixed shape and no host sync (``paged_attention_unchecked``); the same bits.
    """
    b, h, w, d = q.shape
    hkv = k_new.shape[1]
    g = h // hkv
    ct = acc_dtype(q.dtype)
    qg = q.reshape(b, hkv, g * w, d).to(ct) * scale  # GQA: query head h uses kv head h // g; rows (group, slot)

    # The window itself: slot i sees slots 0..i.
    s = qg @ k_new.to(ct).transpose(-1, -2)  # [B, Hkv, gW, W]
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).tril().repeat(g, 1)  # [gW, W]
    s = s.masked_fill(~causal, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    acc = p @ v_new.to(ct)  # [B, Hkv, gW, D]

    page = k_pages.shape[1]
    if static:
        n_pages = block_table.shape[1]
    else:
        l_max = int(context_lens.max()) if b else 0
        n_pages = math.ceil(l_max / page)
    per = max(1, CHUNK_TOKENS // page)
    lens = context_lens.to(q.device)
    # Columns past a request's last page may hold anything (vLLM pads them): read page 0 there, then mask.
    used = torch.arange(n_pages, device=q.device)[None] < ((lens + page - 1) // page)[:, None]
    table = torch.where(used, block_table[:, :n_pages].long(), 0)
    for c0 in range(0, n_pages, per):
        c1 = min(n_pages, c0 + per)
        ids = table[:, c0:c1]  # [B, n]
        kc = k_pages[ids].reshape(b, -1, hkv, d).permute(0, 2, 1, 3).to(ct)  # [B, Hkv, n*S, D]
        vc = v_pages[ids].reshape(b, -1, hkv, d).permute(0, 2, 1, 3).to(ct)
        pos = torch.arange(c0 * page, c1 * page, device=q.device)
        seen = pos[None] < lens[:, None]  # [B, n*S]
        sc = (qg @ kc.transpose(-1, -2)).masked_fill(~seen[:, None, None], float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1, keepdim=True))  # finite: m already is
        alpha = torch.exp(m - m_new)
        pc = torch.exp(sc - m_new)
        # Keys a row cannot see must not reach it even when their V is inf/NaN (stale or junk slots).
        vc = vc.masked_fill(~seen[:, None, :, None], 0.0)
        denom = denom * alpha + pc.sum(-1, keepdim=True)
        acc = acc * alpha + pc @ vc
        m = m_new
    return (acc / denom).reshape(b, h, w, d).to(q.dtype)

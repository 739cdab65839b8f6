"""FlexAttention interop, derived from the row intervals: ``mask_mod``, tile counts, ``BlockMask``."""

from __future__ import annotations

from typing import Union

import torch

from .base import LayoutBase


def mask_mod(iv: torch.Tensor, per_batch: bool, device: Union[str, torch.device] = "cpu"):
    """``mask_mod(b, h, q_idx, kv_idx)``: whether row ``q_idx`` sees ``kv_idx`` (union of its intervals)."""
    iv = iv.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        bi = b if per_batch else 0
        seen = (iv[bi, q_idx, 0, 0] <= kv_idx) & (kv_idx < iv[bi, q_idx, 0, 1])
        for j in range(1, iv.shape[2]):
            seen = seen | ((iv[bi, q_idx, j, 0] <= kv_idx) & (kv_idx < iv[bi, q_idx, j, 1]))
        return seen

    return mask_mod


def block_counts(iv: torch.Tensor, n_keys: int, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile classification at (block_q, block_k) from row intervals, in O(L * Lk/block_k).

    Returns bool ``(any, full)`` of shape [B', nQ, nK]: a tile has some visible pair,
    or all of its pairs visible (tiles that overhang the sequence end count as full
    when every in-range pair is visible).
    """
    nb, lq = iv.shape[0], iv.shape[1]
    nq, nk = -(-lq // block_q), -(-n_keys // block_k)
    k0 = torch.arange(nk) * block_k
    k1 = torch.clamp(k0 + block_k, max=n_keys)
    overlap = (torch.minimum(iv[..., 1, None], k1) - torch.maximum(iv[..., 0, None], k0)).clamp(min=0).sum(2)
    pad = nq * block_q - lq
    seen_any = overlap > 0
    seen_all = overlap == (k1 - k0)
    if pad:
        seen_any = torch.cat([seen_any, torch.zeros(nb, pad, nk, dtype=torch.bool)], 1)
        seen_all = torch.cat([seen_all, torch.ones(nb, pad, nk, dtype=torch.bool)], 1)
    tile_any = seen_any.view(nb, nq, block_q, nk).any(2)
    tile_full = seen_all.view(nb, nq, block_q, nk).all(2) & tile_any
    return tile_any, tile_full


def to_block_mask(layout: LayoutBase, block_size: int = 128, device: Union[str, torch.device] = "cpu"):
    """A FlexAttention ``BlockMask`` for ``layout``, built analytically (no mask_mod sweep)."""
    from torch.nn.attention.flex_attention import BlockMask

    tile_any, tile_full = layout.block_counts(block_size, block_size)
    partial = tile_any & ~tile_full

    def to_indices(sel: torch.Tensor):
        n = sel.sum(-1).to(torch.int32)
        # Stable sort puts the selected key blocks first, in increasing order.
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return n[:, None].to(device), order[:, None].to(device)

    kv_num, kv_idx = to_indices(partial)
    full_num, full_idx = to_indices(tile_full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=layout.mask_mod(device),
        seq_lengths=(layout.n_queries, layout.n_keys),
    )

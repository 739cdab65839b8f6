"""What a context-parallel attention layer communicates and holds, by accounting (bytes, no run needed).

Communication per layer and training step, per rank (``context_parallel.py``): the forward all-gathers
the K/V shards padded to the longest one, the backward all-gathers them again (only local shards are
saved) and reduce-scatters dK/dV. A ring all-gather or reduce-scatter of ``P`` shards of ``s`` bytes
moves ``(P - 1) * s`` bytes through each rank. The *ideal* is mask-aware: a rank must receive the K/V
of the keys its rows see and others own, and send their gradients back, nothing else (no padding,
no second gather, no keys its rows never see).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .balance import RowSplit


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes through one rank for one attention layer, forward + backward."""

    actual: int  # all-gather (forward) + all-gather (backward) + reduce-scatter, padded shards
    all_gather_once: int  # the same collectives without the backward's second gather (K/V kept whole)
    ideal: int  # mask-aware lower bound: receive the needed K/V once, send their gradients once


def needed_keys(split: RowSplit, rank: int) -> torch.Tensor:
    """bool [n_keys]: the keys some row of ``rank`` sees (any batch element), from the row intervals."""
    iv = split.layout.row_intervals(copy=False)[:, split.query_rows[rank]]  # [B', R, J, 2]
    lo, hi = iv[..., 0].flatten(), iv[..., 1].flatten()
    keep = hi > lo
    delta = torch.zeros(split.layout.n_keys + 1, dtype=torch.int64)
    delta.index_add_(0, lo[keep], torch.ones_like(lo[keep]))
    delta.index_add_(0, hi[keep], -torch.ones_like(hi[keep]))
    return torch.cumsum(delta, 0)[:-1] > 0


def layer_traffic(
    split: RowSplit, rank: int, *, batch: int, kv_heads: int, head_dim: int, elem_bytes: int
) -> LayerTraffic:
    """Bytes through ``rank`` for one attention layer of one training step (forward and backward)."""
    per_key = 2 * batch * kv_heads * head_dim * elem_bytes  # K and V (or dK and dV) of one key
    shard = split.max_keys * per_key
    ring = (split.world - 1) * shard
    owned = torch.zeros(split.layout.n_keys, dtype=torch.bool)
    owned[split.key_rows[rank]] = True
    foreign = int((needed_keys(split, rank) & ~owned).sum())
    return LayerTraffic(actual=3 * ring, all_gather_once=2 * ring, ideal=2 * foreign * per_key)


def attention_transient_bytes(
    split: RowSplit, *, batch: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int, chunk_rows: int
) -> int:
    """Peak bytes one CP attention backward adds on a rank on top of saved activations (the larger of
    forward and backward), by accounting: gathered + reordered K/V (2 x 2 full-length), full-length dK/dV
    in fp32 and their padded scatter buffers (2 x 2), dq, and one row chunk's fp32 score-sized tensors
    (scores, probabilities, their gradient: 3 x chunk x span x H)."""
    n = split.layout.n_keys
    full_kv = 2 * batch * kv_heads * n * head_dim
    padded = 2 * batch * kv_heads * split.world * split.max_keys * head_dim
    rows = max(int(r.numel()) for r in split.query_rows)
    chunk = 3 * batch * heads * min(chunk_rows, rows) * n * 4
    gather = (padded + full_kv) * elem_bytes
    grads = 2 * full_kv * 4 + 2 * padded * 4 + batch * heads * rows * head_dim * 4
    return gather + grads + chunk

"""Context-parallel window attention: the query rows of one sequence split over a process group.

Each rank holds q/k/v of its own rows (:class:`~kforcing_kernels.parallel.balance.RowSplit`: its
query rows, and the keys whose K/V it computes). Forward: the K/V shards are all-gathered (padded to
the longest shard, one collective for K and V together) and put back into the layout's key order;
the rank computes its rows on its sub-layout (``layout.restrict_rows``) with the kernels of the default
row-subset backend (``op.query_rows_backend``: ``cpp`` on CPU, ``triton`` on CUDA).
Backward: K/V are all-gathered again (only the local shards are saved, so a layer keeps ``1/P`` of
its K/V between forward and backward, not the whole sequence), the rank's rows give dq and
full-length dK/dV, and dK/dV are reduce-scattered so each rank gets the sum over ranks for its own
keys. GQA: K/V carry ``Hkv <= H`` heads, and only those travel.

Collectives go through ``torch.distributed`` (gloo on CPU, nccl on CUDA) on the group given;
``group=None`` with a one-rank split needs no process group at all (the single-process path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..layouts import WindowLayout
from ..ops.common.saved import autograd_records, own_storage
from ..ops.common.validation import check_scale
from ..ops.window_attention.backends import get_backend
from ..ops.window_attention.checks import check_layout_batch, check_qkv
from ..ops.window_attention.op import query_rows_backend
from .balance import RowSplit, balanced_split


@dataclass
class ContextParallel:
    """A CP group: ``rank`` of ``world`` ranks in ``group`` (None: the default group, or no group when world == 1).

    Splits are cached per layout content, so every layer of a forward reuses one."""

    rank: int = 0
    world: int = 1
    group: Optional[object] = None
    _splits: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank: expected a rank in [0, {self.world}), got {self.rank}")

    def split(self, layout: WindowLayout) -> RowSplit:
        key = layout.cache_key
        if key not in self._splits:
            if len(self._splits) > 16:
                self._splits.clear()
            self._splits[key] = balanced_split(layout, self.world)
        return self._splits[key]

    def shard(self, layout: WindowLayout) -> "RankRows":
        """This rank's rows of ``layout``: what the model passes to its attention layers instead of the layout."""
        return RankRows(self.split(layout), self.rank, self.group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (a no-op for one rank)."""
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t


@dataclass(frozen=True)
class RankRows:
    """Rank ``rank``'s rows of ``split.layout``: :meth:`attend` is its attention layer."""

    split: RowSplit
    rank: int
    group: Optional[object] = None

    @property
    def query_rows(self) -> torch.Tensor:
        return self.split.query_rows[self.rank]

    @property
    def key_rows(self) -> torch.Tensor:
        return self.split.key_rows[self.rank]

    def attend(self, q, k, v, scale: Optional[float] = None) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.split, self.rank, self.group, scale=scale)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: RowSplit,
    rank: int,
    group=None,
    *,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Window attention of this rank's rows over the whole sequence's keys.

    Args:
        q: ``[B, H, R_r, D]``, the queries of ``split.query_rows[rank]`` (in that order).
        k, v: ``[B, Hkv, K_r, D]``, the keys/values of ``split.key_rows[rank]``; ``H % Hkv == 0`` (GQA).
        split: the same :class:`RowSplit` on every rank of ``group``.
        rank: this process's rank in ``group``.

    Returns:
        ``out [B, H, R_r, D]``: rows ``query_rows[rank]`` of ``window_attention(q_all, k_all, v_all, split.layout)``.
        Differentiable in q, k, v (dK/dV summed over the ranks whose rows see the key).
    """
    world = split.world
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected a rank in [0, {world}), got {rank}")
    if world > 1 and not dist.is_initialized():
        raise ValueError(f"group: a {world}-rank split needs an initialised torch.distributed process group")
    # The op's own checks (window_attention refuses the same inputs with the same words), then the shard's lengths.
    check_qkv(q, k, v)
    check_layout_batch(split.layout, q.shape[0])
    if q.shape[2] != split.query_rows[rank].numel():
        raise ValueError(
            f"q: expected {split.query_rows[rank].numel()} rows (split.query_rows[{rank}]), got {q.shape[2]}"
        )
    if k.shape[2] != split.key_rows[rank].numel():
        raise ValueError(f"k: expected {split.key_rows[rank].numel()} keys (split.key_rows[{rank}]), got {k.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_scale(scale)
    return _GatheredAttention.apply(q, k, v, split, rank, group, scale, autograd_records(q, k, v))


def _all_gather_single(output: torch.Tensor, local: torch.Tensor, group=None) -> None:
    """``output`` = every rank's ``local`` concatenated along dim 0. torch 2.13 names it ``all_gather_single``
    (``all_gather_into_tensor`` warns there, a FutureWarning on every rank); older torch has only the old name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _reduce_scatter_single(output: torch.Tensor, per_rank: torch.Tensor, group=None) -> None:
    """``output`` = the sum over ranks of their ``per_rank`` chunk (dim 0) of this rank: ``reduce_scatter_single`` on
    torch 2.13 (``reduce_scatter_tensor`` warns there), the old name before."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, per_rank, op=dist.ReduceOp.SUM, group=group)


def gather_keys(k: torch.Tensor, v: torch.Tensor, split: RowSplit, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the ranks' K/V shards ``[B, Hkv, K_r, D]`` into the layout's key order ``[B, Hkv, Lk, D]`` (no
    autograd)."""
    world, pad = split.world, split.max_keys
    local = k.new_zeros(2, *k.shape[:2], pad, k.shape[3])
    local[0, :, :, : k.shape[2]], local[1, :, :, : k.shape[2]] = k, v
    if world == 1:
        gathered = local[None]
    else:
        gathered = local.new_empty(world * 2, *local.shape[1:])  # shards concatenated along dim 0
        _all_gather_single(gathered, local.contiguous(), group=group)
        gathered = gathered.view(world, *local.shape)
    flat = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, k.shape[0], k.shape[1], world * pad, k.shape[3])
    full = flat.index_select(3, split.key_order().to(k.device))
    return full[0], full[1]


def scatter_key_grads(dk: torch.Tensor, dv: torch.Tensor, split: RowSplit, rank: int, group=None):
    """Reduce-scatter full-length dK/dV ``[B, Hkv, Lk, D]``: rank r gets the sum over ranks at its keys
    ``[B, Hkv, K_r, D]``."""
    world, pad = split.world, split.max_keys
    b, hkv, _, d = dk.shape
    flat = dk.new_zeros(2, b, hkv, world * pad, d)
    flat.index_copy_(3, split.key_order().to(dk.device), torch.stack([dk, dv]))
    per_rank = flat.view(2, b, hkv, world, pad, d).permute(3, 0, 1, 2, 4, 5).contiguous()  # [P, 2, B, Hkv, pad, D]
    if world == 1:
        mine = per_rank[0]
    else:
        mine = per_rank.new_empty(per_rank.shape[1:])
        _reduce_scatter_single(mine, per_rank.view(-1, *per_rank.shape[2:]), group=group)
    n = split.key_rows[rank].numel()
    return mine[0, :, :, :n], mine[1, :, :, :n]


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split: RowSplit, rank: int, group, scale: float, records: bool):
        # records: autograd_records(q, k, v) at the call (grad mode is off in here); without it nothing is kept.
        k_all, v_all = gather_keys(k, v, split, group)
        sub = split.sub_layout(rank)
        # The rank's rows through a backend's kernels, planned from the sub-layout's own row intervals.
        backend = get_backend(query_rows_backend(q))
        out, lse = backend.forward(q.contiguous(), k_all.contiguous(), v_all.contiguous(), sub, scale)
        # local K/V only (re-gathered in backward), none a view that pins a larger buffer (a fused qkv)
        if records:
            ctx.save_for_backward(*(own_storage(t) for t in (q, k, v)), out, lse)
        ctx.meta = (split, rank, group, scale, sub, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        split, rank, group, scale, sub, backend = ctx.meta
        k_all, v_all = gather_keys(k, v, split, group)
        dq, dk_all, dv_all = backend.backward(
            dout.contiguous(), q.contiguous(), k_all.contiguous(), v_all.contiguous(), out, lse, sub, scale
        )
        dk, dv = scatter_key_grads(dk_all, dv_all, split, rank, group)
        return dq, dk, dv, None, None, None, None, None

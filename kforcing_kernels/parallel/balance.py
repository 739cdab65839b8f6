"""Split the query rows of one sequence over a context-parallel group, balanced by attended pairs.

A rank's attention work is the number of (query, key) pairs its rows see (``num_pairs``), not its
number of rows: in a staircase (causal context, K-Forcing windows whose prefix grows with t) the
last rows see the most keys, so equal row counts leave the last rank most of the work (the paper's
challenge (i), load imbalance). Its memory and its MLP work, on the other hand, scale with its rows.

The split keeps both balanced. Rows are cut into contiguous blocks of equal length (at least
``2 x world`` of them), and the blocks, sorted by their pairs (heaviest first), are dealt one by one
to the rank with the fewest pairs among the ranks that still hold fewer than their share of blocks.
Every rank thus gets the same number of blocks (rows equal within one block) and pairs within about
one block's pairs. With ``2 x world`` blocks of a staircase this is exactly zig-zag (ring) CP: rank r
gets blocks r and 2P-1-r. It generalises to layouts zig-zag does not balance: SingleForward stores
``[context | windows]``, two staircases of different heights one after the other; packed documents
are many small staircases. Blocks are halved until the pairs are within ``tolerance`` of equal (or
blocks are single rows). Contiguous blocks keep each rank's rows in runs, so a chunk of its rows
covers a short key span (the row-subset tiles of ``layouts/intervals.py``).

Contiguous chunks with equal pairs (no dealing) were rejected: they balance pairs but not rows
(causal, 2 ranks: 71% / 29% of the rows), so the memory CP exists to divide would stay on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import QueryRowsLayout, WindowLayout
from ..layouts.documents import positive_int
from ..layouts.intervals import pairs_per_row


@dataclass(frozen=True)
class RowSplit:
    """Which query rows and which keys each rank of a CP group owns (the same object on every rank).

    ``query_rows[r]``: int64 ``[R_r]``, strictly increasing; the ranks' rows partition ``[0, n_queries)``.
    ``key_rows[r]``: int64 ``[K_r]``, the keys whose K/V rank r computes; they partition ``[0, n_keys)``.
    With ``queries="all"`` a key is the query row at the same position; with ``queries="windows"``
    window key ``n_ctx + i`` belongs to the owner of query row i and the context keys (the cached
    prefix) are cut into equal contiguous runs.
    ``pairs[r]``: attended pairs of rank r's rows (summed over per-batch ranges).
    """

    layout: WindowLayout
    query_rows: tuple[torch.Tensor, ...]
    key_rows: tuple[torch.Tensor, ...]
    pairs: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.query_rows)

    def imbalance(self) -> float:
        """``max(pairs) / mean(pairs) - 1`` (0 for a perfect split or a layout without pairs)."""
        total = sum(self.pairs)
        return 0.0 if total == 0 else max(self.pairs) * self.world / total - 1.0

    def sub_layout(self, rank: int) -> QueryRowsLayout:
        """Rank ``rank``'s rows of the layout, over all keys."""
        return self.layout.restrict_rows(self.query_rows[rank])

    def key_order(self) -> torch.Tensor:
        """int64 [n_keys]: for each key, its index in the ranks' key shards laid end to end, each padded to
        ``max_keys`` (what an all-gather of padded shards holds)."""
        pad = self.max_keys
        order = torch.empty(self.layout.n_keys, dtype=torch.int64)
        for r, keys in enumerate(self.key_rows):
            order[keys] = r * pad + torch.arange(keys.numel())
        return order

    @property
    def max_keys(self) -> int:
        return max(int(k.numel()) for k in self.key_rows)


def balanced_split(layout: WindowLayout, world: int, *, tolerance: float = 0.05) -> RowSplit:
    """A :class:`RowSplit` of ``layout``'s query rows over ``world`` ranks (see the module docstring).

    Deterministic: every rank computes the same split from the same layout. The split stops refining
    once pairs are within ``tolerance`` of equal; tiny layouts (fewer rows than the balance needs)
    may end above it, and ``imbalance()`` says by how much.
    """
    if not isinstance(layout, WindowLayout):
        raise ValueError(f"layout: expected a WindowLayout, got {type(layout).__name__}")
    world = positive_int("world", world)
    if not 0 <= tolerance:
        raise ValueError(f"tolerance: expected >= 0, got {tolerance}")
    cost = pairs_per_row(layout.row_intervals(copy=False)).sum(0)  # [Lq], over per-batch ranges
    n = int(cost.numel())
    best = None
    blocks = 2 * world
    while True:
        size = max(1, -(-n // blocks))
        owner = _deal(cost, size, world)
        pairs = [int(cost[owner == r].sum()) for r in range(world)]
        total = sum(pairs)
        imbalance = 0.0 if total == 0 else max(pairs) * world / total - 1.0
        if best is None or imbalance < best[0]:
            best = (imbalance, owner)
        if imbalance <= tolerance or size == 1:
            break
        blocks *= 2
    owner = best[1]
    query_rows = tuple(torch.nonzero(owner == r).flatten() for r in range(world))
    return RowSplit(
        layout, query_rows, _key_rows(layout, query_rows, world), tuple(int(cost[rows].sum()) for rows in query_rows)
    )


def _deal(cost: torch.Tensor, size: int, world: int) -> torch.Tensor:
    """int64 [Lq]: the rank of each row when blocks of ``size`` rows are dealt heaviest first."""
    n = cost.numel()
    n_blocks = -(-n // size)
    block_cost = torch.zeros(n_blocks, dtype=torch.int64).index_add_(0, torch.arange(n) // size, cost)
    share = -(-n_blocks // world)
    load, count = [0] * world, [0] * world
    block_owner = torch.empty(n_blocks, dtype=torch.int64)
    for b in torch.argsort(block_cost, descending=True, stable=True).tolist():
        r = min((r for r in range(world) if count[r] < share), key=lambda r: (load[r], count[r], r))
        block_owner[b] = r
        load[r] += int(block_cost[b])
        count[r] += 1
    return block_owner[torch.arange(n) // size]


def _key_rows(layout: WindowLayout, query_rows, world: int) -> tuple[torch.Tensor, ...]:
    off = layout.query_offset
    if off == 0:
        return tuple(rows.clone() for rows in query_rows)
    bounds = [off * r // world for r in range(world + 1)]
    return tuple(torch.cat([torch.arange(bounds[r], bounds[r + 1]), rows + off]) for r, rows in enumerate(query_rows))

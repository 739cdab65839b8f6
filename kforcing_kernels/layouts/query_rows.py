"""``QueryRowsLayout``: a ``WindowLayout`` restricted to a subset of its query rows.

Context parallelism gives each rank some query rows of one sequence; the rank attends over
every key (all-gathered, in the parent's key order) but computes only its rows. The
sub-layout is derived from the parent's per-row key intervals, the one source of the mask
semantics: row ``i`` of the sub-layout is row ``rows[i]`` of the parent, with the same key
intervals over the same ``n_keys`` keys. So ``sub.dense_mask() == parent.dense_mask()[..., rows, :]``.

Rows must be strictly increasing (sorted, no repeats): a rank's rows keep the parent's
order, so its outputs line up with its slice of the sequence; an unsorted or repeated list is
refused rather than silently reordered.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import intervals as _iv
from .base import LayoutBase
from .documents import IntsLike, as_int_tensor

# What a subset reads from its parent unchanged: the key storage geometry (queries are its own rows).
_PARENT_GEOMETRY = (
    "n_ctx",
    "num_windows",
    "window_size",
    "last_window_size",
    "n_streams",
    "slots_per_stream",
    "intra",
    "queries",
    "query_offset",
    "n_window_tokens",
    "window_token_keys",
)


class QueryRowsLayout:
    """Rows ``rows`` (int64 ``[R]``, strictly increasing, in ``[0, parent.n_queries)``) of ``parent``.

    Keys stay the parent's: ``n_keys == parent.n_keys``, in the parent's order. Queries are the
    R selected rows, in increasing order. Immutable, like the parent.
    """

    def __init__(self, parent: LayoutBase, rows: IntsLike):
        if not isinstance(parent, LayoutBase):  # a WindowLayout (a QueryRowsLayout is a view, not one)
            raise ValueError(f"parent: expected a WindowLayout, got {type(parent).__name__}")
        r = as_int_tensor("rows", rows, dims=(1,))
        n = parent.n_queries
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= n):
            bad = int(r[(r < 0) | (r >= n)][0])
            raise ValueError(f"rows: expected query rows in [0, {n}) (parent.n_queries), got {bad}")
        if r.numel() > 1 and bool((r[1:] <= r[:-1]).any()):
            at = int(torch.nonzero(r[1:] <= r[:-1])[0, 0])
            raise ValueError(
                f"rows: expected strictly increasing rows (sorted, no repeats), got {int(r[at])} "
                f"then {int(r[at + 1])} at index {at + 1}"
            )
        self.parent = parent
        self._rows = r
        self._iv: Optional[torch.Tensor] = None
        self._rows_key = None

    @property
    def rows(self) -> torch.Tensor:
        """int64 [R]: the parent rows, in order (a copy)."""
        return self._rows.clone()

    @property
    def n_queries(self) -> int:
        return int(self._rows.numel())

    @property
    def n_keys(self) -> int:
        return self.parent.n_keys

    @property
    def range_batch(self):
        return self.parent.range_batch

    batch_size = range_batch

    def row_intervals(self, copy: bool = True) -> torch.Tensor:
        """int64 [B', R, 1 + S, 2]: the parent's intervals of the selected rows.

        ``copy=False`` returns the subset's own tensor (no copy; read it, never write it)."""
        if self._iv is None:  # derived from the parent's intervals, never re-derived from its ranges
            self._iv = self.parent.row_intervals(copy=False)[:, self._rows].contiguous()
        return self._iv.clone() if copy else self._iv

    # The kernels take a layout's geometry (key storage, streams, window size: it sizes the keys and picks
    # the small-window path) with per-row intervals and query tiles; a subset keeps its parent's geometry
    # and brings its own rows' intervals and tiles (backends ``cpp``, ``triton``, ``composite``).
    def __getattr__(self, name: str):
        if name in _PARENT_GEOMETRY:
            return getattr(self.parent, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def derived(self, name, build):
        """An artifact of this subset, kept in the parent's store (keyed by the rows), built once
        (``WindowLayout.derived``: the same contract; callers must not modify it)."""
        if self._rows_key is None:
            self._rows_key = (self._rows.numel(), self._rows.numpy().tobytes())
        return self.parent.derived(("query_rows", self._rows_key, name), build)

    @property
    def row_intervals_int32(self) -> torch.Tensor:
        """int32 contiguous copy of :meth:`row_intervals` (what the kernels read)."""
        return self.derived(
            "layout.row_intervals_int32", lambda: self.parent.row_intervals_int32[:, self._rows].contiguous()
        )

    @property
    def cpu_query_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``(row_order [R], tile_begin [T + 1])``: the parent's C++ query tiles restricted to these rows
        (indices into the subset), re-packed up to ``CPU_TILE_ROWS`` rows (``intervals.subset_query_tiles``)."""
        return self.derived("layout.cpu_query_tiles", lambda: _iv.subset_query_tiles(self.parent, self._rows))

    def dense_mask(self) -> torch.Tensor:
        """bool [R, Lk] (or [B, R, Lk] for per-batch ranges): the parent's mask rows."""
        mask = _iv.dense_mask_from(self.row_intervals(copy=False), self.n_keys)
        return mask if self.range_batch is not None else mask[0]

    def num_pairs(self) -> Union[int, torch.Tensor]:
        """Attended (query, key) pairs of the selected rows: an int, or int64 [B] for per-batch ranges."""
        total = _iv.count_pairs(self.row_intervals(copy=False))
        return int(total[0]) if self.range_batch is None else total

    def restrict_rows(self, rows: IntsLike) -> "QueryRowsLayout":
        """Rows ``rows`` of this sub-layout (indices into it), as a sub-layout of the same parent."""
        r = as_int_tensor("rows", rows, dims=(1,))
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= self.n_queries):
            raise ValueError(f"rows: expected rows in [0, {self.n_queries}) (n_queries), got {r.tolist()}")
        return QueryRowsLayout(self.parent, self._rows[r])

    @property
    def cache_key(self) -> tuple:
        return ("query_rows", self.parent.cache_key, tuple(self._rows.tolist()))

    def __repr__(self) -> str:
        return f"QueryRowsLayout(rows={self.n_queries} of {self.parent.n_queries}, parent={self.parent!r})"

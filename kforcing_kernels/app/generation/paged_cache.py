"""A paged KV cache for KV-cached generation, and the model pass that reads it in place.

:class:`PagedKVCache` keeps, per layer, K and V in a pool of fixed-size pages
``[num_pages, page_size, Hkv, D]`` (the vLLM / FlashInfer layout). Each sequence
(a cache row) owns a list of pages, taken from the pool as it grows and given
back when it is freed; its block table row lists them in order, so its context
token t sits in page ``table[row, t // page_size]`` at slot ``t % page_size``.
Appending writes K/V in place (one ``index_copy_`` per layer through a slot
mapping); nothing is ever copied to grow a sequence.

:meth:`PagedKVCache.views` gives the model, per layer, a
:class:`~kforcing_kernels.model.PagedPast` that its attention reads in place
(``model.trunk(x, positions, None, past=cache.views(rows))``): the model's own blocks
decode over the pages, there is no second copy of its forward.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ...model import KForcingLM
from ...model.decode_paths import PagedPast
from ...ops.paged_attention import PAGED_BACKENDS, paged_backends_available


class PagePoolFull(RuntimeError):
    """The page pool cannot hold what was asked; nothing was allocated or written."""


class PagedKVCache:
    """Per-layer K/V pages, a free list, and each row's pages and length.

    Args:
        n_layer, n_kv_heads, head_dim: the model's attention sizes.
        num_pages: pages in the pool (shared by all rows), or give ``capacity``
            (tokens; a multiple of ``page_size``) instead.
        page_size: tokens per page.
        dtype, device: of the pages (the model's).

    Rows are ids handed out by :meth:`add_row`; a row holds no page until tokens
    are appended. All methods that can run out of pages check first and raise
    :class:`PagePoolFull` before changing anything.
    """

    def __init__(
        self,
        n_layer: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        num_pages: Optional[int] = None,
        capacity: Optional[int] = None,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, value in (
            ("n_layer", n_layer),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if (num_pages is None) == (capacity is None):
            raise ValueError(
                f"num_pages: give exactly one of num_pages or capacity, got num_pages={num_pages!r}, "
                f"capacity={capacity!r}"
            )
        if capacity is not None:
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise ValueError(f"capacity: expected a positive int (tokens), got {capacity!r}")
            if capacity % page_size:
                raise ValueError(f"page_size: expected a divisor of capacity={capacity}, got {page_size}")
            num_pages = capacity // page_size
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages!r}")
        self.page_size, self.num_pages = page_size, num_pages
        # One tensor [layer, K/V, page, slot, head, dim]: a decode step writes every layer's K/V in one index_copy_.
        self.kv = torch.zeros((n_layer, 2, num_pages, page_size, n_kv_heads, head_dim), dtype=dtype, device=device)
        self.k = [self.kv[layer, 0] for layer in range(n_layer)]  # per layer [num_pages, page_size, Hkv, D]
        self.v = [self.kv[layer, 1] for layer in range(n_layer)]
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pages are reused most-recently-freed first
        self._pages: dict[int, list[int]] = {}  # live rows -> their pages, in order
        # The same on tensors (CPU), so a step's block table, lengths and slot mapping are a few tensor ops:
        # table[row, j] = the row's j-th page (-1 past its pages), lens[row] = its length.
        self._table = torch.full((8, num_pages), -1, dtype=torch.int32)
        self._lens = torch.zeros(8, dtype=torch.int64)
        self._npages = torch.zeros(8, dtype=torch.int64)  # pages each row holds
        self._free_rows: list[int] = []
        self.version = 0  # bumped whenever a table entry changes: a device copy of rows of the table is then stale

    @classmethod
    def for_model(
        cls, model: KForcingLM, *, page_size: int = 16, num_pages: Optional[int] = None, capacity: Optional[int] = None
    ) -> "PagedKVCache":
        """A pool shaped for ``model`` (its dtype and device)."""
        cfg = model.config
        w = model.wte.weight
        return cls(
            cfg.n_layer,
            cfg.n_head,
            cfg.head_dim,
            num_pages=num_pages,
            capacity=capacity,
            page_size=page_size,
            dtype=w.dtype,
            device=w.device,
        )

    # -------------------------------------------------------------- rows

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def add_row(self) -> int:
        """A new empty row (no pages yet); returns its id."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self._pages) + len(self._free_rows)
            while row >= self._table.shape[0]:  # grow the row tensors geometrically
                self._table = torch.cat([self._table, torch.full_like(self._table, -1)])
                self._lens = torch.cat([self._lens, torch.zeros_like(self._lens)])
                self._npages = torch.cat([self._npages, torch.zeros_like(self._npages)])
        self._pages[row] = []
        self._table[row] = -1
        self._lens[row] = 0
        self._npages[row] = 0
        return row

    def free(self, row: int) -> None:
        """Give the row's pages back to the pool; the row id may be handed out again by :meth:`add_row`."""
        self._check_rows([row])
        self._free.extend(reversed(self._pages.pop(row)))
        self._table[row] = -1
        self._lens[row] = 0
        self._npages[row] = 0
        self._free_rows.append(row)
        self.version += 1

    def length(self, row: int) -> int:
        self._check_rows([row])
        return int(self._lens[row])

    def pages_of(self, row: int) -> list[int]:
        self._check_rows([row])
        return list(self._pages[row])

    def lengths(self, rows: Sequence[int]) -> torch.Tensor:
        """int64 ``[B]`` (CPU): each row's context length."""
        self._check_rows(rows)
        return self._lens[list(rows)]

    def block_table(self, rows: Sequence[int], min_pages: int = 1) -> torch.Tensor:
        """int32 ``[B, max_pages]`` on the pages' device; entries past a row's pages are -1."""
        self._check_rows(rows)
        width = max([min_pages] + [len(self._pages[r]) for r in rows])
        return self._table[list(rows), :width].to(self.k[0].device)

    def views(self, rows: Sequence[int], backend: Optional[str] = None) -> list[PagedPast]:
        """Per layer, the rows' cached context as the model's attention reads it in place (not written).

        The block table and lengths are built once for all layers; only the first layer's view scans the
        table (it is the cache's own, so one check per step suffices).
        """
        table, lens = self.block_table(rows), self.lengths(rows)
        return [
            PagedPast(k, v, table, lens, backend=backend, check_table=layer == 0)
            for layer, (k, v) in enumerate(zip(self.k, self.v))
        ]

    # -------------------------------------------------------------- writes

    def reserve(self, rows: Sequence[int], counts: Sequence[int]) -> None:
        """Make room for ``counts[i]`` more tokens in ``rows[i]``: all or nothing (:class:`PagePoolFull`)."""
        self._check_rows(rows)
        need = [
            max(0, math.ceil((int(self._lens[r]) + c) / self.page_size) - len(self._pages[r]))
            for r, c in zip(rows, counts)
        ]
        if sum(need) > len(self._free):
            raise PagePoolFull(
                f"page pool full: {sum(need)} more pages of {self.page_size} tokens needed for {len(rows)} rows, "
                f"{len(self._free)} of {self.num_pages} free; free finished rows or use a larger pool (num_pages)"
            )
        for r, n in zip(rows, need):
            if n:
                have = len(self._pages[r])
                new = [self._free.pop() for _ in range(n)]
                self._pages[r].extend(new)
                self._table[r, have : have + n] = torch.tensor(new, dtype=torch.int32)
                self._npages[r] = have + n
                self.version += 1

    # -------------------------------------------------------------- a static decode step's bookkeeping

    def pages_to_grow(self, index: torch.Tensor, count: int) -> int:
        """Pages the rows ``index`` (int64 CPU ``[B]``, live rows, unchecked) need for ``count`` more tokens each."""
        need = (self._lens[index] + count + self.page_size - 1) // self.page_size - self._npages[index]
        return int(need.clamp_min(0).sum())

    def grow(self, index: torch.Tensor, count: int) -> None:
        """Account ``count`` more tokens in each of the rows ``index`` (int64 CPU ``[B]``) whose K/V a static decode
        step writes itself (:class:`~kforcing_kernels.app.generation.static_step.StaticDecodeStep`): reserve the
        pages they cross into (all or nothing, :class:`PagePoolFull`) and advance the lengths. Host work only;
        the table changes (and :attr:`version` with it) only when a row crosses into a new page."""
        if bool(((self._lens[index] + count) > self._npages[index] * self.page_size).any()):
            rows = index.tolist()
            self.reserve(rows, [count] * len(rows))
        self._lens[index] += count

    def table_rows(self, index: torch.Tensor) -> torch.Tensor:
        """int32 ``[B, num_pages]`` (CPU): the rows' full table rows (-1 past their pages)."""
        return self._table[index]

    def append(
        self, rows: Sequence[int], kvs: Sequence[tuple[torch.Tensor, torch.Tensor]], counts: Sequence[int]
    ) -> None:
        """Write tokens ``[0, counts[i])`` of batch row i of each layer's ``(k, v)`` ``[B, Hkv, >= max(counts), D]``
        at ``rows[i]``'s current length, in place; lengths grow by ``counts``."""
        if len(set(rows)) != len(rows):
            raise ValueError(
                f"rows: expected distinct rows (a repeated row would write twice into the same slots), got {list(rows)}"
            )
        counts = [int(c) for c in counts]
        if len(counts) != len(rows) or any(c < 0 for c in counts):
            raise ValueError(f"counts: expected {len(rows)} non-negative ints (one per row), got {counts}")
        if len(kvs) != len(self.k):
            raise ValueError(f"kvs: expected {len(self.k)} layers, got {len(kvs)}")
        width = max(counts, default=0)
        if width == 0:
            return
        k0 = kvs[0][0]
        if k0.shape[0] != len(rows) or k0.shape[2] < width or k0.shape[1:2] + k0.shape[3:] != self.k[0].shape[2:]:
            raise ValueError(
                f"kvs: expected [B={len(rows)}, Hkv, >= {width}, D] matching the pages "
                f"{tuple(self.k[0].shape)}, got {tuple(k0.shape)}"
            )
        self.reserve(rows, counts)
        idx = torch.tensor(list(rows), dtype=torch.int64)
        cnt = torch.tensor(counts, dtype=torch.int64)
        steps = torch.arange(width)
        valid = steps[None] < cnt[:, None]  # [B, width]
        pos = self._lens[idx][:, None] + steps  # position of each written token
        pos = torch.where(valid, pos, 0)
        page = self._table[idx[:, None], pos // self.page_size].to(torch.int64)
        device = self.k[0].device
        slots = (page * self.page_size + pos % self.page_size)[valid].to(device)  # flat slot in [num_pages * page_size]
        # (batch row, token) in [B * L]
        src = (torch.arange(len(rows))[:, None] * k0.shape[2] + steps)[valid].to(device)
        for layer, (k, v) in enumerate(kvs):
            for pool, x in ((self.k[layer], k), (self.v[layer], v)):
                flat = x.transpose(1, 2).reshape(-1, *pool.shape[2:])  # [B * L, Hkv, D]
                pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, flat.index_select(0, src).to(pool.dtype))
        self._lens[idx] += cnt

    def _check_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            if r not in self._pages:
                raise ValueError(f"rows: {r!r} is not a live row of this cache (freed or never added)")


def paged_backend(model: KForcingLM) -> Optional[str]:
    """The paged backend matching the model's attention backend when there is one (else the default)."""
    name = model.config.attention_backend
    return name if name in PAGED_BACKENDS and paged_backends_available()[name] is None else None

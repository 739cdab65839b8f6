"""Analytic tile plans for the fused prefix-window attention kernels.

A plan says which (query tile, key tile) products a kernel runs, derived in
closed form from a :class:`~kforcing_kernels.layouts.WindowLayout` (its prefix
ranges and geometry) in O(number of tiles): no mask is ever materialised.

Every query row sees a union of 1 + S half-open key intervals
(``WindowLayout.row_intervals``, the one derivation of a layout's semantics):
interval 0 is its context part, intervals 1..S its own window, one per storage
stream. The plan is a reduction of that tensor: a query tile visits, per interval,
the key tiles covering the union of its rows' intervals; key tiles inside the
intersection of its rows' intervals are *full* and skip masking. The kernels
mask boundary tiles with the same row intervals (passed to them as a tensor).

Query tiles never mix context and window rows, and never split a window unless
it is longer than a tile: windows of w <= BLOCK_M rows are packed
``BLOCK_M // w`` per tile (k=4 -> 16 windows in a 64-row tile), so every
context key tile loaded is reused by all of them. Stream-major storage
(DoubleForward) is tiled per stream; rows are located by index arithmetic.

Small windows (w <= ``SLOT_WINDOW_MAX``) handle their intra-window part in
*slot steps* instead of tile products: step i gathers slot i of every row's
own window (a row-wise dot, no tensor-core product). A packed tile of BLOCK_M
rows would otherwise pay a BLOCK_M x BLOCK_M block-diagonal product for
BLOCK_M * (w+1)/2 useful pairs. The default kernels run them inside the
window ("seeded") query tiles, which start their online softmax (forward) or
dQ from them; window keys are only seen by their own window, so their dK/dV
come outright from slot blocks of ``block_t // w`` whole windows.
Large windows use tile products (their intra part is a causal band, intervals 1..S).

The transposed plan lists for each key tile (aligned BLOCK_N chunks of the context, and of each
window stream in tile mode) the (query tile, interval, full) that touch it, in CSR form; the
backward's dK/dV programs walk its row-step form (``steps.py``), built from it on the host.

A row subset (``QueryRowsLayout``: a context-parallel rank, an EAGLE-3 step) is planned the same way
from its own rows' intervals (``build_tile_plan``), in tile mode, with query tiles of runs of its rows.

Plans (``tile_plan``, per tile shapes) and their int32 device copies
(``plan_device.device_plan``, per device and CUDA stream) are artifacts of the layout
(``layout.derived``): built once for every layout with the same content.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ....layouts import QueryRowsLayout, WindowLayout
from ....layouts.base import LayoutBase
from ....layouts.intervals import reduce_over_tiles, subset_query_runs


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shapes of one launch.

    block_m x block_n: query rows x keys of the forward and dQ tile products (the
    work-accounting unit); block_n_dkdv: keys per dK/dV program (the transposed
    plan's key tiles); block_t: tokens per slot-step block (a power of two >= w);
    block_m_dkdv: query rows per dK/dV step, a divisor of block_m (0: block_m). The
    dK/dV kernel re-reads q and dO once per key tile, so its traffic falls with
    block_n_dkdv; stepping through a query tile keeps large key tiles in registers.
    """

    block_m: int = 64
    block_n: int = 64
    block_n_dkdv: int = 32
    block_t: int = 64
    block_m_dkdv: int = 0
    slot_window_max: Optional[int] = None  # lowers SLOT_WINDOW_MAX for these tiles (None: the module's)

    @property
    def dkdv_step_rows(self) -> int:
        return self.block_m_dkdv or self.block_m

    @property
    def slot_windows_up_to(self) -> int:
        """Windows of at most this many slots take slot steps for their intra-window part."""
        return SLOT_WINDOW_MAX if self.slot_window_max is None else min(SLOT_WINDOW_MAX, self.slot_window_max)


# The tiles the dispatcher uses for head dims 32 and 64 (the accounting contract is stated for these).
DEFAULT_TILES = Tiles()
# Windows up to this size use slot steps for their intra-window part (a tile set may lower it:
# Tiles.slot_window_max).
SLOT_WINDOW_MAX = 16
# Per-interval bound fields: key start, number of key tiles, full tiles [t0, t1).
BOUND_FIELDS = ("key_start", "n_tiles", "full_begin", "full_end")
_EMPTY = torch.iinfo(torch.int64).max


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The layout as the ints a kernel needs for index arithmetic."""

    n_ctx: int
    num_windows: int
    window_size: int
    last_window_size: int
    n_streams: int
    slots_per_stream: int
    query_offset: int  # key index of query row 0
    n_queries: int
    n_keys: int
    causal: bool
    use_slots: bool

    @property
    def stream_len(self) -> int:
        """Storage length of one stream of the window region (M * slots per stream)."""
        return self.num_windows * self.slots_per_stream

    @property
    def n_intervals(self) -> int:
        """Intervals a query tile walks with tile products: context, plus one per stream in tile mode."""
        return 1 if self.use_slots or self.num_windows == 0 else 1 + self.n_streams

    @classmethod
    def of(cls, layout: LayoutBase, tiles: "Tiles") -> "Geometry":
        return cls(
            n_ctx=layout.n_ctx,
            num_windows=layout.num_windows,
            window_size=layout.window_size,
            last_window_size=layout.last_window_size,
            n_streams=layout.n_streams,
            slots_per_stream=layout.slots_per_stream,
            query_offset=layout.query_offset,
            n_queries=layout.n_queries,
            n_keys=layout.n_keys,
            causal=layout.intra == "causal",
            use_slots=layout.num_windows > 0 and layout.window_size <= tiles.slot_windows_up_to,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class TilePlan:
    """Which tile products the forward, dQ and dK/dV kernels run for one layout and tile shape.

    All tensors are int32 on the CPU. B' is the batch size for per-batch prefix
    ranges (``[B, M]``), else 1 (the plan is shared by the batch).

    Attributes:
        query_tiles: [T, 3] ``(q_start, q_len, seeded)`` per query tile (rows of q); seeded tiles
            (window rows in slot mode) start from their rows' intra-window slot steps.
        bounds: [B', T, J, 4] per query tile and interval: ``key_start`` (any key
            index, not tile-aligned), ``n_tiles`` key tiles of BLOCK_N from there, and
            the full (unmasked) ones ``[full_begin, full_end)``.
        order: [T] query tiles, longest first (the launch order).
        key_tiles: [KT, 2] ``(k_start, k_len)`` per dK/dV key tile (context, plus window
            streams in tile mode; in slot mode the slot kernel owns window keys).
        intra_blocks: number of slot-step blocks (0 in tile mode), ``windows_per_block`` windows each.
        key_ptr: [B', KT + 1] CSR offsets into ``key_entries`` (absolute, batches concatenated).
        key_entries: [E, 3] ``(query tile, interval, full)`` touching each key tile.
        key_order: [KT] key tiles, longest first.
    """

    layout_key: tuple
    tiles: Tiles
    geometry: Geometry
    query_tiles: torch.Tensor
    bounds: torch.Tensor
    order: torch.Tensor
    key_tiles: torch.Tensor
    intra_blocks: int
    windows_per_block: int
    key_ptr: torch.Tensor
    key_entries: torch.Tensor
    key_order: torch.Tensor

    @property
    def num_query_tiles(self) -> int:
        return self.query_tiles.shape[0]

    @property
    def num_key_tiles(self) -> int:
        return self.key_tiles.shape[0]

    def tile_products(self) -> torch.Tensor:
        """int64 [B']: (query tile, key tile) products the forward (and dQ) kernel runs per (batch, head)."""
        return self.bounds[..., 1].to(torch.int64).sum((1, 2))

    def slot_steps(self) -> int:
        """Slot steps of the forward slot kernel per (batch, head), each block_t tokens x 1 key.

        The backward slot kernel runs twice as many (one pass for dQ, one for dK/dV).
        """
        return self.intra_blocks * self.geometry.window_size

    def inline_slot_steps(self) -> int:
        """Slot steps per (batch, head) when the window tiles do their rows' intra-window part inline
        (the default kernels), each block_m rows x 1 key: the forward's, and the backward's dQ part
        (whose dK/dV part still runs :meth:`slot_steps` in slot blocks)."""
        return int(self.query_tiles[:, 2].sum()) * self.geometry.window_size if self.intra_blocks else 0

    def dkdv_tile_products(self) -> torch.Tensor:
        """int64 [B']: (key tile, query tile) products the dK/dV kernel runs per (batch, query head)."""
        return (self.key_ptr[:, -1] - self.key_ptr[:, 0]).to(torch.int64)

    def waste_ratio(self, num_pairs: Union[int, torch.Tensor], *, include_slot_steps: bool = False) -> float:
        """Visited tile area over attended pairs: ``visited * BLOCK_M * BLOCK_N / |M|`` (summed over the batch).

        ``include_slot_steps`` adds the slot kernel's area (block_t pairs per step).
        """
        nb = self.bounds.shape[0]
        area = int(self.tile_products().sum()) * self.tiles.block_m * self.tiles.block_n
        if include_slot_steps:
            area += nb * self.slot_steps() * self.tiles.block_t
        return area / int(torch.as_tensor(num_pairs).sum())


# ---------------------------------------------------------------------- query tiles


def _window_lengths_in_stream(g: Geometry, m: torch.Tensor) -> torch.Tensor:
    """Rows of window m in one stream (only the last window of S=1 storage can be short)."""
    if g.n_streams > 1:
        return torch.full_like(m, g.slots_per_stream)
    return torch.where(m == g.num_windows - 1, g.last_window_size, g.window_size)


def _window_tiles(g: Geometry, bm: int, stream: int) -> dict:
    """Query tiles of one window stream: packed whole windows, or chunks of one long window."""
    s = g.slots_per_stream
    if s <= bm:
        per = bm // s
        m_a = torch.arange(0, g.num_windows, per)
        m_b = torch.clamp(m_a + per, max=g.num_windows) - 1
        u0 = torch.zeros_like(m_a)
        u_end = _window_lengths_in_stream(g, m_b)
    else:
        lens = _window_lengths_in_stream(g, torch.arange(g.num_windows))
        chunks = -(-lens // bm)
        m_a = torch.repeat_interleave(torch.arange(g.num_windows), chunks)
        first = torch.cumsum(chunks, 0) - chunks
        u0 = (torch.arange(m_a.numel()) - first[m_a]) * bm
        m_b = m_a
        u_end = torch.minimum(u0 + bm, lens[m_a])
    base = g.n_ctx - g.query_offset + stream * g.stream_len  # query row of the stream's first slot
    q_start = base + m_a * s + u0
    q_end = base + m_b * s + u_end
    return dict(
        q_start=q_start,
        q_len=q_end - q_start,
        m_a=m_a,
        m_b=m_b,
        u0=u0,
        u_end=u_end,
        stream=torch.full_like(m_a, stream),
    )


def _query_tiles(g: Geometry, bm: int) -> dict:
    parts = []
    if g.query_offset == 0 and g.n_ctx:
        start = torch.arange(0, g.n_ctx, bm)
        none = torch.full_like(start, -1)
        parts.append(
            dict(
                q_start=start,
                q_len=torch.clamp(g.n_ctx - start, max=bm),
                m_a=none,
                m_b=none,
                u0=none,
                u_end=none,
                stream=none,
            )
        )
    if g.num_windows:
        parts += [_window_tiles(g, bm, j) for j in range(g.n_streams)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


# ---------------------------------------------------------------------- key intervals per query tile


def tile_intervals(layout: Union[WindowLayout, QueryRowsLayout], g: Geometry, qt: dict) -> torch.Tensor:
    """int64 [B', T, J, 4] ``(klo, khi, flo, fhi)``: union and intersection of each tile's row intervals.

    A reduction of ``layout.row_intervals()`` (the one derivation of what a row sees)
    over the rows of each query tile, in O(Lq * J).
    """
    iv = layout.row_intervals()[:, :, : g.n_intervals]
    tile_of_row = torch.full((g.n_queries,), -1, dtype=torch.int64)
    starts, lens = qt["q_start"], qt["q_len"]
    owner = torch.repeat_interleave(torch.arange(starts.numel()), lens)
    rows = starts[owner] + torch.arange(owner.numel()) - (torch.cumsum(lens, 0) - lens)[owner]
    tile_of_row[rows] = owner
    return reduce_over_tiles(iv, tile_of_row, starts.numel())


def _to_tile_bounds(iv: torch.Tensor, bn: int) -> torch.Tensor:
    """(klo, khi, flo, fhi) -> (key_start, n_tiles, full_begin, full_end) in key tiles of bn from klo."""
    klo, khi, flo, fhi = iv.unbind(-1)
    n = torch.clamp(khi - klo, min=0)
    n = -(-n // bn)
    has_full = fhi > flo
    t0 = torch.where(has_full, -(-(flo - klo) // bn), 0)
    t1 = torch.where(has_full, torch.div(fhi - klo, bn, rounding_mode="floor"), 0)
    t1 = torch.maximum(torch.minimum(t1, n), t0)
    t0 = torch.minimum(t0, t1)
    return torch.stack([klo, n, t0, t1], -1)


# ---------------------------------------------------------------------- transposed plan (dK/dV)


def _key_tiles(g: Geometry, bn: int) -> torch.Tensor:
    """int64 [KT, 2] ``(k_start, k_len)``: aligned key tiles of the context and (tile mode) of each stream."""
    spans = [(0, g.n_ctx)]
    if g.num_windows and not g.use_slots:
        n_window_tokens = (g.num_windows - 1) * g.window_size + g.last_window_size
        for j in range(g.n_streams):
            start = g.n_ctx + j * g.stream_len
            spans.append((start, start + (g.stream_len if g.n_streams > 1 else n_window_tokens)))
    starts = torch.cat([torch.arange(a, b, bn) for a, b in spans])
    ends = torch.cat([torch.full((len(range(a, b, bn)),), b) for a, b in spans])
    return torch.stack([starts, torch.clamp(ends - starts, max=bn)], -1)


def transpose_intervals(intervals: torch.Tensor, key_tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (key_ptr [B', KT+1], entries [E, 3]) of the key tiles each (query tile, interval) touches."""
    nb, t, nj, _ = intervals.shape
    kt = key_tiles.shape[0]
    ks, kl = key_tiles[:, 0].contiguous(), key_tiles[:, 1].contiguous()
    flat = intervals.reshape(-1, 4)
    klo, khi, flo, fhi = flat.unbind(-1)
    live = khi > klo
    b_idx = torch.arange(nb).repeat_interleave(t * nj)[live]
    q_idx = torch.arange(t).repeat_interleave(nj).repeat(nb)[live]
    j_idx = torch.arange(nj).repeat(nb * t)[live]
    klo, khi, flo, fhi = klo[live], khi[live], flo[live], fhi[live]
    first = torch.searchsorted(ks, klo, right=True) - 1
    last = torch.searchsorted(ks, khi - 1, right=True) - 1
    count = last - first + 1
    owner = torch.repeat_interleave(torch.arange(count.numel()), count)
    tile = first[owner] + torch.arange(owner.numel()) - (torch.cumsum(count, 0) - count)[owner]
    full = (ks[tile] >= flo[owner]) & (ks[tile] + kl[tile] <= fhi[owner])
    key = b_idx[owner] * kt + tile
    sort = torch.sort(key, stable=True).indices
    entries = torch.stack([q_idx[owner], j_idx[owner], full.to(torch.int64)], -1)[sort]
    ptr = torch.zeros(nb * kt + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(torch.bincount(key, minlength=nb * kt), 0)
    # Row b holds offsets [b*KT .. (b+1)*KT] into the concatenated entries.
    key_ptr = torch.stack([ptr[b * kt : (b + 1) * kt + 1] for b in range(nb)])
    return key_ptr, entries


# ---------------------------------------------------------------------- build


def build_tile_plan(layout: Union[WindowLayout, QueryRowsLayout], tiles: Tiles) -> TilePlan:
    """The plan of ``layout`` at ``tiles`` built now, unchecked and uncached (:func:`tile_plan` checks and caches)."""
    if isinstance(layout, QueryRowsLayout):
        # A row subset: tile mode always (every interval as tile products: the slot steps locate a row's window
        # slots by index arithmetic over the parent's rows), query tiles from the subset's rows
        # (intervals.subset_query_runs), key tiles the parent's.
        g = dataclasses.replace(Geometry.of(layout.parent, tiles), n_queries=layout.n_queries, use_slots=False)
        q_start, q_len = subset_query_runs(layout, tiles.block_m)
        qt, seeded, per_block = dict(q_start=q_start, q_len=q_len), torch.zeros_like(q_start, dtype=torch.bool), 1
    else:
        g = Geometry.of(layout, tiles)
        qt = _query_tiles(g, tiles.block_m)
        seeded, per_block = (qt["m_a"] >= 0) & g.use_slots, tiles.block_t // g.window_size
    intervals = tile_intervals(layout, g, qt)  # [B', T, J, 4] (klo, khi, flo, fhi)
    bounds = _to_tile_bounds(intervals, tiles.block_n)
    query_tiles = torch.stack([qt["q_start"], qt["q_len"], seeded.to(torch.int64)], -1)
    # Longest first (ties keep storage order).
    order = torch.sort(bounds[..., 1].sum((0, 2)), descending=True, stable=True).indices

    key_tiles = _key_tiles(g, tiles.block_n_dkdv)
    key_ptr, entries = transpose_intervals(intervals, key_tiles)
    key_order = torch.sort((key_ptr[:, 1:] - key_ptr[:, :-1]).sum(0), descending=True, stable=True).indices
    intra_blocks = -(-g.num_windows // per_block) if g.use_slots else 0

    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return TilePlan(
        layout_key=layout.cache_key,
        tiles=tiles,
        geometry=g,
        query_tiles=i32(query_tiles),
        bounds=i32(bounds),
        order=i32(order),
        key_tiles=i32(key_tiles),
        intra_blocks=intra_blocks,
        windows_per_block=per_block,
        key_ptr=i32(key_ptr),
        key_entries=i32(entries),
        key_order=i32(key_order),
    )


def tile_plan(layout: Union[WindowLayout, QueryRowsLayout], tiles: Tiles = DEFAULT_TILES) -> TilePlan:
    """The tile plan of ``layout`` (or of a row subset) at ``tiles``, built once per layout content
    (``layout.derived``)."""
    sizes = (tiles.block_m, tiles.block_n, tiles.block_n_dkdv, tiles.dkdv_step_rows)
    if min(sizes) < 16 or any(x & (x - 1) for x in sizes + (tiles.block_t,)):
        raise ValueError(f"tiles: expected powers of two, block sizes >= 16 (tl.dot), got {tiles}")
    if tiles.dkdv_step_rows > tiles.block_m:
        raise ValueError(f"tiles: expected block_m_dkdv <= block_m, got {tiles}")
    if tiles.block_t < SLOT_WINDOW_MAX:
        raise ValueError(f"tiles: expected block_t >= {SLOT_WINDOW_MAX} (a whole window per slot block), got {tiles}")
    return layout.derived(("triton.tile_plan", tiles), lambda: build_tile_plan(layout, tiles))


__all__ = [
    "Tiles",
    "DEFAULT_TILES",
    "SLOT_WINDOW_MAX",
    "Geometry",
    "TilePlan",
    "tile_plan",
]

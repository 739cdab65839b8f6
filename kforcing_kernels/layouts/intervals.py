"""The one derivation of a layout's semantics: per query row, the key intervals it sees.

Every backend, the dense mask, FlexAttention's ``mask_mod``/``BlockMask`` and the
kernels' tile plans read the tensor built here; nothing else re-derives which key
a row sees. Row ``r`` sees the union of ``1 + S`` half-open key intervals:

    interval 0        its context part: a context row i sees [context_lo[i], context_hi[i])
                      (default [0, i+1)); a row of window m sees [prefix_lo[m], prefix_hi[m]), or
                      with sliding bounds slot o sees [max(prefix_lo[m], slide_lo[m] + o),
                      min(prefix_hi[m], slide_hi[m] + o))
    interval 1 + j    stream j of its own window (causal: earlier streams whole, its own
                      stream up to itself, later streams nothing; full: every live slot)

A blank row (a window slot ``>= live_slots[m]``) sees nothing: all its intervals are
``[0, 0)``; blank slots are also seen by no row. Empty intervals are ``[0, 0)``.
"""

from __future__ import annotations

import torch

from .base import LayoutBase


def window_slot_keys(layout: LayoutBase) -> torch.Tensor:
    """int64 [M, w]: key index of slot i of window m (-1 past the end of a short last window).

    Stream-major storage (S streams of s = w/S slots): slot i of window m sits at
    ``n_ctx + (i // s) * (M * s) + m * s + i % s``; S = 1 is position-major. This is
    the only place the formula is written.
    """
    m_idx = torch.arange(layout.num_windows)[:, None]
    slot = torch.arange(layout.window_size)[None, :]
    s = layout.slots_per_stream
    keys = layout.n_ctx + (slot // s) * (layout.num_windows * s) + m_idx * s + slot % s
    valid = slot < layout.window_lengths()[:, None]
    return torch.where(valid, keys, torch.full_like(keys, -1))


def build_row_intervals(layout: LayoutBase) -> torch.Tensor:
    """int64 [B', Lq, 1 + S, 2] (B' = layout.range_batch or 1), in O(Lq * S)."""
    nb = layout.range_batch or 1
    S, s = layout.n_streams, layout.slots_per_stream
    c = layout.n_ctx
    iv = torch.zeros(nb, layout.n_keys, 1 + S, 2, dtype=torch.int64)  # indexed by key position
    if layout.context_lo is None:
        iv[:, :c, 0, 1] = torch.arange(1, c + 1)
    else:
        assert layout.context_hi is not None  # WindowLayout sets both or neither
        iv[:, :c, 0, 0] = layout.context_lo.reshape(-1, c)
        iv[:, :c, 0, 1] = layout.context_hi.reshape(-1, c)
    if layout.num_windows:
        keys = window_slot_keys(layout)  # [M, w]
        valid = keys >= 0
        m_of = torch.arange(layout.num_windows)[:, None].expand_as(keys)[valid]
        slot_of = torch.arange(layout.window_size)[None, :].expand_as(keys)[valid]
        key_of = keys[valid]
        live = layout.live_lengths().reshape(-1, layout.num_windows)[:, m_of]  # [B'|1, Nw]
        alive = slot_of[None] < live
        lo = layout.prefix_lo.reshape(-1, layout.num_windows)[:, m_of]
        hi = layout.prefix_hi.reshape(-1, layout.num_windows)[:, m_of]
        if layout.has_sliding_context:  # the bounds move with the slot, clipped to the window's range
            if layout.prefix_slide_lo is not None:
                lo = torch.maximum(lo, layout.prefix_slide_lo.reshape(-1, layout.num_windows)[:, m_of] + slot_of)
            if layout.prefix_slide_hi is not None:
                hi = torch.minimum(hi, layout.prefix_slide_hi.reshape(-1, layout.num_windows)[:, m_of] + slot_of)
            seen = lo < hi  # an empty context part is [0, 0); the slot still sees its own window
            lo, hi = torch.where(seen, lo, 0), torch.where(seen, hi, 0)
        iv[:, key_of, 0, 0] = torch.where(alive, lo, 0)
        iv[:, key_of, 0, 1] = torch.where(alive, hi, 0)
        # Live slots of stream j in each row's window; for S = 1 the stream is the whole window.
        stream, within = slot_of // s, slot_of % s
        for j in range(S):
            n_j = torch.clamp(live - j * s, min=0, max=s)
            if layout.intra == "full":
                seen = n_j
            else:
                seen = torch.where(stream > j, n_j, torch.where(stream == j, within + 1, 0))
            seen = torch.where(alive, torch.minimum(seen, n_j), 0)
            start = keys[m_of, j * s]
            iv[:, key_of, 1 + j, 0] = torch.where(seen > 0, start, 0)
            iv[:, key_of, 1 + j, 1] = torch.where(seen > 0, start + seen, 0)
    return iv[:, layout.query_offset :].contiguous()


# Query rows per tile of the C++ (cpp backend) kernels: 64 rows x 256-key chunks was the
# best of {32, 64, 128} x {128, 256, 512} on SingleForward, DoubleForward and Jacobi
# (AVX-512, D = 64). The kernels read the grouping below and size their scratch by it;
# this is the only place the number is written.
CPU_TILE_ROWS = 64


def cpu_query_tiles(layout: LayoutBase, tile_rows: int = CPU_TILE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_order int32 [Lq], tile_begin int32 [T + 1])``: the query tiles of the C++ kernels.

    Tile ``t`` holds query rows ``row_order[tile_begin[t]:tile_begin[t + 1]]`` (a permutation
    of the rows, tile by tile). Tiles never mix context and window rows: context rows
    (``queries="all"``) in tiles of ``tile_rows``, then the windows, either packed whole
    (``w <= tile_rows``: ``tile_rows // w`` windows a tile, k=4 gives 16, each window's rows
    in slot order, all of its streams together) or, for larger windows, each window cut
    into tiles of ``tile_rows`` slots. So a context K/V chunk is loaded once per tile and
    applied to every window packed in it.
    """
    if tile_rows < 1:
        raise ValueError(f"tile_rows: expected >= 1, got {tile_rows}")
    rows, tile_of = [], []
    n_tiles = 0
    if layout.query_offset == 0 and layout.n_ctx:
        r = torch.arange(layout.n_ctx)
        rows.append(r)
        tile_of.append(r // tile_rows)
        n_tiles = -(-layout.n_ctx // tile_rows)
    if layout.num_windows:
        keys = window_slot_keys(layout)  # [M, w], -1 past the end of a short last window
        valid = keys >= 0
        m = torch.arange(layout.num_windows)[:, None]
        slot = torch.arange(layout.window_size)[None, :]
        w = layout.window_size
        if w <= tile_rows:
            t = (m // (tile_rows // w)).expand_as(keys)
        else:
            chunks = -(-layout.window_lengths() // tile_rows)  # tiles per window
            first = torch.cumsum(chunks, 0) - chunks
            t = first[:, None] + slot // tile_rows
        rows.append(keys[valid] - layout.query_offset)  # window-major, slot order
        tile_of.append(t[valid] + n_tiles)
    rows_t, tiles_t = torch.cat(rows), torch.cat(tile_of)
    begin = torch.zeros(int(tiles_t[-1]) + 2, dtype=torch.int64)
    begin[1:] = torch.cumsum(torch.bincount(tiles_t), 0)
    return rows_t.to(torch.int32).contiguous(), begin.to(torch.int32).contiguous()


# Windows of at most this many slots do their intra-window part row by row in the C++ kernels (a few dot
# products, csrc/kf_kernels.h kDirectWindowMax): their window intervals cost no tile area.
CPU_DIRECT_WINDOW_MAX = 16

# A subset tile takes the next parent tile's selected rows only when that adds at most this share to the
# key area the two would visit apart (rows x union span, per interval): neighbouring windows of a staircase
# merge, a zig-zag rank's far-apart blocks do not.
SUBSET_MERGE_SLACK = 0.1


def subset_query_tiles(
    layout: LayoutBase, rows: torch.Tensor, tile_rows: int = CPU_TILE_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_order int32 [R], tile_begin int32 [T + 1])``: C++ query tiles of the parent rows ``rows``
    (int64 [R], strictly increasing), as indices into ``rows``.

    Each parent tile (:func:`cpu_query_tiles`) keeps its selected rows together, in the parent's tile
    order. Consecutive parent tiles' rows share a subset tile while it holds at most ``tile_rows`` rows,
    context and window rows are not mixed, and the merge visits at most ``SUBSET_MERGE_SLACK`` more key
    area (:func:`tile_area`) than the two apart. So an EAGLE-3 step (one slot of each window: 16 rows of a
    parent tile at k=4) fills 64-row tiles, while a balanced context-parallel rank's distant blocks keep
    their own spans.
    """
    order, begin = (t.to(torch.int64) for t in cpu_query_tiles(layout, tile_rows))
    position = torch.full((layout.n_queries,), -1, dtype=torch.int64)
    position[rows] = torch.arange(rows.numel())
    in_order = position[order]  # subset index of each parent row in tile order, -1 when not selected
    parent_tile = torch.repeat_interleave(torch.arange(begin.numel() - 1), begin[1:] - begin[:-1])
    keep = in_order >= 0
    in_order, parent_tile = in_order[keep], parent_tile[keep]
    parent_rows = rows[in_order]
    n_ctx_rows = layout.n_ctx if layout.query_offset == 0 else 0
    # Per selected row and interval, its [lo, hi) (empty: lo = +big, hi = -1), for union spans by min/max.
    iv = layout.row_intervals(copy=False)[:, parent_rows]  # [B', r, J, 2]
    if uses_direct_windows(layout):
        iv = iv[:, :, :1]  # only the context part is walked in key chunks
    seen = iv[..., 1] > iv[..., 0]
    lo = torch.where(seen, iv[..., 0], torch.iinfo(torch.int64).max).amin(0)  # [r, J] over the batch
    hi = torch.where(seen, iv[..., 1], -1).amax(0)
    n_pieces = int(parent_tile.max()) + 1 if parent_tile.numel() else 0
    counts = torch.bincount(parent_tile, minlength=n_pieces)
    idx = parent_tile[:, None].expand_as(lo)
    big = torch.iinfo(torch.int64).max
    p_lo = torch.full((n_pieces, lo.shape[1]), big, dtype=torch.int64).scatter_reduce(0, idx, lo, "amin")
    p_hi = torch.full((n_pieces, lo.shape[1]), -1, dtype=torch.int64).scatter_reduce(0, idx, hi, "amax")
    p_ctx = torch.zeros(n_pieces, dtype=torch.bool)
    p_ctx[parent_tile] = parent_rows < n_ctx_rows

    sizes = merge_subset_pieces(counts.tolist(), p_ctx.tolist(), p_lo.tolist(), p_hi.tolist(), tile_rows)
    tile_begin = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    tile_begin[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0)
    return in_order.to(torch.int32).contiguous(), tile_begin.to(torch.int32).contiguous()


def merge_subset_pieces(counts: list, kinds: list, los: list, his: list, tile_rows: int) -> list:
    """Row counts of a subset's query tiles, built greedily from consecutive pieces of its rows (the one rule
    both the C++ and the Triton subset plans use). Piece p has ``counts[p]`` rows of kind ``kinds[p]``
    (context or window) whose intervals' union spans are ``[los[p][j], his[p][j])`` (empty: ``hi <= lo``).
    A piece is cut at ``tile_rows``; a cut joins the current tile while the tile stays within ``tile_rows``
    rows of one kind and the merge visits at most ``SUBSET_MERGE_SLACK`` more key area (rows x union span,
    per interval) than the two apart."""

    def area(n, lo, hi):
        return sum(n * (end - start) for start, end in zip(lo, hi) if end > start)

    sizes: list[int] = []
    size, kind = 0, None
    cur_lo: list = []  # the current tile's union spans (read only once it has rows)
    cur_hi: list = []
    for n, c, lo, hi in zip(counts, kinds, los, his):
        while n:
            take = min(n, tile_rows)
            if size:
                if size + take <= tile_rows and c == kind:
                    m_lo = [min(a, b) for a, b in zip(cur_lo, lo)]
                    m_hi = [max(a, b) for a, b in zip(cur_hi, hi)]
                    apart = area(size, cur_lo, cur_hi) + area(take, lo, hi)
                    if area(size + take, m_lo, m_hi) <= (1 + SUBSET_MERGE_SLACK) * apart:
                        size, cur_lo, cur_hi, n = size + take, m_lo, m_hi, n - take
                        continue
                sizes.append(size)
            size, kind, cur_lo, cur_hi, n = take, c, lo, hi, n - take
    if size:
        sizes.append(size)
    return sizes


def subset_query_runs(layout, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_start, q_len)`` int64 [T]: the Triton query tiles of a row subset (a ``QueryRowsLayout``), as
    ranges of its rows (contiguous in q: a subset keeps its parent's order). Runs of consecutive parent
    rows of one kind (context or window) are cut at ``tile_rows`` and merged as
    :func:`merge_subset_pieces` says (an EAGLE-3 step's rows form one run; a zig-zag rank's distant
    blocks stay apart)."""
    rows = layout.rows
    n_ctx_rows = layout.n_ctx if layout.query_offset == 0 else 0
    is_ctx = rows < n_ctx_rows
    brk = torch.ones(rows.numel(), dtype=torch.bool)
    brk[1:] = (rows[1:] != rows[:-1] + 1) | (is_ctx[1:] != is_ctx[:-1])
    run_start = torch.nonzero(brk).flatten().tolist() + [rows.numel()]
    iv = layout.row_intervals(copy=False)
    seen = iv[..., 1] > iv[..., 0]
    lo = torch.where(seen, iv[..., 0], torch.iinfo(torch.int64).max).amin(0)  # [R, J] over the batch
    hi = torch.where(seen, iv[..., 1], -1).amax(0)
    cuts = [
        (p0, min(b, p0 + tile_rows)) for a, b in zip(run_start[:-1], run_start[1:]) for p0 in range(a, b, tile_rows)
    ]
    lens = merge_subset_pieces(
        [p1 - p0 for p0, p1 in cuts],
        [bool(is_ctx[p0]) for p0, _ in cuts],
        [lo[p0:p1].amin(0).tolist() for p0, p1 in cuts],
        [hi[p0:p1].amax(0).tolist() for p0, p1 in cuts],
        tile_rows,
    )
    q_len = torch.tensor(lens, dtype=torch.int64)
    return torch.cumsum(q_len, 0) - q_len, q_len


def tile_area(
    iv: torch.Tensor, row_order: torch.Tensor, tile_begin: torch.Tensor, *, direct_windows: bool = False
) -> torch.Tensor:
    """int64 [B']: the key area the C++ kernels visit with these query tiles: per tile and interval, (rows of
    the tile seeing the interval) x (the union span of their intervals), the unit their plan costs
    (``waste = tile_area / num_pairs``). ``direct_windows`` (windows of at most ``CPU_DIRECT_WINDOW_MAX``
    slots): intervals 1.. are done row by row, so they cost their pairs. ``iv`` int64 [B', Lq, J, 2]; tiles
    as :func:`cpu_query_tiles`."""
    order, begin = row_order.to(torch.int64), tile_begin.to(torch.int64)
    tile_of_row = torch.empty(iv.shape[1], dtype=torch.int64)
    tile_of_row[order] = torch.repeat_interleave(torch.arange(begin.numel() - 1), begin[1:] - begin[:-1])
    walked = iv[:, :, :1] if direct_windows else iv
    spans = reduce_over_tiles(walked, tile_of_row, begin.numel() - 1)  # [B', T, J, 4]
    seen = (walked[..., 1] > walked[..., 0]).to(torch.int64)  # [B', Lq, J]
    rows_seeing = torch.zeros(iv.shape[0], begin.numel() - 1, walked.shape[2], dtype=torch.int64)
    rows_seeing.index_add_(1, tile_of_row, seen)
    area = (rows_seeing * (spans[..., 1] - spans[..., 0])).sum((1, 2))
    if direct_windows:
        area = area + (iv[:, :, 1:, 1] - iv[:, :, 1:, 0]).clamp(min=0).sum((1, 2))
    return area


def uses_direct_windows(layout) -> bool:
    """Whether the C++ kernels do ``layout``'s intra-window part row by row (windows of at most
    ``CPU_DIRECT_WINDOW_MAX`` slots)."""
    return layout.num_windows > 0 and layout.window_size <= CPU_DIRECT_WINDOW_MAX


def dense_mask_from(iv: torch.Tensor, n_keys: int) -> torch.Tensor:
    """bool [B', Lq, Lk]: the union of each row's intervals."""
    cols = torch.arange(n_keys)
    mask = torch.zeros(iv.shape[0], iv.shape[1], n_keys, dtype=torch.bool)
    for j in range(iv.shape[2]):
        mask |= (iv[:, :, j, 0, None] <= cols) & (cols < iv[:, :, j, 1, None])
    return mask


def count_pairs(iv: torch.Tensor) -> torch.Tensor:
    """int64 [B']: attended (query, key) pairs (a row's intervals never overlap)."""
    return (iv[..., 1] - iv[..., 0]).clamp(min=0).sum((1, 2))


def reduce_over_tiles(iv: torch.Tensor, tile_of_row: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """int64 [B', T, J, 4] ``(klo, khi, flo, fhi)`` per tile and interval, in O(Lq * J).

    ``[klo, khi)`` is the union of the tile rows' non-empty intervals (``[0, 0)`` when
    all are empty); ``[flo, fhi)`` their intersection, empty unless every row of the
    tile sees a non-empty interval (keys there need no mask). ``tile_of_row`` is
    int64 [Lq] (-1: row in no tile).
    """
    nb, lq, nj, _ = iv.shape
    lo, hi = iv[..., 0], iv[..., 1]
    nonempty = hi > lo
    big = torch.iinfo(torch.int64).max
    idx = tile_of_row.clamp(min=0)[None, :, None].expand(nb, lq, nj)
    in_tile = (tile_of_row >= 0)[None, :, None]
    sel = nonempty & in_tile

    def reduce(values, fill, how):
        out = torch.full((nb, n_tiles, nj), fill, dtype=torch.int64)
        return out.scatter_reduce(1, idx, torch.where(in_tile, values, fill), reduce=how, include_self=True)

    klo = reduce(torch.where(sel, lo, big), big, "amin")
    khi = reduce(torch.where(sel, hi, -1), -1, "amax")
    flo = reduce(torch.where(in_tile, lo, -1), -1, "amax")
    fhi = reduce(torch.where(in_tile, hi, big), big, "amin")
    all_seen = reduce(torch.where(in_tile, nonempty.long(), 1), 1, "amin") > 0
    any_seen = khi >= 0
    has_full = all_seen & (fhi > flo)
    zero = torch.zeros_like(klo)
    return torch.stack(
        [
            torch.where(any_seen, klo, zero),
            torch.where(any_seen, khi, zero),
            torch.where(has_full, flo, zero),
            torch.where(has_full, fhi, zero),
        ],
        -1,
    )


def pairs_per_row(iv: torch.Tensor) -> torch.Tensor:
    """int64 [B', Lq]: attended keys of each query row (the work a row costs an attention kernel)."""
    return (iv[..., 1] - iv[..., 0]).clamp(min=0).sum(-1)

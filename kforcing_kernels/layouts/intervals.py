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

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .window_layout import WindowLayout


def window_slot_keys(layout: "WindowLayout") -> torch.Tensor:
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


def build_row_intervals(layout: "WindowLayout") -> torch.Tensor:
    """int64 [B', Lq, 1 + S, 2] (B' = layout.range_batch or 1), in O(Lq * S)."""
    nb = layout.range_batch or 1
    S, s = layout.n_streams, layout.slots_per_stream
    c = layout.n_ctx
    iv = torch.zeros(nb, layout.n_keys, 1 + S, 2, dtype=torch.int64)  # indexed by key position
    if layout.context_lo is None:
        iv[:, :c, 0, 1] = torch.arange(1, c + 1)
    else:
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
    return iv[:, layout.query_offset:].contiguous()


# Query rows per tile of the C++ (cpp backend) kernels: 64 rows x 256-key chunks was the
# best of {32, 64, 128} x {128, 256, 512} on SingleForward, DoubleForward and Jacobi
# (AVX-512, D = 64). The kernels read the grouping below and size their scratch by it;
# this is the only place the number is written.
CPU_TILE_ROWS = 64


def cpu_query_tiles(layout: "WindowLayout", tile_rows: int = CPU_TILE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
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
    return torch.stack([torch.where(any_seen, klo, zero), torch.where(any_seen, khi, zero),
                        torch.where(has_full, flo, zero), torch.where(has_full, fhi, zero)], -1)


def pairs_per_row(iv: torch.Tensor) -> torch.Tensor:
    """int64 [B', Lq]: attended keys of each query row (the work a row costs an attention kernel)."""
    return (iv[..., 1] - iv[..., 0]).clamp(min=0).sum(-1)

"""Prefix-window attention layouts: what attends to what.

A :class:`WindowLayout` describes the mask family of DESIGN.md §2:

* ``n_ctx`` context tokens, causal among themselves;
* ``num_windows`` windows of ``window_size`` tokens (the last may be shorter);
  window ``m`` sees the context keys ``[prefix_lo[m], prefix_hi[m])`` and its own
  tokens, ``causal`` (slot i sees slots 0..i) or ``full``;
* windows never see other windows and context never sees windows.

Keys are always stored ``[context | window tokens]``. Queries are either all
tokens (``queries="all"``, same order as the keys) or only the window tokens
(``queries="windows"``; the context K/V then come from a cache).

Window tokens are stored position-major (``n_streams=1``: window m occupies
``[m*w, (m+1)*w)`` of the window region) or stream-major (``n_streams=S``: the
window is S streams of ``w/S`` slots, and stream j of window m sits at
``j*M*(w/S) + m*(w/S)``), which is how K-Forcing stores DoubleForward:
``[Future-1 of all windows | Future-2 of all windows]``. Intra-window order is
always stream-major *within* the window, so a causal window of size 2k over
``[F1 ; F2]`` is exactly the paper's DoubleForward.

``dense_mask()`` is the single source of truth for every backend.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

IntsLike = Union[torch.Tensor, Sequence[int]]

INTRA_MODES = ("causal", "full")
QUERY_MODES = ("all", "windows")


def _as_range_tensor(name: str, value: IntsLike) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if t.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape [M] or [B, M], got {tuple(t.shape)}")
    return t.detach().to(device="cpu", dtype=torch.int64).contiguous()


class WindowLayout:
    """A prefix-window attention mask, described by O(M) numbers instead of O(L^2) bits.

    Args:
        n_ctx: C, the number of context tokens (causal among themselves).
        num_windows: M, the number of windows (0 gives plain causal attention).
        window_size: w, the size of every window but the last.
        prefix_lo, prefix_hi: int ``[M]`` or ``[B, M]`` (per batch element); window m
            sees context keys ``[prefix_lo[m], prefix_hi[m])``; ``0 <= lo <= hi <= C``.
        last_window_size: size of the last window (default ``window_size``).
        intra: ``"causal"`` or ``"full"`` attention inside each window.
        queries: ``"all"`` (queries = ``[context | windows]``) or ``"windows"``.
        n_streams: 1 for position-major window storage, S > 1 for stream-major.
    """

    def __init__(
        self,
        n_ctx: int,
        num_windows: int,
        window_size: int,
        prefix_lo: IntsLike,
        prefix_hi: IntsLike,
        *,
        last_window_size: Optional[int] = None,
        intra: str = "causal",
        queries: str = "all",
        n_streams: int = 1,
    ):
        for name, val in (("n_ctx", n_ctx), ("num_windows", num_windows), ("window_size", window_size), ("n_streams", n_streams)):
            if not isinstance(val, int) or isinstance(val, bool):
                raise ValueError(f"{name}: expected an int, got {type(val).__name__}")
        if n_ctx < 0:
            raise ValueError(f"n_ctx: expected >= 0, got {n_ctx}")
        if num_windows < 0:
            raise ValueError(f"num_windows: expected >= 0, got {num_windows}")
        if window_size < 1:
            raise ValueError(f"window_size: expected >= 1, got {window_size}")
        last = window_size if last_window_size is None else last_window_size
        if not isinstance(last, int) or not 1 <= last <= window_size:
            raise ValueError(f"last_window_size: expected an int in [1, {window_size}], got {last_window_size}")
        if intra not in INTRA_MODES:
            raise ValueError(f"intra: expected one of {INTRA_MODES}, got {intra!r}")
        if queries not in QUERY_MODES:
            raise ValueError(f"queries: expected one of {QUERY_MODES}, got {queries!r}")
        if n_streams < 1 or window_size % n_streams != 0:
            raise ValueError(f"n_streams: expected a divisor of window_size={window_size}, got {n_streams}")
        if n_streams > 1 and last != window_size:
            raise ValueError(f"last_window_size: stream-major storage (n_streams={n_streams}) needs equal windows, got {last} != {window_size}")
        if n_ctx + num_windows == 0:
            raise ValueError("n_ctx: a layout needs at least one token (n_ctx=0 and num_windows=0)")
        if queries == "windows" and num_windows == 0:
            raise ValueError("num_windows: queries='windows' needs at least one window, got 0")

        lo = _as_range_tensor("prefix_lo", prefix_lo)
        hi = _as_range_tensor("prefix_hi", prefix_hi)
        if lo.shape != hi.shape:
            raise ValueError(f"prefix_hi: expected the shape of prefix_lo {tuple(lo.shape)}, got {tuple(hi.shape)}")
        if lo.shape[-1] != num_windows:
            raise ValueError(f"prefix_lo: expected {num_windows} windows in the last dim, got shape {tuple(lo.shape)}")
        if lo.numel() and int(lo.min()) < 0:
            raise ValueError(f"prefix_lo: expected values >= 0, got min {int(lo.min())}")
        if hi.numel() and int(hi.max()) > n_ctx:
            raise ValueError(f"prefix_hi: expected values <= n_ctx={n_ctx}, got max {int(hi.max())}")
        if bool((lo > hi).any()):
            bad = int(torch.nonzero(lo > hi)[0, -1])
            raise ValueError(f"prefix_lo: expected lo <= hi for every window, window {bad} has lo > hi")

        self.n_ctx = n_ctx
        self.num_windows = num_windows
        self.window_size = window_size
        self.last_window_size = last if num_windows else window_size
        self.prefix_lo = lo
        self.prefix_hi = hi
        self.intra = intra
        self.queries = queries
        self.n_streams = n_streams

    # ------------------------------------------------------------------ constructors

    @classmethod
    def causal(cls, n: int) -> "WindowLayout":
        """Plain causal attention over ``n`` tokens (no windows): the AR forward."""
        return cls(n, 0, 1, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))

    @classmethod
    def kforcing_single(cls, n_ctx: int, k: int) -> "WindowLayout":
        """K-Forcing SingleForward (paper eq. 18).

        Storage ``[ctx (N) | noise (N*k)]``, noise window t (after context token t)
        at ``N + t*k + i``; it sees context ``[0, t+1)`` and its slots causally.
        Queries: all ``N + N*k`` tokens.
        """
        _check_positive("n_ctx", n_ctx)
        _check_positive("k", k)
        hi = torch.arange(1, n_ctx + 1)
        return cls(n_ctx, n_ctx, k, torch.zeros_like(hi), hi, intra="causal", queries="all")

    @classmethod
    def kforcing_double(cls, n_ctx: int, k: int) -> "WindowLayout":
        """K-Forcing DoubleForward (paper eq. 19), in the paper's stream-major storage.

        Keys ``[ctx (N) | Future-1 (N*k) | Future-2 (N*k)]``, queries
        ``[Future-1 | Future-2]``. Window t = ``[F1 slots of t ; F2 slots of t]`` sees
        context ``[0, t+1)``; causal over the 2k: Future-1 as in SingleForward,
        Future-2 slot j sees all of its window's Future-1 and Future-2 slots 0..j.
        """
        _check_positive("n_ctx", n_ctx)
        _check_positive("k", k)
        hi = torch.arange(1, n_ctx + 1)
        return cls(n_ctx, n_ctx, 2 * k, torch.zeros_like(hi), hi, intra="causal", queries="windows", n_streams=2)

    @classmethod
    def sbd(cls, n_ctx: int, block: int) -> "WindowLayout":
        """Set Block Decoding training mask (its Figure 9 mask_mod) over ``[clean (L) | masked copy (L)]``.

        Clean tokens are causal; masked block b (tokens ``L + b*block ..``) sees the
        clean tokens ``[0, b*block)`` and its whole block. The last block is
        shorter when ``block`` does not divide L. Queries: all ``2L`` tokens.
        """
        _check_positive("n_ctx", n_ctx)
        _check_positive("block", block)
        m = -(-n_ctx // block)
        hi = torch.arange(m) * block
        return cls(n_ctx, m, block, torch.zeros_like(hi), hi, last_window_size=n_ctx - (m - 1) * block, intra="full", queries="all")

    @classmethod
    def ptp(cls, n_ctx: int, starts: IntsLike, completion_len: int, doc_starts: Optional[IntsLike] = None) -> "WindowLayout":
        """Parallel Token Prediction completion pass.

        Keys ``[ctx (S, cached) | completion 0 (L) | completion 1 (L) | ...]``, queries the
        completion tokens only. Completion n sees context ``[doc_starts[n], starts[n])``
        (its document up to the split point) and its own auxiliary tokens causally.
        ``starts``/``doc_starts`` are ``[n]`` or ``[B, n]``; ``doc_starts`` defaults to 0.
        """
        _check_positive("n_ctx", n_ctx)
        _check_positive("completion_len", completion_len)
        hi = _as_range_tensor("starts", starts)
        lo = torch.zeros_like(hi) if doc_starts is None else _as_range_tensor("doc_starts", doc_starts)
        if lo.shape != hi.shape:
            raise ValueError(f"doc_starts: expected the shape of starts {tuple(hi.shape)}, got {tuple(lo.shape)}")
        return cls(n_ctx, hi.shape[-1], completion_len, lo, hi, intra="causal", queries="windows")

    @classmethod
    def jacobi(cls, n_prompt: int, n_noisy: int) -> "WindowLayout":
        """Jacobi Forcing noise-conditioned mask, one noisy stream.

        Storage ``[prompt (P) | clean stream (T) | noisy stream (T)]``: prompt and clean
        stream form one causal (AR) sequence; the noisy stream is one causal window
        that sees the prompt ``[0, P)`` only. Queries: all ``P + 2T`` tokens.
        """
        _check_positive("n_prompt", n_prompt)
        _check_positive("n_noisy", n_noisy)
        return cls(n_prompt + n_noisy, 1, n_noisy, [0], [n_prompt], intra="causal", queries="all")

    # ------------------------------------------------------------------ sizes

    @property
    def batch_size(self) -> Optional[int]:
        """B when the prefix ranges are per batch element (``[B, M]``), else None."""
        return self.prefix_lo.shape[0] if self.prefix_lo.dim() == 2 else None

    @property
    def slots_per_stream(self) -> int:
        return self.window_size // self.n_streams

    @property
    def n_window_tokens(self) -> int:
        if self.num_windows == 0:
            return 0
        return (self.num_windows - 1) * self.window_size + self.last_window_size

    @property
    def n_keys(self) -> int:
        return self.n_ctx + self.n_window_tokens

    @property
    def n_queries(self) -> int:
        return self.n_keys if self.queries == "all" else self.n_window_tokens

    @property
    def query_offset(self) -> int:
        """Key index of query row 0 (0 for ``queries='all'``, C for ``'windows'``)."""
        return 0 if self.queries == "all" else self.n_ctx

    def window_lengths(self) -> torch.Tensor:
        """int64 [M]: the size of each window."""
        w = torch.full((self.num_windows,), self.window_size, dtype=torch.int64)
        if self.num_windows:
            w[-1] = self.last_window_size
        return w

    def num_pairs(self) -> Union[int, torch.Tensor]:
        """|M|, the number of attended (query, key) pairs, computed analytically.

        An int, or an int64 tensor [B] when the prefix ranges are per batch element.
        """
        w = self.window_lengths()
        prefix = ((self.prefix_hi - self.prefix_lo) * w).sum(-1)
        if self.intra == "causal":
            intra = int((w * (w + 1) // 2).sum())
        else:
            intra = int((w * w).sum())
        ctx = self.n_ctx * (self.n_ctx + 1) // 2 if self.queries == "all" else 0
        total = prefix + (ctx + intra)
        return int(total) if total.dim() == 0 else total

    def __repr__(self) -> str:
        return (
            f"WindowLayout(n_ctx={self.n_ctx}, num_windows={self.num_windows}, window_size={self.window_size}, "
            f"last_window_size={self.last_window_size}, intra={self.intra!r}, queries={self.queries!r}, "
            f"n_streams={self.n_streams}, ranges={tuple(self.prefix_lo.shape)})"
        )

    @functools.cached_property
    def cache_key(self) -> tuple:
        """A hashable identity of the layout (used to cache per-layout plans)."""
        return (
            self.n_ctx, self.num_windows, self.window_size, self.last_window_size, self.intra,
            self.queries, self.n_streams, tuple(self.prefix_lo.shape),
            self.prefix_lo.numpy().tobytes(), self.prefix_hi.numpy().tobytes(),
        )

    # ------------------------------------------------------------------ token maps

    @functools.cached_property
    def window_token_keys(self) -> torch.Tensor:
        """int64 [M, w]: key index of slot i of window m (-1 past the end of a short last window)."""
        m_idx = torch.arange(self.num_windows)[:, None]
        slot = torch.arange(self.window_size)[None, :]
        s = self.slots_per_stream
        if self.n_streams == 1:
            keys = self.n_ctx + m_idx * self.window_size + slot
        else:
            keys = self.n_ctx + (slot // s) * (self.num_windows * s) + m_idx * s + slot % s
        valid = slot < self.window_lengths()[:, None]
        return torch.where(valid, keys, torch.full_like(keys, -1))

    def row_intervals(self) -> torch.Tensor:
        """int64 [B', Lq, 1 + S, 2]: the half-open key intervals each query row sees.

        Interval 0 is the context part, intervals 1..S the row's own window, one per
        stream (empty ones are ``[0, 0)``). B' is B for per-batch ranges, else 1.
        The union of a row's intervals is exactly that row of ``dense_mask()``.
        """
        nb = self.batch_size or 1
        S, s = self.n_streams, self.slots_per_stream
        iv = torch.zeros(nb, self.n_keys, 1 + S, 2, dtype=torch.int64)  # indexed by key position
        c = self.n_ctx
        iv[:, :c, 0, 1] = torch.arange(1, c + 1)
        if self.num_windows:
            keys = self.window_token_keys  # [M, w]
            valid = keys >= 0
            m_of = torch.arange(self.num_windows)[:, None].expand_as(keys)[valid]
            slot_of = torch.arange(self.window_size)[None, :].expand_as(keys)[valid]
            key_of = keys[valid]
            lo = self.prefix_lo.reshape(nb, -1)
            hi = self.prefix_hi.reshape(nb, -1)
            iv[:, key_of, 0, 0] = lo[:, m_of]
            iv[:, key_of, 0, 1] = hi[:, m_of]
            # Stream j of the row's window is contiguous in storage; for S=1 the
            # single stream is the whole window (s == w, so stream == 0).
            n_j = torch.clamp(self.window_lengths()[m_of], max=s)
            stream, within = slot_of // s, slot_of % s
            for j in range(S):
                start = keys[m_of, j * s]
                if self.intra == "full":
                    seen = n_j
                else:
                    seen = torch.where(stream > j, n_j, torch.where(stream == j, within + 1, 0))
                iv[:, key_of, 1 + j, 0] = torch.where(seen > 0, start, 0)
                iv[:, key_of, 1 + j, 1] = torch.where(seen > 0, start + seen, 0)
        return iv[:, self.query_offset:]

    def dense_mask(self) -> torch.Tensor:
        """bool [Lq, Lk] (or [B, Lq, Lk] for per-batch ranges): True where query row sees key column."""
        iv = self.row_intervals()
        cols = torch.arange(self.n_keys)
        mask = torch.zeros(iv.shape[0], iv.shape[1], self.n_keys, dtype=torch.bool)
        for j in range(iv.shape[2]):
            mask |= (iv[:, :, j, 0, None] <= cols) & (cols < iv[:, :, j, 1, None])
        return mask if self.batch_size is not None else mask[0]

    # ------------------------------------------------------------------ FlexAttention interop

    def mask_mod(self, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` equal to ``dense_mask()``."""
        iv = self.row_intervals().to(device)
        per_batch = self.batch_size is not None

        def mask_mod(b, h, q_idx, kv_idx):
            bi = b if per_batch else 0
            seen = (iv[bi, q_idx, 0, 0] <= kv_idx) & (kv_idx < iv[bi, q_idx, 0, 1])
            for j in range(1, iv.shape[2]):
                seen = seen | ((iv[bi, q_idx, j, 0] <= kv_idx) & (kv_idx < iv[bi, q_idx, j, 1]))
            return seen

        return mask_mod

    def block_counts(self, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile classification at (block_q, block_k), computed from row intervals in O(L * Lk/block_k).

        Returns bool ``(any, full)`` of shape [B', nQ, nK]: a tile has some visible pair,
        or all of its pairs visible (tiles that overhang the sequence end count as full
        when every in-range pair is visible).
        """
        iv = self.row_intervals()  # [B', Lq, J, 2]
        nb, lq = iv.shape[0], iv.shape[1]
        nq, nk = -(-lq // block_q), -(-self.n_keys // block_k)
        k0 = torch.arange(nk) * block_k
        k1 = torch.clamp(k0 + block_k, max=self.n_keys)
        overlap = (torch.minimum(iv[..., 1, None], k1) - torch.maximum(iv[..., 0, None], k0)).clamp(min=0).sum(2)  # [B', Lq, nK]
        pad = nq * block_q - lq
        seen_any = overlap > 0
        seen_all = overlap == (k1 - k0)
        if pad:
            seen_any = torch.cat([seen_any, torch.zeros(nb, pad, nk, dtype=torch.bool)], 1)
            seen_all = torch.cat([seen_all, torch.ones(nb, pad, nk, dtype=torch.bool)], 1)
        tile_any = seen_any.view(nb, nq, block_q, nk).any(2)
        tile_full = seen_all.view(nb, nq, block_q, nk).all(2) & tile_any
        return tile_any, tile_full

    def to_block_mask(self, block_size: int = 128, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``BlockMask`` for this layout, built analytically (no mask_mod sweep)."""
        from torch.nn.attention.flex_attention import BlockMask

        tile_any, tile_full = self.block_counts(block_size, block_size)
        partial = tile_any & ~tile_full

        def to_indices(sel: torch.Tensor):
            n = sel.sum(-1).to(torch.int32)
            # Stable sort puts the selected key blocks first, in increasing order.
            order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
            return n[:, None].to(device), order[:, None].to(device)

        kv_num, kv_idx = to_indices(partial)
        full_num, full_idx = to_indices(tile_full)
        return BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx,
            BLOCK_SIZE=block_size, mask_mod=self.mask_mod(device),
            seq_lengths=(self.n_queries, self.n_keys),
        )


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def ideal_causal_pairs(n: int) -> int:
    """Pairs of one causal attention over n tokens, the unit of the 'ideal' benchmark line."""
    return n * (n + 1) // 2


__all__ = ["WindowLayout", "ideal_causal_pairs", "INTRA_MODES", "QUERY_MODES"]

"""``WindowLayout``: a prefix-window attention mask, described by O(C + M) numbers.

Glossary (these words mean one thing each, in Python and in C++):

* **token** / **key**: a position in key storage ``[context (C) | window tokens]``.
* **context**: the first C tokens. Context row i sees the context keys
  ``[context_lo[i], context_hi[i])``; by default ``[0, i+1)`` (causal). Packed
  documents and block-causal contexts only change these two numbers per row.
* **window**: M groups of w tokens after the context (the last may be shorter).
  Window m sees the context keys ``[prefix_lo[m], prefix_hi[m])`` and its own tokens,
  ``causal`` (slot i sees slots 0..i) or ``full``; never another window's.
* **slot**: a window-local index ``i`` in ``[0, w)``. Slots ``>= live_slots[m]`` are
  *blank*: they see nothing and nobody sees them (a window cut short).
* **stream**: stream-major storage keeps each window as S streams of ``w/S`` slots, and
  stream j of *all* windows is contiguous (``[F1 of all windows | F2 of all windows]``
  for K-Forcing's DoubleForward). Slot order inside a window is stream-major.
* **interval**: a half-open key range ``[lo, hi)``. Every query row sees the union
  of ``1 + S`` intervals (:meth:`WindowLayout.row_intervals`): 0 = its context
  part, ``1 + j`` = stream j of its own window.
* **tile**: a block of query rows x keys that a kernel processes at once; tile plans
  are reductions of the row intervals (``layouts.intervals.reduce_over_tiles``).

Queries are all tokens (``queries="all"``, in key order) or the window tokens only
(``queries="windows"``: the context K/V come from a cache).

Example, ``WindowLayout.kforcing_single(n_ctx=3, k=2)`` (``#`` = attended)::

             keys: c0 c1 c2 | w0 w0 | w1 w1 | w2 w2
    c0             #        |       |       |
    c1             #  #     |       |       |
    c2             #  #  #  |       |       |
    w0 slot 0      #        |  #    |       |
    w0 slot 1      #        |  #  # |       |
    w1 slot 0      #  #     |       |  #    |
    ...
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from . import flex as _flex
from . import intervals as _iv
from .documents import IntsLike, as_int, as_int_tensor, check_block_aligned, document_bounds, parse_cu_seqlens, stack_rows

INTRA_MODES = ("causal", "full")
QUERY_MODES = ("all", "windows")


class WindowLayout:
    """A prefix-window attention mask.

    Args:
        n_ctx: C, the number of context tokens.
        num_windows: M, the number of windows (0: context only).
        window_size: w, the size of every window but the last.
        prefix_lo, prefix_hi: int ``[M]`` or ``[B, M]`` (per batch element); window m
            sees context keys ``[prefix_lo[m], prefix_hi[m])``, ``0 <= lo <= hi <= C``.
        last_window_size: size of the last window (default ``window_size``).
        intra: ``"causal"`` or ``"full"`` attention inside each window.
        queries: ``"all"`` (queries = ``[context | windows]``) or ``"windows"``.
        n_streams: 1 for position-major window storage, S > 1 for stream-major.
        context_lo, context_hi: int ``[C]`` or ``[B, C]``: context row i sees context keys
            ``[context_lo[i], context_hi[i])`` (default ``[0, i+1)``: causal); both or neither.
        live_slots: int ``[M]`` or ``[B, M]``: slots ``>= live_slots[m]`` of window m are
            blank (default: every slot live).

    All range tensors are copied: a layout owns its numbers and never changes.
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
        context_lo: Optional[IntsLike] = None,
        context_hi: Optional[IntsLike] = None,
        live_slots: Optional[IntsLike] = None,
    ):
        n_ctx, num_windows = as_int("n_ctx", n_ctx), as_int("num_windows", num_windows)
        window_size, n_streams = as_int("window_size", window_size), as_int("n_streams", n_streams)
        if n_ctx < 0:
            raise ValueError(f"n_ctx: expected >= 0, got {n_ctx}")
        if num_windows < 0:
            raise ValueError(f"num_windows: expected >= 0, got {num_windows}")
        if window_size < 1:
            raise ValueError(f"window_size: expected >= 1, got {window_size}")
        last = window_size if last_window_size is None else as_int("last_window_size", last_window_size)
        if not 1 <= last <= window_size:
            raise ValueError(f"last_window_size: expected an int in [1, {window_size}], got {last_window_size}")
        if intra not in INTRA_MODES:
            raise ValueError(f"intra: expected one of {INTRA_MODES}, got {intra!r}")
        if queries not in QUERY_MODES:
            raise ValueError(f"queries: expected one of {QUERY_MODES}, got {queries!r}")
        if n_streams < 1 or window_size % n_streams != 0:
            raise ValueError(f"n_streams: expected a divisor of window_size={window_size}, got {n_streams}")
        if n_streams > 1 and num_windows and last != window_size:
            raise ValueError(f"last_window_size: stream-major storage (n_streams={n_streams}) needs equal windows, got {last} != {window_size}")
        if n_ctx + num_windows == 0:
            raise ValueError("n_ctx: a layout needs at least one token (n_ctx=0 and num_windows=0)")
        if queries == "windows" and num_windows == 0:
            raise ValueError("num_windows: queries='windows' needs at least one window, got 0")

        lo = _ranges("prefix_lo", prefix_lo, num_windows, "windows")
        hi = _ranges("prefix_hi", prefix_hi, num_windows, "windows")
        if lo.shape != hi.shape:
            raise ValueError(f"prefix_hi: expected the shape of prefix_lo {tuple(lo.shape)}, got {tuple(hi.shape)}")
        _check_spans("prefix", lo, hi, n_ctx, "window")

        if (context_lo is None) != (context_hi is None):
            raise ValueError("context_lo: expected context_lo and context_hi together (or neither)")
        clo = chi = None
        if context_lo is not None:
            clo = _ranges("context_lo", context_lo, n_ctx, "context tokens")
            chi = _ranges("context_hi", context_hi, n_ctx, "context tokens")
            if clo.shape != chi.shape:
                raise ValueError(f"context_hi: expected the shape of context_lo {tuple(clo.shape)}, got {tuple(chi.shape)}")
            _check_spans("context", clo, chi, n_ctx, "context row")
        live = None
        if live_slots is not None:
            live = _ranges("live_slots", live_slots, num_windows, "windows")
            if live.numel() and int(live.min()) < 0:
                raise ValueError(f"live_slots: expected values >= 0, got min {int(live.min())}")

        batches = {t.shape[0] for t in (lo, clo, live) if t is not None and t.dim() == 2}
        if len(batches) > 1:
            raise ValueError(f"live_slots: per-batch ranges disagree on the batch size: {sorted(batches)}")

        self.n_ctx = n_ctx
        self.num_windows = num_windows
        self.window_size = window_size
        self.last_window_size = last if num_windows else window_size
        self.intra = intra
        self.queries = queries
        self.n_streams = n_streams
        self._prefix_lo, self._prefix_hi = lo, hi
        self._context_lo, self._context_hi = clo, chi
        self._live = None if live is None else torch.minimum(live, self.window_lengths().expand_as(live))
        self._range_batch = batches.pop() if batches else None

    # ------------------------------------------------------------------ constructors

    @classmethod
    def causal(cls, n: int, *, cu_seqlens=None, block: Optional[int] = None) -> "WindowLayout":
        """Causal attention over ``n`` tokens (the AR forward), no windows.

        ``cu_seqlens``: packed documents (nothing crosses a boundary). ``block``: a
        block-causal context (token i sees its whole block and every earlier block of
        its document; blocks start at each document's start).
        """
        n = _positive("n", n)
        ctx = _context_ranges(n, cu_seqlens, block)
        return cls(n, 0, 1, [], [], **ctx)

    @classmethod
    def kforcing_single(cls, n_ctx: int, k: int, *, cu_seqlens=None) -> "WindowLayout":
        """K-Forcing SingleForward (paper eq. 18).

        Storage ``[ctx (N) | noise (N*k)]``, noise window t (after context token t)
        at ``N + t*k + i``; it sees context ``[0, t+1)`` (with ``cu_seqlens``:
        ``[start of t's document, t+1)``) and its slots causally. Queries: all
        ``N + N*k`` tokens.
        """
        n_ctx, k = _positive("n_ctx", n_ctx), _positive("k", k)
        lo, hi = _staircase(n_ctx, cu_seqlens)
        return cls(n_ctx, n_ctx, k, lo, hi, intra="causal", queries="all", **_context_ranges(n_ctx, cu_seqlens, None))

    @classmethod
    def kforcing_double(cls, n_ctx: int, k: int, *, cu_seqlens=None) -> "WindowLayout":
        """K-Forcing DoubleForward (paper eq. 19), in the paper's stream-major storage.

        Keys ``[ctx (N) | Future-1 (N*k) | Future-2 (N*k)]``, queries
        ``[Future-1 | Future-2]``. Window t = ``[F1 slots of t ; F2 slots of t]`` sees
        context ``[0, t+1)`` (document-local with ``cu_seqlens``); causal over the 2k:
        Future-1 as in SingleForward, Future-2 slot j sees all of its window's
        Future-1 and Future-2 slots 0..j.
        """
        n_ctx, k = _positive("n_ctx", n_ctx), _positive("k", k)
        lo, hi = _staircase(n_ctx, cu_seqlens)
        return cls(n_ctx, n_ctx, 2 * k, lo, hi, intra="causal", queries="windows", n_streams=2)

    @classmethod
    def sbd(cls, n_ctx: int, block: int, *, cu_seqlens=None) -> "WindowLayout":
        """Set Block Decoding training mask (its Figure 9 mask_mod) over ``[clean (L) | masked copy (L)]``.

        Clean tokens are causal; masked block b (tokens ``L + b*block ..``) sees the
        clean tokens ``[0, b*block)`` and its whole block. The last block is shorter
        when ``block`` does not divide L. With ``cu_seqlens`` (boundaries at
        multiples of ``block``) everything stays inside its document.
        """
        n_ctx, block = _positive("n_ctx", n_ctx), _positive("block", block)
        return cls._blockwise(n_ctx, block, cu_seqlens, context_block=None)

    @classmethod
    def bd3lm(cls, n_ctx: int, block: int, *, cu_seqlens=None) -> "WindowLayout":
        """BD3-LM block-diffusion training mask, stored ``[x_0 (clean, n) | x_t (noisy, n)]``.

        x_0 block b sees x_0 blocks ``<= b`` (block-causal); x_t block b sees x_t block b
        (full) and x_0 blocks ``< b``; x_0 never sees x_t. This is kuleshov-group/bd3lms'
        ``block_diff_mask`` after moving its ``[x_t | x_0]`` halves to ``[x_0 | x_t]``:
        ``ours = theirs[perm][:, perm]`` with ``perm = [n..2n) ++ [0..n)``.
        """
        n_ctx, block = _positive("n_ctx", n_ctx), _positive("block", block)
        return cls._blockwise(n_ctx, block, cu_seqlens, context_block=block)

    @classmethod
    def _blockwise(cls, n_ctx: int, block: int, cu_seqlens, context_block: Optional[int]) -> "WindowLayout":
        docs = parse_cu_seqlens(cu_seqlens, n_ctx)
        check_block_aligned("cu_seqlens", docs, block)
        m = -(-n_ctx // block)
        hi = torch.arange(m) * block
        lo = stack_rows([document_bounds(cu, n_ctx)[0][hi] for cu in docs]) if docs else torch.zeros_like(hi)
        hi = hi.expand_as(lo).clone()
        return cls(n_ctx, m, block, lo, hi, last_window_size=n_ctx - (m - 1) * block, intra="full", queries="all",
                   **_context_ranges(n_ctx, cu_seqlens, context_block))

    @classmethod
    def ptp(cls, n_ctx: int, starts: IntsLike, completion_len: int, doc_starts: Optional[IntsLike] = None,
            doc_ends: Optional[IntsLike] = None) -> "WindowLayout":
        """Parallel Token Prediction completion pass.

        Keys ``[ctx (S, cached) | completion 0 (L) | completion 1 (L) | ...]``, queries the
        completion tokens only. Completion n sees context ``[doc_starts[n], starts[n])``
        (its document up to the split point) and its own auxiliary tokens causally.
        With ``doc_ends``, aux token i of completion n (position ``starts[n] + i``) is
        blank when ``starts[n] + i >= doc_ends[n]``, as the original PTP packing does.
        ``starts``/``doc_starts``/``doc_ends`` are ``[n]`` or ``[B, n]``; ``doc_starts`` defaults to 0.
        """
        n_ctx, completion_len = _positive("n_ctx", n_ctx), _positive("completion_len", completion_len)
        hi = as_int_tensor("starts", starts)
        if hi.shape[-1] == 0:
            raise ValueError("starts: expected at least one completion, got none")
        lo = torch.zeros_like(hi) if doc_starts is None else as_int_tensor("doc_starts", doc_starts)
        if lo.shape != hi.shape:
            raise ValueError(f"doc_starts: expected the shape of starts {tuple(hi.shape)}, got {tuple(lo.shape)}")
        _check_spans("", lo, hi, n_ctx, "completion", lo_name="doc_starts", hi_name="starts")
        live = None
        if doc_ends is not None:
            ends = as_int_tensor("doc_ends", doc_ends)
            if ends.shape != hi.shape:
                raise ValueError(f"doc_ends: expected the shape of starts {tuple(hi.shape)}, got {tuple(ends.shape)}")
            if bool((ends < hi).any()):
                raise ValueError("doc_ends: expected doc_ends >= starts for every completion")
            live = torch.clamp(ends - hi, max=completion_len)
        return cls(n_ctx, hi.shape[-1], completion_len, lo, hi, intra="causal", queries="windows", live_slots=live)

    @classmethod
    def jacobi(cls, n_prompt: int, n_noisy: int) -> "WindowLayout":
        """Jacobi Forcing noise-conditioned mask, one noisy stream.

        Storage ``[prompt (P) | clean stream (T) | noisy stream (T)]``: prompt and clean
        stream form one causal (AR) sequence; the noisy stream is one causal window
        that sees the prompt ``[0, P)`` only. Queries: all ``P + 2T`` tokens.
        """
        n_prompt, n_noisy = _positive("n_prompt", n_prompt), _positive("n_noisy", n_noisy)
        return cls(n_prompt + n_noisy, 1, n_noisy, [0], [n_prompt], intra="causal", queries="all")

    # ------------------------------------------------------------------ the numbers (copies)

    @property
    def prefix_lo(self) -> torch.Tensor:
        return self._prefix_lo.clone()

    @property
    def prefix_hi(self) -> torch.Tensor:
        return self._prefix_hi.clone()

    @property
    def context_lo(self) -> Optional[torch.Tensor]:
        """int64 [C] or [B, C], or None for the default causal context."""
        return None if self._context_lo is None else self._context_lo.clone()

    @property
    def context_hi(self) -> Optional[torch.Tensor]:
        return None if self._context_hi is None else self._context_hi.clone()

    @property
    def live_slots(self) -> Optional[torch.Tensor]:
        """int64 [M] or [B, M] (capped at each window's length), or None when every slot is live."""
        return None if self._live is None else self._live.clone()

    def live_lengths(self) -> torch.Tensor:
        """int64 [M] or [B, M]: live slots per window (the window length when none is blank)."""
        return self.window_lengths() if self._live is None else self._live.clone()

    # ------------------------------------------------------------------ sizes

    @property
    def range_batch(self) -> Optional[int]:
        """B when any range is given per batch element, else None (shared by the batch)."""
        return self._range_batch

    batch_size = range_batch

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

    @property
    def has_default_context(self) -> bool:
        """Context rows are plain causal (``[0, i+1)``)."""
        return self._context_lo is None

    @property
    def has_blank_slots(self) -> bool:
        return self._live is not None and bool((self._live < self.window_lengths()).any())

    def window_lengths(self) -> torch.Tensor:
        """int64 [M]: the size of each window."""
        w = torch.full((self.num_windows,), self.window_size, dtype=torch.int64)
        if self.num_windows:
            w[-1] = self.last_window_size
        return w

    def num_pairs(self) -> Union[int, torch.Tensor]:
        """|M|, the number of attended (query, key) pairs, from the row intervals in O(Lq).

        An int, or an int64 tensor [B] when ranges are per batch element.
        """
        total = _iv.count_pairs(self._row_intervals)
        return int(total[0]) if self._range_batch is None else total

    def __repr__(self) -> str:
        extra = ""
        if self._context_lo is not None:
            extra += f", context_ranges={tuple(self._context_lo.shape)}"
        if self._live is not None:
            extra += f", live_slots={tuple(self._live.shape)}"
        return (
            f"WindowLayout(n_ctx={self.n_ctx}, num_windows={self.num_windows}, window_size={self.window_size}, "
            f"last_window_size={self.last_window_size}, intra={self.intra!r}, queries={self.queries!r}, "
            f"n_streams={self.n_streams}, ranges={tuple(self._prefix_lo.shape)}{extra})"
        )

    @functools.cached_property
    def cache_key(self) -> tuple:
        """A hashable identity of the layout (used to cache per-layout plans)."""
        def blob(t):
            return None if t is None else (tuple(t.shape), t.numpy().tobytes())

        return (
            self.n_ctx, self.num_windows, self.window_size, self.last_window_size, self.intra, self.queries,
            self.n_streams, blob(self._prefix_lo), blob(self._prefix_hi), blob(self._context_lo),
            blob(self._context_hi), blob(self._live),
        )

    def batch_element(self, b: int) -> "WindowLayout":
        """The layout batch element ``b`` sees (itself when the ranges are shared by the batch)."""
        if self._range_batch is None:
            return self
        b = as_int("b", b)
        if not 0 <= b < self._range_batch:
            raise ValueError(f"b: expected a batch index in [0, {self._range_batch}), got {b}")
        pick = lambda t: None if t is None else (t[b] if t.dim() == 2 else t)  # noqa: E731
        return WindowLayout(
            self.n_ctx, self.num_windows, self.window_size, pick(self._prefix_lo), pick(self._prefix_hi),
            last_window_size=self.last_window_size, intra=self.intra, queries=self.queries, n_streams=self.n_streams,
            context_lo=pick(self._context_lo), context_hi=pick(self._context_hi), live_slots=pick(self._live),
        )

    # ------------------------------------------------------------------ semantics (derived once)

    @functools.cached_property
    def window_token_keys(self) -> torch.Tensor:
        """int64 [M, w]: key index of slot i of window m (-1 past the end of a short last window)."""
        return _iv.window_slot_keys(self)

    @functools.cached_property
    def _row_intervals(self) -> torch.Tensor:
        return _iv.build_row_intervals(self)

    def row_intervals(self) -> torch.Tensor:
        """int64 [B', Lq, 1 + S, 2]: the half-open key intervals each query row sees.

        Interval 0 is the context part, intervals 1..S the row's own window, one per
        stream (empty ones are ``[0, 0)``). B' is B for per-batch ranges, else 1.
        The union of a row's intervals is exactly that row of ``dense_mask()``; every
        backend and tile plan reads this tensor (``layouts/intervals.py``).
        """
        return self._row_intervals.clone()

    @functools.cached_property
    def row_intervals_int32(self) -> torch.Tensor:
        """int32 contiguous copy of :meth:`row_intervals` (what the kernels read)."""
        if self.n_keys >= 2**31:
            raise ValueError(f"layout: expected fewer than 2^31 keys, got {self.n_keys}")
        return self._row_intervals.to(torch.int32).contiguous()

    @functools.cached_property
    def cpu_query_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``(row_order [Lq], tile_begin [T + 1])``: which query rows the C++ kernels compute
        together (``layouts/intervals.py``, ``cpu_query_tiles``)."""
        if self.n_keys >= 2**31:
            raise ValueError(f"layout: expected fewer than 2^31 keys, got {self.n_keys}")
        return _iv.cpu_query_tiles(self)

    def dense_mask(self) -> torch.Tensor:
        """bool [Lq, Lk] (or [B, Lq, Lk] for per-batch ranges): True where query row sees key column."""
        mask = _iv.dense_mask_from(self._row_intervals, self.n_keys)
        return mask if self._range_batch is not None else mask[0]

    # ------------------------------------------------------------------ FlexAttention interop (layouts/flex.py)

    def mask_mod(self, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` equal to ``dense_mask()``."""
        return _flex.mask_mod(self._row_intervals, self._range_batch is not None, device)

    def block_counts(self, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bool ``(any, full)`` [B', nQ, nK]: tiles with some / all pairs visible (see ``flex.block_counts``)."""
        return _flex.block_counts(self._row_intervals, self.n_keys, block_q, block_k)

    def to_block_mask(self, block_size: int = 128, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``BlockMask`` for this layout, built analytically (no mask_mod sweep)."""
        return _flex.to_block_mask(self, block_size, device)


# ---------------------------------------------------------------------- helpers


def _positive(name: str, value) -> int:
    v = as_int(name, value)
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return v


def _ranges(name: str, value: IntsLike, n: int, what: str) -> torch.Tensor:
    t = as_int_tensor(name, value)
    if t.shape[-1] != n:
        raise ValueError(f"{name}: expected {n} {what} in the last dim, got shape {tuple(t.shape)}")
    return t


def _check_spans(prefix: str, lo: torch.Tensor, hi: torch.Tensor, n_ctx: int, what: str, *,
                 lo_name: Optional[str] = None, hi_name: Optional[str] = None) -> None:
    lo_name, hi_name = lo_name or f"{prefix}_lo", hi_name or f"{prefix}_hi"
    if lo.numel() and int(lo.min()) < 0:
        raise ValueError(f"{lo_name}: expected values >= 0, got min {int(lo.min())}")
    if hi.numel() and int(hi.max()) > n_ctx:
        raise ValueError(f"{hi_name}: expected values <= n_ctx={n_ctx}, got max {int(hi.max())}")
    if bool((lo > hi).any()):
        bad = int(torch.nonzero(lo > hi)[0, -1])
        raise ValueError(f"{lo_name}: expected {lo_name} <= {hi_name} for every {what}, {what} {bad} has {lo_name} > {hi_name}")


def _staircase(n_ctx: int, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """Window t after context token t sees ``[start of t's document, t+1)``."""
    hi = torch.arange(1, n_ctx + 1)
    docs = parse_cu_seqlens(cu_seqlens, n_ctx)
    if docs is None:
        return torch.zeros_like(hi), hi
    lo = stack_rows([document_bounds(cu, n_ctx)[0] for cu in docs])
    return lo, hi.expand_as(lo).clone()


def _context_ranges(n: int, cu_seqlens, block: Optional[int]) -> dict:
    """``context_lo``/``context_hi`` for documents and/or blocks (empty dict: plain causal)."""
    docs = parse_cu_seqlens(cu_seqlens, n)
    if docs is None and block is None:
        return {}
    if block is not None:
        block = _positive("block", block)
    pos = torch.arange(n)
    los, his = [], []
    for cu in docs or [torch.tensor([0, n])]:
        start, end = document_bounds(cu, n)
        hi = pos + 1 if block is None else torch.minimum(start + ((pos - start) // block + 1) * block, end)
        los.append(start)
        his.append(hi)
    return dict(context_lo=stack_rows(los), context_hi=stack_rows(his))


def ideal_causal_pairs(n: int) -> int:
    """Pairs of one causal attention over n tokens, the unit of the 'ideal' benchmark line."""
    return n * (n + 1) // 2

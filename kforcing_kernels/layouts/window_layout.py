"""``WindowLayout``: a prefix-window attention mask, described by O(C + M) numbers.

Glossary (these words mean one thing each, in Python and in C++):

* **token** / **key**: a position in key storage ``[context (C) | window tokens]``.
* **context**: the first C tokens. Context row i sees the context keys
  ``[context_lo[i], context_hi[i])``; by default ``[0, i+1)`` (causal). Packed
  documents and block-causal contexts only change these two numbers per row.
* **window**: M groups of w tokens after the context (the last may be shorter).
  Window m sees the context keys ``[prefix_lo[m], prefix_hi[m])`` and its own tokens,
  ``causal`` (slot i sees slots 0..i) or ``full``; never another window's.
* **sliding bound**: optionally, a window's context bounds move with the slot: slot o of
  window m sees ``[max(prefix_lo[m], slide_lo[m] + o), min(prefix_hi[m], slide_hi[m] + o))``
  (``prefix_slide_lo`` / ``prefix_slide_hi``; a sliding-window attention layer over a draft
  block, SpecForge's DFlash). Without them every slot of a window sees the same context.
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

from typing import Callable, Hashable, Optional, TypeVar, Union

import torch

from . import derived as _derived_store
from . import flex as _flex
from . import intervals as _iv
from .base import Store
from .constructors import Constructors
from .documents import IntsLike, as_int, as_int_tensor, check_spans
from .query_rows import QueryRowsLayout

_T = TypeVar("_T")
INTRA_MODES = ("causal", "full")
QUERY_MODES = ("all", "windows")


class WindowLayout(Constructors):
    """A prefix-window attention mask (its named constructors, ``causal``, ``kforcing_single``, ...:
    ``constructors.py``).

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
        prefix_slide_lo, prefix_slide_hi: int ``[M]`` or ``[B, M]`` (each optional): sliding
            context bounds; slot o of window m sees context keys
            ``[max(prefix_lo[m], prefix_slide_lo[m] + o), min(prefix_hi[m], prefix_slide_hi[m] + o))``
            (an empty range sees no context). Any ints: the prefix range clips them.

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
        prefix_slide_lo: Optional[IntsLike] = None,
        prefix_slide_hi: Optional[IntsLike] = None,
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
            raise ValueError(
                f"last_window_size: stream-major storage (n_streams={n_streams}) needs equal windows, got "
                f"{last} != {window_size}"
            )
        if n_ctx + num_windows == 0:
            raise ValueError("n_ctx: a layout needs at least one token (n_ctx=0 and num_windows=0)")
        if queries == "windows" and num_windows == 0:
            raise ValueError("num_windows: queries='windows' needs at least one window, got 0")

        lo = _ranges("prefix_lo", prefix_lo, num_windows, "windows")
        hi = _ranges("prefix_hi", prefix_hi, num_windows, "windows")
        if lo.shape != hi.shape:
            raise ValueError(f"prefix_hi: expected the shape of prefix_lo {tuple(lo.shape)}, got {tuple(hi.shape)}")
        check_spans("prefix", lo, hi, n_ctx, "window")

        if (context_lo is None) != (context_hi is None):
            raise ValueError("context_lo: expected context_lo and context_hi together (or neither)")
        clo = chi = None
        if context_lo is not None and context_hi is not None:  # together (checked above)
            clo = _ranges("context_lo", context_lo, n_ctx, "context tokens")
            chi = _ranges("context_hi", context_hi, n_ctx, "context tokens")
            if clo.shape != chi.shape:
                raise ValueError(
                    f"context_hi: expected the shape of context_lo {tuple(clo.shape)}, got {tuple(chi.shape)}"
                )
            check_spans("context", clo, chi, n_ctx, "context row")
        live = None
        if live_slots is not None:
            live = _ranges("live_slots", live_slots, num_windows, "windows")
            if live.numel() and int(live.min()) < 0:
                raise ValueError(f"live_slots: expected values >= 0, got min {int(live.min())}")

        slides = [
            None if value is None else _ranges(name, value, num_windows, "windows")
            for name, value in (("prefix_slide_lo", prefix_slide_lo), ("prefix_slide_hi", prefix_slide_hi))
        ]

        batches = {t.shape[0] for t in (lo, clo, live, *slides) if t is not None and t.dim() == 2}
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
        self._prefix_slide_lo, self._prefix_slide_hi = slides
        self._range_batch = batches.pop() if batches else None
        self._key: Optional[tuple] = None  # cache_key, computed on first use
        self.store = Store()  # derived artifacts, shared by equal layouts (derived.py)

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
    def prefix_slide_lo(self) -> Optional[torch.Tensor]:
        """int64 [M] or [B, M]: slot o's context starts at ``max(prefix_lo, prefix_slide_lo + o)``; None: no slide."""
        return None if self._prefix_slide_lo is None else self._prefix_slide_lo.clone()

    @property
    def prefix_slide_hi(self) -> Optional[torch.Tensor]:
        """int64 [M] or [B, M]: slot o's context ends at ``min(prefix_hi, prefix_slide_hi + o)``; None: no slide."""
        return None if self._prefix_slide_hi is None else self._prefix_slide_hi.clone()

    def range_tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        """The layout's own int64 CPU range tensors, not copies (read them, never write them), in the order
        ``(prefix_lo, prefix_hi, context_lo, context_hi, live_slots, prefix_slide_lo, prefix_slide_hi)``;
        None where a range is the default. What the custom op carries and the content key hashes."""
        return (
            self._prefix_lo,
            self._prefix_hi,
            self._context_lo,
            self._context_hi,
            self._live,
            self._prefix_slide_lo,
            self._prefix_slide_hi,
        )

    @property
    def has_sliding_context(self) -> bool:
        """Whether some window's context bounds move with the slot (then its slots may see different context)."""
        return self._prefix_slide_lo is not None or self._prefix_slide_hi is not None

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
        total = _iv.count_pairs(self.row_intervals(copy=False))
        return int(total[0]) if self._range_batch is None else total

    def __repr__(self) -> str:
        extra = ""
        if self._context_lo is not None:
            extra += f", context_ranges={tuple(self._context_lo.shape)}"
        if self._live is not None:
            extra += f", live_slots={tuple(self._live.shape)}"
        for name in ("prefix_slide_lo", "prefix_slide_hi"):
            t = getattr(self, "_" + name)
            if t is not None:
                extra += f", {name}={tuple(t.shape)}"
        return (
            f"WindowLayout(n_ctx={self.n_ctx}, num_windows={self.num_windows}, window_size={self.window_size}, "
            f"last_window_size={self.last_window_size}, intra={self.intra!r}, queries={self.queries!r}, "
            f"n_streams={self.n_streams}, ranges={tuple(self._prefix_lo.shape)}{extra})"
        )

    @property
    def cache_key(self) -> tuple:
        """A hashable identity of the layout's content (ints, flags, range bytes); equal layouts share derived data.

        Kept on the layout itself, not in its store: the store is found by this key (derived.py)."""
        if self._key is None:
            self._key = _derived_store.content_key(
                self.n_ctx,
                self.num_windows,
                self.window_size,
                self.last_window_size,
                self.intra,
                self.queries,
                self.n_streams,
                self.range_tensors(),
            )
        return self._key

    def derived(self, name: Hashable, build: Callable[[], _T]) -> _T:
        """The artifact ``name`` derived from this layout, ``build()`` on the first request.

        The one cache of per-layout data (row intervals, composite pieces, tile plans, device copies): a
        store shared by every layout with this content, bounded; see ``layouts/derived.py``. ``name`` is any
        hashable key, by convention ``("owner.what", *what it depends on)`` (tile shapes, device, stream);
        ``build()`` takes no argument. The artifact is shared: callers must not modify it."""
        return _derived_store.derived(self, name, build)

    def batch_element(self, b: int) -> "WindowLayout":
        """The layout batch element ``b`` sees (itself when the ranges are shared by the batch)."""
        if self._range_batch is None:
            return self
        b = as_int("b", b)
        if not 0 <= b < self._range_batch:
            raise ValueError(f"b: expected a batch index in [0, {self._range_batch}), got {b}")

        def row(t: torch.Tensor) -> torch.Tensor:
            return t[b] if t.dim() == 2 else t

        def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else row(t)

        return WindowLayout(
            self.n_ctx,
            self.num_windows,
            self.window_size,
            row(self._prefix_lo),
            row(self._prefix_hi),
            last_window_size=self.last_window_size,
            intra=self.intra,
            queries=self.queries,
            n_streams=self.n_streams,
            context_lo=pick(self._context_lo),
            context_hi=pick(self._context_hi),
            live_slots=pick(self._live),
            prefix_slide_lo=pick(self._prefix_slide_lo),
            prefix_slide_hi=pick(self._prefix_slide_hi),
        )

    def with_sliding_window(self, window: int) -> "WindowLayout":
        """This layout under a model's sliding window of ``window`` positions (a token at position p sees
        ``(p - window, p]``), intersected in position space: ``layouts/sliding.py``."""
        from .sliding import with_sliding_window

        return with_sliding_window(self, window)

    def restrict_rows(self, rows: IntsLike) -> "QueryRowsLayout":
        """This layout's query rows ``rows`` (int ``[R]``, strictly increasing) over all of its keys, in order:
        a :class:`~kforcing_kernels.layouts.query_rows.QueryRowsLayout` derived from the row intervals
        (context parallelism: one rank's rows). Its ``dense_mask()`` is ``self.dense_mask()[..., rows, :]``."""
        return QueryRowsLayout(self, rows)

    # ------------------------------------------------------------------ semantics (derived once)

    @property
    def window_token_keys(self) -> torch.Tensor:
        """int64 [M, w]: key index of slot i of window m (-1 past the end of a short last window)."""
        return self.derived("layout.window_token_keys", lambda: _iv.window_slot_keys(self))

    def row_intervals(self, copy: bool = True) -> torch.Tensor:
        """int64 [B', Lq, 1 + S, 2]: the half-open key intervals each query row sees.

        Interval 0 is the context part, intervals 1..S the row's own window, one per
        stream (empty ones are ``[0, 0)``). B' is B for per-batch ranges, else 1.
        The union of a row's intervals is exactly that row of ``dense_mask()``; every
        backend and tile plan reads this tensor (``layouts/intervals.py``).
        ``copy=False`` returns the layout's own derived tensor (no copy; read it, never write it).
        """
        iv = self.derived("layout.row_intervals", lambda: _iv.build_row_intervals(self))
        return iv.clone() if copy else iv

    @property
    def row_intervals_int32(self) -> torch.Tensor:
        """int32 contiguous copy of :meth:`row_intervals` (what the kernels read)."""
        if self.n_keys >= 2**31:
            raise ValueError(f"layout: expected fewer than 2^31 keys, got {self.n_keys}")
        return self.derived(
            "layout.row_intervals_int32", lambda: self.row_intervals(copy=False).to(torch.int32).contiguous()
        )

    @property
    def cpu_query_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``(row_order [Lq], tile_begin [T + 1])``: which query rows the C++ kernels compute
        together (``layouts/intervals.py``, ``cpu_query_tiles``)."""
        if self.n_keys >= 2**31:
            raise ValueError(f"layout: expected fewer than 2^31 keys, got {self.n_keys}")
        return self.derived("layout.cpu_query_tiles", lambda: _iv.cpu_query_tiles(self))

    def dense_mask(self) -> torch.Tensor:
        """bool [Lq, Lk] (or [B, Lq, Lk] for per-batch ranges): True where query row sees key column."""
        mask = _iv.dense_mask_from(self.row_intervals(copy=False), self.n_keys)
        return mask if self._range_batch is not None else mask[0]

    # ------------------------------------------------------------------ FlexAttention interop (layouts/flex.py)

    def mask_mod(self, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` equal to ``dense_mask()``."""
        return _flex.mask_mod(self.row_intervals(copy=False), self._range_batch is not None, device)

    def block_counts(self, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bool ``(any, full)`` [B', nQ, nK]: tiles with some / all pairs visible (see ``flex.block_counts``)."""
        return _flex.block_counts(self.row_intervals(copy=False), self.n_keys, block_q, block_k)

    def to_block_mask(self, block_size: int = 128, device: Union[str, torch.device] = "cpu"):
        """A FlexAttention ``BlockMask`` for this layout, built analytically (no mask_mod sweep)."""
        return _flex.to_block_mask(self, block_size, device)


# ---------------------------------------------------------------------- helpers


def _ranges(name: str, value: IntsLike, n: int, what: str) -> torch.Tensor:
    t = as_int_tensor(name, value)
    if t.shape[-1] != n:
        raise ValueError(f"{name}: expected {n} {what} in the last dim, got shape {tuple(t.shape)}")
    return t


def ideal_causal_pairs(n: int) -> int:
    """Pairs of one causal attention over n tokens, the unit of the 'ideal' benchmark line."""
    return n * (n + 1) // 2

"""A layout intersected with a model's sliding window, in position space (what inference gives the window).

A sliding-window attention layer with window ``W`` (Mistral, Qwen2, Gemma's local layers; the
transformers convention) lets the token at position ``p`` see the keys at positions ``(p - W, p]``.
Over a layout this means, for the layouts of the K-Forcing recipe (and every constructor whose
windows continue their visible context: SingleForward, DoubleForward, SBD, BD3-LM, PTP, packed
documents, the generation windows):

* context row i (positions increase by one per key inside its document) keeps its context keys
  ``j >= i - W + 1``: it sees ``[max(context_lo[i], i - W + 1), context_hi[i])``;
* window m sits right after the last context key it sees: slot o is at position
  ``pos(prefix_hi[m] - 1) + 1 + o``, so it keeps the context keys ``j >= prefix_hi[m] - W + 1 + o``,
  a sliding lower bound ``prefix_slide_lo[m] = prefix_hi[m] - W + 1`` (for K-Forcing's window t,
  ``[max(doc_start, t + 2 + o - W), t + 1)``);
* a window's own slots are at most ``w - 1`` positions apart: every one stays in sight iff ``W >= w``;
  a shorter window is refused (the intra-window part has no per-slot bound).

Keys are counted in key storage order only through these relations, never as distances in storage
(window tokens sit after the whole context in storage, but next to their context in positions).
"""

from __future__ import annotations

import operator
from typing import Optional, TypeVar

import torch

from .base import LayoutBase

L = TypeVar("L", bound=LayoutBase)

__all__ = ["with_sliding_window", "check_window", "sliding_bounds", "window_hides_nothing"]


def with_sliding_window(layout: L, window: int) -> L:
    """``layout`` as seen by a sliding-window attention layer of window ``window`` (see the module docstring).

    Returns a layout with the same storage, geometry, documents and blank slots whose rows see only the
    keys of ``layout`` that lie less than ``window`` positions back; ``layout`` itself when the window
    hides nothing. Raises ValueError naming ``window`` when it is shorter than the layout's windows
    (``window_size``), and ``layout`` when it already has per-slot sliding bounds (two sliding rules).
    """
    window = check_window(layout, window)
    if window_hides_nothing(layout, window):
        return layout
    return layout.derived(("sliding.window", window), lambda: _intersect(layout, window))


def check_window(layout: LayoutBase, window) -> int:
    """``window`` as an int after the refusals of :func:`with_sliding_window` (no value of a tensor is read)."""
    if isinstance(window, bool):
        raise ValueError(f"window: expected a positive int, got {window!r}")
    try:
        window = operator.index(window)
    except TypeError:
        raise ValueError(f"window: expected a positive int, got {window!r}") from None
    if window < 1:
        raise ValueError(f"window: expected a positive int, got {window}")
    if not isinstance(layout, LayoutBase):  # a WindowLayout (a QueryRowsLayout has no ranges to intersect)
        raise ValueError(f"layout: expected a WindowLayout, got {type(layout).__name__}")
    if layout.num_windows and window < layout.window_size:
        raise ValueError(
            f"window: a sliding window of {window} positions is shorter than the layout's windows of "
            f"{layout.window_size} slots (a slot would lose sight of its own window's first slots); "
            f"expected a window >= {layout.window_size}"
        )
    if layout.has_sliding_context:
        raise ValueError(
            "layout: expected a layout without prefix_slide_lo/hi (its own sliding bounds) to intersect "
            "with a model's sliding window"
        )
    return window


def window_hides_nothing(layout: LayoutBase, window: int) -> bool:
    """Whether no row reaches ``window`` positions back: the last context row, or the last slot of a window."""
    return layout.n_ctx + (layout.window_size if layout.num_windows else 0) <= window


def _intersect(layout: L, window: int) -> L:
    context_lo, context_hi, slide_lo = sliding_bounds(
        layout.n_ctx, layout.queries == "all", layout.prefix_hi, layout.context_lo, layout.context_hi, window
    )
    return type(layout)(
        layout.n_ctx,
        layout.num_windows,
        layout.window_size,
        layout.prefix_lo,
        layout.prefix_hi,
        last_window_size=layout.last_window_size,
        intra=layout.intra,
        queries=layout.queries,
        n_streams=layout.n_streams,
        context_lo=context_lo,
        context_hi=context_hi,
        live_slots=layout.live_slots,
        prefix_slide_lo=slide_lo if layout.num_windows else None,
    )


def sliding_bounds(
    n_ctx: int,
    queries_all: bool,
    prefix_hi: torch.Tensor,
    context_lo: Optional[torch.Tensor],
    context_hi: Optional[torch.Tensor],
    window: int,
):
    """The range numbers of the intersection: ``(context_lo, context_hi, prefix_slide_lo)``.

    The one place the rule is written; tensor ops only, so compiled callers (``integrations/hf.py`` under
    torch.compile, where no layout can be built) trace it. ``context_lo/hi`` None mean causal; they are
    returned unchanged when the context rows are no queries (``queries="windows"``).
    """
    if queries_all:
        rows = torch.arange(n_ctx, device=prefix_hi.device)
        lo = torch.zeros_like(rows) if context_lo is None else context_lo
        context_lo = torch.maximum(lo, rows - window + 1)  # row i keeps keys j >= i - W + 1
        context_hi = (rows + 1 if context_hi is None else context_hi).expand_as(context_lo).clone()
    return context_lo, context_hi, prefix_hi - window + 1  # slot o keeps context keys j >= prefix_hi - W + 1 + o

"""The named constructors of ``WindowLayout`` (exposed as its classmethods): one per attention family.

Each builds the O(C + M) range numbers of a published mask; ``cu_seqlens`` (packed documents,
``documents.py``) keeps everything inside its document. ``cls`` is the class the classmethod
was called on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .documents import (IntsLike, PerBatch, as_int_tensor, check_block_aligned, check_spans, document_bounds,
                        parse_cu_seqlens, positive_int, stack_rows)

if TYPE_CHECKING:
    from .window_layout import WindowLayout


def causal(cls: "type[WindowLayout]", n: int, *, cu_seqlens=None, block: Optional[int] = None) -> "WindowLayout":
    """Causal attention over ``n`` tokens (the AR forward), no windows.

    ``cu_seqlens``: packed documents (nothing crosses a boundary). ``block``: a
    block-causal context (token i sees its whole block and every earlier block of
    its document; blocks start at each document's start).
    """
    n = positive_int("n", n)
    ctx = _context_ranges(n, cu_seqlens, block)
    return cls(n, 0, 1, [], [], **ctx)


def kforcing_single(cls: "type[WindowLayout]", n_ctx: int, k: int, *, cu_seqlens=None) -> "WindowLayout":
    """K-Forcing SingleForward (paper eq. 18).

    Storage ``[ctx (N) | noise (N*k)]``, noise window t (after context token t)
    at ``N + t*k + i``; it sees context ``[0, t+1)`` (with ``cu_seqlens``:
    ``[start of t's document, t+1)``) and its slots causally. Queries: all
    ``N + N*k`` tokens.
    """
    n_ctx, k = positive_int("n_ctx", n_ctx), positive_int("k", k)
    lo, hi = _staircase(n_ctx, cu_seqlens)
    return cls(n_ctx, n_ctx, k, lo, hi, intra="causal", queries="all", **_context_ranges(n_ctx, cu_seqlens, None))


def kforcing_double(cls: "type[WindowLayout]", n_ctx: int, k: int, *, cu_seqlens=None) -> "WindowLayout":
    """K-Forcing DoubleForward (paper eq. 19), in the paper's stream-major storage.

    Keys ``[ctx (N) | Future-1 (N*k) | Future-2 (N*k)]``, queries
    ``[Future-1 | Future-2]``. Window t = ``[F1 slots of t ; F2 slots of t]`` sees
    context ``[0, t+1)`` (document-local with ``cu_seqlens``); causal over the 2k:
    Future-1 as in SingleForward, Future-2 slot j sees all of its window's
    Future-1 and Future-2 slots 0..j.
    """
    n_ctx, k = positive_int("n_ctx", n_ctx), positive_int("k", k)
    lo, hi = _staircase(n_ctx, cu_seqlens)
    return cls(n_ctx, n_ctx, 2 * k, lo, hi, intra="causal", queries="windows", n_streams=2)


def sbd(cls: "type[WindowLayout]", n_ctx: int, block: int, *, cu_seqlens=None) -> "WindowLayout":
    """Set Block Decoding training mask (its Figure 9 mask_mod) over ``[clean (L) | masked copy (L)]``.

    Clean tokens are causal; masked block b (tokens ``L + b*block ..``) sees the
    clean tokens ``[0, b*block)`` and its whole block. The last block is shorter
    when ``block`` does not divide L. With ``cu_seqlens`` (boundaries at
    multiples of ``block``) everything stays inside its document.
    """
    n_ctx, block = positive_int("n_ctx", n_ctx), positive_int("block", block)
    return _blockwise(cls, n_ctx, block, cu_seqlens, context_block=None)


def bd3lm(cls: "type[WindowLayout]", n_ctx: int, block: int, *, cu_seqlens=None) -> "WindowLayout":
    """BD3-LM block-diffusion training mask, stored ``[x_0 (clean, n) | x_t (noisy, n)]``.

    x_0 block b sees x_0 blocks ``<= b`` (block-causal); x_t block b sees x_t block b
    (full) and x_0 blocks ``< b``; x_0 never sees x_t. This is kuleshov-group/bd3lms'
    ``block_diff_mask`` after moving its ``[x_t | x_0]`` halves to ``[x_0 | x_t]``:
    ``ours = theirs[perm][:, perm]`` with ``perm = [n..2n) ++ [0..n)``.
    """
    n_ctx, block = positive_int("n_ctx", n_ctx), positive_int("block", block)
    return _blockwise(cls, n_ctx, block, cu_seqlens, context_block=block)


def _blockwise(cls: "type[WindowLayout]", n_ctx: int, block: int, cu_seqlens,
               context_block: Optional[int]) -> "WindowLayout":
    docs = parse_cu_seqlens(cu_seqlens, n_ctx)
    check_block_aligned("cu_seqlens", docs, block)
    m = -(-n_ctx // block)
    hi = torch.arange(m) * block
    lo = stack_rows([document_bounds(cu, n_ctx)[0][hi] for cu in docs], isinstance(docs, PerBatch)) if docs else torch.zeros_like(hi)
    hi = hi.expand_as(lo).clone()
    return cls(n_ctx, m, block, lo, hi, last_window_size=n_ctx - (m - 1) * block, intra="full", queries="all",
               **_context_ranges(n_ctx, cu_seqlens, context_block))


def ptp(cls: "type[WindowLayout]", n_ctx: int, starts: IntsLike, completion_len: int,
        doc_starts: Optional[IntsLike] = None, doc_ends: Optional[IntsLike] = None) -> "WindowLayout":
    """Parallel Token Prediction completion pass.

    Keys ``[ctx (S, cached) | completion 0 (L) | completion 1 (L) | ...]``, queries the
    completion tokens only. Completion n sees context ``[doc_starts[n], starts[n])``
    (its document up to the split point) and its own auxiliary tokens causally.
    With ``doc_ends``, aux token i of completion n (position ``starts[n] + i``) is
    blank when ``starts[n] + i >= doc_ends[n]``, as the original PTP packing does.
    ``starts``/``doc_starts``/``doc_ends`` are ``[n]`` or ``[B, n]``; ``doc_starts`` defaults to 0.
    """
    n_ctx, completion_len = positive_int("n_ctx", n_ctx), positive_int("completion_len", completion_len)
    hi = as_int_tensor("starts", starts)
    if hi.shape[-1] == 0:
        raise ValueError("starts: expected at least one completion, got none")
    if hi.numel() and int(hi.min()) < 0:  # checked here: with doc_starts left out, check_spans would name it
        raise ValueError(f"starts: expected values >= 0, got min {int(hi.min())}")
    lo = torch.zeros_like(hi) if doc_starts is None else as_int_tensor("doc_starts", doc_starts)
    if lo.shape != hi.shape:
        raise ValueError(f"doc_starts: expected the shape of starts {tuple(hi.shape)}, got {tuple(lo.shape)}")
    check_spans("", lo, hi, n_ctx, "completion", lo_name="doc_starts", hi_name="starts")
    live = None
    if doc_ends is not None:
        ends = as_int_tensor("doc_ends", doc_ends)
        if ends.shape != hi.shape:
            raise ValueError(f"doc_ends: expected the shape of starts {tuple(hi.shape)}, got {tuple(ends.shape)}")
        if bool((ends < hi).any()):
            raise ValueError("doc_ends: expected doc_ends >= starts for every completion")
        live = torch.clamp(ends - hi, max=completion_len)
    return cls(n_ctx, hi.shape[-1], completion_len, lo, hi, intra="causal", queries="windows", live_slots=live)


def jacobi(cls: "type[WindowLayout]", n_prompt: int, n_noisy: int) -> "WindowLayout":
    """Jacobi Forcing noise-conditioned mask, one noisy stream.

    Storage ``[prompt (P) | clean stream (T) | noisy stream (T)]``: prompt and clean
    stream form one causal (AR) sequence; the noisy stream is one causal window
    that sees the prompt ``[0, P)`` only. Queries: all ``P + 2T`` tokens.
    """
    n_prompt, n_noisy = positive_int("n_prompt", n_prompt), positive_int("n_noisy", n_noisy)
    return cls(n_prompt + n_noisy, 1, n_noisy, [0], [n_prompt], intra="causal", queries="all")


# ---------------------------------------------------------------------- range helpers


def _staircase(n_ctx: int, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """Window t after context token t sees ``[start of t's document, t+1)``."""
    hi = torch.arange(1, n_ctx + 1)
    docs = parse_cu_seqlens(cu_seqlens, n_ctx)
    if docs is None:
        return torch.zeros_like(hi), hi
    lo = stack_rows([document_bounds(cu, n_ctx)[0] for cu in docs], isinstance(docs, PerBatch))
    return lo, hi.expand_as(lo).clone()


def _context_ranges(n: int, cu_seqlens, block: Optional[int]) -> dict:
    """``context_lo``/``context_hi`` for documents and/or blocks (empty dict: plain causal)."""
    docs = parse_cu_seqlens(cu_seqlens, n)
    if docs is None and block is None:
        return {}
    if block is not None:
        block = positive_int("block", block)
    pos = torch.arange(n)
    los, his = [], []
    for cu in docs or [torch.tensor([0, n])]:
        start, end = document_bounds(cu, n)
        hi = pos + 1 if block is None else torch.minimum(start + ((pos - start) // block + 1) * block, end)
        los.append(start)
        his.append(hi)
    per_batch = isinstance(docs, PerBatch)
    return dict(context_lo=stack_rows(los, per_batch), context_hi=stack_rows(his, per_batch))

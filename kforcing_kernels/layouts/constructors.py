"""The named constructors of ``WindowLayout`` (exposed as its classmethods): one per attention family.

Each builds the O(C + M) range numbers of a published mask; ``cu_seqlens`` (packed documents,
``documents.py``) keeps everything inside its document. ``cls`` is the class the classmethod
was called on.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

from .base import LayoutBase
from .documents import (
    IntsLike,
    PerBatch,
    as_int,
    as_int_tensor,
    check_block_aligned,
    check_spans,
    document_bounds,
    parse_cu_seqlens,
    positive_int,
    stack_rows,
)
from .query_rows import QueryRowsLayout

L = TypeVar("L", bound=LayoutBase)  # the class the classmethod is called on (WindowLayout)


def _blockwise(cls: type[L], n_ctx: int, block: int, cu_seqlens, context_block: Optional[int]) -> L:
    docs = parse_cu_seqlens(cu_seqlens, n_ctx)
    check_block_aligned("cu_seqlens", docs, block, n_ctx)
    m = -(-n_ctx // block)
    hi = torch.arange(m) * block
    lo = (
        stack_rows([document_bounds(cu, n_ctx)[0][hi] for cu in docs], isinstance(docs, PerBatch))
        if docs
        else torch.zeros_like(hi)
    )
    hi = hi.expand_as(lo).clone()
    return cls(
        n_ctx,
        m,
        block,
        lo,
        hi,
        last_window_size=n_ctx - (m - 1) * block,
        intra="full",
        queries="all",
        **_context_ranges(n_ctx, cu_seqlens, context_block),
    )


def _per_sample(name: str, value) -> torch.Tensor:
    """An int (0-dim int64 tensor) or a per-sample ``[B]`` sequence of positive ints.

    A scalar is a Python or numpy int or a 0-dim tensor; a sequence a list, tuple, tensor or numpy array."""
    if getattr(value, "ndim", None) != 0 and hasattr(value, "__len__"):
        t = as_int_tensor(name, value, dims=(1,))
        if t.numel() == 0 or bool((t < 1).any()):
            raise ValueError(f"{name}: expected positive ints, one per sample, got {t.tolist()}")
        return t
    return torch.tensor(positive_int(name, value))


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


class Constructors(LayoutBase):
    """The named constructors, inherited by ``WindowLayout`` as classmethods (``cls`` is the class called)."""

    @classmethod
    def causal(cls: type[L], n: int, *, cu_seqlens=None, block: Optional[int] = None) -> L:
        """Causal attention over ``n`` tokens (the AR forward), no windows.

        ``cu_seqlens``: packed documents (nothing crosses a boundary). ``block``: a
        block-causal context (token i sees its whole block and every earlier block of
        its document; blocks start at each document's start).
        """
        n = positive_int("n", n)
        ctx = _context_ranges(n, cu_seqlens, block)
        return cls(n, 0, 1, [], [], **ctx)

    @classmethod
    def kforcing_single(cls: type[L], n_ctx: int, k: int, *, cu_seqlens=None) -> L:
        """K-Forcing SingleForward (paper eq. 18).

        Storage ``[ctx (N) | noise (N*k)]``, noise window t (after context token t)
        at ``N + t*k + i``; it sees context ``[0, t+1)`` (with ``cu_seqlens``:
        ``[start of t's document, t+1)``) and its slots causally. Queries: all
        ``N + N*k`` tokens.
        """
        n_ctx, k = positive_int("n_ctx", n_ctx), positive_int("k", k)
        lo, hi = _staircase(n_ctx, cu_seqlens)
        return cls(n_ctx, n_ctx, k, lo, hi, intra="causal", queries="all", **_context_ranges(n_ctx, cu_seqlens, None))

    @classmethod
    def kforcing_double(cls: type[L], n_ctx: int, k: int, *, cu_seqlens=None) -> L:
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

    @classmethod
    def sbd(cls: type[L], n_ctx: int, block: int, *, cu_seqlens=None) -> L:
        """Set Block Decoding training mask (its Figure 9 mask_mod) over ``[clean (L) | masked copy (L)]``.

        Clean tokens are causal; masked block b (tokens ``L + b*block ..``) sees the
        clean tokens ``[0, b*block)`` and its whole block. The last block is shorter
        when ``block`` does not divide L. With ``cu_seqlens`` (boundaries at
        multiples of ``block``, but for L itself) everything stays inside its document.
        """
        n_ctx, block = positive_int("n_ctx", n_ctx), positive_int("block", block)
        return _blockwise(cls, n_ctx, block, cu_seqlens, context_block=None)

    @classmethod
    def bd3lm(cls: type[L], n_ctx: int, block: int, *, cu_seqlens=None) -> L:
        """BD3-LM block-diffusion training mask, stored ``[x_0 (clean, n) | x_t (noisy, n)]``.

        x_0 block b sees x_0 blocks ``<= b`` (block-causal); x_t block b sees x_t block b
        (full) and x_0 blocks ``< b``; x_0 never sees x_t. This is kuleshov-group/bd3lms'
        ``block_diff_mask`` after moving its ``[x_t | x_0]`` halves to ``[x_0 | x_t]``:
        ``ours = theirs[perm][:, perm]`` with ``perm = [n..2n) ++ [0..n)``.
        """
        n_ctx, block = positive_int("n_ctx", n_ctx), positive_int("block", block)
        return _blockwise(cls, n_ctx, block, cu_seqlens, context_block=block)

    @classmethod
    def ptp(
        cls: type[L],
        n_ctx: int,
        starts: IntsLike,
        completion_len: int,
        doc_starts: Optional[IntsLike] = None,
        doc_ends: Optional[IntsLike] = None,
    ) -> L:
        """Parallel Token Prediction completion pass.

        Keys ``[ctx (S, cached) | completion 0 (L) | completion 1 (L) | ...]``, queries the
        completion tokens only. Completion n sees context ``[doc_starts[n], starts[n])``
        (its document up to the split point) and its own auxiliary tokens causally.
        With ``doc_ends``, aux token i of completion n (position ``starts[n] + i``) is
        blank when ``starts[n] + i >= doc_ends[n]``, as the original PTP packing does (its training
        mask always blanks past the document end: pass ``doc_ends`` to reproduce it). Without
        ``doc_ends`` no aux token is blank, even past ``n_ctx`` (completions of new tokens, as at inference).
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

    @classmethod
    def jacobi(cls: type[L], n_prompt, n_noisy=None, *, num_blocks=None, block_size=None) -> L:
        """Jacobi Forcing noise-conditioned mask, one noisy stream.

        Storage ``[prompt (P) | clean stream (T) | noisy stream (T)]``: prompt and clean
        stream form one causal (AR) sequence; the noisy stream is one causal window
        that sees the prompt ``[0, P)`` only. Queries: all ``P + 2T`` tokens.

        Batched (Jacobi Forcing's trainer: prompt length, block count and block size per sample):
        give ``n_prompt`` and ``n_noisy`` (or ``num_blocks`` and ``block_size``, ``T = N * block``)
        as ints or per-sample ``[B]`` sequences. Sample b is then ``jacobi(P_b, T_b)`` padded to the
        batch: context ``[prompt_b | clean_b | padding]`` of ``C = max(P_b + T_b)`` tokens, one window
        of ``max(T_b)`` slots ``[noisy_b | padding]``; padding rows see nothing and nobody sees them.
        ``layouts.jacobi`` maps Jacobi Forcing's interleaved storage to this order and back.
        """
        if n_noisy is None:
            if num_blocks is None or block_size is None:
                raise ValueError("n_noisy: give n_noisy, or num_blocks and block_size")
            counts, sizes = _per_sample("num_blocks", num_blocks), _per_sample("block_size", block_size)
            if counts.dim() and sizes.dim() and counts.shape != sizes.shape:
                raise ValueError(
                    f"block_size: expected the shape of num_blocks {tuple(counts.shape)}, got {tuple(sizes.shape)}"
                )
            noisy = counts * sizes
        elif num_blocks is not None or block_size is not None:
            raise ValueError("num_blocks: give n_noisy or num_blocks and block_size, not both")
        else:
            noisy = _per_sample("n_noisy", n_noisy)
        prompt = _per_sample("n_prompt", n_prompt)
        if prompt.dim() == 0 and noisy.dim() == 0:
            p, t = int(prompt), int(noisy)
            return cls(p + t, 1, t, [0], [p], intra="causal", queries="all")
        if prompt.dim() and noisy.dim() and prompt.shape != noisy.shape:
            raise ValueError(
                f"n_noisy: expected one value per sample like n_prompt {tuple(prompt.shape)}, got {tuple(noisy.shape)}"
            )
        b = (prompt if prompt.dim() else noisy).shape[0]
        prompt, noisy = prompt.expand(b).clone(), noisy.expand(b).clone()
        c, t = int((prompt + noisy).max()), int(noisy.max())
        pos = torch.arange(c)
        inside = pos[None] < (prompt + noisy)[:, None]  # [B, C]: prompt + clean tokens; the rest is padding
        context_hi = torch.where(inside, pos[None] + 1, 0)
        return cls(
            c,
            1,
            t,
            torch.zeros(b, 1, dtype=torch.int64),
            prompt[:, None],
            intra="causal",
            queries="all",
            context_lo=torch.zeros_like(context_hi),
            context_hi=context_hi,
            live_slots=noisy[:, None],
        )

    @classmethod
    def anchor_blocks(
        cls: type[L],
        n_ctx: int,
        anchors: IntsLike,
        block: int,
        *,
        keep=None,
        intra: Optional[str] = None,
        window: Optional[int] = None,
        window_mode: str = "block",
        cu_seqlens=None,
    ) -> L:
        """Anchor blocks: DFlash-style block-draft training (SpecForge, vLLM speculators).

        Keys ``[context (S) | block_0 | ... | block_{n-1}]`` (``block`` tokens each), queries the
        blocks only. Block i, anchored at context position ``anchors[i]``, sees the context strictly
        before its anchor, ``[doc_start(a_i), a_i)`` (``[0, a_i)`` unpacked), and its own block:
        ``intra="full"`` (DFlash, the default) or ``"causal"``; never another block. A block with
        ``keep[i]`` False (dropped by the sampler) sees nothing and nobody sees it.

        ``window=W`` restricts the context to a sliding window:

        * ``window_mode="block"`` (vLLM speculators): the whole block sees ``[max(doc_start, a - W), a)``;
          ``intra`` stays ``"full"`` unless given; speculators' sliding-window layers with its default
          ``sliding_window_non_causal=False`` are causal inside the block: pass ``intra="causal"`` for them;
        * ``window_mode="slot"`` (SpecForge's sliding-window layers): slot o sees
          ``[max(doc_start, a + o - (W - 1)), a)``, the window counting the slot itself; these layers
          are causal inside the block, so ``intra`` defaults to ``"causal"`` in this mode.

        S=6, anchors=[2, 5], block=2, full (``#`` = attended)::

                        keys: c0 c1 c2 c3 c4 c5 | b0 b0 | b1 b1
            block 0 slot 0    #  #              |  #  # |
            block 0 slot 1    #  #              |  #  # |
            block 1 slot 0    #  #  #  #  #     |       |  #  #
            block 1 slot 1    #  #  #  #  #     |       |  #  #

        Args:
            n_ctx: S, the context length.
            anchors: int ``[n]`` or ``[B, n]`` (per batch element), each in ``[0, S]``.
            block: tokens per block.
            keep: bool ``[n]`` or ``[B, n]``: blocks to train on (default all).
            intra: ``"full"`` or ``"causal"`` inside a block (default: full; causal for ``window_mode="slot"``).
            window: W >= 1, the sliding window (None: the whole context before the anchor).
            window_mode: ``"block"`` or ``"slot"``, see above.
            cu_seqlens: packed documents over the S context tokens (shared or per batch element).
        """
        n_ctx = int(as_int_tensor("n_ctx", [n_ctx], dims=(1,))[0])
        if n_ctx < 0:
            raise ValueError(f"n_ctx: expected >= 0, got {n_ctx}")
        block = positive_int("block", block)
        a = as_int_tensor("anchors", anchors)
        if a.shape[-1] == 0:
            raise ValueError("anchors: expected at least one block, got none")
        if bool((a < 0).any()) or bool((a > n_ctx).any()):
            bad = a[(a < 0) | (a > n_ctx)][0]
            raise ValueError(f"anchors: expected positions in [0, n_ctx={n_ctx}], got {int(bad)}")
        if window_mode not in ("block", "slot"):
            raise ValueError(f"window_mode: expected 'block' or 'slot', got {window_mode!r}")
        intra = intra if intra is not None else ("causal" if window is not None and window_mode == "slot" else "full")
        lo = torch.zeros_like(a)
        docs = parse_cu_seqlens(cu_seqlens, n_ctx) if n_ctx else None
        if docs is not None:
            starts = stack_rows(
                [document_bounds(cu, n_ctx)[0] for cu in docs], isinstance(docs, PerBatch)
            )  # [S] or [B, S]
            if starts.dim() == 2 and a.dim() == 2 and starts.shape[0] != a.shape[0]:
                raise ValueError(
                    f"cu_seqlens: expected one row per batch element ({a.shape[0]}), got {starts.shape[0]}"
                )
            at = a.clamp(max=n_ctx - 1)  # an anchor at S belongs to the last document
            if starts.dim() == 2:
                at = at.expand(starts.shape[0], -1) if at.dim() == 1 else at
                lo = torch.gather(starts, 1, at)
            else:
                lo = starts[at]
            a = a.expand_as(lo).clone()
        slide = None
        if window is not None:
            w = positive_int("window", window)
            if window_mode == "block":
                lo = torch.maximum(lo, a - w)
            else:
                slide = a - (w - 1)
        live = None
        if keep is not None:
            try:
                kept = torch.as_tensor(keep)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ValueError(f"keep: expected a bool sequence, got {type(keep).__name__} ({exc})") from None
            if kept.dtype != torch.bool or kept.dim() not in (1, 2) or kept.shape[-1] != a.shape[-1]:
                raise ValueError(
                    f"keep: expected bool [{a.shape[-1]}] or [B, {a.shape[-1]}] (one per block), "
                    f"got dtype {kept.dtype} shape {tuple(kept.shape)}"
                )
            if kept.dim() == 2 and a.dim() == 2 and kept.shape[0] != a.shape[0]:
                raise ValueError(f"keep: expected {a.shape[0]} rows (anchors'), got {kept.shape[0]}")
            live = kept.to(torch.int64) * block
        return cls(
            n_ctx, a.shape[-1], block, lo, a, intra=intra, queries="windows", live_slots=live, prefix_slide_lo=slide
        )

    @classmethod
    def eagle3_ttt(
        cls: type[L],
        length: int,
        step: int,
        *,
        valid_lengths=None,
        drop_per_step: int = 0,
        cu_seqlens=None,
        window: Optional[int] = None,
    ):
        """One step of EAGLE-3's training-time test (SpecForge, vLLM speculators): its ``length`` query rows only.

        Keys ``[base (L) | step 1 (L) | ... | step j (L)]`` (``(j + 1) * L``, ``j = step``): the draft's
        K/V of the base pass and of each earlier test step, then this step's own; queries the L rows of
        step j. Row i sees the base keys ``[doc_start(i), i]`` (``[max(doc_start(i), i - window + 1), i]``
        with a sliding ``window``, which counts the row's own position) and key ``t * L + i`` of every
        step ``t = 1..j`` (its own position at each step, itself last). A row past its sample's valid
        length sees nothing (output 0, no gradient) and no row sees its keys.

        Args:
            length: L, the positions of one pass.
            step: j >= 1, the test step (step 0 is the base pass: ``WindowLayout.causal(L, cu_seqlens=...)``).
            valid_lengths: an int or ``[B]`` ints (per batch element), the valid positions (default L); rows
                ``>= valid`` are padding.
            drop_per_step: rows dropped from the valid length per step, SpecForge's flex path (1: step j's
                valid length is ``valid - j``); 0 (default) keeps every valid row live, as its eager path.
            cu_seqlens: packed documents (speculators' one packed row): base keys never cross a boundary.
                Padding given as one-token documents sees only its own position's keys, as speculators does.
            window: a sliding window over the base keys (None: all of the row's document up to it).

        Returns:
            A :class:`~kforcing_kernels.layouts.QueryRowsLayout`: the last stream of the stream-major layout
            with one window of j slots per position (``n_ctx=L``, ``num_windows=L``, ``n_streams=j``,
            ``queries="windows"``), restricted to step j's rows; ``window_attention`` runs only those rows.
        """
        length, step = positive_int("length", length), positive_int("step", step)
        drop = as_int("drop_per_step", drop_per_step)
        if drop < 0:
            raise ValueError(f"drop_per_step: expected an int >= 0, got {drop}")
        if window is not None:
            window = positive_int("window", window)
        valid = torch.tensor(length) if valid_lengths is None else _per_sample("valid_lengths", valid_lengths)
        if bool((valid > length).any()):
            raise ValueError(f"valid_lengths: expected ints in [1, {length}] (length), got {valid.tolist()}")
        live_rows = torch.clamp(valid - step * drop, min=0)  # [] or [B]
        pos = torch.arange(length)
        live = (pos < live_rows[..., None]).to(torch.int64) * step  # [L] or [B, L]: every slot of a live row, or none
        lo, hi = _staircase(length, cu_seqlens)
        if window is not None:
            lo = torch.maximum(lo, pos - (window - 1))
        if live.dim() == 2 and lo.dim() == 2 and live.shape[0] != lo.shape[0]:
            raise ValueError(f"valid_lengths: expected {lo.shape[0]} values (cu_seqlens' batch), got {live.shape[0]}")
        parent = cls(length, length, step, lo, hi, intra="causal", queries="windows", n_streams=step, live_slots=live)
        return QueryRowsLayout(parent, torch.arange((step - 1) * length, step * length))  # parent.restrict_rows

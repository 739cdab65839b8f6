"""What a Hugging Face attention call asks for beyond its tensors, as layouts (for ``hf.py``).

transformers describes one call's mask in three places: the mask builder's ``mask_function``
(causal, sliding window, documents found from restarting ``position_ids``, padding), the
attention kwargs (``sliding_window=``, the flash kwargs ``cu_seq_lens_q/k``, ``position_ids``)
and attributes of the attention module (Qwen2-MoE keeps its window there). ``hf.py``'s mask
builder materialises a mask only for what it cannot pass on otherwise (padding, keys that are not
exactly the sequence, extra mask functions); everything else is rebuilt here from the kwargs:

* :func:`structure_layout` (eager): causal + per-document + sliding-window rows as one
  context-only :class:`WindowLayout` (row i sees ``[max(doc_start, i - W + 1), i + 1)``, the
  transformers 5 convention ``kv_idx > q_idx - W``);
* :func:`structure_mask` (under ``torch.compile``): the same rows as a dense boolean mask built
  with tensor ops only (no data-dependent Python, so ``fullgraph=True`` holds);
* :func:`interval_layout_from_mask`: a materialised boolean mask whose rows are contiguous key
  intervals, as a layout (exact by construction);
* :func:`check_layout_documents`: a user's ``kforcing_layout`` composed with packed documents;
  refused (naming the setting) when they would change what the layout computes;
* :func:`sliding_layout`: a ``kforcing_layout`` under the model's sliding window, as inference
  sees it (a token at position p sees positions ``(p - W, p]``), per layer;
* :func:`additive_mask`: a layout as the additive float mask HF ``eager`` attention expects;
* :func:`rank_rows_attention`: context parallelism, a :class:`~kforcing_kernels.parallel.RankRows` as the
  ``kforcing_layout`` (this rank's rows; each layer's sliding window applied to the split's layout).

Pure torch: importing this module never imports transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional

import torch

from ..layouts import WindowLayout
from ..parallel.context_parallel import RankRows

__all__ = [
    "sliding_window_of",
    "flash_documents",
    "documents_from_positions",
    "structure_layout",
    "structure_mask",
    "interval_layout_from_mask",
    "check_layout_documents",
    "sliding_layout",
    "additive_mask",
    "rank_rows_attention",
]


def sliding_window_of(module, kwargs: dict) -> Optional[int]:
    """The sliding window W of this attention call, or None.

    Read from the ``sliding_window`` kwarg when the model passes one (Mistral, Qwen2, Phi3,
    Gemma2/3: None on full-attention layers), else from the module's ``sliding_window``
    attribute (Qwen2-MoE sets it on sliding layers only), else from ``config.layer_types``.
    """
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    else:
        window = getattr(module, "sliding_window", None)
        config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
        layer_types = getattr(config, "layer_types", None)
        if window is None and layer_types is not None and idx is not None and idx < len(layer_types):
            window = getattr(config, "sliding_window", None) if layer_types[idx] == "sliding_attention" else None
    if window is None:
        return None
    if isinstance(window, bool):
        raise ValueError(f"sliding_window: expected a positive int or None, got {window!r}")
    try:
        window = operator.index(window)
    except TypeError:
        raise ValueError(f"sliding_window: expected a positive int or None, got {window!r}") from None
    if window < 1:
        raise ValueError(f"sliding_window: expected a positive int or None, got {window}")
    return window


def flash_documents(kwargs: dict, batch: int, lq: int, lk: int) -> Optional[torch.Tensor]:
    """The packed documents of the flash kwargs ``cu_seq_lens_q/k`` as one ``cu_seqlens`` [D+1], or None.

    They describe one row of packed documents without a cache (``DataCollatorWithFlattening``,
    ``use_cache=False``); anything else is refused rather than ignored. ``max_length_q/k`` must
    cover the longest document (flash kernels would truncate it).
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.numel() < 2:
            got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(
                f"{name}: expected a 1-D integer tensor [num_docs + 1] (with the other cu_seq_lens), got {got}"
            )
    assert isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)  # checked in the loop above
    if lq != lk:
        raise ValueError(
            f"cu_seq_lens_q: packed flash kwargs need the keys to be exactly this call's tokens (use_cache=False, "
            f"no past_key_values), got {lq} queries and {lk} keys"
        )
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q: packed documents come as one row (batch size 1), got batch size {batch}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seq_lens_k: expected the shape of cu_seq_lens_q {tuple(cu_q.shape)}, got {tuple(cu_k.shape)}"
        )
    if torch.compiler.is_compiling():
        return cu_q  # values are checked in eager mode only (reading them would break the graph)
    cu = cu_q.detach().to("cpu", torch.int64)
    if not torch.equal(cu, cu_k.detach().to("cpu", torch.int64)):
        raise ValueError(
            f"cu_seq_lens_k: expected equal to cu_seq_lens_q without a cache, got {cu_k.tolist()} vs {cu.tolist()}"
        )
    if int(cu[0]) != 0 or int(cu[-1]) != lq or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seq_lens_q: expected non-decreasing offsets from 0 to {lq} (the packed length), got {cu.tolist()}"
        )
    longest = int((cu[1:] - cu[:-1]).max())
    for name in ("max_length_q", "max_length_k"):
        value = kwargs.get(name)
        if value is not None and int(value) < longest:
            raise ValueError(f"{name}: expected at least the longest document ({longest} tokens), got {int(value)}")
    return cu


def documents_from_positions(position_ids: Optional[torch.Tensor], batch: int, n: int):
    """Documents of packed rows, found as transformers finds them: a new one wherever a position is not its
    predecessor + 1. Returns None (no restart anywhere), one shared ``cu_seqlens`` [D+1] (``position_ids``
    of one row) or a list of one per batch element. Eager only (reads values)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != n:
        return None
    pos = position_ids.detach()
    starts = torch.diff(pos, dim=-1) != 1  # [B|1, n - 1]: token j + 1 starts a document
    if not bool(starts.any()):
        return None
    rows = []
    for row in starts.cpu():
        inner = (torch.nonzero(row).flatten() + 1).tolist()
        rows.append(torch.tensor([0, *inner, n], dtype=torch.int64))
    if len(rows) == 1:
        return rows[0]
    if len(rows) != batch:
        raise ValueError(f"position_ids: expected {batch} rows (the batch size) or 1, got {len(rows)}")
    return rows


def _documents_key(docs) -> Optional[tuple]:
    if docs is None:
        return None
    if isinstance(docs, torch.Tensor):
        return tuple(docs.tolist())
    return tuple(tuple(d.tolist()) for d in docs)


def structure_layout(n: int, docs, window: Optional[int]) -> Optional[WindowLayout]:
    """Causal attention over ``n`` tokens, kept inside packed ``docs`` and a sliding ``window``, as a
    context-only layout; None when that is plain causal (no documents, no window shorter than ``n``)."""
    if window is not None and window >= n:
        window = None  # the window hides nothing: row i sees at most i + 1 <= n <= W keys
    if docs is None and window is None:
        return None
    return _structure_layout(n, _documents_key(docs), window)


@functools.lru_cache(maxsize=64)
def _structure_layout(n: int, docs: Optional[tuple], window: Optional[int]) -> WindowLayout:
    per_batch = docs is not None and isinstance(docs[0], tuple)
    cu = None if docs is None else ([list(d) for d in docs] if per_batch else list(docs))
    causal = WindowLayout.causal(n, cu_seqlens=cu)
    if window is None:
        return causal
    rows = torch.arange(n)
    lo = causal.context_lo if causal.context_lo is not None else torch.zeros(n, dtype=torch.int64)
    hi = causal.context_hi if causal.context_hi is not None else rows + 1
    return WindowLayout(n, 0, 1, [], [], context_lo=torch.maximum(lo, rows - window + 1), context_hi=hi)


def structure_mask(
    lq: int, lk: int, position_ids, cu: Optional[torch.Tensor], window: Optional[int], device, use_positions: bool
) -> torch.Tensor:
    """bool [B|1, 1, Lq, Lk]: the rows of :func:`structure_layout` built with tensor ops only (for compiled code).

    Keys are the cached tokens then this call's (query i is key ``lk - lq + i``); documents come from
    ``cu`` or, when ``use_positions``, from restarting ``position_ids`` (both only without a cache).
    """
    q = torch.arange(lk - lq, lk, device=device)[:, None]
    k = torch.arange(lk, device=device)
    mask = (k <= q)[None]  # [1, Lq, Lk]
    if window is not None:
        mask = mask & (k > q - window)[None]
    if cu is not None:
        doc = torch.searchsorted(cu.to(device), torch.arange(lk, device=device), right=True)
        mask = mask & (doc[:, None] == doc[None, :])[None]
    elif use_positions and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and lq == lk:
        pos = position_ids.to(device)
        doc = torch.cumsum(torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1, -1)  # [B|1, L]
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    return mask[:, None]


def interval_layout_from_mask(mask: torch.Tensor, batch: int) -> Optional[WindowLayout]:
    """A boolean [B|1, 1, L, L] mask whose every row attends one non-empty contiguous key range, as a
    context-only layout (per batch element when the mask differs over the batch); None otherwise. Eager only."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    if mask.shape[0] not in (1, batch):
        return None
    rows = mask[:, 0]  # [B|1, L, L]
    n = rows.shape[-1]
    counts = rows.sum(-1)
    if not bool((counts > 0).all()):
        return None  # a row that sees nothing (padding): SDPA's convention for it is kept
    lo = rows.to(torch.int8).argmax(-1)
    hi = n - rows.flip(-1).to(torch.int8).argmax(-1)
    if not bool((hi - lo == counts).all()):
        return None  # a row with a gap is no interval
    lo, hi = lo.cpu(), hi.cpu()
    if lo.shape[0] == 1 or bool((lo == lo[:1]).all() and (hi == hi[:1]).all()):
        lo, hi = lo[0], hi[0]
    return WindowLayout(n, 0, 1, [], [], context_lo=lo, context_hi=hi)


def _document_index(cu: torch.Tensor, n: int) -> torch.Tensor:
    return torch.searchsorted(cu, torch.arange(n), right=True) - 1


def check_layout_documents(layout: WindowLayout, docs, source: str) -> None:
    """Refuse a ``kforcing_layout`` that lets a token see another packed document.

    ``docs``: ``cu_seqlens`` over the layout's context tokens (shared or one per batch element),
    from ``source`` (named in the error). Every row's context interval must lie inside one
    document, and a context row's inside its own (window slots only see their own window).
    """
    if docs is None or layout.queries != "all":
        return  # queries="windows": the context sits in a cache, its positions are not this call's
    iv = layout.row_intervals()[..., 0, :]  # [B'|1, Lq, 2]: the context interval of every row
    rows = [docs] if isinstance(docs, torch.Tensor) else list(docs)
    if len(rows) > 1 and iv.shape[0] not in (1, len(rows)):
        raise ValueError(f"{source}: expected documents for {iv.shape[0]} batch elements, got {len(rows)}")
    n = layout.n_ctx
    for b in range(max(len(rows), iv.shape[0])):  # a shared row of documents holds for every batch element
        cu = rows[min(b, len(rows) - 1)]
        if int(cu[-1]) != n:
            raise ValueError(
                f"{source}: with kforcing_layout, packed documents must cover the layout's {n} context tokens, "
                f"got offsets ending at {int(cu[-1])}"
            )
        doc = _document_index(cu, n)
        lo, hi = iv[min(b, iv.shape[0] - 1)].unbind(-1)
        row_ids = torch.arange(lo.shape[0])
        first, last = doc[lo.clamp(0, n - 1)], doc[(hi - 1).clamp(0, n - 1)]
        crosses = (hi > lo) & ((first != last) | ((row_ids < n) & (first != doc[row_ids.clamp(max=n - 1)])))
        if bool(crosses.any()):
            row = int(torch.nonzero(crosses)[0])
            raise ValueError(
                f"kforcing_layout: {source} pack several documents, but the layout lets query row {row} see context "
                "keys "
                f"[{int(lo[row])}, {int(hi[row])}) across a document boundary; build the layout per document "
                f"(e.g. WindowLayout.kforcing_single(n, k, cu_seqlens={cu.tolist()}))"
            )


def sliding_layout(layout: WindowLayout, window: Optional[int], position_ids) -> WindowLayout:
    """A ``kforcing_layout`` under the model's sliding ``window`` (None: unchanged), in position space.

    The token at position p sees the keys at positions ``(p - W, p]``, as at inference: context row i
    keeps ``[max(lo, i - W + 1), hi)``, slot o of a window keeps the context keys less than W positions
    back of its own position (:meth:`WindowLayout.with_sliding_window`). That reading needs the
    positions the recipe gives (``layouts/positions.py``): consecutive inside each document, and every
    window right after the last context token it sees; ``position_ids`` (eager calls; the model's
    default ``arange`` when None) are checked against it, and refused naming them otherwise. A window
    shorter than the layout's windows is refused naming ``sliding_window``.
    """
    if window is None:
        return layout
    try:
        windowed = layout.with_sliding_window(window)
    except ValueError as exc:
        raise ValueError(f"sliding_window: the model's window ({window}) with this kforcing_layout: {exc}") from None
    if windowed is not layout and not torch.compiler.is_compiling():
        _check_window_positions(layout, position_ids)
    return windowed


_LAST_POSITION_CHECK: list = []  # (layout, position_ids, version): every layer of one forward checks the same pair


def _check_window_positions(layout: WindowLayout, position_ids) -> None:
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        return
    key = (layout, position_ids, None if position_ids is None else position_ids._version)
    if _LAST_POSITION_CHECK:
        last = _LAST_POSITION_CHECK[0]
        if last[0] is key[0] and last[1] is key[1] and last[2] == key[2]:
            return
    lq, start = layout.n_queries, layout.n_keys - layout.n_queries  # query row r is key start + r
    pos = (
        torch.arange(start, layout.n_keys)[None]
        if position_ids is None
        else position_ids.detach().cpu().to(torch.int64)
    )
    if pos.dim() != 2 or pos.shape[-1] != lq:
        raise ValueError(f"position_ids: expected [B, {lq}] (one per input token), got {tuple(pos.shape)}")
    slots = layout.window_token_keys  # [M, w], -1 past a short last window
    ranges = layout.range_batch
    for b in range(max(pos.shape[0], ranges or 1)):  # a shared row of positions or ranges holds for every element
        row = layout if ranges is None else layout.batch_element(min(b, ranges - 1))
        _check_row_positions(row, pos[min(b, pos.shape[0] - 1)], start, slots)
    _LAST_POSITION_CHECK[:] = [key]


def _check_row_positions(layout: WindowLayout, pos: torch.Tensor, start: int, slots: torch.Tensor) -> None:
    def refuse(what: str):
        raise ValueError(
            "position_ids: with the model's sliding window, attn_implementation='kforcing' reads a kforcing_layout in "
            "position space: positions consecutive within each document and window slot o at the position of the last "
            f"context token the window sees + 1 + o (layouts/positions.py, e.g. kforcing_position_ids); {what}"
        )

    if layout.queries == "all":  # context rows are queries: their positions are known
        iv = layout.row_intervals()[0, : layout.n_ctx, 0]  # [C, 2]
        rows = torch.arange(layout.n_ctx)
        lo, hi = iv.unbind(-1)
        seen = hi > lo
        lo, hi, rows = lo[seen], hi[seen], rows[seen]
        if bool(((pos[rows] - pos[lo]) != (rows - lo)).any() or ((pos[hi - 1] - pos[lo]) != (hi - 1 - lo)).any()):
            bad = int(rows[((pos[rows] - pos[lo]) != (rows - lo)) | ((pos[hi - 1] - pos[lo]) != (hi - 1 - lo))][0])
            refuse(
                f"context row {bad} at position {int(pos[bad])} sees keys [{int(iv[bad, 0])}, {int(iv[bad, 1])}) "
                "whose positions are not consecutive up to it"
            )
    if not layout.num_windows:
        return
    valid = slots >= 0
    slot_pos = torch.where(valid, pos[(slots - start).clamp(min=0)], 0)  # [M, w]
    first = slot_pos[:, :1]
    offsets = torch.arange(slots.shape[1])[None]
    if bool((valid & (slot_pos != first + offsets)).any()):
        m = int(torch.nonzero((valid & (slot_pos != first + offsets)).any(-1))[0])
        refuse(f"window {m}'s slots are at positions {slot_pos[m][valid[m]].tolist()}, not consecutive")
    if layout.queries == "all":
        lo, hi = layout.prefix_lo.reshape(-1), layout.prefix_hi.reshape(-1)
        seen = hi > lo
        late = seen & (
            (pos[(hi - 1).clamp(min=0)] + 1 != first[:, 0])
            | (pos[(hi - 1).clamp(min=0)] - pos[lo.clamp(max=max(layout.n_ctx - 1, 0))] != hi - 1 - lo)
        )
        if bool(late.any()):
            m = int(torch.nonzero(late)[0])
            refuse(
                f"window {m} at position {int(first[m, 0])} sees context [{int(lo[m])}, {int(hi[m])}) whose last "
                f"token is at position {int(pos[hi[m] - 1])}"
            )


def additive_mask(
    layout: WindowLayout, batch: Optional[int] = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The layout as the additive 4-D float mask HF ``attn_implementation="eager"`` adds to its scores.

    Returns ``[B|1, 1, Lq, Lk]`` (``batch`` expands a shared layout): 0 where a query sees a key and
    ``torch.finfo(dtype).min`` elsewhere, as transformers' own eager masks (a row that sees nothing
    stays finite). HF ``eager`` needs this form: given the boolean ``dense_mask()`` it would add
    True/False as 1/0 to the scores and attend everywhere. ``sdpa`` and ``"kforcing"`` take either.
    """
    dense = layout.dense_mask()
    dense = dense[:, None] if dense.dim() == 3 else dense[None, None]
    if batch is not None and dense.shape[0] == 1:
        dense = dense.expand(batch, 1, -1, -1)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(dense, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype))


def rank_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: RankRows,
    window: Optional[int],
    scaling: Optional[float],
    backend: Optional[str],
    flash: bool,
) -> torch.Tensor:
    """Attention of this rank's rows under context parallelism (``kforcing_layout`` a ``RankRows``): ``[B, H, R, D]``.

    query ``[B, H, R, D]`` holds the rank's query rows (``rows.query_rows``), key/value ``[B, Hkv, K_r, D]`` its keys
    (``rows.key_rows``; no cache: the other ranks' K/V are all-gathered per layer, GQA's Hkv heads only). A sliding
    layer's ``window`` is applied to the split's whole layout in position space (:func:`sliding_layout`'s rule;
    the positions must be those of ``layouts/positions.py`` at the rows, as ``HFStudent`` passes them): the rows and
    the key gather stay the split's, the rank's sub-layout is the windowed layout restricted to its rows.
    """
    if torch.compiler.is_compiling():
        raise ValueError(
            "kforcing_layout: a RankRows (context parallelism) runs eagerly; torch.compile is not supported with it"
        )
    if backend is not None:
        raise ValueError(
            "kforcing_backend: a RankRows kforcing_layout (context parallelism) runs the row-subset "
            "kernels "
            f"of op.query_rows_backend; expected None, got {backend!r}"
        )
    if flash:
        raise ValueError(
            "cu_seq_lens_q: flash kwargs with a RankRows kforcing_layout (context parallelism); build the "
            "split's layout with cu_seqlens= instead"
        )
    n_rows, n_keys = int(rows.query_rows.numel()), int(rows.key_rows.numel())
    if query.shape[2] != n_rows:
        raise ValueError(
            f"kforcing_layout: expected {n_rows} input tokens (this rank's rows, RankRows.query_rows), "
            f"got {query.shape[2]}"
        )
    if key.shape[2] != n_keys:
        raise ValueError(
            f"kforcing_layout: expected {n_keys} keys (this rank's keys, RankRows.key_rows; context "
            f"parallelism runs without a cache), got {key.shape[2]}"
        )
    if window is not None:
        layout = rows.split.layout
        try:
            windowed = layout.with_sliding_window(window)
        except ValueError as exc:
            raise ValueError(
                f"sliding_window: the model's window ({window}) with this context-parallel split's layout: {exc}"
            ) from None
        if windowed is not layout:  # same rows and keys: only the rows' intervals shrink
            rows = RankRows(dataclasses.replace(rows.split, layout=windowed), rows.rank, rows.group)
    return rows.attend(query, key, value, scaling)

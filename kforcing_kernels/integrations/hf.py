"""Hugging Face transformers integration: ``attn_implementation="kforcing"``.

Importing this module registers the attention implementation ``"kforcing"`` with
transformers' ``AttentionInterface`` (and a matching mask builder), so any model
that dispatches attention through that interface (Llama, Qwen2, GPT-2, ...) runs
prefix-window layouts without code changes::

    import kforcing_kernels.integrations.hf as kf_hf
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="kforcing")
    batch = kf_hf.single_forward_inputs(model, input_ids, noise, noise_embedding)
    logits = model(**batch).logits                   # [B, N + N*k, V]

The layout travels as the forward kwarg ``kforcing_layout`` (a :class:`WindowLayout`
describing the whole sequence: cached tokens + this call's tokens, or under context parallelism a
:class:`~kforcing_kernels.parallel.RankRows`: this rank's rows, ``hf_masks.rank_rows_attention``),
optionally with ``kforcing_backend``. Per call:

* with ``kforcing_layout``: ``window_attention`` under that layout. Padding masks,
  attention dropout and soft-capping are rejected, not ignored; the model's sliding window
  (per layer) is intersected with the layout in position space, as inference has it (a token
  at position p sees ``(p - W, p]``: :meth:`WindowLayout.with_sliding_window`); packed documents
  (flash kwargs, or restarting context ``position_ids``) run only where the layout keeps them apart.
* without it, a 4-D mask: a mask whose rows are key intervals runs as that layout;
  otherwise routed to ``window_attention`` if it equals a known layout's dense mask
  exactly (:mod:`kforcing_kernels.sdpa`), else SDPA with it.
* without either: causal attention (aligned to the end of the cache), kept inside the
  packed documents of ``cu_seq_lens_q/k`` or of restarting ``position_ids`` (without a
  cache, as transformers does) and inside the model's sliding window: a layout in eager
  mode, a dense mask under ``torch.compile`` (:mod:`.hf_masks`).

Under ``torch.autocast`` q, k and v are cast to the autocast dtype and attention runs with autocast
off, as SDPA's autocast rule does (so bf16 training and HF ``Trainer(bf16=True)`` run); outside
autocast a dtype mix is refused, as SDPA refuses it.

HF ``eager`` attention adds its 4-D mask to the scores, so give it :func:`additive_mask`
(never the boolean ``dense_mask()``). transformers is an optional dependency
(``pip install kforcing_kernels[hf]``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "kforcing_kernels.integrations.hf needs Hugging Face transformers; install it with "
        "`pip install transformers` (or `pip install kforcing_kernels[hf]`)"
    ) from exc

from ..layouts import WindowLayout
from ..layouts.sliding import check_window, sliding_bounds, window_hides_nothing
from ..ops.window_attention import op as window_op
from ..ops.window_attention import window_attention
from ..parallel.context_parallel import RankRows
from ..sdpa import scaled_dot_product_attention
from .hf_batches import (
    double_forward_inputs,
    double_forward_position_ids,
    kforcing_position_ids,
    sbd_inputs,
    sbd_position_ids,
    single_forward_inputs,
)
from .hf_masks import (
    additive_mask,
    check_layout_documents,
    documents_from_positions,
    flash_documents,
    interval_layout_from_mask,
    rank_rows_attention,
    sliding_layout,
    sliding_window_of,
    structure_layout,
    structure_mask,
)
from .hf_noise import NoiseEmbedding  # noqa: F401  (public here: the noise half of an HF PFLM)

ATTN_IMPLEMENTATION = "kforcing"

# Per-call features of other attention implementations that no layout can express (they change every score).
_UNSUPPORTED_KWARGS = ("softcap", "s_aux")
SOFTCAP_ADVICE = (
    " (the model's config.attn_logit_softcapping, Gemma2's default: tanh-capped scores); turn it off with "
    "attn_logit_softcapping=None, e.g. AutoModelForCausalLM.from_pretrained(path, attn_implementation='kforcing', "
    "attn_logit_softcapping=None) or config.attn_logit_softcapping = None in config.json; this changes the "
    "model's scores, so the teacher is then the uncapped model"
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register",
    "kforcing_attention_forward",
    "kforcing_mask",
    "additive_mask",
    "crop_cache",
    "NoiseEmbedding",
    "kforcing_position_ids",
    "double_forward_position_ids",
    "sbd_position_ids",
    "single_forward_inputs",
    "double_forward_inputs",
    "sbd_inputs",
]


# ---------------------------------------------------------------------- attention implementation


def kforcing_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D] (cache + this call's tokens)
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    attention_mask: Optional[torch.Tensor],  # None or a 4-D mask (bool, or additive float)
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    kforcing_layout: Optional[WindowLayout] = None,
    kforcing_backend: Optional[str] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: returns ``(out [B, Lq, H, D], None)``.

    Under ``torch.autocast`` the inputs are cast to the autocast dtype and attention runs with
    autocast off, as SDPA's autocast rule does (Llama and Qwen2 leave q/k in fp32 after RoPE while
    v is bf16); the output is in that dtype. Outside autocast q, k and v must share a dtype (as SDPA requires).
    """
    query, key, value = _autocast_inputs(query, key, value)
    if torch.is_autocast_enabled(query.device.type):
        with torch.autocast(query.device.type, enabled=False):
            return _attention(
                module, query, key, value, attention_mask, scaling, dropout, kforcing_layout, kforcing_backend, **kwargs
            )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"key, value: expected dtype {query.dtype} (query's) with attn_implementation='kforcing', got key "
            f"{key.dtype}, value {value.dtype}; outside torch.autocast nothing is cast (sdpa refuses the mix too): "
            "run the model in one dtype or under torch.autocast"
        )
    return _attention(
        module, query, key, value, attention_mask, scaling, dropout, kforcing_layout, kforcing_backend, **kwargs
    )


def _autocast_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k, v in the autocast dtype when autocast is on for their device (SDPA's rule), else unchanged."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t if t.dtype == dtype or t.dtype == torch.float64 else t.to(dtype) for t in (query, key, value))


def _attention(
    module, query, key, value, attention_mask, scaling, dropout, kforcing_layout, kforcing_backend, **kwargs
) -> tuple[torch.Tensor, None]:
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}: not supported by attn_implementation='kforcing', got {kwargs[name]!r}"
                + (SOFTCAP_ADVICE if name == "softcap" else "")
            )
    batch, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    compiling = torch.compiler.is_compiling()
    window = sliding_window_of(module, kwargs)
    flash = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    # transformers packs by restarting position_ids only without a cache (use_cache=False); so do we.
    positions = kwargs.get("position_ids") if kwargs.get("use_cache") is not True and lq == lk else None
    if kforcing_layout is not None:
        if window is not None and isinstance(kforcing_layout, WindowLayout) and lk < kforcing_layout.n_keys:
            raise ValueError(
                f"kforcing_layout: expected {kforcing_layout.n_keys} keys (layout.n_keys = cached + input tokens), got "
                f"{lk}: a sliding layer's own cache keeps only its last window - 1 tokens; with a layout pass a full "
                "cache, past_key_values=DynamicCache()"
            )
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: expected None or all ones with kforcing_layout (the layout is the mask; padding, "
                "caches with unused slots such as static caches, and extra mask rules are not supported), got a mask "
                "that hides keys (under torch.compile, pass no attention_mask)"
            )
        if dropout:
            raise ValueError(
                "dropout: window_attention has no attention dropout, expected 0.0 (model.eval() or "
                f"attention_dropout=0), got {dropout}"
            )
        # context parallelism: this rank's rows (hf_masks.rank_rows_attention)
        if isinstance(kforcing_layout, RankRows):
            out = rank_rows_attention(query, key, value, kforcing_layout, window, scaling, kforcing_backend, flash)
            return out.transpose(1, 2).contiguous(), None
        if not isinstance(kforcing_layout, WindowLayout):
            raise ValueError(
                f"kforcing_layout: expected a WindowLayout (or a RankRows), got {type(kforcing_layout).__name__}"
            )
        if lq != kforcing_layout.n_queries:
            raise ValueError(
                f"kforcing_layout: expected {kforcing_layout.n_queries} input tokens (layout.n_queries), got {lq}"
            )
        if lk != kforcing_layout.n_keys:
            raise ValueError(
                f"kforcing_layout: expected {kforcing_layout.n_keys} keys (layout.n_keys = cached + input tokens), got "
                f"{lk}"
            )
        if flash and (kforcing_layout.num_windows or kforcing_layout.queries != "all"):
            raise ValueError(
                "cu_seq_lens_q: flash kwargs describe rows of plain tokens; a kforcing_layout with windows keeps "
                "packed "
                "documents apart itself: build it with cu_seqlens= (and per-document position ids) instead"
            )
        cu = flash_documents(kwargs, batch, lq, lk)
        if not compiling:  # layout numbers and position values: checked eagerly, once per call and layer
            if cu is not None:
                check_layout_documents(kforcing_layout, cu, "cu_seq_lens_q")
            elif kwargs.get("position_ids") is not None and kforcing_layout.queries == "all":
                # Only the context part: K-Forcing's window slots repeat positions by design.
                n_ctx = kforcing_layout.n_ctx
                docs = documents_from_positions(kwargs["position_ids"][:, :n_ctx], batch, n_ctx)
                check_layout_documents(kforcing_layout, docs, "position_ids")
        # This layer's window (Gemma's local layers; None on global ones) in position space, as inference has it.
        if (
            compiling
            and window is not None
            and not window_hides_nothing(kforcing_layout, check_window(kforcing_layout, window))
        ):
            out = _traced_sliding_attention(query, key, value, kforcing_layout, window, scaling, kforcing_backend)
        else:
            sliding = sliding_layout(kforcing_layout, window, kwargs.get("position_ids"))
            out = window_attention(query, key, value, sliding, scale=scaling, backend=kforcing_backend)
        return out.transpose(1, 2).contiguous(), None

    gqa = query.shape[1] != key.shape[1]
    cu = flash_documents(kwargs, batch, lq, lk)
    if attention_mask is not None:
        # The builder materialised the whole mask (padding, offset keys, extra rules): windows and documents
        # are in it already, so only flash kwargs it cannot know about are refused.
        if cu is not None:
            raise ValueError(
                "cu_seq_lens_q: packed flash kwargs together with an attention_mask (padding) are not supported"
            )
        layout = None
        if not compiling and lq == lk and attention_mask.dtype == torch.bool:
            layout = interval_layout_from_mask(attention_mask, batch)
        if layout is not None:
            out = window_attention(query, key, value, layout, scale=scaling, backend=kforcing_backend)
        else:
            out = scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=gqa,
                layout="auto",
                backend=kforcing_backend,
            )
        return out.transpose(1, 2).contiguous(), None

    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if causal and (cu is not None or positions is not None or (window is not None and lk > window)):
        if not compiling and lq == lk and not dropout:
            docs = cu if cu is not None else documents_from_positions(positions, batch, lq)
            layout = structure_layout(lq, docs, window)
            if layout is not None:
                out = window_attention(query, key, value, layout, scale=scaling, backend=kforcing_backend)
                return out.transpose(1, 2).contiguous(), None
        elif compiling or lq != lk or dropout:
            mask: Optional[torch.Tensor] = structure_mask(
                lq, lk, positions, cu, window, query.device, use_positions=positions is not None
            )
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
            return out.transpose(1, 2).contiguous(), None
    mask = None
    if causal and 1 < lq < lk:  # a chunk after a cache: query i is token lk - lq + i
        mask = torch.arange(lk, device=query.device) <= torch.arange(lk - lq, lk, device=query.device)[:, None]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=bool(causal and lq == lk and lq > 1),
        scale=scaling,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2).contiguous(), None


def _traced_sliding_attention(query, key, value, layout: WindowLayout, window: int, scaling, backend) -> torch.Tensor:
    """``window_attention`` under ``layout.with_sliding_window(window)`` while torch.compile traces.

    No layout can be built in a trace (its constructor checks values), so the intersection's range numbers
    (``layouts.sliding.sliding_bounds``, the rule's one home) replace the layout's through
    ``window_attention_with_bounds``, which the op turns back into that layout outside the graph. The
    ``position_ids`` it relies on are checked by eager calls only.
    """
    context_lo, context_hi, slide_lo = sliding_bounds(
        layout.n_ctx, layout.queries == "all", layout.prefix_hi, layout.context_lo, layout.context_hi, window
    )
    return window_op.window_attention_with_bounds(
        query,
        key,
        value,
        layout,
        context_lo=context_lo if layout.queries == "all" else None,
        context_hi=context_hi if layout.queries == "all" else None,
        prefix_slide_lo=slide_lo if layout.num_windows else None,
        scale=scaling,
        backend=backend,
    )


def kforcing_mask(*args, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """transformers mask builder for ``"kforcing"``: a mask only for what the attention call cannot rebuild.

    Returns None (nothing materialised) when the keys are precisely the cached plus the
    new tokens (``kv_offset == 0``, ``kv_length == q_offset + q_length``), no key is hidden
    by the 2-D padding mask (None, or all ones outside torch.compile) and the mask has no
    rule beyond causal, sliding window and documents from restarting ``position_ids``: the
    attention function rebuilds those from its kwargs (``hf_masks.py``), or the layout
    replaces them. Otherwise (padding, a static cache whose unused slots are keys too, a
    sliding cache, extra ``or``/``and`` mask functions, chunked attention) SDPA's boolean
    4-D mask is built, which the attention function then runs (or rejects alongside a layout).
    """
    exact = _keys_are_exactly_the_sequence(kwargs)
    if exact and _rules_are_rebuilt_by_the_call(kwargs) and _no_padding(attention_mask, kwargs):
        return None
    if not exact:
        # A causal skip would let the unused slots of a static cache be attended.
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _no_padding(attention_mask: Optional[torch.Tensor], kwargs: dict) -> bool:
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling():
        return False  # reading the mask would break the graph: keep it
    return bool(attention_mask[:, : int(kwargs["kv_length"])].all())


def _rules_are_rebuilt_by_the_call(kwargs: dict) -> bool:
    """Whether the mask is causal with at most a sliding window and position-id documents (which the call rebuilds).

    ``use_vmap`` marks user ``or``/``and`` mask functions; a blockwise overlay is an ``or_masks``
    composition (looked up in eager mode only: dynamo cannot read a traced closure's name; the
    multimodal models that use it are not compiled with "kforcing"); chunked attention comes
    from ``config.attention_chunk_size``.
    """
    if kwargs.get("use_vmap") or getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        return False
    if torch.compiler.is_compiling():
        return True
    return "or_mask" not in getattr(kwargs.get("mask_function"), "__qualname__", "")


def _keys_are_exactly_the_sequence(kwargs: dict) -> bool:
    """Whether the keys are the cached tokens then this call's, with nothing else (no empty static-cache slots)."""
    values = [kwargs.get(name, 0) for name in ("q_length", "kv_length", "q_offset", "kv_offset")]
    if torch.compiler.is_compiling() and any(isinstance(x, torch.Tensor) for x in values):
        return False  # reading a traced offset (static caches) would break the graph
    try:
        q_length, kv_length = int(kwargs["q_length"]), int(kwargs["kv_length"])
        q_offset, kv_offset = int(kwargs.get("q_offset", 0)), int(kwargs.get("kv_offset", 0))
    except (KeyError, TypeError, RuntimeError):  # an unknown caller, or offsets that cannot be read while tracing
        return False
    return kv_offset == 0 and kv_length == q_offset + q_length


def crop_cache(cache, length: int) -> None:
    """Cut an HF cache back to its first ``length`` tokens, in place (e.g. the N context tokens after a DoubleForward).

    transformers 5 ``Cache.crop`` takes the (negative) number of tokens to remove; a positive
    argument raises there. ``length`` must be between 0 and ``cache.get_seq_length()``.
    """
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"length: expected an int, got {length!r}")
    held = int(cache.get_seq_length())
    if not 0 <= length <= held:
        raise ValueError(f"length: expected an int in [0, {held}] (the tokens the cache holds), got {length}")
    if length < held:
        cache.crop(length - held)


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the attention function and mask builder under ``name`` (idempotent); returns ``name``."""
    AttentionInterface.register(name, kforcing_attention_forward)
    AttentionMaskInterface.register(name, kforcing_mask)
    return name


register()

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
describing the whole sequence: cached tokens + this call's tokens), optionally with
``kforcing_backend``. Per call:

* with ``kforcing_layout``: ``window_attention`` under that layout. Padding masks,
  attention dropout, sliding windows and soft-capping are rejected, not ignored.
* without it, a 4-D mask: routed to ``window_attention`` if it equals a known
  layout's dense mask exactly (:mod:`kforcing_kernels.sdpa`), otherwise SDPA with it.
* without either: causal attention (aligned to the end of the cache), via SDPA.

``position_ids`` are positions only under ``"kforcing"``: they never imply packed
sequences (transformers infers those for ``sdpa``); pack with a layout instead.
transformers is an optional dependency (``pip install kforcing_kernels[hf]``).
"""

from __future__ import annotations

import math
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

from ..ops.window_attention import window_attention
from ..layouts import WindowLayout
from ..layouts.positions import double_positions, sbd_positions, single_positions
from ..sdpa import scaled_dot_product_attention
from .hf_noise import NoiseEmbedding  # noqa: F401  (public here: the noise half of an HF PFLM)

ATTN_IMPLEMENTATION = "kforcing"

# Per-call features of other attention implementations that a layout cannot honour.
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")

__all__ = [
    "ATTN_IMPLEMENTATION", "register", "kforcing_attention_forward", "kforcing_mask",
    "NoiseEmbedding", "kforcing_position_ids", "double_forward_position_ids", "sbd_position_ids",
    "single_forward_inputs", "double_forward_inputs", "sbd_inputs",
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
    """transformers attention function: returns ``(out [B, Lq, H, D], None)``."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by attn_implementation='kforcing', got {kwargs[name]!r}")
    lq, lk = query.shape[2], key.shape[2]
    if kforcing_layout is not None:
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: expected None or all ones with kforcing_layout (the layout is the mask; padding "
                "and caches with unused slots, such as static caches, are not supported), got a mask that hides keys"
            )
        if dropout:
            raise ValueError(f"dropout: window_attention has no attention dropout, expected 0.0 (model.eval() or attention_dropout=0), got {dropout}")
        if not isinstance(kforcing_layout, WindowLayout):
            raise ValueError(f"kforcing_layout: expected a WindowLayout, got {type(kforcing_layout).__name__}")
        if lq != kforcing_layout.n_queries:
            raise ValueError(f"kforcing_layout: expected {kforcing_layout.n_queries} input tokens (layout.n_queries), got {lq}")
        if lk != kforcing_layout.n_keys:
            raise ValueError(
                f"kforcing_layout: expected {kforcing_layout.n_keys} keys (layout.n_keys = cached + input tokens), got {lk}"
            )
        out = window_attention(query, key, value, kforcing_layout, scale=scaling, backend=kforcing_backend)
        return out.transpose(1, 2).contiguous(), None

    gqa = query.shape[1] != key.shape[1]
    if attention_mask is not None:
        out = scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa,
            layout="auto", backend=kforcing_backend,
        )
    else:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        mask = None
        if causal and 1 < lq < lk:  # a chunk after a cache: query i is token lk - lq + i
            mask = torch.arange(lk, device=query.device) <= torch.arange(lk - lq, lk, device=query.device)[:, None]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=bool(causal and lq == lk and lq > 1),
            scale=scaling, enable_gqa=gqa,
        )
    return out.transpose(1, 2).contiguous(), None


def kforcing_mask(*args, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """transformers mask builder for ``"kforcing"``: no mask when the call is plain causal over exactly its keys.

    The structure comes from ``kforcing_layout`` (or is causal, aligned to the end
    of the keys), so nothing is materialised when that is exact: no token hidden by
    the 2-D padding mask, and the keys are precisely the cached plus the new tokens
    (``kv_offset == 0`` and ``kv_length == q_offset + q_length``). Otherwise (padding,
    a static cache whose unused slots are keys too, a sliding cache) SDPA's boolean
    4-D mask is built, which the attention function then runs with SDPA (or rejects
    alongside a layout).
    """
    if not torch.compiler.is_compiling() and _keys_are_exactly_the_sequence(kwargs):
        if attention_mask is None or bool(attention_mask[:, : int(kwargs["kv_length"])].all()):
            return None
    if not _keys_are_exactly_the_sequence(kwargs):
        # A causal skip would let the unused slots of a static cache be attended.
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


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


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the attention function and mask builder under ``name`` (idempotent); returns ``name``."""
    AttentionInterface.register(name, kforcing_attention_forward)
    AttentionMaskInterface.register(name, kforcing_mask)
    return name


register()


# ---------------------------------------------------------------------- K-Forcing batches


# The position ids of each storage order come from the one place the model uses too (layouts/positions.py).
kforcing_position_ids = single_positions  # [N + N*k]: SingleForward ``[ctx | noise]``
double_forward_position_ids = double_positions  # [2*N*k]: DoubleForward ``[Future-1 | Future-2]``
sbd_position_ids = sbd_positions  # [2L]: SBD ``[clean | masked copy]``


def _check_ids(name: str, ids: torch.Tensor, dims: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype.is_floating_point:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name}: expected an integer tensor of rank {dims}, got {shape}")


def _check_noise(noise: torch.Tensor, batch: int, n_ctx: int) -> int:
    if not isinstance(noise, torch.Tensor) or noise.dim() != 3 or noise.shape[:2] != (batch, n_ctx):
        shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise ValueError(f"noise: expected shape [{batch}, {n_ctx}, k] (batch, context length, k), got {shape}")
    return noise.shape[2]


def single_forward_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,  # [B, N] context tokens
    noise: torch.Tensor,  # [B, N, k] uniform noise; window t follows context token t
    noise_embedding: nn.Module,
    tau: Optional[torch.Tensor] = None,  # [B]
) -> dict:
    """Forward kwargs for a K-Forcing SingleForward on an HF model.

    Returns ``{"inputs_embeds": [B, N + N*k, d], "position_ids": [B, N + N*k],
    "kforcing_layout": WindowLayout.kforcing_single(N, k)}``. Logits come back in
    the same order: ``logits[:, N + t*k + i]`` is the prediction for token t+1+i.
    """
    _check_ids("input_ids", input_ids, 2)
    b, n = input_ids.shape
    k = _check_noise(noise, b, n)
    tokens = model.get_input_embeddings()(input_ids)
    noise_tokens = noise_embedding(noise, tau).reshape(b, n * k, -1).to(tokens.dtype)
    positions = kforcing_position_ids(n, k, device=input_ids.device)
    return {
        "inputs_embeds": torch.cat([tokens, noise_tokens], 1),
        "position_ids": positions.expand(b, -1),
        "kforcing_layout": WindowLayout.kforcing_single(n, k),
    }


def double_forward_inputs(
    model: nn.Module,
    future1_ids: torch.Tensor,  # [B, N, k] tokens t+1..t+k of window t (e.g. the teacher's SingleForward samples)
    noise: torch.Tensor,  # [B, N, k] noise for tokens t+k+1..t+2k
    noise_embedding: nn.Module,
    tau: Optional[torch.Tensor] = None,  # [B]
) -> dict:
    """Forward kwargs for the teacher's DoubleForward; pass the N-token context cache as ``past_key_values``.

    Returns ``{"inputs_embeds": [B, 2Nk, d] as [Future-1 | Future-2], "position_ids",
    "kforcing_layout": WindowLayout.kforcing_double(N, k)}``. The call appends the
    window tokens to the cache; crop it back (``cache.crop(N)``) to reuse it.
    """
    _check_ids("future1_ids", future1_ids, 3)
    b, n, k = future1_ids.shape
    if _check_noise(noise, b, n) != k:
        raise ValueError(f"noise: expected shape {tuple(future1_ids.shape)} (future1_ids'), got {tuple(noise.shape)}")
    f1 = model.get_input_embeddings()(future1_ids.reshape(b, n * k))
    f2 = noise_embedding(noise, tau).reshape(b, n * k, -1).to(f1.dtype)
    positions = double_forward_position_ids(n, k, device=future1_ids.device)
    return {
        "inputs_embeds": torch.cat([f1, f2], 1),
        "position_ids": positions.expand(b, -1),
        "kforcing_layout": WindowLayout.kforcing_double(n, k),
    }


def sbd_inputs(
    input_ids: torch.Tensor,  # [B, L]
    masked: torch.Tensor,  # bool [B, L]: which tokens of the copy are replaced by mask_token_id
    mask_token_id: int,
    block: int,
) -> dict:
    """Forward kwargs for Set Block Decoding training: ``[clean (L) | masked copy (L)]``.

    Returns ``{"input_ids": [B, 2L], "position_ids": [B, 2L], "kforcing_layout":
    WindowLayout.sbd(L, block)}``; the loss goes on ``logits[:, L:]`` at masked slots.
    """
    _check_ids("input_ids", input_ids, 2)
    if not isinstance(masked, torch.Tensor) or masked.dtype != torch.bool or masked.shape != input_ids.shape:
        shape = tuple(masked.shape) if isinstance(masked, torch.Tensor) else type(masked).__name__
        raise ValueError(f"masked: expected a bool tensor of shape {tuple(input_ids.shape)}, got {shape}")
    b, n = input_ids.shape
    copy = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    return {
        "input_ids": torch.cat([input_ids, copy], 1),
        "position_ids": sbd_position_ids(n, device=input_ids.device).expand(b, -1),
        "kforcing_layout": WindowLayout.sbd(n, block),
    }

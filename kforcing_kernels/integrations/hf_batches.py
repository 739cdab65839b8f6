"""K-Forcing batches for a Hugging Face model: the forward kwargs of SingleForward, DoubleForward and SBD.

Each builder returns the ``inputs_embeds`` (or ``input_ids``), ``position_ids`` and ``kforcing_layout`` that a
model loaded with ``attn_implementation="kforcing"`` (:mod:`kforcing_kernels.integrations.hf`, which re-exports
every name here) takes. Pure torch: transformers is not imported here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..layouts import WindowLayout
from ..layouts.positions import double_positions, sbd_positions, single_positions

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
    # torch's stubs type nn.Module's unknown attributes as Tensor | Module, so the method reads as not callable.
    tokens = model.get_input_embeddings()(input_ids)  # type: ignore[operator]
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
    window tokens to the cache; crop it back with ``crop_cache(cache, N)`` to reuse it.
    """
    _check_ids("future1_ids", future1_ids, 3)
    b, n, k = future1_ids.shape
    if _check_noise(noise, b, n) != k:
        raise ValueError(f"noise: expected shape {tuple(future1_ids.shape)} (future1_ids'), got {tuple(noise.shape)}")
    # torch's stubs type nn.Module's unknown attributes as Tensor | Module, so the method reads as not callable.
    f1 = model.get_input_embeddings()(future1_ids.reshape(b, n * k))  # type: ignore[operator]
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

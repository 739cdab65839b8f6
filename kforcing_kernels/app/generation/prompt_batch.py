"""Prompts as the generation functions take them, checked and right-padded into one batch.

:func:`pad_prompts` is what :func:`~kforcing_kernels.app.generation.inference.generate_kforcing` and
:func:`~kforcing_kernels.app.generation.inference.generate_ar` do first (``inference`` re-exports both names).
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from typing import Sequence, Union

import torch

Prompts = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]], Sequence[torch.Tensor]]


def _is_token(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and x.dtype != torch.bool and not x.is_complex()
    return isinstance(x, Integral) and not isinstance(x, bool)


def _id_tensor(i: int, ids) -> torch.Tensor:
    try:
        return torch.tensor([int(x) for x in ids], dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError) as exc:  # an id past int64: not a token id of any vocabulary
        raise ValueError(f"prompts: prompt {i}: expected token ids that fit int64, got {list(ids)!r}") from exc


def _prompt_row(i: int, p) -> torch.Tensor:
    t = p if isinstance(p, torch.Tensor) else torch.as_tensor(p) if not isinstance(p, (list, tuple)) else None
    if t is None:
        if not all(_is_token(x) for x in p):
            raise ValueError(f"prompts: prompt {i}: expected integer token ids, got {list(p)!r}")
        t = _id_tensor(i, p)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex() or t.dim() > 1:
        raise ValueError(
            f"prompts: prompt {i}: expected a 1-D sequence of integer token ids, got dtype {t.dtype}, "
            f"shape {tuple(t.shape)}"
        )
    if t.numel() == 0:
        raise ValueError(f"prompts: prompt {i} is empty; every prompt needs at least one token")
    return t.flatten().to(torch.int64)


def pad_prompts(prompts: Prompts, pad_id: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (right-padded tokens ``[B, P_max]`` int64, lengths ``[B]`` int64 on CPU).

    ``prompts`` is a ``[B, P]`` tensor, B sequences of ids (of any lengths), or one
    flat sequence of ids / a 1-D tensor, which is ONE prompt (``[5, 6, 7, 8]`` is a
    single four-token prompt, not four prompts).
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype.is_floating_point or prompts.dtype == torch.bool or prompts.is_complex():
            raise ValueError(f"prompts: expected integer token ids, got dtype {prompts.dtype}")
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.shape[0] == 0 or prompts.shape[1] == 0:
            raise ValueError(
                f"prompts: expected a [B, P] tensor with B, P >= 1 (or a 1-D prompt), got shape {tuple(prompts.shape)}"
            )
        return prompts.to(device=device, dtype=torch.int64), torch.full(
            (prompts.shape[0],), prompts.shape[1], dtype=torch.int64
        )
    if isinstance(prompts, (str, bytes)):
        raise ValueError(
            f"prompts: expected token ids (encode text with the tokenizer first), got {type(prompts).__name__}"
        )
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts: expected a [B, P] tensor or sequences of token ids, got {type(prompts).__name__}")
    items = list(prompts)
    if not items:
        raise ValueError("prompts: expected at least one prompt, got an empty batch")
    if all(_is_token(x) for x in items):
        rows = [_id_tensor(0, items)]  # a flat list of ids is one prompt
    elif any(_is_token(x) for x in items):
        raise ValueError(
            "prompts: expected one flat list of ids (one prompt) or a list of prompts, got a mix of ids and sequences"
        )
    else:
        rows = [_prompt_row(i, p) for i, p in enumerate(items)]
    lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
    tokens = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens[i, : r.numel()] = r
    return tokens.to(device), lengths

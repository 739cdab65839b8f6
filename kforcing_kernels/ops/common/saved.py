"""What the ops' autograd functions save for their backward."""

from __future__ import annotations

import torch


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy of it when ``t`` is a view into a larger buffer (a model's fused qkv projection,
    a K/V cache, a batch slice of a larger batch, ...): saving the view would keep that whole buffer alive until
    the backward, about 3x the bytes the backward reads for a fused qkv; the copy lets it be freed after the
    forward. Contiguity is not the test: a contiguous view (``x[:2]`` of a ``[4, ...]`` tensor) pins its base too.

    Call it only for what autograd will save (:func:`autograd_records`): the copy is wasted otherwise."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def autograd_records(*inputs: torch.Tensor) -> bool:
    """Whether a custom ``autograd.Function`` applied to ``inputs`` now will record a backward (and so keep what it
    saves): grad mode on (not ``no_grad``, not ``inference_mode``) and some input requiring grad. A Function cannot
    ask this in its forward (grad mode is always off there, and ``ctx.needs_input_grad`` follows ``requires_grad``
    alone), so the caller asks and passes the answer, or skips the Function."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)

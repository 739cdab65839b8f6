"""What the ops' autograd functions save for their backward."""

from __future__ import annotations

import torch


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy of it when ``t`` is a view into a larger buffer (a model's fused qkv projection,
    a K/V cache, ...): saving the view would keep that whole buffer alive until the backward, about 3x the bytes
    the backward reads for a fused qkv; the copy lets it be freed after the forward."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t

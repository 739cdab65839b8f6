"""Type aliases shared by the library and the app (one definition each)."""

from __future__ import annotations

from typing import Union

import torch

# A sampling temperature: one value, or one per sample / row (> 0 everywhere).
Temperature = Union[float, torch.Tensor]
# One layer's keys and values, each [B, H, L, D].
KV = tuple[torch.Tensor, torch.Tensor]

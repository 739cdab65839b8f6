"""Model configuration: a tiny CPU default and the paper's backbone as a preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..settings import POSITIVE, check_reals


@dataclass
class ModelConfig:
    """Sizes of :class:`~kforcing_kernels.model.KForcingLM`.

    The default is small enough to train on two CPU cores in minutes; use
    :meth:`paper_backbone` for the 12-layer, 768-wide, 12-head backbone of the paper.
    """

    vocab_size: int = 2048
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    seq_len: int = 128  # training context length N
    rope_base: float = 10000.0
    noise_features: int = 32  # sinusoidal features of the noise scalar z (a wide frequency ladder)
    tau_features: int = 8  # sinusoidal features of the temperature tau (a low-frequency ladder for tau's range)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # None: window_attention picks the fastest backend for the device. "reference"
    # (dense mask) is the oracle the tests compare against.
    attention_backend: Optional[str] = None
    # How a PFLM decodes its slots (kforcing_kernels/model/decoding.py): "argmax" (the paper's greedy
    # decoding) or "residual" (the inverse CDF of the slot's softmax at the noise's unresolved digits).
    decode: str = "argmax"

    # The real-valued fields and their ranges (kforcing_kernels/settings.py): a NaN, infinite, zero or negative
    # rope_base or norm_eps makes every logit NaN, so each is refused by name here.
    REAL_SETTINGS = {"rope_base": POSITIVE, "norm_eps": POSITIVE}

    def __post_init__(self) -> None:
        check_reals(self, self.REAL_SETTINGS)
        for name in (
            "vocab_size",
            "n_layer",
            "n_head",
            "n_embd",
            "mlp_ratio",
            "seq_len",
            "noise_features",
            "tau_features",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.decode not in ("argmax", "residual"):
            raise ValueError(f"decode: expected 'argmax' or 'residual', got {self.decode!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: expected a multiple of n_head={self.n_head}, got {self.n_embd}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd: head dim n_embd/n_head must be even for RoPE, got {self.n_embd // self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def paper_backbone(cls, vocab_size: int = 50258, seq_len: int = 1024, **overrides) -> "ModelConfig":
        """12 layers, width 768, 12 heads (~100M parameters with a GPT-2 vocabulary), as in the paper."""
        base = dict(
            vocab_size=vocab_size,
            n_layer=12,
            n_head=12,
            n_embd=768,
            seq_len=seq_len,
            noise_features=128,
            tau_features=16,
        )
        return cls(**{**base, **overrides})  # overrides may change the backbone's sizes (bench --override n_layer=1)

    @classmethod
    def micro(cls, **overrides) -> "ModelConfig":
        """A few thousand parameters: for tests that must run in seconds."""
        base: dict[str, Any] = dict(
            vocab_size=64, n_layer=2, n_head=2, n_embd=16, seq_len=16, noise_features=8, tau_features=4
        )
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model config: unknown fields {unknown}")
        return cls(**d)


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "micro": ModelConfig.micro,
    "tiny": ModelConfig,
    "paper": ModelConfig.paper_backbone,
}

"""The noise embedding of a Hugging Face model run as a push-forward LM: the package's own noise encoder.

:class:`NoiseEmbedding` is :class:`~kforcing_kernels.model.gpt.NoiseEncoder` (the same features and
layers, one implementation) sized by a hidden width instead of a ``ModelConfig``: sinusoids of z with
periods from ~0.006 to ~60 z units (narrow inverse-CDF bins must be told apart), separate low-frequency
features of tau (tau - 1, log tau, periods 1 to 16 tau units) acting on the z layer as a FiLM scale and
shift. It needs neither transformers nor the app.

Format 2. Format 1 (kforcing_kernels <= 0.3) had sinusoids ``pi * 1..n_freqs`` (shortest period 0.125 in
z) shared by u and tau and a plain MLP (keys ``mlp.*``); its weights mean nothing to format 2, so loading
them raises a ``ValueError`` that says so instead of loading them wrongly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..model.gpt import NoiseEncoder

NOISE_EMBEDDING_FORMAT = 2


class NoiseEmbedding(NoiseEncoder):
    """Embeds uniform noise ``u`` and the sampling temperature ``tau`` as model inputs (format 2).

    Args:
        hidden_size: the model's embedding width.
        noise_features: sinusoidal features of u (half sines, half cosines), as ``ModelConfig.noise_features``.
        tau_features: sinusoidal features of tau, as ``ModelConfig.tau_features``.
    """

    _version = NOISE_EMBEDDING_FORMAT  # saved in state_dict metadata; format-1 state dicts carry version 1

    def __init__(self, hidden_size: int, noise_features: int = 32, tau_features: int = 8):
        torch.nn.Module.__init__(self)
        for name, value in (
            ("hidden_size", hidden_size),
            ("noise_features", noise_features),
            ("tau_features", tau_features),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.hidden_size, self.noise_features, self.tau_features_count = hidden_size, noise_features, tau_features
        self._build(hidden_size, noise_features, tau_features)

    def settings(self) -> dict:
        """What rebuilds this module: ``NoiseEmbedding(**settings())``."""
        return {
            "hidden_size": self.hidden_size,
            "noise_features": self.noise_features,
            "tau_features": self.tau_features_count,
        }

    def forward(self, u: torch.Tensor, tau: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u ``[B, ...]`` in [0, 1), tau scalar, ``[1]`` or ``[B]`` (> 0) -> ``[B, ..., hidden_size]``."""
        if tau is None:
            raise ValueError("tau: expected a temperature (a scalar or one per sample, shape [B]), got None")
        tau = torch.as_tensor(tau, dtype=torch.float32, device=u.device).reshape(-1)
        if tau.numel() not in (1, u.shape[0]):
            raise ValueError(f"tau: expected shape [{u.shape[0]}] or [1], got {tuple(tau.shape)}")
        return super().forward(u, tau.view(-1, *([1] * (u.dim() - 1))))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        old_keys = [key for key in state_dict if key.startswith(prefix + "mlp.")]
        version = local_metadata.get("version")
        if old_keys or (version is not None and version < NOISE_EMBEDDING_FORMAT):
            raise ValueError(
                "NoiseEmbedding: these weights are format 1 (kforcing_kernels <= 0.3: shared u/tau features "
                "pi*1..n_freqs, "
                f"keys {prefix}mlp.*); format {NOISE_EMBEDDING_FORMAT} has the native noise encoder's features and "
                "layers, "
                "so they cannot be loaded or converted; train the noise embedding again"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

"""The native reference model (``kforcing_kernels.model.KForcingLM``) in the form vLLM serves it (no vLLM needed).

No architecture vLLM ships is the native block exactly (its MLP is ``proj(gelu(fc(x)))``, not gated: vLLM's
Llama refuses any ``hidden_act`` but silu), so the native stage is served by the registered architecture
``KForcingNativeForCausalLM`` (:mod:`.native`: vLLM's Llama with the native MLP in its decoder layers). This module
is the mapping the export (``python -m kforcing_kernels.app.vllm_export``) writes through:

* :func:`vllm_config`: the ``config.json`` vLLM's ``ModelConfig`` reads (``model_type`` llama: layers, heads,
  head_dim, RoPE base, RMSNorm eps, vocabulary, tied head, max positions; ``hidden_act`` gelu, ``intermediate_size``
  the native MLP's width);
* :func:`vllm_tensors`: the backbone's tensors under the names vLLM's Llama loads (the fused ``qkv`` as
  ``qkv_proj``: the native ``[q | k | v]`` rows are QKVParallelLinear's layout with as many KV heads as heads);
* :func:`noise_tensors`: the native noise encoder's tensors, which are a format-2 noise embedding as they are
  (``integrations/hf_noise.py``'s ``NoiseEmbedding`` is the native ``NoiseEncoder``, sized by a width).

The folder's ``model.json`` carries ``native_export`` (:data:`NATIVE_EXPORT_FORMAT`) in place of the HF recipe's
``hf_format``; :func:`~.stage.read_stage` checks it as it checks an HF stage. An AR stage (k = 0, the teacher) is
exported the same way without the noise encoder, as the architecture ``KForcingNativeARForCausalLM`` (the same
layers, stock vLLM decoding): the AR baseline on the native backbone.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import NATIVE_AR_ARCHITECTURE, NATIVE_ARCHITECTURE

NATIVE_EXPORT_FORMAT = 1


def vllm_config(
    config, *, max_positions: Optional[int] = None, eos_token_id: Optional[int] = None, autoregressive: bool = False
) -> dict:
    """``config.json`` of the export of a native model of ``config`` (a ``ModelConfig``); ``max_positions``
    (default the trained context ``seq_len``): the longest sequence vLLM serves (``max_model_len`` at most);
    ``autoregressive``: an AR stage's (k = 0), architecture ``KForcingNativeARForCausalLM``."""
    positions = config.seq_len if max_positions is None else max_positions
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise ValueError(f"max_positions: expected a positive int, got {positions!r}")
    return {
        "architectures": [NATIVE_AR_ARCHITECTURE if autoregressive else NATIVE_ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_ratio * config.n_embd,
        "hidden_act": "gelu",  # exact (erf) GELU, F.gelu's default, as model/gpt.py's MLP
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "max_position_embeddings": positions,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


# native name (after "blocks.{i}.") -> vLLM name (after "model.layers.{i}.")
_BLOCK_NAMES = {
    "norm1.weight": "input_layernorm.weight",
    "attn.qkv.weight": "self_attn.qkv_proj.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.fc.weight": "mlp.fc.weight",
    "mlp.proj.weight": "mlp.proj.weight",
}
_TOP_NAMES = {
    "wte.weight": "model.embed_tokens.weight",
    "norm_f.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
NOISE_PREFIX = "noise_encoder."


def vllm_tensors(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """The backbone of a native ``state_dict`` under vLLM's names (the noise encoder's tensors left out; a tied head
    saved once, as its embedding). A name the mapping does not know raises ``ValueError`` naming it: a model this
    mapping was not written for is refused, not exported in part."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(NOISE_PREFIX) or (tie_embeddings and name == "head.weight"):
            continue
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
            continue
        head, _, rest = name.partition(".")
        index, _, rest = rest.partition(".")
        if head != "blocks" or not index.isdigit() or rest not in _BLOCK_NAMES:
            raise ValueError(f"model: the vLLM export knows no tensor {name!r} of the native model")
        out[f"model.layers.{index}.{_BLOCK_NAMES[rest]}"] = tensor
    return out


def noise_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The native noise encoder's tensors of a ``state_dict``, named as a ``NoiseEmbedding``'s."""
    return {name[len(NOISE_PREFIX) :]: t for name, t in state.items() if name.startswith(NOISE_PREFIX)}


def noise_settings(config) -> dict:
    """``NoiseEmbedding(**noise_settings(config))`` builds the native noise encoder of ``config``."""
    return {"hidden_size": config.n_embd, "noise_features": config.noise_features, "tau_features": config.tau_features}

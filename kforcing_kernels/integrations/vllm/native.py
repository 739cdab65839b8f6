"""The native reference model (``kforcing_kernels/model/gpt.py``) as a vLLM architecture, run as paper Algorithm 1
by :class:`~.model.KForcingMixin`.

``KForcingNativeForCausalLM`` is vLLM's ``LlamaForCausalLM`` (its embedding, RMSNorms, fused-QKV attention with
neox RoPE, residual stream, final norm and tied or untied head are the native block's) with one part replaced: the
decoder layers' MLP is the native non-gated ``proj(gelu(fc(x)))`` (vLLM's ``LlamaMLP`` is gated and refuses any
activation but silu), built from vLLM's own linear layers. It serves the folder the export writes
(:mod:`.export`, ``python -m kforcing_kernels.app.vllm_export``), whose ``config.json`` names this architecture.

``KForcingNativeARForCausalLM`` is the same network without ``KForcingMixin``: the export of a native AR stage
(k = 0, the teacher) decoded by stock vLLM, one token per step (the AR baseline on the native backbone).
"""

from __future__ import annotations

from torch import nn
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

from .model import KForcingConfigError, KForcingMixin
from .stage import is_native_export, read_stage


class NativeMLP(nn.Module):
    """``proj(gelu(fc(x)))``, no biases (``model/gpt.py``'s ``MLP``): ``[N, C] -> [N, C]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, quant_config, prefix: str):
        super().__init__()
        self.fc = ColumnParallelLinear(
            hidden_size, intermediate_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.fc"
        )
        self.act = get_act_fn(hidden_act)
        self.proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.proj"
        )

    def forward(self, x):
        x, _ = self.fc(x)
        x, _ = self.proj(self.act(x))
        return x


class NativeDecoderLayer(LlamaDecoderLayer):
    """``model/gpt.py``'s ``Block``: vLLM's Llama decoder layer (its forward: pre-norm attention, pre-norm MLP,
    residual adds) over the native MLP."""

    def __init__(self, vllm_config, prefix: str = ""):
        # LlamaDecoderLayer.__init__ would build a LlamaMLP, which refuses gelu: this layer builds its four
        # modules itself, under the names LlamaDecoderLayer.forward uses.
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        quant_config = self.get_quant_config(vllm_config)
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            quant_config=quant_config,
            bias=False,
            bias_o_proj=False,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = NativeMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, quant_config, prefix=f"{prefix}.mlp"
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class NativeLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama over :class:`NativeDecoderLayer`: the native network (``model/gpt.py``'s ``KForcingLM`` less its
    noise encoder), as vLLM runs it."""

    def _init_model(self, vllm_config, prefix: str = "", layer_type=NativeDecoderLayer):
        return LlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=NativeDecoderLayer)


class KForcingNativeForCausalLM(KForcingMixin, NativeLlamaForCausalLM):
    """A native K-Forced stage's export served by vLLM (``KForcingMixin`` over vLLM's Llama with native layers)."""

    kf_base_arch = "native"


class KForcingNativeARForCausalLM(NativeLlamaForCausalLM):
    """A native AR stage's export (k = 0) served by stock vLLM decoding: checked on load as the K-Forced
    architectures are (:func:`~.stage.read_stage`: files, sizes, SHA-256, format), and refused for anything but an AR
    export or beside a speculative config (a draft model would not be this stage's decoding)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        folder = vllm_config.model_config.model
        info = read_stage(folder)
        if not is_native_export(info) or info["k"] != 0:
            what = f"a K-Forced stage (k_train = {info['k']})" if info["k"] else "not a native stage's export"
            raise KForcingConfigError(
                f"architectures: {type(self).__name__} serves a native AR stage's export (k = 0); {folder} is {what}: "
                "select the architecture kforcing_kernels.integrations.vllm.architecture_of(folder) names "
                "(engine_kwargs does)"
            )
        if vllm_config.speculative_config is not None:
            raise KForcingConfigError(
                f"speculative_config: an AR stage's export decodes one token per step, got "
                f"{vllm_config.speculative_config.method!r}; serve it without one (engine_kwargs(folder))"
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix)

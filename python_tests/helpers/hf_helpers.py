"""Tiny random Hugging Face models for the "kforcing" attention tests (no downloads): configs of several
families, twins with the same weights under different attention implementations, logits + gradients."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402

import kforcing_kernels.integrations.hf  # noqa: E402,F401  (registers "kforcing")

VOCAB, HIDDEN = 48, 32
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
)


def llama(**extra):
    return transformers.LlamaConfig(**_COMMON, **extra)


def qwen2(**extra):
    return transformers.Qwen2Config(**_COMMON, **extra)


def mistral(**extra):
    return transformers.MistralConfig(**{"sliding_window": None, **_COMMON, **extra})


def phi3(**extra):
    return transformers.Phi3Config(**{**_COMMON, "pad_token_id": 0, **extra})


def gpt2(**extra):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )


def qwen2_moe(**extra):
    return transformers.Qwen2MoeConfig(
        **_COMMON,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        **extra,
    )


def gemma3(**extra):
    return transformers.Gemma3TextConfig(**{**_COMMON, "head_dim": 8, "query_pre_attn_scalar": 8, **extra})


def twin_models(config, *implementations, seed: int = 0):
    """One randomly initialised model per attention implementation, all with the same weights (eval mode)."""
    torch.manual_seed(seed)
    models = []
    for impl in implementations:
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model.eval())
    # Each model still runs its own implementation (a shared config would give every one the last).
    assert [m.config._attn_implementation for m in models] == list(implementations)
    return models


def logits_and_grads(model, **inputs):
    """(logits, grads of every parameter) for a fixed random weighting of the logits."""
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((logits * weights).sum(), list(model.parameters()), allow_unused=True)
    return logits.detach(), grads


def assert_same_logits_and_grads(ours, theirs, tol: float = 1e-5):
    torch.testing.assert_close(ours[0], theirs[0], atol=tol, rtol=tol)
    for a, b in zip(ours[1], theirs[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)

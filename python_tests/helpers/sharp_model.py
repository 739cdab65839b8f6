"""A small KForcingLM whose attention is sharp, for behavioural tests that compare logits (issue 17, item 1).

At the default init (std 0.02) attention is nearly uniform: moving a token's RoPE
position by one changes the logits by ~1e-3 while the gap between the top two
logits is ~1e-2, so tests that compare argmax tokens never notice. Here the query
and key projections are scaled up (scores of order ten, so each query attends to a
few keys and RoPE's relative angle matters), and the tied embedding too (logits of
order one). Built once per process (seconds on CPU) and never modified: callers
must not train it.
"""

import functools

import torch

from kforcing_kernels.model import KForcingLM, ModelConfig

VOCAB = 48
QK_SCALE = 25.0
EMBED_SCALE = 30.0


@functools.lru_cache(maxsize=None)
def sharp_model(backend=None) -> KForcingLM:
    """fp32, eval mode; 2 layers, 2 heads of dim 16, vocab 48."""
    gen = torch.Generator().manual_seed(1234)
    cfg = ModelConfig.micro(
        vocab_size=VOCAB, n_embd=32, n_head=2, n_layer=2, seq_len=64, noise_features=16, attention_backend=backend
    )
    model = KForcingLM(cfg)
    model.reset_parameters(gen)
    c = cfg.n_embd
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * c] *= QK_SCALE  # the q and k rows of the fused projection
        model.wte.weight *= EMBED_SCALE
    return model.eval().requires_grad_(False)


def attention_entropy(model: KForcingLM, tokens: torch.Tensor) -> float:
    """Mean entropy (nats) of layer 0's causal attention rows over ``tokens`` [B, N]: low means sharp."""
    from kforcing_kernels.model.gpt import apply_rope, rope_cos_sin

    b, n = tokens.shape
    cfg = model.config
    block = model.blocks[0]
    x = block.norm1(model.wte(tokens))
    q, k, _ = block.attn.qkv(x).view(b, n, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
    cos, sin = rope_cos_sin(torch.arange(n), cfg.head_dim, cfg.rope_base)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    return float(-(p * p.clamp_min(1e-30).log()).sum(-1)[..., n // 2 :].mean())

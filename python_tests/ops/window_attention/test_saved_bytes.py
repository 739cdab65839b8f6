"""window_attention saves only what its backward reads (issue 45): never a view that pins a larger buffer.

The model's q, k, v are views of its fused qkv projection ``[B, L, 3, H, D]``; saving v as given kept the whole
buffer alive until the backward. Measured with autograd's saved-tensor hooks against the same model whose
attention costs nothing (returns q: the bytes every other layer saves).
"""

import pytest
import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.model import KForcingLM, ModelConfig, gpt
from kforcing_kernels.tools.memory import SavedTensors


def _saved(model, tokens, noise, zero_cost: bool) -> SavedTensors:
    saved = SavedTensors(exclude=model.parameters())
    original = gpt.window_attention
    if zero_cost:
        gpt.window_attention = lambda q, k, v, layout, backend=None: q
    try:
        with saved.context():
            model(tokens, noise, 0.8, return_hidden=True)
    finally:
        gpt.window_attention = original
    return saved


@pytest.mark.parametrize("backend", ["composite", "cpp", "reference"])
def test_attention_saves_no_pinned_buffer(backend):
    from kforcing_kernels import backends_available

    if backends_available().get(backend) is not None:
        pytest.skip(f"{backend}: {backends_available()[backend]}")
    cfg = ModelConfig.micro(vocab_size=64, n_embd=32, n_head=2, n_layer=1, attention_backend=backend)
    model = KForcingLM(cfg)
    b, n, k = 2, 16, 4
    tokens, noise = torch.randint(0, 64, (b, n)), torch.rand(b, n, k)
    ours, zero = _saved(model, tokens, noise, False), _saved(model, tokens, noise, True)
    assert ours.pinned_excess == 0, ours.pinned_excess  # before: the fused qkv buffer, 2/3 of it unused by the backward
    rows = n * (1 + k)
    qkv_bytes = b * rows * cfg.n_embd * 4  # each of q, k, v; out the same; lse [B, H, L] fp32
    attention_needs = 4 * qkv_bytes + b * cfg.n_head * rows * 4
    # What ours saves beyond the zero-cost variant: q, k, v, out, lse; at most RoPE's rotated copies are shared.
    assert ours.total - zero.total <= attention_needs, (ours.total - zero.total, attention_needs)


def test_views_of_a_larger_buffer_are_saved_compact():
    layout = WindowLayout.kforcing_single(n_ctx=8, k=2)
    qkv = torch.randn(1, layout.n_queries, 3, 2, 8, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    saved = SavedTensors()
    with saved.context():
        out = window_attention(q * 1.0, k * 1.0, v, layout)  # v: a view of qkv
    assert saved.pinned_excess == 0
    out.sum().backward()
    fresh = qkv.detach().clone().requires_grad_()
    q2, k2, v2 = (t.contiguous() for t in fresh.permute(2, 0, 3, 1, 4))
    window_attention(q2 * 1.0, k2 * 1.0, v2, layout).sum().backward()
    torch.testing.assert_close(qkv.grad, fresh.grad, atol=0, rtol=0)  # the copy changes no gradient

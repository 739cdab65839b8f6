"""The portable math path of lse_attention (``force_math``) against a plain fp64 softmax with autograd.

It is what the ``reference`` backend runs under torch.compile (the custom op) and what
composite uses where PyTorch's CPU flash kernel is absent, so eager tests of the
reference backend never reach it (issue 17: a wrong scale in its dK survived them).
_MATH_ROW_CHUNK is patched small so dK/dV accumulate over several row chunks.
"""

import pytest
import torch

from kforcing_kernels.layouts import zoo
from kforcing_kernels.ops.window_attention import lse_attention
from kforcing_kernels.ops.window_attention.lse_attention import attend, attend_backward

SCALE = 0.3


def dense_attention(q, k, v, allowed):
    """(out, lse) by the textbook formula; rows that see nothing give out 0, lse -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * SCALE
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return p @ vv, lse


@pytest.mark.parametrize(
    "name", ["ptp_per_batch", "double_k2", "sbd_short_last", "blank_full_windows", "ptp_empty_prefixes"]
)
def test_math_path_forward_and_backward(monkeypatch, name):
    monkeypatch.setattr(lse_attention, "_MATH_ROW_CHUNK", 8)
    layout = zoo.small()[name]
    b = layout.batch_size or 2
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, 4, layout.n_queries, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, layout.n_keys, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, layout.n_keys, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, 4, layout.n_queries, 8, generator=gen, dtype=torch.float64)
    mask = layout.dense_mask()
    allowed = mask[:, None] if mask.dim() == 3 else mask[None, None]
    assert layout.n_queries > 8  # several row chunks

    out, lse = attend(q, k, v, causal=False, scale=SCALE, allowed=allowed, force_math=True)
    dq, dk, dv = attend_backward(
        dout,
        q,
        k,
        v,
        out,
        torch.where(lse > float("-inf"), lse, float("inf")),
        causal=False,
        scale=SCALE,
        allowed=allowed,
        force_math=True,
    )
    ref_out, ref_lse = dense_attention(q, k, v, allowed)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for label, a, e in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, label=label: f"{label}: {m}")


def test_math_path_causal(monkeypatch):
    monkeypatch.setattr(lse_attention, "_MATH_ROW_CHUNK", 8)
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 21, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = attend(q, k, v, causal=True, scale=SCALE, force_math=True)
    grads = attend_backward(dout, q, k, v, out, lse, causal=True, scale=SCALE, force_math=True)
    ref_out, _ = dense_attention(q, k, v, torch.ones(21, 21, dtype=torch.bool).tril()[None, None])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, e in zip(grads, torch.autograd.grad(ref_out, (q, k, v), dout)):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)

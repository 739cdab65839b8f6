"""Random q/k/v for a layout and the comparison against the reference backend in float64 that the op tests share."""

import torch


def make_qkv(
    layout, *, batch=1, heads=2, kv_heads=None, head_dim=16, dtype=torch.float32, scale_std=1.0, requires_grad=True
):
    """Random q [B, H, Lq, D], k/v [B, Hkv, Lk, D] matching ``layout``."""
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, layout.n_queries, head_dim, dtype=torch.float64) * scale_std
    k = torch.randn(batch, kv_heads, layout.n_keys, head_dim, dtype=torch.float64) * scale_std
    v = torch.randn(batch, kv_heads, layout.n_keys, head_dim, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def run_with_grads(fn, q, k, v, dout):
    """Output and (dq, dk, dv) of fn(q, k, v) for upstream gradient dout."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return out, dq, dk, dv


def compare_with_reference(layout, backend, *, dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, batch=None):
    """(ours, ref64, ref_lp): (out, dq, dk, dv) of ``backend``, of the ``reference`` backend on the
    same inputs in float64, and of ``reference`` in ``dtype`` (PyTorch's own error at that precision)."""
    from kforcing_kernels import window_attention

    batch = layout.batch_size or batch or 2
    q, k, v = make_qkv(layout, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    dout = torch.randn(batch, heads, layout.n_queries, head_dim, dtype=torch.float64)
    ours = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend=backend), q, k, v, dout)
    ref64 = run_with_grads(
        lambda q, k, v: window_attention(q, k, v, layout, backend="reference"), *(t.double() for t in (q, k, v)), dout
    )
    # PyTorch's own error at this precision: SDPA with the dense mask, differentiated by autograd.
    from kforcing_kernels.ops.window_attention import reference

    scale = q.shape[-1] ** -0.5
    ref_lp = run_with_grads(
        lambda q, k, v: reference.attention(q, k, v, layout, scale, with_lse=False)[0], q, k, v, dout
    )
    return ours, ref64, ref_lp


def assert_within_2x_torch_error(ours, ref64, ref_lp, dtype):
    """Each of (out, dq, dk, dv) is ``dtype`` and its max error vs float64 is at most 2x PyTorch's
    own error in ``dtype`` (``ref_lp``) plus a small floor."""
    floor = 1e-3 if dtype == torch.float16 else 8e-3
    for label, a, b, c in zip(("out", "dq", "dk", "dv"), ours, ref64, ref_lp):
        assert a.dtype == dtype
        our_err = (a.double() - b).abs().max().item()
        torch_err = (c.double() - b).abs().max().item()
        assert our_err <= 2 * torch_err + floor, f"{label}: ours {our_err:.3g} vs torch {torch_err:.3g}"

import os

import pytest
import torch

# Tests are CPU-only and deterministic; keep thread count small like CI's 2 cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_qkv(layout, *, batch=1, heads=2, kv_heads=None, head_dim=16, dtype=torch.float32, scale_std=1.0, requires_grad=True):
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

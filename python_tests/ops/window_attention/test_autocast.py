"""window_attention under torch.autocast (issue 56 item 3): one rule for every backend.

The rule (window_attention's docstring, docs/DESIGN.md section 3): under autocast for q's device, fp32/fp16/bf16 q, k, v
are cast to the autocast dtype at the op's entry and the op runs on them with autocast off. Before, reference and
flex computed in bf16 (autocast re-cast their products) while composite and cpp stayed fp32: the dispatch choice
changed the precision. Oracles: the same backend called on inputs cast by hand outside autocast (the same bits),
and fp64 attention from the dense mask (the error is bf16's, for every backend alike).
"""

import math

import pytest
import torch

from kforcing_kernels import WindowLayout, backends_available, window_attention

LAYOUT = WindowLayout.kforcing_single(n_ctx=12, k=3)
BACKENDS = ["reference", "composite", "cpp", "flex"]


def _inputs():
    gen = torch.Generator().manual_seed(4)
    n = LAYOUT.n_queries
    return [torch.randn(2, 2, n, 16, generator=gen, requires_grad=True) for _ in range(3)]


def _fp64_oracle(q, k, v):
    q, k, v = (t.detach().double() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~LAYOUT.dense_mask(), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_the_inputs_for_every_backend(backend, dtype):
    reason = backends_available().get(backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    q, k, v = _inputs()
    with torch.autocast("cpu", dtype):
        out, lse = window_attention(q, k, v, LAYOUT, backend=backend, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    # The same bits as the backend on inputs cast by hand without autocast: the rule, not a backend's own.
    want = window_attention(*(t.detach().to(dtype) for t in (q, k, v)), LAYOUT, backend=backend)
    torch.testing.assert_close(out.detach(), want, atol=0, rtol=0)
    # The error against fp64 is the low-precision dtype's (and not fp32's: it did compute in that dtype).
    err = (out.detach().double() - _fp64_oracle(q, k, v)).abs().max().item()
    assert 1e-5 < err < (5e-2 if dtype == torch.bfloat16 else 1e-2), err
    if backend == "flex":
        return  # FlexAttention has no backward on CPU (flex.py refuses it by name)
    # Gradients reach the fp32 leaves in fp32, through the casts.
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_every_backend_gives_the_same_precision_under_autocast():
    """The dispatch choice does not change the result's dtype or its error class."""
    q, k, v = _inputs()
    oracle = _fp64_oracle(q, k, v)
    errors = {}
    for backend in BACKENDS:
        if backends_available().get(backend) is not None:
            continue
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            out = window_attention(q, k, v, LAYOUT, backend=backend)
        assert out.dtype == torch.bfloat16, (backend, out.dtype)
        errors[backend] = (out.double() - oracle).abs().max().item()
    assert len(errors) >= 3, errors
    assert max(errors.values()) < 4 * min(errors.values()), errors  # all bf16-class, none fp32-class


def test_fp64_inputs_are_not_cast():
    q, k, v = (t.detach().double() for t in _inputs())
    with torch.autocast("cpu", torch.bfloat16):
        out = window_attention(q, k, v, LAYOUT, backend="reference")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _fp64_oracle(q, k, v))

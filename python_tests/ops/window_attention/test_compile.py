"""window_attention under torch.compile(fullgraph=True): no graph breaks, same numbers, no recompiles across N.

The recompile policy is stated in kforcing_kernels/ops/window_attention/op.py's module docstring.
Compiles are slow on 2 cores, so shapes are tiny and most graphs use the
``aot_eager`` backend (dynamo + AOTAutograd, which is where breaks and guards
arise); one test runs inductor end to end.
"""

import os

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from helpers.attention import make_qkv, run_with_grads
from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.ops.window_attention import backend_limits

# Backends with a limit (flex: no CPU backward) are not CPU backends for these fwd + bwd checks.
CPU_BACKENDS = [
    name for name, reason in backends_available().items() if reason is None and name not in backend_limits()
]
# On a CUDA machine the composite backend also runs its CUDA path (composite_cuda) under compile.
CASES = CPU_BACKENDS + (["composite-cuda"] if torch.cuda.is_available() else [])


def _inputs_for(case: str):
    """(backend, device, dtype, head dim, tolerance): inputs each backend takes. triton runs compiled only on
    CUDA in fp16/bf16 (fp32 on CPU under TRITON_INTERPRET=1), and only for head dims 32/64/128."""
    if case == "triton":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "triton", torch.device("cpu"), torch.float32, 32, 1e-5
        return "triton", torch.device("cuda"), torch.bfloat16, 32, 2e-2
    if case == "composite-cuda":
        return "composite", torch.device("cuda"), torch.bfloat16, 32, 2e-2
    return case, torch.device("cpu"), torch.float32, 16, 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _attend(backend):
    def fn(q, k, v, layout):
        return window_attention(q, k, v, layout, backend=backend) * 2.0

    return fn


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_matches_eager_forward_and_backward(case):
    backend, device, dtype, d, tol = _inputs_for(case)
    layout = WindowLayout.kforcing_double(5, 2)

    def qkv(**kw):
        return tuple(
            t.detach().to(device).requires_grad_(True) for t in make_qkv(layout, head_dim=d, dtype=dtype, **kw)
        )

    explanation = torch._dynamo.explain(_attend(backend))(*qkv(), layout)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(_attend(backend), backend="aot_eager", fullgraph=True)
    q, k, v = qkv(batch=2, heads=4, kv_heads=2)
    dout = torch.randn(2, 4, layout.n_queries, d, device=device)
    got = run_with_grads(lambda q, k, v: compiled(q, k, v, layout), q, k, v, dout)
    want = run_with_grads(lambda q, k, v: _attend(backend)(q, k, v, layout), q, k, v, dout)
    for a, b in zip(got, want):
        assert a.device.type == device.type and a.dtype == dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_inductor_default_backend_matches_eager():
    layout = WindowLayout.kforcing_single(6, 2)
    compiled = torch.compile(_attend(None), fullgraph=True)
    q, k, v = make_qkv(layout, heads=2)
    dout = torch.randn_like(q)
    got = run_with_grads(lambda q, k, v: compiled(q, k, v, layout), q, k, v, dout)
    want = run_with_grads(lambda q, k, v: _attend(None)(q, k, v, layout), q, k, v, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _count_compiles(make_layout, sizes, *, dynamic):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attend("composite"), backend=counter, fullgraph=True, dynamic=dynamic)
    for n in sizes:
        layout = make_layout(n)
        q, k, v = make_qkv(layout, heads=2, head_dim=8)
        got = compiled(q, k, v, layout)
        torch.testing.assert_close(got, _attend("composite")(q, k, v, layout), atol=1e-5, rtol=1e-5)
    return counter.frame_count


def test_changing_sizes_within_a_bucket_does_not_recompile():
    single = lambda n: WindowLayout.kforcing_single(n, 3)  # noqa: E731
    assert _count_compiles(single, (4, 5, 9, 16), dynamic=True) == 1
    # Default dynamic=None: dynamo specialises the first size, then makes it symbolic once.
    assert _count_compiles(single, (4, 5, 9, 16), dynamic=None) == 2
    # Geometry ints are symbolic too: k, the SBD block and its short last block may change.
    assert _count_compiles(lambda n: WindowLayout.kforcing_single(n, n // 3), (6, 9, 13), dynamic=True) == 1
    assert _count_compiles(lambda n: WindowLayout.sbd(n, 4 if n < 14 else 5), (12, 13, 14, 17), dynamic=True) == 1


def test_a_new_bucket_compiles_a_new_graph():
    family = lambda n: WindowLayout.kforcing_single(n, 2) if n < 10 else WindowLayout.kforcing_double(n, 2)  # noqa: E731
    assert _count_compiles(family, (5, 7, 10, 12), dynamic=True) == 2  # queries: all -> windows
    # N = 1 is specialised
    assert _count_compiles(lambda n: WindowLayout.kforcing_single(n, 2), (5, 1), dynamic=True) == 2


def test_default_backend_fullgraph_dynamic_one_graph_for_two_sizes():
    """Issue #29 item 14: what users write, ``window_attention(q, k, v, layout)`` with no backend and a scale
    argument, under fullgraph=True and dynamic=True. The default choice took the head dim as an argument of an
    ``assume_constant_result`` function (a SymInt there fails), and the scale check called math.isfinite on a
    SymFloat. Forward and backward match eager; two sizes share one graph."""

    def fn(q, k, v, layout, scale):
        return window_attention(q, k, v, layout, scale=scale) * 2.0

    def default_only(q, k, v, layout):
        return window_attention(q, k, v, layout) * 2.0

    for f, extra in ((fn, (0.3,)), (default_only, ())):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        for n in (6, 9):
            layout = WindowLayout.kforcing_single(n, 2)
            q, k, v = make_qkv(layout, heads=2, head_dim=16)
            dout = torch.randn_like(q)
            got = run_with_grads(lambda q, k, v, c=compiled, lay=layout, ex=extra: c(q, k, v, lay, *ex), q, k, v, dout)
            want = run_with_grads(lambda q, k, v, f=f, lay=layout, ex=extra: f(q, k, v, lay, *ex), q, k, v, dout)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # One graph: one cache entry for the frame (a float argument makes dynamo restart its first trace
        # once, specialising the scale, so the backend may be called twice for that one entry).
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)) == 1, f.__name__


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("inf"), float("nan")])
def test_scale_check_refuses_without_math_isfinite(bad):
    from kforcing_kernels.ops.common.validation import check_scale

    with pytest.raises(ValueError, match="scale: expected a positive finite number"):
        check_scale(bad)
    assert check_scale(0.5) == 0.5 and check_scale(None) is None


def test_an_argument_error_under_fullgraph_carries_the_message_the_readme_promises():
    """Under fullgraph=True dynamo reports a ValueError raised while tracing as its own "Observed exception"
    (torch._dynamo.exc.Unsupported), not as the ValueError; the README says so and that the original message is in its
    text and __cause__. Eagerly the same call raises the ValueError itself."""
    layout = WindowLayout.causal(8)
    q = torch.randn(1, 2, 8, 4)
    torch._dynamo.reset()
    f = torch.compile(lambda x: window_attention(x, x, x, layout, scale=-1.0), fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        f(q)
    assert "Observed exception" in str(info.value)
    assert "ValueError('scale: expected a positive finite number" in str(info.value)
    assert "scale: expected a positive finite number" in repr(info.value.__cause__)
    with pytest.raises(ValueError, match="^scale: expected a positive finite number"):
        window_attention(q, q, q, layout, scale=-1.0)

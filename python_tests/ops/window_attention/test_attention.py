"""window_attention: composite backend vs the dense-mask reference, forward and backward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.attention import assert_within_2x_torch_error, compare_with_reference, make_qkv
from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.layouts import zoo
from kforcing_kernels.ops.window_attention import lse_attention as _lse_attention
from kforcing_kernels.ops.window_attention.composite import pieces as composite

LAYOUTS = zoo.small()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composite_matches_reference_fp32(name):
    ours, ref64, _ = compare_with_reference(LAYOUTS[name], "composite")
    for label, a, b in zip(("out", "dq", "dk", "dv"), ours, ref64):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=label)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "name", ["single_k3_odd", "double_k2", "sbd_short_last", "ptp_per_batch", "jacobi", "sbd_large_block"]
)
def test_composite_low_precision_within_2x_torch_error(name, dtype):
    """Our error vs fp64 is at most 2x PyTorch's own low-precision error (plus a floor)."""
    ours, ref64, ref_lp = compare_with_reference(LAYOUTS[name], "composite", dtype=dtype)
    assert_within_2x_torch_error(ours, ref64, ref_lp, dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_composite_head_dims_and_gqa(head_dim, heads, kv_heads):
    ours, ref64, _ = compare_with_reference(
        WindowLayout.kforcing_single(12, 4), "composite", heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    for a, b in zip(ours, ref64):
        torch.testing.assert_close(a.double(), b, atol=3e-5, rtol=3e-5)


def test_lse_matches_reference():
    layout = LAYOUTS["double_k2"]
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, dtype=torch.float64, requires_grad=False)
    out, lse = window_attention(q, k, v, layout, backend="composite", return_lse=True)
    ref_out, ref_lse = window_attention(q, k, v, layout, backend="reference", return_lse=True)
    assert lse.shape == (2, 4, layout.n_queries) and lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out)


def test_gradcheck_float64():
    layout = WindowLayout(5, 3, 3, [0, 1, 2], [2, 4, 5], last_window_size=2, intra="causal")
    q, k, v = make_qkv(layout, batch=1, heads=2, kv_heads=1, head_dim=4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: window_attention(q, k, v, layout, backend="composite"), (q, k, v))


def test_gradcheck_staircase_fast_path():
    layout = WindowLayout.kforcing_double(3, 2)
    assert composite.is_staircase(layout)
    q, k, v = make_qkv(layout, batch=1, heads=2, kv_heads=2, head_dim=4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: window_attention(q, k, v, layout, backend="composite"), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["single_k3_odd", "sbd_short_last", "ptp_per_batch"])
def test_huge_scores_stay_finite(name, dtype):
    """|q.k| ~ 1e4 before scaling: outputs and gradients are finite, never NaN/inf."""
    layout = LAYOUTS[name]
    batch = layout.batch_size or 1
    q, k, v = make_qkv(layout, batch=batch, heads=2, head_dim=16, dtype=dtype, scale_std=25.0)
    raw = (q.double() @ k.double().transpose(-1, -2)).abs().max().item()
    assert raw > 5e3
    out = window_attention(q, k, v, layout, backend="composite")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for t in (out, *grads):
        assert torch.isfinite(t).all()


def test_portable_math_path_matches_flash_cpu():
    """The non-CPU code path (fp32 matmul) agrees with PyTorch's CPU flash kernel."""
    q = torch.randn(2, 4, 37, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 41, 16, dtype=torch.float64)
    v = torch.randn(2, 2, 41, 16, dtype=torch.float64)
    allowed = torch.rand(2, 1, 37, 41) > 0.3
    allowed[:, :, 3] = False  # a row that sees nothing
    dout = torch.randn(2, 4, 37, 16, dtype=torch.float64)
    for causal, mask in ((True, None), (False, allowed)):
        o1, l1 = _lse_attention.attend(q, k, v, causal=causal, scale=0.3, allowed=mask)
        o2, l2 = _lse_attention.attend(q, k, v, causal=causal, scale=0.3, allowed=mask, force_math=True)
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(l1, l2)
        if mask is not None:
            assert torch.isinf(l1[:, :, 3]).all() and (o1[:, :, 3] == 0).all()
            continue
        g1 = _lse_attention.attend_backward(dout, q, k, v, o1, l1, causal=causal, scale=0.3)
        g2 = _lse_attention.attend_backward(dout, q, k, v, o1, l1, causal=causal, scale=0.3, force_math=True)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b)


def test_composite_portable_path_end_to_end(monkeypatch):
    """The whole composite backend on the portable path (as on a non-CPU device)."""
    monkeypatch.setattr(_lse_attention, "_use_flash_cpu", lambda q: False)
    for name in ("single_k3_odd", "ptp_per_batch", "sbd_large_block"):
        ours, ref64, _ = compare_with_reference(LAYOUTS[name], "composite")
        for a, b in zip(ours, ref64):
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("loop_per_head", [True, False])
@pytest.mark.parametrize(
    "name",
    [
        "single_k3_odd",
        "double_k2",
        "sbd_short_last",
        "ptp_per_batch",
        "general_streams_full",
        "ptp_doc_ends",
        "double_packed",
    ],
)
def test_composite_intra_loop_and_batched_paths(monkeypatch, name, loop_per_head):
    """Both intra-window product paths (per-head bmm loop on CPU, batched matmul elsewhere) match the reference."""
    monkeypatch.setattr(composite, "_loop_per_head", lambda x: loop_per_head)
    ours, ref64, _ = compare_with_reference(LAYOUTS[name], "composite", heads=6, kv_heads=2)
    for a, b in zip(ours, ref64):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_default_backend_is_available_and_used():
    status = backends_available()
    assert status["reference"] is None and status["composite"] is None
    layout = LAYOUTS["single_k3_odd"]
    q, k, v = make_qkv(layout, requires_grad=False)
    torch.testing.assert_close(
        window_attention(q, k, v, layout), window_attention(q, k, v, layout, backend="reference"), atol=2e-5, rtol=2e-5
    )


def test_default_backend_skips_backends_that_cannot_take_the_inputs(monkeypatch):
    """On CUDA, triton takes fp16/bf16 and D in {32, 64, 128}; anything else defaults to composite."""
    from kforcing_kernels.ops.window_attention import backends
    from kforcing_kernels.ops.window_attention import triton as triton_backend

    monkeypatch.delenv("KFORCING_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real_load = backends.REGISTRY.load
    monkeypatch.setattr(
        backends.REGISTRY, "load", lambda name: (triton_backend, None) if name == "triton" else real_load(name)
    )
    cuda = torch.device("cuda")
    assert backends.default_backend(cuda, torch.bfloat16, 64) == "triton"
    assert backends.default_backend(cuda, torch.float32, 64) == "composite"
    assert backends.default_backend(cuda, torch.float16, 80) == "composite"


def test_torch_compile_matches_eager():
    layout = LAYOUTS["double_k2"]
    q, k, v = make_qkv(layout, batch=1, heads=2, kv_heads=1)

    def f(q, k, v):
        return window_attention(q, k, v, layout, backend="composite").square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_loss = f(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- random general layouts


# Every compiled CPU backend present here is held to the same random layouts.
CPU_BACKENDS = [name for name in ("composite", "cpp") if backends_available()[name] is None]


@st.composite
def general_layouts(draw):
    n_ctx = draw(st.integers(0, 12))
    n_streams = draw(st.sampled_from([1, 1, 2, 3]))
    slots = draw(st.integers(1, 4))
    window = n_streams * slots
    num_windows = draw(st.integers(0 if n_ctx else 1, 5))
    queries = draw(st.sampled_from(["all", "windows"])) if num_windows else "all"
    last = window if n_streams > 1 or not num_windows else draw(st.integers(1, window))
    per_batch = draw(st.booleans())
    shape = (2, num_windows) if per_batch else (num_windows,)
    los, his = [], []
    for _ in range(math.prod(shape)):
        a, b = sorted(draw(st.integers(0, n_ctx)) for _ in range(2))
        los.append(a)
        his.append(b)
    lo = torch.tensor(los, dtype=torch.int64).view(shape)
    hi = torch.tensor(his, dtype=torch.int64).view(shape)
    return WindowLayout(
        n_ctx,
        num_windows,
        window,
        lo,
        hi,
        last_window_size=last,
        intra=draw(st.sampled_from(["causal", "full"])),
        queries=queries,
        n_streams=n_streams,
    )


@settings(max_examples=40, deadline=None)
@given(layout=general_layouts())
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_random_layouts_match_reference(backend, layout):
    ours, ref64, _ = compare_with_reference(layout, backend, heads=2, kv_heads=1, head_dim=8)
    for a, b in zip(ours, ref64):
        torch.testing.assert_close(a.double(), b, atol=3e-5, rtol=3e-5)


@settings(max_examples=40, deadline=None)
@given(layout=general_layouts())
def test_random_layouts_num_pairs(layout):
    expected = layout.dense_mask().flatten(-2).sum(-1)
    got = layout.num_pairs()
    assert torch.equal(torch.as_tensor(got), expected)


# ---------------------------------------------------------------- validation


def _valid():
    layout = WindowLayout.kforcing_single(4, 2)
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, requires_grad=False)
    return q, k, v, layout


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda q, k, v, lay: (q[0], k, v, lay, {}), "q: expected rank 4"),
        (lambda q, k, v, lay: (q, k[0], v, lay, {}), "k: expected rank 4"),
        (lambda q, k, v, lay: (q, k, v[..., :8], lay, {}), "v: expected the shape of k"),
        (lambda q, k, v, lay: (q[:, :, :-1], k, v, lay, {}), r"q: expected length 12 \(layout.n_queries\), got 11"),
        (
            lambda q, k, v, lay: (q, k[:, :, :-1], v[:, :, :-1], lay, {}),
            r"k: expected length 12 \(layout.n_keys\), got 11",
        ),
        (lambda q, k, v, lay: (q, k.half(), v.half(), lay, {}), "k, v: expected dtype torch.float32"),
        (lambda q, k, v, lay: (q.int(), k, v, lay, {}), "q: expected dtype in"),
        (lambda q, k, v, lay: (q[:, :3], k, v, lay, {}), "q: expected a head count that is a multiple of k's 2"),
        (lambda q, k, v, lay: (q, k[:1], v[:1], lay, {}), "k: expected batch 2"),
        (lambda q, k, v, lay: (q, k[..., :8], v[..., :8], lay, {}), "k: expected head dim 16"),
        (lambda q, k, v, lay: (q, k, v, lay, {"backend": "cudnn"}), "backend: expected one of"),
        (lambda q, k, v, lay: (q, k, v, "single", {}), "layout: expected a WindowLayout"),
        (lambda q, k, v, lay: (q, k, v, lay, {"scale": -1.0}), "scale: expected a positive"),
        (
            lambda q, k, v, lay: (
                q,
                k,
                v,
                WindowLayout(4, 4, 2, torch.zeros(3, 4, dtype=torch.long), torch.arange(1, 5).repeat(3, 1)),
                {},
            ),
            "layout: expected per-batch ranges for batch 2, got 3",
        ),
        (lambda q, k, v, lay: (q, k.to("meta"), v.to("meta"), lay, {}), "k, v: expected device"),
    ],
)
def test_validation_errors_name_the_argument(mutate, needle):
    q, k, v, layout, kwargs = mutate(*_valid())
    with pytest.raises(ValueError, match=needle):
        window_attention(q, k, v, layout, **kwargs)


def test_absent_backend_says_why():
    status = backends_available()
    for name, reason in status.items():
        if reason is not None:
            q, k, v, layout = _valid()
            with pytest.raises(RuntimeError, match=f"backend '{name}' is not available"):
                window_attention(q, k, v, layout, backend=name)


def test_a_bad_backend_switch_names_the_environment_variable(monkeypatch):
    """KFORCING_BACKEND=<typo> is a clear error that names the switch, not the backend= argument."""
    layout = LAYOUTS["single_k3_odd"]
    q, k, v = make_qkv(layout, requires_grad=False)
    monkeypatch.setenv("KFORCING_BACKEND", "CPP")
    with pytest.raises(ValueError, match="KFORCING_BACKEND: expected one of"):
        window_attention(q, k, v, layout)
    monkeypatch.setenv("KFORCING_BACKEND", "reference")
    torch.testing.assert_close(
        window_attention(q, k, v, layout), window_attention(q, k, v, layout, backend="reference")
    )

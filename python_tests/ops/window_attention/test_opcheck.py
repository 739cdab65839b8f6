"""The two custom ops under torch.library.opcheck: fake kernels describe exactly what the real ones return.

Inputs are deliberately not contiguous (transposed from [B, L, H, D], stride-0
expanded heads, GQA): the real kernels return contiguous tensors whatever the
input strides, and the fake kernels must say so or Inductor asserts on strides.
"""

import pytest
import torch

from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.ops.window_attention import backend_limits
from kforcing_kernels.ops.window_attention.op import layout_args

# Backends with a limit (flex: no CPU backward) are not CPU backends for these fwd + bwd checks.
CPU_BACKENDS = [
    name for name, reason in backends_available().items() if reason is None and name not in backend_limits()
]
LAYOUTS = {
    "single": WindowLayout.kforcing_single(4, 2),
    "double": WindowLayout.kforcing_double(3, 2),
    "per_batch": WindowLayout(
        3, 2, 3, torch.tensor([[0, 1], [1, 3]]), torch.tensor([[2, 3], [3, 3]]), last_window_size=2
    ),
}


def _strided(kind, b, h, n, d, dtype=torch.float32):
    """[b, h, n, d] with the strides of ``kind``."""
    if kind == "contiguous":
        return torch.randn(b, h, n, d, dtype=dtype)
    if kind == "transposed":  # HF's [B, L, H, D] projections viewed as [B, H, L, D]
        return torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2)
    if kind == "expanded":  # one head broadcast over h (stride 0)
        return torch.randn(b, 1, n, d, dtype=dtype).expand(b, h, n, d)
    raise AssertionError(kind)


def _utils(kind, layout_name):
    # The AOT-dispatch check compiles (seconds each on 2 cores): run it on one layout per input kind.
    fast = ("test_schema", "test_autograd_registration", "test_faketensor")
    return fast + ("test_aot_dispatch_dynamic",) if layout_name == "single" else fast


def _inputs(layout, kind, heads=4, kv_heads=2, d=8, dtype=torch.float32):
    b = layout.batch_size or 2
    q = _strided(kind, b, heads, layout.n_queries, d, dtype)
    k = _strided(kind, b, kv_heads, layout.n_keys, d, dtype)
    v = _strided("transposed" if kind == "expanded" else kind, b, kv_heads, layout.n_keys, d, dtype)
    return q, k, v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["contiguous", "transposed", "expanded"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_forward_op_passes_opcheck(backend, kind, layout_name):
    layout = LAYOUTS[layout_name]
    q, k, v = (t.requires_grad_() for t in _inputs(layout, kind))
    args = (q, k, v, *layout_args(layout), 0.35, backend)
    torch.library.opcheck(
        torch.ops.kforcing_kernels.window_attention.default, args, test_utils=_utils(kind, layout_name)
    )
    out, lse = torch.ops.kforcing_kernels.window_attention(*args)
    assert out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["contiguous", "transposed", "expanded"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_backward_op_passes_opcheck(backend, kind, layout_name):
    layout = LAYOUTS[layout_name]
    q, k, v = _inputs(layout, kind)
    lay = layout_args(layout)
    out, lse = torch.ops.kforcing_kernels.window_attention(q, k, v, *lay, 0.35, backend)
    dout = _strided(kind if kind != "expanded" else "transposed", q.shape[0], q.shape[1], q.shape[2], q.shape[3])
    args = (dout, q, k, v, out, lse, *lay, 0.35, backend)
    torch.library.opcheck(
        torch.ops.kforcing_kernels.window_attention_backward.default, args, test_utils=_utils(kind, layout_name)
    )
    for g in torch.ops.kforcing_kernels.window_attention_backward(*args):
        assert g.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_opcheck_other_dtypes(dtype):
    layout = LAYOUTS["single"]
    q, k, v = (t.requires_grad_() for t in _inputs(layout, "transposed", dtype=dtype))
    for backend in CPU_BACKENDS:
        torch.library.opcheck(
            torch.ops.kforcing_kernels.window_attention.default,
            (q, k, v, *layout_args(layout), 0.35, backend),
            test_utils=_utils("transposed", "double"),
        )


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "reference"])
def test_double_backward_says_it_is_not_supported(backend):
    layout = LAYOUTS["single"]
    q, k, v = (t.requires_grad_() for t in _inputs(layout, "contiguous"))
    out = window_attention(q, k, v, layout, backend=backend)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported by window_attention"):
        dq.sum().backward()


def test_first_order_grads_still_work_with_create_graph():
    # create_graph=True alone (e.g. a gradient penalty elsewhere) must not raise.
    layout = LAYOUTS["single"]
    q, k, v = (t.requires_grad_() for t in _inputs(layout, "contiguous"))
    out = window_attention(q, k, v, layout, backend="composite")
    grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    want = torch.autograd.grad(window_attention(q, k, v, layout, backend="reference").sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_eager_fast_path_equals_the_custom_op_bit_for_bit(backend, layout_name):
    """Plain eager calls skip the custom op (host overhead) and must give exactly what the op gives."""
    from kforcing_kernels.ops.window_attention import op

    layout = LAYOUTS[layout_name]
    q, k, v = (t.requires_grad_() for t in _inputs(layout, "transposed"))
    dout = torch.randn(q.shape)
    op.clear_eager_cache()
    out, lse = window_attention(q, k, v, layout, backend=backend, return_lse=True)
    assert op.eager_cache_info().size == 1, "a plain eager call should take the fast path (the autograd.Function)"
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse = torch.ops.kforcing_kernels.window_attention(q, k, v, *layout_args(layout), 1 / 8**0.5, backend)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    for a, b in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        assert torch.equal(a, b)


def test_fake_tensors_and_modes_take_the_custom_op():
    """Under FakeTensorMode (or any dispatch / torch-function mode) the op's fake kernel answers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kforcing_kernels.ops.window_attention import op

    layout = LAYOUTS["double"]
    with FakeTensorMode(allow_non_fake_inputs=True):  # the layout's range tensors are real
        q, k, v = _inputs(layout, "transposed")
        assert not op._plain_eager(q, k, v)
        out = window_attention(q, k, v, layout, backend="reference")
    assert out.shape == q.shape and out.is_contiguous()
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not op._plain_eager(*_inputs(layout, "contiguous"))
    assert op._plain_eager(*_inputs(layout, "contiguous"))

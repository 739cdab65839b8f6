"""window_attention's eager fast path, observed through op.eager_cache_info: a validated plain eager call's
resolution is cached under a key of everything its checks read; a hit gives the general path's results, and an
input that differs in any checked property misses and is refused by name, as on a first call. CPU backends (the
path is the same for every backend; the triton launchers' side is python_tests/ops/window_attention/triton/)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.window_attention import op


@pytest.fixture(autouse=True)
def _fresh_cache():
    op.clear_eager_cache()
    yield
    op.clear_eager_cache()


def _size_and_hits() -> tuple[int, int]:
    info = op.eager_cache_info()
    assert info.max_size == op.EAGER_CACHE_MAX and len(info.backends) == info.size
    return info.size, info.hits


def _qkv(layout, dtype=torch.float32, d=16, batch=2, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, layout.n_queries, d, generator=g, dtype=dtype).requires_grad_(True)
    k = torch.randn(batch, kv_heads, layout.n_keys, d, generator=g, dtype=dtype).requires_grad_(True)
    v = torch.randn(batch, kv_heads, layout.n_keys, d, generator=g, dtype=dtype).requires_grad_(True)
    return q, k, v


def _fwd_bwd(q, k, v, layout, **kw):
    out, lse = window_attention(q, k, v, layout, return_lse=True, **kw)
    dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("backend", ["composite", "reference", None])
def test_a_cached_call_gives_the_general_paths_results(backend):
    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)
    # The oracle: the float64 reference.
    ref = _fwd_bwd(*(t.detach().double().requires_grad_(True) for t in (q, k, v)), layout, backend="reference")
    op.clear_eager_cache()
    first = _fwd_bwd(q, k, v, layout, backend=backend)
    assert _size_and_hits() == (1, 0)
    again = _fwd_bwd(q, k, v, layout, backend=backend)  # a hit
    assert _size_and_hits() == (1, 1)
    for a, b, r in zip(first, again, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-5)


def test_scale_and_strides_are_part_of_the_key():
    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)
    ref = _fwd_bwd(
        *(t.detach().double().requires_grad_(True) for t in (q, k, v)), layout, backend="reference", scale=0.5
    )
    op.clear_eager_cache()
    base = _fwd_bwd(q, k, v, layout, backend="composite")
    scaled = _fwd_bwd(q, k, v, layout, backend="composite", scale=0.5)
    assert op.eager_cache_info().size == 2 and not torch.equal(base[0], scaled[0])
    torch.testing.assert_close(scaled[0].double(), ref[0], atol=1e-5, rtol=1e-5)
    # The same values through a transposed layout in memory: another key, the same numbers.
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    assert qt.shape == q.shape and qt.stride() != q.stride()
    strided = _fwd_bwd(qt, k, v, layout, backend="composite")
    assert _size_and_hits() == (3, 0)  # three keys, no hit
    for a, b in zip(base, strided):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bad_inputs_are_still_refused_by_name_after_a_cached_call():
    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)
    window_attention(q, k, v, layout, backend="composite")
    window_attention(q, k, v, layout, backend="composite")  # cached
    with pytest.raises(ValueError, match=r"^k, v: expected dtype"):  # same shapes, another dtype
        window_attention(q, k.double(), v, layout, backend="composite")
    with pytest.raises(ValueError, match=r"^k, v: expected device"):  # same shapes, another device
        window_attention(q, torch.empty(k.shape, device="meta"), v, layout, backend="composite")
    with pytest.raises(ValueError, match=r"^q: expected length"):  # another layout with the same shapes of k
        window_attention(q, k, v, WindowLayout.kforcing_single(21, 4), backend="composite")
    with pytest.raises(ValueError, match=r"^layout: expected per-batch ranges"):
        per_batch = WindowLayout(20, 20, 4, torch.zeros(3, 20, dtype=torch.long), torch.full((3, 20), 20))
        window_attention(q, k, v, per_batch, backend="composite")
    with pytest.raises(ValueError, match=r"^scale:"):
        window_attention(q, k, v, layout, backend="composite", scale=-1.0)
    with pytest.raises(ValueError, match=r"^scale:"):
        window_attention(q, k, v, layout, backend="composite", scale=float("nan"))
    with pytest.raises(ValueError, match=r"^backend:"):
        window_attention(q, k, v, layout, backend="tritn")
    with pytest.raises(ValueError, match=r"^q: expected rank 4"):
        window_attention(q[0], k, v, layout, backend="composite")
    with pytest.raises(ValueError, match=r"^layout: expected a WindowLayout"):
        window_attention(q, k, v, "single", backend="composite")
    with pytest.raises(ValueError, match=r"^q: expected a head count"):  # GQA: 3 heads over 2 kv heads
        window_attention(q[:, :3], k, v, layout, backend="composite")
    assert op.eager_cache_info().size == 1  # nothing refused was cached


def test_the_environment_switches_are_part_of_the_key(monkeypatch):
    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)
    monkeypatch.delenv("KFORCING_BACKEND", raising=False)
    window_attention(q, k, v, layout)
    assert op.eager_cache_info().backends == (op.default_backend_for(q.device, q.dtype, 16, layout),)
    monkeypatch.setenv("KFORCING_BACKEND", "reference")
    window_attention(q, k, v, layout)
    assert op.eager_cache_info().backends[1:] == ("reference",) and op.eager_cache_info().hits == 0
    monkeypatch.setenv("KFORCING_BACKEND", "bogus")
    with pytest.raises(ValueError, match="KFORCING_BACKEND"):
        window_attention(q, k, v, layout)


def test_modes_and_non_tensors_take_the_general_path():
    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    window_attention(q, k, v, layout, scale=1.0, backend="composite")  # plain: cached
    assert _size_and_hits() == (1, 0)
    with Passthrough():  # the same call under a mode: the general path, although its key is cached
        window_attention(q, k, v, layout, scale=1.0, backend="composite")
    # An int scale equals (and hashes as) the cached float 1.0, yet is not a float: the general path too.
    window_attention(q, k, v, layout, scale=1, backend="composite")
    rows = layout.restrict_rows(torch.arange(5))  # a QueryRowsLayout: eager, never cached
    window_attention(q[:, :, :5], k, v, rows, backend="composite")
    assert _size_and_hits() == (1, 0)
    window_attention(q, k, v, layout, scale=1.0, backend="composite")  # plain again: the hit
    assert _size_and_hits() == (1, 1)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(op, "EAGER_CACHE_MAX", 4)
    for n in range(8, 16):
        layout = WindowLayout.kforcing_single(n, 4)
        window_attention(*_qkv(layout), layout, backend="composite")
        assert op.eager_cache_info()[:2] == (min(n - 7, 4), 4)  # (size, max_size)
    assert op.eager_cache_info().size == 4


def test_a_backend_function_replaced_after_a_cached_call_is_the_one_that_runs(monkeypatch):
    from kforcing_kernels.ops.window_attention import composite

    layout = WindowLayout.kforcing_single(20, 4)
    q, k, v = _qkv(layout)
    window_attention(q, k, v, layout, backend="composite")  # cached
    calls, real = [], composite.forward
    monkeypatch.setattr(composite, "forward", lambda *a: calls.append(1) or real(*a))
    window_attention(q, k, v, layout, backend="composite")
    assert calls == [1] and _size_and_hits() == (1, 1)

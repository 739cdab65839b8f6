import os

import pytest
import torch

# Tests are CPU-only and deterministic; keep thread count small like CI's 2 cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# KFORCING_REQUIRE_EXT=1 (set by .ci/run): the C++ extension is expected. Without it the
# cpp tests skip and the backend lists silently drop "cpp", so a failed build would leave
# CI green; with it, a missing extension ends the session with an error and any skip that
# names the extension becomes a failure. An explicit KFORCING_DISABLE_EXT=1 (the fallback
# subprocess runs) means the extension is not expected.
REQUIRE_ENV = "KFORCING_REQUIRE_EXT"
_EXT_SKIP_MARKERS = ("cpp backend", "C++ extension", "kforcing_kernels._C")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def extension_required() -> bool:
    return _flag(REQUIRE_ENV) and not _flag("KFORCING_DISABLE_EXT")


def extension_problem():
    """None when the cpp backend is usable, else why not."""
    from kforcing_kernels import backends_available

    return backends_available()["cpp"]


def pytest_sessionstart(session):
    if extension_required() and extension_problem() is not None:
        pytest.exit(f"{REQUIRE_ENV}=1 but the C++ extension is not usable: {extension_problem()}", returncode=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and extension_required():
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(m in reason for m in _EXT_SKIP_MARKERS):
            report.outcome = "failed"
            report.longrepr = f"{REQUIRE_ENV}=1 turns this skip into a failure: {reason}"


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


def compare_with_reference(layout, backend, *, dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, batch=None):
    """(ours, ref64, ref_lp): (out, dq, dk, dv) of ``backend``, of the ``reference`` backend on the
    same inputs in float64, and of ``reference`` in ``dtype`` (PyTorch's own error at that precision)."""
    from kforcing_kernels import window_attention

    batch = layout.batch_size or batch or 2
    q, k, v = make_qkv(layout, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    dout = torch.randn(batch, heads, layout.n_queries, head_dim, dtype=torch.float64)
    ours = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend=backend), q, k, v, dout)
    ref64 = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend="reference"), *(t.double() for t in (q, k, v)), dout)
    # PyTorch's own error at this precision: SDPA with the dense mask, differentiated by autograd.
    from kforcing_kernels.ops.window_attention import reference

    scale = q.shape[-1] ** -0.5
    ref_lp = run_with_grads(lambda q, k, v: reference.attention(q, k, v, layout, scale, with_lse=False)[0], q, k, v, dout)
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


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz_long: the long random-layout fuzzer (run with -m fuzz_long; counts from KFORCING_FUZZ_COUNT)")


def pytest_collection_modifyitems(config, items):
    # The long fuzzer runs only when selected explicitly with -m fuzz_long.
    if "fuzz_long" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="long fuzzer: run with -m fuzz_long")
    for item in items:
        if "fuzz_long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def isolated_cache(tmp_path_factory):
    """KFORCING_CACHE in a fresh folder for the module (tokenizer and dataset caches never shared)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield

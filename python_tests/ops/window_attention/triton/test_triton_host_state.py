"""The triton backend's cached host path on CPU: the launchers' host state (tiles, plan, device copies) cached
per layout/shape/device/stream/switches, device copies a CUDA-graph capture finds without uploading, and the
op's eager fast path handing Triton's launcher exactly what the checked launchers do (bench/gpu/triton_stub_driver.py
as Triton's driver: kernels compile for sm_90a, launches are recorded, not run)."""

import gc

import pytest
import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.window_attention import op
from kforcing_kernels.ops.window_attention.triton import plan as plan_mod
from kforcing_kernels.ops.window_attention.triton import plan_device
from kforcing_kernels.ops.window_attention.triton import steps as steps_mod

triton = pytest.importorskip("triton")
from kforcing_kernels.ops.window_attention.triton import launch  # noqa: E402
from kforcing_kernels.tools import aot_report  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("KFORCING_TRITON_TILES", raising=False)
    launch.clear_host_states()
    op.clear_eager_cache()
    yield
    launch.clear_host_states()
    op.clear_eager_cache()
    plan_device.clear_device_copies(captured=True)  # CPU copies only: no graph was captured


def _copies() -> tuple[int, int]:
    """(latest, captured) device copies plan_device keeps."""
    info = plan_device.device_copies_info()
    return info.latest, info.captured


def _q(layout, d=64, batch=2, heads=4, dtype=torch.float16):
    return torch.zeros(batch, heads, layout.n_queries, d, dtype=dtype)


def test_host_state_is_cached_per_key_and_follows_the_switches(monkeypatch):
    layout = WindowLayout.kforcing_single(200, 4)
    q = _q(layout)
    state = launch.host_state(layout, q)
    assert launch.host_state(layout, q) is state
    assert launch.host_state(layout, _q(layout, batch=5)) is state  # batch and heads: not in the plan
    assert state.plan is plan_mod.tile_plan(layout, state.tiles)
    assert launch.host_state(WindowLayout.kforcing_single(200, 4), q) is not state  # another layout
    assert launch.host_state(layout, _q(layout, d=32)).tiles == launch.tiles_for(32)
    monkeypatch.setenv("KFORCING_TRITON_TILES", "hopper")  # a switch the tiles depend on: another state
    forced = launch.host_state(layout, q)
    assert forced is not state and forced.tile_set == "hopper" and forced.tiles == launch.TILE_SETS["hopper"][64]
    monkeypatch.delenv("KFORCING_TRITON_TILES")
    assert launch.host_state(layout, q) is state
    # Explicit tiles or counters: built for the call, never cached.
    n = launch.host_state_info().size
    assert launch.host_state(layout, q, launch.TILE_SETS["base"][64]) is not state
    assert launch.host_state_info().size == n


def test_host_states_are_bounded(monkeypatch):
    monkeypatch.setattr(launch, "HOST_STATE_MAX", 3)
    for n in range(40, 46):
        layout = WindowLayout.kforcing_single(n, 4)
        launch.host_state(layout, _q(layout))
        assert launch.host_state_info()[:2] == (min(n - 39, 3), 3)


def test_a_capture_uses_the_warm_up_copies_and_never_uploads(monkeypatch):
    layout = WindowLayout.kforcing_single(96, 4)
    tiles = launch.tiles_for(64)
    plan = plan_mod.tile_plan(layout, tiles)
    steps = steps_mod.step_plan(layout, plan)
    cpu = torch.device("cpu")
    plan_device.clear_device_copies(captured=True)
    monkeypatch.setattr(plan_device, "stream_id", lambda device: 11)  # the warm-up's stream
    warm = plan_device.device_plan(plan, layout, cpu)
    warm_steps = steps_mod.device_steps(steps, layout, tiles, cpu)
    assert _copies() == (2, 0)  # latest: the plan's and the steps' copies
    # A capture on another stream: the warm-up's copies (another stream would upload new ones), and they stay
    # alive for the process.
    monkeypatch.setattr(plan_device, "stream_id", lambda device: 22)
    monkeypatch.setattr(plan_device, "_capturing", lambda device: True)  # no CUDA graph on CPU: planted
    assert plan_device.device_plan(plan, layout, cpu) is warm
    assert steps_mod.device_steps(steps, layout, tiles, cpu) is warm_steps
    assert _copies() == (2, 2)
    # The same for an equal layout made later (copies are keyed by content) once the latest copies are forgotten.
    twin = WindowLayout.kforcing_single(96, 4)
    plan_device.clear_device_copies()
    assert plan_device.device_plan(plan_mod.tile_plan(twin, tiles), twin, cpu) is warm
    # A layout no call has warmed up: refused, naming the capture and the fix, instead of a copy inside the graph.
    cold = WindowLayout.kforcing_single(97, 4)
    with pytest.raises(RuntimeError, match="capturing a CUDA graph.*warm-up"):
        plan_device.device_plan(plan_mod.tile_plan(cold, tiles), cold, cpu)
    assert _copies() == (0, 2)


def _launch_record(record):
    name, grid, stream, _function, args = record
    return name, grid, stream, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.skipif(launch.interpreting(), reason="kernels were built for the interpreter")
@pytest.mark.skipif(aot_report.tools_missing() is not None, reason=f"{aot_report.tools_missing()}")
def test_the_eager_fast_path_launches_what_the_checked_launchers_do(monkeypatch):
    from bench.gpu.triton_host_cost import triton_op_on_cpu
    from bench.gpu.triton_stub_driver import stub_driver

    monkeypatch.setenv("KFORCING_TRITON_AUTOTUNE", "0")
    layout = WindowLayout.kforcing_single(128, 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, layout.n_queries, 64, generator=g).to(torch.bfloat16).requires_grad_(True) for _ in range(3)
    )
    dout = torch.randn_like(q)
    records = []
    with stub_driver() as driver, triton_op_on_cpu():
        driver.on_launch = lambda *launched: records.append(_launch_record(launched))
        out, lse = launch.attention_forward(q.detach(), k.detach(), v.detach(), layout, 0.125)
        launch.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, layout, 0.125)
        checked = list(records)
        for _ in range(3):  # the first call validates and caches, the next ones hit
            records.clear()
            torch.autograd.grad(window_attention(q, k, v, layout, scale=0.125, backend="triton"), (q, k, v), dout)
            assert records == checked
        assert (op.eager_cache_info().size, op.eager_cache_info().hits) == (
            1,
            2,
        )  # one entry; the two calls after the first hit
        # The same shapes in another dtype or head count: refused by name, as on a first call.
        with pytest.raises(ValueError, match=r"^q: the triton backend takes dtype"):
            window_attention(q.detach().float(), k.detach().float(), v.detach().float(), layout, backend="triton")
        with pytest.raises(ValueError, match=r"^q: the triton backend supports head dims"):
            q48 = torch.zeros(1, 2, layout.n_queries, 48, dtype=torch.bfloat16)
            window_attention(q48, q48, q48, layout, backend="triton")
        records.clear()
        launch._direct.clear()  # free the stub-loaded kernels while the stub is Triton's driver
        gc.collect()

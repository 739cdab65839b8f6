"""How the triton backend picks tiles and autotune keys, guards devices and bounds int32 offsets (CPU),
and that the H100-class "wide" tiles compute the right thing in Triton's interpreter (subprocess)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from helpers import REPO
from kforcing_kernels import WindowLayout  # noqa: E402
from kforcing_kernels.ops.window_attention.triton import configs, launch  # noqa: E402
from kforcing_kernels.ops.window_attention.triton.plan import tile_plan  # noqa: E402

ROOT = str(REPO)


@pytest.fixture
def env(monkeypatch):
    for var in ("KFORCING_TRITON_TILES", "KFORCING_TRITON_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_length_bucket_is_the_clamped_next_power_of_two():
    assert [configs.length_bucket(n) for n in (1, 300, 1024, 1025, 2048, 5000, 8192, 8193, 10**7)] == [
        1024,
        1024,
        1024,
        2048,
        2048,
        8192,
        8192,
        16384,
        16384,
    ]


def test_wide_tiles_only_for_d128_long_rows_on_hopper(env):
    env.setattr(configs, "_capabilities", {0: (9, 0), 1: (8, 0)})
    hopper, ampere = torch.device("cuda:0"), torch.device("cuda:1")
    assert configs.tile_set_for(128, configs.WIDE_MIN_ROWS, hopper) == "wide"
    assert configs.tiles_for(128, 8192, hopper) == configs.TILE_SETS["wide"][128]
    assert configs.tile_set_for(128, configs.WIDE_MIN_ROWS - 1, hopper) == "base"
    assert configs.tile_set_for(128, 8192, ampere) == "base"
    assert configs.tile_set_for(64, 8192, hopper) == "hopper"  # D=64 on sm_90+: the 64-key dK/dV set
    assert configs.tile_set_for(64, 8192, ampere) == "base"
    assert configs.tile_set_for(128, 8192, torch.device("cpu")) == "base"
    env.setenv("KFORCING_TRITON_TILES", "base")
    assert configs.tile_set_for(128, 8192, hopper) == "base"
    env.setenv("KFORCING_TRITON_TILES", "wide")
    assert configs.tile_set_for(128, 16, hopper) == "wide" and configs.tile_set_for(32, 16, hopper) == "base"
    assert configs.tile_set_for(128, 8192, ampere) == "base"  # below the set's minimum capability: never forced
    assert configs.tile_set_for(128, 16, torch.device("cpu")) == "wide"  # the interpreter runs any set
    env.setenv("KFORCING_TRITON_TILES", "huge")
    with pytest.raises(ValueError, match="KFORCING_TRITON_TILES"):
        configs.tile_set_for(128)


def test_tune_key_separates_what_changes_the_best_config():
    q = torch.empty(1, 2, 3000, 128, device="meta")
    slot = tile_plan(WindowLayout.kforcing_single(600, 4), configs.TILE_SETS["base"][128])
    tiles = tile_plan(WindowLayout.kforcing_single(150, 19), configs.TILE_SETS["base"][128])
    full = tile_plan(WindowLayout.sbd(3000, 7), configs.TILE_SETS["base"][128])
    assert launch._tune_key("base", q, slot) == ("base", 128, 4096, "slot-causal")
    assert launch._tune_key("wide", q, tiles) == ("wide", 128, 4096, "tile-causal")
    assert launch._tune_key("base", q, full)[3] == "slot-full"
    assert launch._resolve_tiles(configs.TILE_SETS["wide"][128], q) == (configs.TILE_SETS["wide"][128], "wide")
    assert launch._resolve_tiles(configs.TILE_SETS["base"][128], q)[1] == "base"


def test_removed_kernel_switches_are_not_read():
    """KFORCING_TRITON_KERNELS (split / legacy kernels) and KFORCING_TRITON_PREFETCH (the non-prefetching dK/dV
    loop) were removed after the H200 run: nothing reads them, so a stale setting changes nothing."""
    from kforcing_kernels import env

    for name in ("KFORCING_TRITON_KERNELS", "KFORCING_TRITON_PREFETCH"):
        assert name not in (env.__doc__ or "")
    assert set(launch.KERNELS) == {"fwd", "delta", "bwd"}
    assert not hasattr(configs, "kernel_variant") and not hasattr(configs, "prefetch_enabled")


def test_launches_per_forward_and_backward(monkeypatch):
    """3 launches per forward + backward whether the windows take slot steps (k = 4) or tile products
    (k = 32), with the tiles of every set. The kernel launcher is replaced by a recorder: what is counted is
    what the launchers ask for."""
    monkeypatch.setenv("KFORCING_TRITON_KERNELS", "split")  # removed switch: ignored
    launched = []
    monkeypatch.setattr(
        launch, "_launch", lambda name, grid, *a, **kw: launched.append(name) if grid[0] * grid[1] else None
    )
    expected = ["fwd", "delta", "bwd"]
    for k in (4, 32):
        layout = WindowLayout.kforcing_single(300, k)
        assert bool(tile_plan(layout, launch.tiles_for(64, layout.n_queries)).intra_blocks) == (k == 4)
        q = torch.randn(1, 2, layout.n_queries, 64)
        kv = torch.randn(1, 2, layout.n_keys, 64)
        launched.clear()
        out, lse = launch.attention_forward(q, kv, kv, layout, 0.125)
        launch.attention_backward(q, q, kv, kv, out, lse, layout, 0.125)
        assert launched == expected
    # The D=128 sets too (the wide set's 128-row dQ programs take the window dot products in column pieces).
    layout = WindowLayout.kforcing_single(300, 4)
    q, kv = torch.randn(1, 2, layout.n_queries, 128), torch.randn(1, 2, layout.n_keys, 128)
    for name, by_d in configs.TILE_SETS.items():
        if 128 in by_d:
            launched.clear()
            out, lse = launch.attention_forward(q, kv, kv, layout, 0.125, tiles=by_d[128])
            launch.attention_backward(q, q, kv, kv, out, lse, layout, 0.125, tiles=by_d[128])
            assert launched == expected, name


def test_hopper_set_is_the_sm90_choice_at_d64(monkeypatch):
    monkeypatch.delenv("KFORCING_TRITON_TILES", raising=False)
    monkeypatch.setattr(configs, "_capability", lambda device: (9, 0) if device.index == 0 else (8, 0))
    hopper, ampere = torch.device("cuda", 0), torch.device("cuda", 1)
    assert configs.tile_set_for(64, 1024, hopper) == "hopper"
    assert configs.tile_set_for(64, 1024, ampere) == configs.tile_set_for(64, 1024) == "base"
    assert configs.tile_set_for(128, 1024, hopper) == "base" and configs.tile_set_for(128, 4096, hopper) == "wide"
    assert configs.dispatched_by_default("hopper", 64, 9) and not configs.dispatched_by_default("base", 64, 9)
    assert configs.dispatched_by_default("base", 64, 8) and not configs.dispatched_by_default("hopper", 64, 8)
    assert configs.dispatched_by_default("base", 128, 9) and configs.dispatched_by_default("base", 32, 9)


@pytest.mark.skipif(launch.interpreting(), reason="builds compiled-mode autotuners")
def test_autotuner_per_key_with_the_tables_configs(env):
    key = ("wide", 128, 8192, "slot-causal")
    tuner = launch._tuned_kernel("fwd", key)
    assert [(c.num_warps, c.num_stages) for c in tuner.configs] == configs.KERNEL_CONFIGS["fwd"][("wide", 128)]
    env.setenv("KFORCING_TRITON_AUTOTUNE", "0")  # deterministic: the first entry only, no timing
    assert not configs.autotune_enabled()
    assert [(c.num_warps, c.num_stages) for c in launch._tuned_kernel("fwd", key).configs] == configs.KERNEL_CONFIGS[
        "fwd"
    ][("wide", 128)][:1]
    env.setenv("KFORCING_TRITON_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="KFORCING_TRITON_AUTOTUNE"):
        configs.autotune_enabled()
    env.delenv("KFORCING_TRITON_AUTOTUNE")
    assert configs.autotune_enabled()  # no process group here


def test_candidate_tile_set_runs_only_when_forced(env):
    """hopper128 (128-key D=64 dK/dV programs, for the GPU A/B) is never picked nor held to the Hopper
    standard unforced; forced, it runs where the hopper set would."""
    env.setattr(configs, "_capabilities", {0: (9, 0), 1: (8, 0)})
    hopper, ampere = torch.device("cuda:0"), torch.device("cuda:1")
    assert "hopper128" in configs.FORCED_ONLY_TILE_SETS
    assert configs.tile_set_for(64, 8192, hopper) == "hopper"
    assert not configs.dispatched_by_default("hopper128", 64, 9)
    env.setenv("KFORCING_TRITON_TILES", "hopper128")
    assert configs.tiles_for(64, 8192, hopper).block_n_dkdv == 128
    assert configs.tile_set_for(128, 8192, hopper) == "base"  # no D=128 tiles in the set
    assert configs.tile_set_for(64, 8192, ampere) == "base"  # sm_90+ only


def test_every_tile_set_has_configs_for_every_kernel():
    for name in launch.KERNELS:
        for tile_set, by_d in configs.TILE_SETS.items():
            for d in by_d:
                table = configs.KERNEL_CONFIGS[name][(tile_set, d)]
                assert table and set(table) <= set(configs.CANDIDATE_CONFIGS), (name, tile_set, d)


def test_grid_limit_keeps_per_head_offsets_in_int32():
    """The kernels index inside one (batch, head) in int32; the 65535-tile grid limit must imply < 2^31."""
    for by_d in configs.TILE_SETS.values():
        for d, tiles in by_d.items():
            rows = 65535 * max(tiles.block_m, tiles.block_n, tiles.block_n_dkdv)
            assert rows * d < launch.INT32_LIMIT, (d, tiles)


def test_shape_checks_name_device_and_int32_violations():
    layout = WindowLayout.causal(64)
    q = torch.empty(1, 2, 64, 32)
    with pytest.raises(ValueError, match="k: expected a tensor on cpu"):
        launch._check_shapes(q, torch.empty(1, 2, 64, 32, device="meta"), layout)
    with pytest.raises(ValueError, match="lse: expected a tensor on cpu"):
        launch._check_shapes(q, q, layout, q, q, q, torch.empty(1, 2, 64, device="meta"))
    huge = torch.empty_strided((1, 1, 64, 32), (64 * 2**26, 64 * 2**26, 2**26, 1), device="meta")
    with pytest.raises(ValueError, match="int32"):
        launch._check_shapes(huge, huge, layout)


_WIDE_SCRIPT = r"""
import torch
from kforcing_kernels import WindowLayout
from kforcing_kernels.ops.window_attention import reference, triton as backend
kernels = backend.kernels()
assert kernels.interpreting()
tiles = kernels.TILE_SETS["wide"][128]
torch.manual_seed(0)
for name, layout in [("single", WindowLayout.kforcing_single(150, 4)), ("double", WindowLayout.kforcing_double(70, 3)),
                     ("sbd", WindowLayout.sbd(170, 20))]:
    q = torch.randn(1, 2, layout.n_queries, 128)
    k, v = (torch.randn(1, 1, layout.n_keys, 128) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = kernels.attention_forward(q, k, v, layout, 128 ** -0.5, tiles=tiles)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, layout, 128 ** -0.5, tiles=tiles)
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    ro, rl = reference.attention(qr, kr, vr, layout, 128 ** -0.5)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double())
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ro, rl, *rg)):
        err = (a.double() - b).abs().max().item()
        assert err < 2e-4, (name, what, err)
    print(name, "ok")
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="starts its own interpreter process")
def test_wide_tiles_match_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-c", _WIDE_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count(" ok") == 3, out[-4000:]


def test_slot_cost_compares_the_two_plans_of_one_layout():
    from kforcing_kernels.ops.window_attention.triton import plan as tp
    from kforcing_kernels.tools import slot_cost

    before = tp.SLOT_WINDOW_MAX
    r = slot_cost.row("single", 256, 4, 128, 16, configs.TILE_SETS["base"][128], 500.0, 3.35)
    assert tp.SLOT_WINDOW_MAX == before  # restored
    assert r["products_tile"] > r["products_slot"] > 0  # in-tile adds the block-diagonal tiles
    assert r["partial_mib_fwd"] * 2**20 == 16 * 256 * 4 * (128 * 4 + 4) * 2
    assert r["partial_us"] == pytest.approx(r["partial_mib_fwd"] * 2**20 / 3.35e12 * 1e6)

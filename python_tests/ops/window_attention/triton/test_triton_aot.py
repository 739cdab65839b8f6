"""The Triton kernels compile for sm_80 and sm_90a without a GPU, without spills or shared-memory overflow.

The thresholds are the hardware's (0 spill bytes, <= 255 registers, shared memory within the target's
opt-in limit), not any Triton version's measured numbers, so the test holds for every Triton in the
supported range (3.6.0 .. newest; `make aot-check` runs the full report for both ends).
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from helpers import REPO
from kforcing_kernels.tools import aot_report, ttgir  # noqa: E402

ROOT = str(REPO)


def test_every_kernel_argument_has_a_type():
    """The report derives signatures from argument roles; a new argument must not slip through untyped."""
    from kforcing_kernels.ops.window_attention.triton import launch as kernels

    if kernels.interpreting():
        pytest.skip("kernels were built for the interpreter in this process")
    for name, fn in kernels.KERNELS.items():
        constexprs = aot_report._constexprs(name, 64)
        signature, attrs = aot_report._signature(fn, "bf16", constexprs)
        assert list(signature) == fn.arg_names
        assert {k for k, v in signature.items() if v == "constexpr"} == {p.name for p in fn.params if p.is_constexpr}
        for arg in ("Q", "K", "V"):
            if arg in signature:
                assert signature[arg] == "*bf16"
        assert all(v in ("*bf16", "*fp32", "*i32", "i32", "fp32", "constexpr") for v in signature.values())


def test_configs_table_is_consistent():
    from kforcing_kernels.ops.window_attention.triton import launch as kernels

    for name in kernels.KERNELS:
        assert set(kernels.KERNEL_CONFIGS[name]) == {(s, d) for s, by_d in kernels.TILE_SETS.items() for d in by_d}
        for key, configs in kernels.KERNEL_CONFIGS[name].items():
            assert configs and set(configs) <= set(kernels.CANDIDATE_CONFIGS), (name, key)
            assert len(set(configs)) == len(configs), (name, key)


def test_report_compiles_each_distinct_kernel_once():
    """Tile sets that do not change a kernel's constexprs (slot, delta) are not compiled twice."""
    jobs = aot_report.jobs("chosen")
    keys = [
        (
            j.arch,
            j.kernel,
            tuple(sorted(aot_report._constexprs(j.kernel, j.head_dim, j.tile_set).items())),
            j.dtype,
            j.num_warps,
            j.num_stages,
        )
        for j in jobs
    ]
    assert len(keys) == len(set(keys))
    assert {(j.kernel, j.tile_set) for j in jobs if j.tile_set == "wide"} == {(name, "wide") for name in ("fwd", "bwd")}
    assert {j.arch for j in jobs if j.tile_set == "wide"} == {90}  # never dispatched below sm_90
    # The paged decode kernel (ops/paged_attention) is in the report too, at its launch config.
    paged = [j for j in jobs if j.kernel == aot_report.PAGED]
    assert {(j.arch, j.head_dim, j.dtype) for j in paged} == {
        (a, d, t) for a in (80, 90) for d in (64, 128) for t in ("fp16", "bf16")
    }
    assert all((j.num_warps, j.num_stages) == aot_report.PAGED_CONFIG and j.chosen for j in paged)


# ---------------------------------------------------------------- TTGIR parsing (tools/ttgir.py), no compiler


def _copy(name, buffer, index):
    return (
        f"    %{name}_view = ttg.memdesc_index %{buffer}[%c{index}_i32] : !ttg.memdesc<3x64x64xf16, #shared, "
        "#smem, "
        f"mutable> -> !ttg.memdesc<64x64xf16, #shared, #smem, mutable> loc(#loc1)\n"
        f"    %{name} = ttg.async_copy_global_to_local %ptr_{name}, %{name}_view mask %ok other %zero : "
        f"tensor<64x64x!tt.ptr<f16>, #blocked> -> <64x64xf16, #shared, #smem, mutable> loc(#loc1)\n"
    )


def _loop(bound, body, indent=4, results="%r:2"):
    pad = " " * indent
    inner = "".join(pad + "  " + line.strip() + "\n" for line in body.strip("\n").splitlines())
    return (
        f"{pad}{results} = scf.for %i = %c0_i32 to %{bound} step %c1_i32 iter_args(%a0 = %t0) -> "
        f"(!ttg.async.token)  : i32 {{\n{inner}{pad}}} loc(#loc9)\n"
    )


ALLOC = "    %buf = ttg.local_alloc : () -> !ttg.memdesc<3x64x64xf16, #shared, #smem, mutable> loc(#loc1)\n"
WGMMA = (
    "%s = ttng.warp_group_dot %q, %k_view, %acc {inputPrecision = 0 : i32, isAsync = true} : "
    "!ttg.memdesc<64x64xf16> * !ttg.memdesc<64x64xf16> -> tensor<64x64xf32, #mma> loc(#loc2)\n"
    "%sw:3 = ttng.warp_group_dot_wait %s, %q, %k_view {pendings = 0 : i32} : tensor<64x64xf32, #mma> loc(#loc2)"
)
MMA_V2 = (
    "%p = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<32x64xf16> * tensor<64x64xf16> "
    "-> tensor<32x64xf32> loc(#loc3)"
)
WAIT0 = "%w = ttg.async_wait %a0 {num = 0 : i32} loc(#loc4)"


def _func(body):
    return (
        "module {\n  tt.func public @k(%n: i32, %kv_group: i32) {\n"
        + body
        + "    tt.return loc(#loc)\n  } loc(#loc)\n}\n"
    )


def test_ttgir_dot_counts_tell_wgmma_from_mma_v2():
    text = _func(_loop("n", WGMMA + "\n" + MMA_V2))
    assert ttgir.dot_counts(text) == (1, 2)  # warp_group_dot_wait is not a product
    assert ttgir.dot_counts(_func(_loop("n", MMA_V2))) == (0, 1)


def test_ttgir_depth_counts_the_iterations_loads_run_ahead():
    in_loop = WAIT0 + "\n" + WGMMA + "\n" + _copy("t2", "buf", 2)
    three = _func(ALLOC + _copy("t0", "buf", 0) + _copy("t1", "buf", 1) + _loop("n", in_loop))
    two = _func(ALLOC + _copy("t0", "buf", 0) + _loop("n", in_loop))  # async_wait num = 0, yet pipelined
    synchronous = _func(_loop("n", "%x = tt.load %ptr : tensor<64x64x!tt.ptr<f16>> loc(#loc5)\n" + WGMMA))
    assert [ttgir.main_loop_depth(t) for t in (three, two, synchronous)] == [3, 2, 0]
    assert ttgir.main_loop_depth(_func("    %x = arith.addi %n, %n : i32 loc(#loc6)\n")) is None  # no loop
    assert ttgir.main_loop_depth(_func(_loop("n", WAIT0))) is None  # a loop without a dot is no main loop


def test_ttgir_a_loop_over_the_gqa_group_is_not_the_main_loop():
    """Pipelining across the GQA group (1 for multi-head attention) overlaps nothing: the enclosing
    loop is the main one, and its loads are waited for in the iteration that issued them."""
    group = _loop("kv_group", WAIT0 + "\n" + MMA_V2 + "\n" + _copy("t2", "buf", 0), indent=6, results="%g:2")
    outer_body = (ALLOC + _copy("t0", "buf", 0)).replace("    ", "      ") + group
    text = (
        "module {\n  tt.func public @k(%n: i32, %kv_group: i32) {\n"
        + (
            "    %r:2 = scf.for %e = %c0_i32 to %e_end step %c1_i32 iter_args(%x = %z) -> (f32)  : i32 {\n"
            + outer_body
            + "    } loc(#loc9)\n"
        )
        + "    tt.return loc(#loc)\n  } loc(#loc)\n}\n"
    )
    loops = ttgir.loops(text)
    assert [(loop.bound, loop.depth, loop.over_group) for loop in loops] == [("e_end", 0, False), ("kv_group", 2, True)]
    assert ttgir.main_loop_depth(text) == 0


def test_ttgir_sibling_main_loops_report_the_shallowest():
    """Separate loops over full and partial tiles are both main loops: the smaller depth is the kernel's."""
    pipelined = ALLOC + _copy("t0", "buf", 0) + _loop("n", WAIT0 + "\n" + WGMMA + "\n" + _copy("t2", "buf", 1))
    plain = _loop("n_partial", "%x = tt.load %ptr : tensor<64x64x!tt.ptr<f16>> loc(#loc5)\n" + WGMMA, results="%s:2")
    assert ttgir.main_loop_depth(_func(pipelined)) == 2
    assert ttgir.main_loop_depth(_func(pipelined + plain)) == 0


def _stepping_loop(buffers, wait):
    """A kernel whose main loop has two copies in its prologue (depth 3: num_stages = 3) into ``buffers``
    buffers and opens each iteration with ``async_wait {num = wait}``."""
    alloc = ALLOC.replace("<3x64x64", f"<{buffers}x64x64")
    body = WAIT0.replace("num = 0", f"num = {wait}") + "\n" + WGMMA + "\n" + _copy("t2", "buf", 2 % buffers)
    return _func(alloc + _copy("t0", "buf", 0) + _copy("t1", "buf", 1 % buffers) + _loop("n", body))


def test_ttgir_reports_each_main_loops_top_wait_and_buffers():
    """Depth 3 alone does not tell a pipeline from a stall: the stepping loop that reads its row start in the
    same iteration (issue 34) had two copies in its prologue, two q/dO buffers, and drained both at the top."""
    stalling, prefetching = _stepping_loop(2, 0), _stepping_loop(3, 2)
    for text in (stalling, prefetching):
        assert ttgir.main_loop_depth(text) == 3
    [stall], [ahead] = ttgir.main_loops(stalling), ttgir.main_loops(prefetching)
    assert (stall.top_wait, stall.buffers) == (0, 2)
    assert (ahead.top_wait, ahead.buffers) == (2, 3)
    assert ttgir.stalls(stall.top_wait, 3) and ttgir.stalls(stall.top_wait, 4)
    assert not ttgir.stalls(ahead.top_wait, 3)
    assert not ttgir.stalls(0, 2)  # two stages: every copy is waited for one iteration after it was issued
    assert not ttgir.stalls(None, 3)  # no async_wait at all: synchronous, which depth 0 reports
    # The wait that counts is the loop's own first one, not one after its math or in a nested loop.
    late = _func(
        ALLOC
        + _copy("t0", "buf", 0)
        + _copy("t1", "buf", 1)
        + _loop("n", WAIT0.replace("num = 0", "num = 2") + "\n" + WGMMA + "\n" + WAIT0 + "\n" + _copy("t2", "buf", 2))
    )
    assert [loop.top_wait for loop in ttgir.main_loops(late)] == [2]
    synchronous = _func(_loop("n", "%x = tt.load %ptr : tensor<64x64x!tt.ptr<f16>> loc(#loc5)\n" + WGMMA))
    assert [(loop.top_wait, loop.buffers) for loop in ttgir.main_loops(synchronous)] == [(None, None)]


def _row(
    kernel, arch=90, default=True, wgmma=2, dots=2, depth=2, error=None, tiles="hopper", d=64, stages=2, top_waits=()
):
    job = aot_report.Job(arch, kernel, tiles, d, "bf16", 4, stages, True, default)
    return aot_report.Row(
        job,
        128,
        0,
        0,
        1024,
        0,
        error=error,
        wgmma=wgmma,
        dots=dots,
        depth=depth,
        top_waits=top_waits,
        buffers=tuple(3 for _ in top_waits),
    )


def test_hopper_failures_judge_default_sm90_main_kernels_only(monkeypatch):
    from kforcing_kernels.ops.window_attention.triton import launch

    assert set(aot_report.main_kernels()) == {"fwd", "bwd"}
    monkeypatch.setitem(launch.KERNELS, "bwd_new", launch.KERNELS["bwd"])  # a new kernel is a main one
    assert "bwd_new" in aot_report.main_kernels()
    rows = [
        _row("fwd"),
        _row("bwd", depth=0),
        _row("bwd_new", wgmma=0, depth=0),
        _row("fwd", depth=None),
        _row("fwd", error="PTXASError: x"),
        _row("bwd", arch=80, wgmma=0),
        _row("bwd", default=False, depth=0),
        _row("delta", wgmma=0, dots=0, depth=None),
        # Not held to the standard: sets sm_90a never picks unforced, D = 32.
        _row("bwd", tiles="base", wgmma=0, depth=1),
        _row("bwd", tiles="hopper128", wgmma=0, depth=4),
        _row("fwd", tiles="base", d=32, depth=0),
        # A stall counts at 3+ stages only (two stages wait with num = 0 in a real pipeline).
        _row("bwd", depth=3, stages=3, top_waits=(0, 6, 2)),
        _row("bwd", depth=5, stages=3, top_waits=(4, 6)),
        _row("fwd", depth=2, stages=2, top_waits=(0,)),
    ]
    failures = {(r.job.kernel, r.depth): problems for r, problems in aot_report.hopper_failures(rows)}
    assert failures == {
        ("bwd", 0): ["main loop not pipelined (depth 0)"],
        ("bwd_new", 0): ["no wgmma (0 of 2 dots)", "main loop not pipelined (depth 0)"],
        ("fwd", None): ["no main loop with a dot"],
        ("fwd", 2): ["does not compile (PTXASError: x)"],
        ("bwd", 3): ["main loop 1 of 3 stalls (async_wait num = 0 at the top, 3 stages)"],
    }
    table = aot_report.format_table(rows[-3:])
    assert [line.split("|")[-4].strip() for line in table.splitlines()[2:]] == ["1", "-", "-"]  # stalls
    assert "| 0/6/2 " in table and "| 3/3/3 " in table


# ---------------------------------------------------------------- the report on the real kernels (compiles)


COLUMNS = (
    "target",
    "kernel",
    "tiles",
    "d",
    "dtype",
    "warps",
    "stages",
    "regs",
    "spill",
    "smem",
    "limit",
    "wgmma",
    "dots",
    "depth",
    "top_wait",
    "bufs",
    "stalls",
    "chosen",
    "status",
)


def _ci_kernels() -> list[str]:
    """Every kernel, the paged decode kernel included."""
    from kforcing_kernels.ops.window_attention.triton import launch

    return [*launch.KERNELS, aot_report.PAGED]


@pytest.fixture(scope="module")
def default_report():
    """One `aot_report --defaults` run (Hopper check on), shared by the tests that read it."""
    if aot_report.tools_missing() is not None:
        pytest.skip(aot_report.tools_missing())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "kforcing_kernels.tools.aot_report", "--defaults", "--kernels", *_ci_kernels()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [
        dict(zip(COLUMNS, (c.strip() for c in line.strip("|").split("|"))))
        for line in result.stdout.splitlines()
        if line.startswith("| sm_")
    ]
    return result, rows


def test_default_configs_compile_for_sm80_and_sm90_without_spills(default_report):
    result, rows = default_report
    out = result.stdout + result.stderr
    assert result.returncode in (0, 1), out[-6000:]
    assert len(rows) == len(aot_report.jobs("defaults", kernels_subset=_ci_kernels())), out[-3000:]
    for row in rows:
        assert row["status"] == "ok" and row["spill"] == "0" and int(row["smem"]) <= int(row["limit"]), row
        assert 0 < int(row["regs"]) <= 255
        assert row["chosen"] == "default"
    assert re.search(r"\n\d+ compiles; 0 chosen configs spill", result.stdout)


def test_wgmma_and_depth_columns_read_the_compiled_kernels(default_report):
    """wgmma is Hopper's: never on sm_80, and the forward (64-row tiles, known to use it) has it on sm_90a;
    depth is num_stages where Triton pipelines the main loop (the forward's key loop is), else 0."""
    _, rows = default_report
    by = {(r["target"], r["kernel"], r["tiles"], r["d"], r["dtype"]): r for r in rows}
    assert all(r["wgmma"] == "0" for r in rows if r["target"] == "sm_80")
    fwd = by[("sm_90a", "fwd", "hopper", "64", "bf16")]
    assert 0 < int(fwd["wgmma"]) <= int(fwd["dots"])
    for r in (r for r in rows if r["depth"] != "-"):  # Triton pipelines a loop num_stages deep, or not at all
        assert int(r["depth"]) in ((0,) if r["stages"] == "1" else (0, int(r["stages"]))), r
    assert any(int(r["depth"]) > 1 for r in rows if r["kernel"] == "fwd" and r["target"] == "sm_90a")
    assert all(r["depth"] == "-" for r in rows if r["kernel"] == "delta")  # no dot, no main loop


def test_hopper_check_fails_exactly_on_the_listed_defaults(default_report):
    """Exit 1 iff a default sm_90a config of a main kernel lacks wgmma or a pipelined main loop, and the
    message lists exactly those (before issue #25's kernel rewrite some do: the check must say which)."""
    from kforcing_kernels.ops.window_attention.triton import configs

    result, rows = default_report
    main = set(aot_report.main_kernels())
    held = [
        r
        for r in rows
        if r["target"] == "sm_90a"
        and r["kernel"] in main
        and int(r["d"]) in aot_report.HOPPER_HEAD_DIMS
        and configs.dispatched_by_default(r["tiles"], int(r["d"]), 9)
    ]
    expected = {
        (r["kernel"], r["tiles"], r["d"], r["dtype"], r["warps"], r["stages"])
        for r in held
        if r["wgmma"] == "0" or r["depth"] in ("0", "-") or r["stalls"] != "-"
    }
    listed = set(
        re.findall(r"NOT HOPPER-GRADE: (\w+) (\w+) D=(\d+) (\w+) \((\d+) warps, (\d+) stages\)", result.stdout)
    )
    assert listed == expected
    assert result.returncode == (1 if expected else 0)
    assert f"{len(held) - len(expected)} of {len(held)} have" in result.stdout


def test_default_main_kernels_are_hopper_grade(default_report):
    """Issue #25's standard: every default sm_90a config of fwd and the fused backward at D = 64 and 128 runs
    wgmma in a software-pipelined main loop; issue #34's: none of those
    loops drains its copies at the top (the dK/dV step loops prefetch q/dO)."""
    result, _ = default_report
    assert "NOT HOPPER-GRADE" not in result.stdout, result.stdout[-3000:]


def test_default_step_loops_keep_a_step_in_flight(default_report):
    """Every default of the fused backward (its dK/dV step loops) that sm_90a dispatches (D = 64, 128) at 3+
    stages: each main loop opens with copies still in flight (top wait >= 1) into at least num_stages q/dO (and
    k/v) buffers. (The mma_v2 sets keep num_stages - 1 buffers: their operands go through registers.)"""
    from kforcing_kernels.ops.window_attention.triton import configs

    _, rows = default_report
    checked = [
        r
        for r in rows
        if r["target"] == "sm_90a"
        and r["kernel"] == "bwd"
        and int(r["stages"]) >= 3
        and int(r["d"]) in aot_report.HOPPER_HEAD_DIMS
        and configs.dispatched_by_default(r["tiles"], int(r["d"]), 9)
    ]
    assert {(r["kernel"], r["tiles"], r["d"]) for r in checked} == {
        ("bwd", t, d) for t, d in (("hopper", "64"), ("base", "128"), ("wide", "128"))
    }
    for r in checked:
        waits, bufs = r["top_wait"].split("/"), r["bufs"].split("/")
        assert len(waits) == len(bufs) >= 2 and "-" not in waits + bufs, r
        assert all(int(w) >= 1 for w in waits) and all(int(b) >= int(r["stages"]) for b in bufs), r

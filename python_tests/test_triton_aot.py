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

from kforcing_kernels.tools import aot_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    keys = [(j.arch, j.kernel, tuple(sorted(aot_report._constexprs(j.kernel, j.head_dim, j.tile_set).items())),
             j.dtype, j.num_warps, j.num_stages) for j in jobs]
    assert len(keys) == len(set(keys))
    assert {(j.kernel, j.tile_set) for j in jobs if j.tile_set == "wide"} == {
        (name, "wide") for name in ("fwd", "dq", "dkdv", "dq_legacy", "dkdv_legacy")}
    assert {j.arch for j in jobs if j.tile_set == "wide"} == {90}  # never dispatched below sm_90
    # The paged decode kernel (ops/paged_attention) is in the report too, at its launch config.
    paged = [j for j in jobs if j.kernel == aot_report.PAGED]
    assert {(j.arch, j.head_dim, j.dtype) for j in paged} == {(a, d, t) for a in (80, 90) for d in (64, 128)
                                                              for t in ("fp16", "bf16")}
    assert all((j.num_warps, j.num_stages) == aot_report.PAGED_CONFIG and j.chosen for j in paged)


@pytest.mark.skipif(aot_report.tools_missing() is not None, reason=f"{aot_report.tools_missing()}")
def test_default_configs_compile_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "kforcing_kernels.tools.aot_report", "--defaults"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sm_")]
    assert len(rows) == len(aot_report.jobs("defaults")), out[-3000:]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        target, kernel, tiles, d, dtype, warps, stages, regs, spill, smem, limit, chosen, status = cells
        assert status == "ok" and spill == "0" and int(smem) <= int(limit), line
        assert 0 < int(regs) <= 255
    assert re.search(r"0 chosen configs spill", result.stdout)

"""The Triton kernels compile for sm_80 and sm_90 without a GPU, without spills or shared-memory overflow."""

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
    from kforcing_kernels.ops.window_attention import triton_kernels as kernels

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
    from kforcing_kernels.ops.window_attention import triton_kernels as kernels

    for name in kernels.KERNELS:
        for d in kernels.SUPPORTED_HEAD_DIMS:
            configs = kernels.KERNEL_CONFIGS[name][d]
            assert configs and set(configs) <= set(kernels.CANDIDATE_CONFIGS), (name, d)


@pytest.mark.skipif(aot_report.tools_missing() is not None, reason=f"{aot_report.tools_missing()}")
def test_default_configs_compile_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "kforcing_kernels.tools.aot_report", "--defaults"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sm_")]
    from kforcing_kernels.ops.window_attention import triton_kernels as kernels

    expected = len(aot_report.TARGETS) * len(kernels.KERNELS) * len(kernels.SUPPORTED_HEAD_DIMS) * len(aot_report.DTYPES)
    assert len(rows) == expected, out[-3000:]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        target, kernel, d, dtype, warps, stages, regs, spill, smem, limit, chosen, status = cells
        assert status == "ok" and spill == "0" and int(smem) <= int(limit), line
        assert 0 < int(regs) <= 255
    assert re.search(r"0 chosen configs spill", result.stdout)

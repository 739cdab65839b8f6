"""``bash bench/gpu/gpu_check.sh --dry-run``: every step of the GPU check runs its Python on CPU and exits 0.

The GPU check is run on a GPU machine lent for minutes; a step that dies at import there wastes them
(issue 34). The dry run executes every step's command as the real run does, rewritten only where a CPU
cannot follow (see the script's header): tiny shapes, fp32, the Triton interpreter, one call per method
instead of do_bench. It takes a few minutes on a busy 2-core machine.
"""

import json
import os
import subprocess
import sys
from helpers import REPO

ROOT = str(REPO)


def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    for var in ("GPU_CHECK_ONLY", "KFORCING_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1500)
    log = result.stdout + result.stderr
    summary = log.split("==================== summary")[-1]
    assert result.returncode == 0, summary + log[-6000:]
    steps = [line.strip().split(":")[0] for line in summary.splitlines() if ": rc=" in line]
    assert steps == ["0_versions", "1_warm", "2_smoke", "3_pytest_gpu", "4_int64_offsets", "5_ab", "6_profile",
                     "7_dispatch_table", "8_train_step", "8b_train_step_n4096", "9_batch_invariance", "9b_grid_d128",
                     "9c_in_tile", "9d_composite_dense", "9e_sampler", "10_serving_b4", "10_serving_b16",
                     "10_serving_b128", "11_table_d64", "11_table_d128"], summary
    assert "skipped" not in summary
    # The A/B ran the default first, FlexAttention (called directly and as the backend) next, then variants.
    ab = json.loads((tmp_path / "bench_ab.json").read_text())
    methods = list(ab["rows"][0]["results"])
    assert methods[:3] == ["triton", "flex", "flex_backend"] and any(m.startswith("triton[") for m in methods), methods
    assert ab["capability"] == "cpu" and ab["config"]["dry_run"]
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert {r["label"] for r in profile["rows"]} >= {"triton", "flex_backend", "triton[split]"}
    from kforcing_kernels.ops.window_attention import dispatch

    dispatch.load(tmp_path / "dispatch_table.json")  # written, and a valid table (no rows: CPU has no flex backward)


def test_variant_lines_are_checked_and_unknown_switches_skipped(tmp_path):
    """bench/gpu/gpu_variants.txt: one variant per line; a switch or tile set this checkout lacks is a skip with a
    reason (candidates may come from another branch), a malformed line an error naming the line."""
    import pytest

    from bench.gpu import gpu_variants

    path = tmp_path / "variants.txt"
    path.write_text("# comment\nsplit KFORCING_TRITON_KERNELS=split  # trailing\nghost KFORCING_NOT_A_SWITCH=1\n"
                    "newtiles KFORCING_TRITON_TILES=no_such_set\nflash KFORCING_FLEX_BACKEND=NOT_A_KERNEL\n")
    variants = dict(gpu_variants.read_variants(str(path)))
    assert variants["split"] == {"KFORCING_TRITON_KERNELS": "split"}
    assert gpu_variants.variant_problem(variants["split"]) is None
    assert "not read by this checkout" in gpu_variants.variant_problem(variants["ghost"])
    assert "no such tile set" in gpu_variants.variant_problem(variants["newtiles"])
    assert "KFORCING_FLEX_BACKEND" in gpu_variants.variant_problem(variants["flash"])
    assert gpu_variants.variant_backend(variants["flash"]) == "flex" and gpu_variants.variant_backend(variants["split"]) == "triton"
    for bad in ("x split\n", "alone\n", "a KFORCING_X=1\na KFORCING_Y=2\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="variants.txt"):
            gpu_variants.read_variants(str(path))
    shipped = gpu_variants.read_variants(os.path.join(ROOT, "bench", "gpu", "gpu_variants.txt"))
    assert {"split", "legacy"} <= {name for name, _ in shipped}


def test_a_forced_tile_set_equal_to_the_dispatchers_choice_is_not_timed_twice():
    import torch

    from bench.gpu import gpu_variants

    cpu = torch.device("cpu")  # the interpreter's choice: base at every head dim
    assert gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "base"}, 64, 1000, cpu)
    assert not gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 128, 1000, cpu)
    assert gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 64, 1000, cpu)  # no D=64 tiles: base
    assert not gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "base", "KFORCING_TRITON_KERNELS": "split"},
                                               64, 1000, cpu)

"""The GPU check (bench/gpu/check.py, ``python -m bench gpu-check``): its plan fits the loan, every step's command
is accepted by its module, and ``--dry-run`` runs every step's Python on CPU and exits 0.

The GPU check runs on a GPU machine lent for minutes; a step that dies at import or on an argument there wastes
them (issue 34). The plan: call 1 <= 480 s, call 2 <= 240 s of step budgets (a 15-minute loan, the machine's
start included; issue 47). The dry run executes every step of both calls and the extras with its CPU arguments
(tiny shapes, fp32, the Triton interpreter, pytest collecting only). It takes a few minutes on a busy 2-core
machine.
"""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from bench.gpu import check
from helpers import REPO

ROOT = str(REPO)
PLANNED_S = {  # the per-step budgets (s), from the H200 run's measured times (bench/gpu/check.py's docstring)
    1: {
        "versions": 15,
        "warm": 90,
        "smoke": 50,
        "pytest_gpu": 90,
        "int64_offsets": 15,
        "batch_invariance": 35,
        "ab": 45,
        "profile": 50,
        "dispatch_table": 10,
        "train_n1024": 40,
        "train_n4096": 40,
    },
    2: {"serving": 150, "table_d64": 45, "table_d128": 45},
}


def test_the_plan_fits_the_loan():
    for call, limit in ((1, 480), (2, 240)):
        budgets = {s.name: s.budget_s for s in check.steps_of(call)}
        assert budgets == PLANNED_S[call]
        assert sum(budgets.values()) == check.planned_seconds(call) <= limit == check.CALL_LIMITS_S[call]
    names = [s.name for s in check.STEPS]
    assert len(names) == len(set(names)) and {s.call for s in check.STEPS} == {0, 1, 2}
    # By value: correctness first, then the A/B and what reads it, the training steps last.
    order = [s.name for s in check.steps_of(1)]
    assert order.index("warm") < order.index("smoke") < order.index("ab") < order.index("dispatch_table")
    assert order[-2:] == ["train_n1024", "train_n4096"]
    serving = next(s for s in check.STEPS if s.name == "serving")
    assert not serving.placeholder and "--paper" in serving.argv and "cudagraph" in serving.argv  # issue 50


@pytest.mark.parametrize("step", check.STEPS, ids=lambda s: s.name)
def test_every_steps_command_is_accepted_by_its_module(step, tmp_path):
    """Each step's GPU and CPU command lines parse with the module's own argparse (the module run as __main__ and
    stopped at its first parse); a pending argument (another branch adds it) is the only thing allowed unknown."""
    for argv, cuda in ((step.argv, True), (step.dry_argv, False)):
        expanded = check.expand(argv, str(tmp_path))
        assert expanded[0] == "-m" and "{" not in " ".join(expanded)
        if step.module == "pytest":
            assert os.path.isfile(os.path.join(ROOT, expanded[2])), expanded
            continue
        namespace, extras = check.parse_step_args([*expanded, *step.pending], as_if_cuda=cuda)
        assert set(extras) <= set(step.pending), (step.name, extras)
        json_path = getattr(namespace, "json", None)
        assert json_path is None or json_path.startswith(str(tmp_path))  # every JSON goes to the work folder
    if step.name.startswith("train_"):
        namespace, _ = check.parse_step_args(check.expand(step.argv, str(tmp_path)), as_if_cuda=True)
        assert (namespace.preset, namespace.batch_size, namespace.ours) == ("paper", 4, "triton")


def test_the_training_steps_are_the_issues_shapes(tmp_path):
    shapes = []
    for step in check.steps_of(1):
        if step.name.startswith("train_"):
            namespace, _ = check.parse_step_args(check.expand(step.argv, str(tmp_path)), as_if_cuda=True)
            shapes.append((namespace.seq_len, namespace.k))
            assert step.pending == ("--ac",)  # activation checkpointing, once the memory branch adds the flag
    assert shapes == [(1024, "2"), (4096, "4")]  # teacher k (the student gets 2k)


def test_a_pending_argument_is_appended_only_where_the_module_takes_it(tmp_path):
    step = next(s for s in check.STEPS if s.name == "train_n1024")
    argv = check.expand(step.dry_argv, str(tmp_path))
    accepted, missing = check.accepted_pending(step, argv)
    assert sorted(accepted + missing) == ["--ac"]
    fake = check.Step("x", 0, 1, step.argv, step.dry_argv, pending=("--no-progress",))  # an argument it has
    assert check.accepted_pending(fake, argv) == (["--no-progress"], [])


def test_the_shell_wrapper_runs_the_python_check():
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu", "gpu_check.sh"), "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "call 1: 480 s planned" in result.stdout and "call 2: 240 s planned" in result.stdout


def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    env = dict(os.environ)
    for var in ("KFORCING_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    work, out = tmp_path / "work", tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "gpu-check", "--dry-run", "--work", str(work), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    log = result.stdout + result.stderr
    summary = log.split("==================== summary")[-1]
    assert result.returncode == 0, summary + log[-6000:]
    report = json.loads((work / "summary_dry.json").read_text())
    assert [r["step"] for r in report["steps"]] == [s.name for s in check.STEPS if s.call == 1] + [
        s.name for s in check.STEPS if s.call != 1
    ]
    assert all(r["rc"] == 0 for r in report["steps"]), report
    # Two files come back per call: the runner's log and the tarball of the work folder.
    assert sorted(os.listdir(out)) == ["gpu_check_dry.log", "gpu_check_dry.tar.gz"]
    with tarfile.open(out / "gpu_check_dry.tar.gz") as tar:
        assert "gpu_check_dry/bench_ab.json" in tar.getnames()
    # The A/B ran the default first, FlexAttention (called directly and as the backend) next, then variants.
    ab = json.loads((work / "bench_ab.json").read_text())
    methods = list(ab["rows"][0]["results"])
    assert methods[:3] == ["triton", "flex", "flex_backend"] and any(m.startswith("triton[") for m in methods), methods
    assert ab["capability"] == "cpu" and ab["config"]["dry_run"]
    profile = json.loads((work / "profile.json").read_text())
    assert {r["label"] for r in profile["rows"]} == {"triton", "flex_backend"}
    variants = json.loads((work / "profile_variants.json").read_text())
    assert any(r["label"].startswith("triton[") for r in variants["rows"])
    from kforcing_kernels.ops.window_attention import dispatch

    dispatch.load(work / "dispatch_table.json")  # written, and a valid table (no rows: CPU has no flex backward)


def test_variant_lines_are_checked_and_unknown_switches_skipped(tmp_path):
    """bench/gpu/gpu_variants.txt: one variant per line; a switch or tile set this checkout lacks is a skip with a
    reason (candidates may come from another branch), a malformed line an error naming the line."""
    from bench.gpu import gpu_variants

    path = tmp_path / "variants.txt"
    path.write_text(
        "# comment\nwide KFORCING_TRITON_TILES=wide  # trailing\nghost KFORCING_NOT_A_SWITCH=1\n"
        "split KFORCING_TRITON_KERNELS=split\n"
        "newtiles KFORCING_TRITON_TILES=no_such_set\nflash KFORCING_FLEX_BACKEND=NOT_A_KERNEL\n"
    )
    variants = dict(gpu_variants.read_variants(str(path)))
    assert variants["wide"] == {"KFORCING_TRITON_TILES": "wide"}
    assert gpu_variants.variant_problem(variants["wide"]) is None
    assert "not read by this checkout" in gpu_variants.variant_problem(variants["ghost"])
    assert "not read by this checkout" in gpu_variants.variant_problem(variants["split"])  # removed after the H200 run
    assert "no such tile set" in gpu_variants.variant_problem(variants["newtiles"])
    assert "KFORCING_FLEX_BACKEND" in gpu_variants.variant_problem(variants["flash"])
    assert gpu_variants.variant_backend(variants["flash"]) == "flex"
    assert gpu_variants.variant_backend(variants["wide"]) == "triton"
    for bad in ("x split\n", "alone\n", "a KFORCING_X=1\na KFORCING_Y=2\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="variants.txt"):
            gpu_variants.read_variants(str(path))
    shipped = gpu_variants.read_variants(os.path.join(ROOT, "bench", "gpu", "gpu_variants.txt"))
    names = {name for name, _ in shipped}
    assert not names & {"split", "legacy", "noprefetch"}  # removed after the H200 run (BENCHMARKS.md)
    # Every shipped variant runs here (its switch is read, its tile set exists), but FlexAttention's FLASH route.
    assert all(gpu_variants.variant_problem(a) is None for name, a in shipped if not name.startswith("flex"))


def test_a_forced_tile_set_equal_to_the_dispatchers_choice_is_not_timed_twice():
    import torch

    from bench.gpu import gpu_variants

    cpu = torch.device("cpu")  # the interpreter's choice: base at every head dim
    assert gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "base"}, 64, 1000, cpu)
    assert not gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 128, 1000, cpu)
    assert gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 64, 1000, cpu)  # no D=64 tiles: base
    assert gpu_variants._repeats_the_default({"KFORCING_TRITON_TILES": "hopper128"}, 128, 1000, cpu)  # base again
    assert not gpu_variants._repeats_the_default(
        {"KFORCING_TRITON_TILES": "base", "KFORCING_FLEX_BACKEND": "TRITON"}, 64, 1000, cpu
    )

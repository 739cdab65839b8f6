"""The GPU check (bench/gpu/check.py, ``python -m bench gpu-check``): its plan fits the loan with the decisive
measurements first, every step's command is accepted by its module, each step's dry run takes the GPU's arguments
(only the sizes and the device differ, or a difference the step declares), and ``--dry-run`` runs every step's Python
on CPU and exits 0, but fails where the GPU would (the fp32 training step of main at d2fd6a4).

The GPU check runs on a GPU machine lent for minutes; a step that dies at import or on an argument there wastes
them (issue 34). The plan: <= 660 s of step caps over both calls (a 15-minute loan, the machine's start included;
issue 53). The dry run executes every step with its dry_argv (the GPU's arguments at reduced sizes on CPU, Triton in
its interpreter or through the stub driver, pytest collecting only). It takes minutes on a busy 2-core machine.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tarfile

import pytest

from bench.gpu import check
from bench.gpu.check_steps import SIZE_KEYS
from helpers import REPO

ROOT = str(REPO)
PLANNED_S = {  # the per-step budgets (s), from the H200 run's measured times (bench/gpu/check.py's docstring)
    1: {
        "versions": 10,
        "smoke_d128": 45,
        "ab_d128": 100,
        "train": 140,
        "dispatch_table": 10,
        "batch_invariance": 35,
        "pytest_gpu": 40,
    },
    2: {"serving_capture": 30, "serving": 100, "vllm": 60, "serving_more": 25, "smoke_d64": 20, "ab_d64": 45},
}


def test_the_plan_fits_the_loan_with_the_decisive_steps_first(capsys):
    for call, limit in ((1, 380), (2, 280)):
        budgets = {s.name: s.budget_s for s in check.steps_of(call)}
        assert budgets == PLANNED_S[call]
        assert sum(budgets.values()) == check.planned_seconds(call) <= limit == check.CALL_LIMITS_S[call]
    total = check.planned_seconds(1) + check.planned_seconds(2)
    assert total <= check.TOTAL_LIMIT_S == 660  # 11 of the loan's 15 minutes: 4 for the start and the transfers
    check.print_plan()
    assert capsys.readouterr().out.startswith(f"plan: {total} s of step caps in calls 1 + 2 (limit 660 s")
    names = [s.name for s in check.STEPS]
    assert len(names) == len(set(names)) and {s.call for s in check.STEPS} == {0, 1, 2}
    # Call 1: the D=128 A/B after the correctness of every tile set it times, then the training step.
    assert [s.name for s in check.steps_of(1)][:4] == ["versions", "smoke_d128", "ab_d128", "train"]
    # Call 2: the capture check, AR and k = 4 at every batch size, the vLLM slot, k = 2 and HF, then the A/B.
    order = [s.name for s in check.steps_of(2)]
    assert order == ["serving_capture", "serving", "vllm", "serving_more", "smoke_d64", "ab_d64"]
    steps = {s.name: s for s in check.STEPS}
    serving, more = steps["serving"], steps["serving_more"]
    assert "cudagraph" in serving.argv and serving.argv[serving.argv.index("--k") + 1] == "4"
    assert "--hf" not in serving.argv and "--hf" in more.argv and more.argv[more.argv.index("--k") + 1] == "2"
    assert "cuda_graph_replay" in steps["serving_capture"].argv
    assert steps["vllm"].budget_s == 60 and steps["vllm"].placeholder
    # Every tile set the D=128 A/B times is checked against float64 first (smoke forces each set with D=128).
    assert "128" in steps["smoke_d128"].argv and "64" in steps["smoke_d64"].argv


def test_every_step_writes_its_rows_as_they_finish():
    """The measuring steps' modules write their JSON after every row, the pytest steps a line per test."""
    for step in check.STEPS:
        if step.module == "pytest":
            assert any(a.startswith("--rows-jsonl={work}/") for a in step.argv), step.name
            assert "bench.gpu.pytest_rows" in step.argv, step.name


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
    if step.name == "train":
        namespace, _ = check.parse_step_args(check.expand(step.argv, str(tmp_path)), as_if_cuda=True)
        assert (namespace.preset, namespace.batch_size, namespace.dtype, namespace.ac) == ("paper", 4, "bfloat16", True)
        assert namespace.shapes[:3] == [(4096, 4), (1024, 2), (8192, 4)]  # the target shape first
        assert {"ours", "zero", "dense", "ours[triton]", "ours[flex]"} <= set(namespace.variants)


def _parsed(argv: tuple, tmp_path, cuda: bool) -> dict:
    namespace, _ = check.parse_step_args(check.expand(argv, str(tmp_path)), as_if_cuda=cuda)
    return {k: v for k, v in vars(namespace).items() if not k.startswith("bench_")}  # python -m bench's own keys


@pytest.mark.parametrize("step", check.STEPS, ids=lambda s: s.name)
def test_each_dry_run_takes_the_gpus_arguments_but_sizes_and_device(step, tmp_path):
    """The dry run is the GPU's command with sizes and the device changed, nothing else: each argument its module
    parses differently is a size (check_steps.SIZE_KEYS) or declared in the step's dry_differs with its reason (and a
    declared difference is a real one); a pytest step only adds --collect-only (its CUDA tests skip on CPU)."""
    assert step.dry_triton in ("interpret", "stub")
    if step.module == "pytest":
        assert step.dry_argv == (*step.argv, "--collect-only") and not step.dry_differs
        return
    gpu, dry = _parsed(step.argv, tmp_path, True), _parsed(step.dry_argv, tmp_path, False)
    assert set(gpu) == set(dry)
    differs = {key for key in gpu if gpu[key] != dry[key]}
    undeclared = differs - SIZE_KEYS - set(step.dry_differs)
    assert not undeclared, {key: (gpu[key], dry[key]) for key in undeclared}
    assert set(step.dry_differs) <= differs  # no stale declaration


def test_the_comparison_catches_a_dry_run_that_changes_more_than_sizes(tmp_path):
    """The test above fails on the kind of difference main at d2fd6a4 had: a training step whose dry run drops
    the GPU's backend (``--ours triton``) or changes its dtype."""
    step = next(s for s in check.STEPS if s.name == "train")
    for extra in (("--dtype", "float32"), ("--variants", "ours", "zero")):
        planted = dataclasses.replace(step, dry_extra=(*step.dry_extra, *extra))
        gpu, dry = _parsed(planted.argv, tmp_path, True), _parsed(planted.dry_argv, tmp_path, False)
        differs = {key for key in gpu if gpu[key] != dry[key]} - SIZE_KEYS
        assert differs == {extra[0][2:]}


def test_a_pending_argument_is_appended_only_where_the_module_takes_it(tmp_path):
    step = next(s for s in check.STEPS if s.name == "train")
    argv = check.expand(step.dry_argv, str(tmp_path))
    fake = check.Step("x", 0, 1, step.argv, step.dry_extra, pending=("--not-an-argument",))
    assert check.accepted_pending(fake, argv) == ([], ["--not-an-argument"])
    fake = check.Step("x", 0, 1, step.argv, step.dry_extra, pending=("--unchunked-loss",))  # an argument it has
    assert check.accepted_pending(fake, argv) == (["--unchunked-loss"], [])


def test_call_is_honoured_under_dry_run(monkeypatch, tmp_path):
    seen = {}

    def fake_run_steps(steps, *, label, out, work, dry, budget_s):
        seen.update(steps=[s.name for s in steps], label=label, dry=dry)
        return 0

    monkeypatch.setattr(check, "run_steps", fake_run_steps)
    parser = check.argparse.ArgumentParser()
    check.add_arguments(parser)
    for argv, want, label in (
        (["--dry-run", "--call", "2"], check.steps_of(2), "dry_call2"),
        (["--dry-run", "--call", "1"], check.steps_of(1), "dry_call1"),
        (["--dry-run"], check.steps_of(1) + check.steps_of(2) + check.steps_of(0), "dry"),
        ([], check.steps_of(1), "call1"),
    ):
        assert check.execute(parser.parse_args([*argv, "--out", str(tmp_path), "--work", str(tmp_path)])) == 0
        assert seen == {"steps": [s.name for s in want], "label": label, "dry": "--dry-run" in argv}


def test_the_dry_run_fails_on_the_fp32_training_step(tmp_path):
    """Planted: the training step as on main at d2fd6a4 (fp32 models, the triton backend) has its dry run fail
    where the GPU would (the triton backend refuses fp32 on CUDA), through the stub driver's CUDA rules, while the
    interpreter would have taken it."""
    step = next(s for s in check.STEPS if s.name == "train")
    argv = list(step.argv)
    argv[argv.index("--dtype") + 1] = "float32"
    planted = dataclasses.replace(step, argv=tuple(argv))
    rc = check.run_steps(
        [planted], label="planted", out=str(tmp_path / "out"), work=str(tmp_path / "work"), dry=True, budget_s=None
    )
    log = (tmp_path / "work" / "train.log").read_text()
    assert rc == 1, log[-3000:]
    assert "the triton backend takes dtype in (torch.float16, torch.bfloat16) on CUDA" in log
    rows = [json.loads(line) for line in (tmp_path / "work" / "train" / "train_gpu.jsonl").read_text().splitlines()]
    by_variant = {r["variant"]: r for r in rows if r["kind"] == "variant"}
    assert by_variant["ours[triton]"]["status"] == "error" and by_variant["zero"]["status"] == "ok"


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
    assert "call 1: 380 s planned" in result.stdout and "call 2: 280 s planned" in result.stdout


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
        timeout=3600,
    )
    log = result.stdout + result.stderr
    summary = log.split("==================== summary")[-1]
    assert result.returncode == 0, summary + log[-6000:]
    report = json.loads((work / "summary_dry.json").read_text())
    assert [r["step"] for r in report["steps"]] == [s.name for s in check.dry_order()]
    assert all(r["rc"] == 0 for r in report["steps"]), report
    # Two files come back per call: the runner's log and the tarball of the work folder.
    assert sorted(os.listdir(out)) == ["gpu_check_dry.log", "gpu_check_dry.tar.gz"]
    with tarfile.open(out / "gpu_check_dry.tar.gz") as tar:
        assert "gpu_check_dry/ab_d128.json" in tar.getnames()
    # The A/B ran the default first, FlexAttention (called directly and as the backend) next, then variants.
    ab = json.loads((work / "ab_d128.json").read_text())
    methods = list(ab["rows"][0]["results"])
    assert methods[:3] == ["triton", "flex", "flex_backend"] and any(m.startswith("triton[") for m in methods), methods
    assert ab["capability"] == "cpu" and ab["config"]["dry_run"] and ab["rows"][0]["dim"] == 128
    # The training step ran its GPU variants in bf16 autocast through the stub driver; flex's CPU limit is named.
    train = [json.loads(line) for line in (work / "train" / "train_gpu.jsonl").read_text().splitlines()]
    variants = {r["variant"]: r for r in train if r["kind"] == "variant"}
    assert all(variants[v]["status"] == "ok" for v in ("ours", "zero", "dense", "ours[triton]")), variants
    assert variants["ours[flex]"]["status"] == "cpu_limit"
    assert variants["ours"]["dispatched"]  # resolved as the dispatcher would on CUDA
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
    assert gpu_variants.repeats_the_default({"KFORCING_TRITON_TILES": "base"}, 64, 1000, cpu)
    assert not gpu_variants.repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 128, 1000, cpu)
    assert gpu_variants.repeats_the_default({"KFORCING_TRITON_TILES": "wide"}, 64, 1000, cpu)  # no D=64 tiles: base
    assert gpu_variants.repeats_the_default({"KFORCING_TRITON_TILES": "hopper128"}, 128, 1000, cpu)  # base again
    assert not gpu_variants.repeats_the_default(
        {"KFORCING_TRITON_TILES": "base", "KFORCING_FLEX_BACKEND": "TRITON"}, 64, 1000, cpu
    )

"""The GPU check, planned to fit a 15-minute GPU loan: two calls on one warm machine, steps as data.

    python -m bench gpu-check                 # call 1 (<= 8 min): correctness, the A/B, the profile, the dispatch
                                              #   table, the training steps
    python -m bench gpu-check --call 2        # call 2 (<= 4 min, issued at once on the warm machine): serving, the
                                              #   README table
    python -m bench gpu-check --only smoke sampler   # the steps named (extras included), whatever their call
    python -m bench gpu-check --list          # the plan: every step, its call, budget and command
    python -m bench gpu-check --dry-run       # every step of both calls and the extras on CPU, tiny shapes

A loan gives 15 minutes of device time, the machine's start (1-2 min) included, and returns at most 8 files
from $OUT. So the plan is two calls whose step budgets sum to <= 480 s and <= 240 s
(python_tests/bench/test_gpu_check.py holds them to it), set from the H200 run's measured step times
(shared/gpu-runs/2026-11-28-h200/gc/gpu_check.log: versions 12 s, warm 84, smoke 45, pytest > 80 cold / 35 warm,
int64 12, A/B 42, dispatch 9, training steps 34 and 38, batch invariance 28). Each step runs as its own process with
its budget as a cap (plus whatever earlier steps of the call left unused), under the call's deadline (the sum); a
failing or timed-out step does not stop the ones after it. Steps write their logs and JSON into a work folder
(``--work``, default a temporary folder) as they finish; after every step the runner re-packs that folder into
``$OUT/gpu_check_call<N>.tar.gz`` and writes its own log ``$OUT/gpu_check_call<N>.log``: two files per call, so a
call cut short still returns what its finished steps wrote.

Nothing is installed (GPU machines have no network). The dry run (``--dry-run``) runs each step's ``dry_argv``: the
same module with CPU arguments (tiny shapes, fp32, the Triton interpreter, pytest collecting only), every step of
every call, no budgets (each step capped at 300 s); it must exit 0 on a CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL_LIMITS_S = {1: 480, 2: 240}  # the planned calls: what their steps' budgets may sum to
DRY_CAP_S = 300  # per step in the dry run (the Triton interpreter on 2 busy cores)
MIN_STEP_S = 20  # a step with less time left than this is skipped
# Switches a step must not inherit (the variants set their own; the dry run sets TRITON_INTERPRET itself).
CLEARED_ENV = ("TRITON_INTERPRET", "KFORCING_BACKEND", "KFORCING_TRITON_TILES", "KFORCING_TRITON_KERNELS",
               "KFORCING_TRITON_PREFETCH", "KFORCING_FLEX_BACKEND", "KFORCING_DISPATCH_TABLE")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: a Python module run as ``python <argv>`` (``{work}``: the work folder; ``{test:NAME}``: the path of
    test file NAME under python_tests/, wherever the tests' regroup put it).

    call: 1 or 2 (the planned calls) or 0 (an extra: runs only when named by ``--only`` or in the dry run).
    budget_s: the planned seconds (its cap on the GPU). dry_argv: the CPU command of the dry run. pending: arguments
    another branch adds to the module; appended only where the module's parser accepts them (so the plan runs on
    either side of that merge), and reported when it does not. placeholder: the command is a stand-in another branch
    replaces (named in ``note``)."""

    name: str
    call: int
    budget_s: int
    argv: tuple[str, ...]
    dry_argv: tuple[str, ...]
    note: str = ""
    pending: tuple[str, ...] = ()
    placeholder: bool = False

    @property
    def module(self) -> str:
        """The module ``python -m`` runs (``bench``: the command line of ``python -m bench <command>``)."""
        return self.argv[1]

    @property
    def command(self) -> str:
        """The ``python -m bench`` command (``gpu``, ``train``, ...), else the module."""
        return self.argv[2] if self.module == "bench" else self.module


def _m(module: str, *args: str) -> tuple[str, ...]:
    return ("-m", module, *args)


_SHAPES = ("--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128", "--batch-size", "1",
           "--heads", "16")
_DRY_SHAPES = ("--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--batch-size", "1", "--heads", "2")
_AB_METHODS = ("--methods", "triton", "flex", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt")
_TRAIN = ("--device", "cuda", "--preset", "paper", "--batch-size", "4", "--ours", "triton", "--warmup", "1",
          "--reps", "3", "--max-seconds", "15", "--no-progress")
_DRY_TRAIN = ("--device", "cpu", "--preset", "micro", "--seq-len", "16", "--batch-size", "1", "--warmup", "0",
              "--reps", "1", "--max-seconds", "1", "--no-progress")
_TABLE = ("--layout", "single", "--n", "1024", "4096", "8192", "--k", "2", "4", "8", "--batch-size", "1", "--heads",
          "16", "--methods", "triton", "flex", "sdpa_flash_causal", "dense_sdpa")
_DRY_TABLE = ("--layout", "single", "--n", "1024", "--k", "2", "--batch-size", "1", "--heads", "2", "--methods",
              "triton", "flex", "sdpa_flash_causal", "dense_sdpa", "--dry-run")

STEPS: tuple[Step, ...] = (
    # ---------------------------------------------------------------- call 1 (<= 480 s), by value
    Step("versions", 1, 15, _m("bench", "gpu-script", "versions"), _m("bench", "gpu-script", "versions"),
         "packages, the GPU, tile sets, composite_cuda's kernels, the dispatch table in use (measured: 12 s)"),
    Step("warm", 1, 90, _m("bench", "gpu", "--warm", *_SHAPES, *_AB_METHODS, "--json", "{work}/warm.json"),
         _m("bench", "gpu", "--warm", *_DRY_SHAPES, *_AB_METHODS, "--json", "{work}/warm.json", "--dry-run"),
         "compiles and autotunes every kernel the A/B times, so later caps do not pay for it (measured: 84 s)"),
    Step("smoke", 1, 50, _m("bench", "gpu-script", "smoke"), _m("bench", "gpu-script", "smoke", "--dry-run"),
         "bf16 vs float64 within 2x torch's error (composite 3x), bitwise repeatable, both D=128 tile sets, flex, "
         "composite (45 s)"),
    Step("pytest_gpu", 1, 90,
         _m("pytest", "{test:test_triton_gpu.py}", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=10",
            "--maxfail=4", "--junitxml={work}/pytest_gpu.xml"),
         _m("pytest", "{test:test_triton_gpu.py}", "-q", "-p", "no:cacheprovider", "--collect-only"),
         "the CUDA tests; cold it compiles its own shapes (timed out at 80 s; 35 s warm)"),
    Step("int64_offsets", 1, 15, _m("bench", "gpu-script", "int64"),
         _m("bench", "gpu-script", "int64", "--dry-run"), "> 2^31 elements per tensor (measured: 12 s)"),
    Step("batch_invariance", 1, 35,
         _m("bench", "batch-invariance", "--n", "1024", "--k", "4", "--dims", "64", "128", "--batch-sizes", "2,4,8,16",
            "--json", "{work}/batch_invariance.json"),
         _m("bench", "batch-invariance", "--n", "4", "--k", "2", "--dims", "32", "--batch-sizes", "2", "--json",
            "{work}/batch_invariance.json", "--device", "cpu", "--backend", "triton", "--layouts", "single",
            "--heads", "1", "--teacher-n", "8"),
         "bitwise batch invariance, forward and backward, every config forced; teacher targets (measured: 28 s)"),
    Step("ab", 1, 45, _m("bench", "gpu", *_SHAPES, *_AB_METHODS, "--json", "{work}/bench_ab.json"),
         _m("bench", "gpu", *_DRY_SHAPES, *_AB_METHODS, "--json", "{work}/bench_ab.json", "--dry-run"),
         "the default vs compiled FlexAttention (direct and backend='flex') and gpu_variants.txt (42 s)"),
    Step("profile", 1, 50,
         _m("bench", "profile", "--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128",
            "--methods", "triton", "flex_backend", "--reps", "5", "--json", "{work}/profile.json"),
         _m("bench", "profile", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--methods",
            "triton", "flex_backend", "--reps", "5", "--json", "{work}/profile.json", "--dry-run"),
         "per-kernel GPU time vs host enqueue, all four shapes, the default and backend='flex' (with every variant "
         "it reached one shape in 45 s: the variants' profile is the extra step profile_variants)"),
    Step("dispatch_table", 1, 10,
         _m("bench", "dispatch-table", "{work}/bench_ab.json", "--out", "{work}/dispatch_table.json", "--command",
            "python -m bench gpu-check"),
         _m("bench", "dispatch-table", "{work}/bench_ab.json", "--out", "{work}/dispatch_table.json", "--command",
            "python -m bench gpu-check"),
         "the A/B's winners with their provenance (measured: 9 s)"),
    Step("train_n1024", 1, 40,
         _m("bench", "train", *_TRAIN, "--seq-len", "1024", "--k", "2", "--out", "{work}/train_n1024"),
         _m("bench", "train", *_DRY_TRAIN, "--k", "1", "--out", "{work}/train_n1024"),
         "paper backbone (12 x 768), N=1024, B=4, teacher k 2 -> student 4, activation checkpointing (34 s measured "
         "without it)", pending=("--ac",)),
    Step("train_n4096", 1, 40,
         _m("bench", "train", *_TRAIN, "--seq-len", "4096", "--k", "4", "--out", "{work}/train_n4096"),
         _m("bench", "train", *_DRY_TRAIN, "--k", "2", "--out", "{work}/train_n4096"),
         "N=4096, B=4, k 4 -> 8 with activation checkpointing (without it: out of memory, 38 s)", pending=("--ac",)),
    # ---------------------------------------------------------------- call 2 (<= 240 s)
    Step("serving", 2, 150,
         _m("bench", "infer", "--paper", "--device", "cuda", "--compile", "cudagraph", "--hf", "eager", "--hf-reps",
            "1", "--no-progress", "--out", "{work}/serving"),
         _m("bench", "infer", "--quick", "--device", "cpu", "--batch-sizes", "2", "--new-tokens", "4", "--warmup",
            "0", "--reps", "1", "--hf", "eager", "--no-progress", "--out", "{work}/serving"),
         "K-Forcing's Table 1 protocol (issue 50): paper backbone, bf16, 64-token prompts to 1,024 tokens, AR and "
         "k = 2 / 4 on both caches at batch 4 / 16 / 128, the decode step captured in a CUDA graph, 1 warm-up + 3 "
         "timed runs, each row written as it finishes; + HF generate (static cache, eager) timed once; estimated "
         "~2 min (the eager step took > 170 s for batch 4 alone)"),
    Step("table_d64", 2, 45, _m("bench", "gpu", *_TABLE, "--dim", "64", "--json", "{work}/table_d64.json"),
         _m("bench", "gpu", *_DRY_TABLE, "--dim", "64", "--json", "{work}/table_d64.json"),
         "the README table (render: python -m bench gpu --render table_d*.json)"),
    Step("table_d128", 2, 45, _m("bench", "gpu", *_TABLE, "--dim", "128", "--json", "{work}/table_d128.json"),
         _m("bench", "gpu", *_DRY_TABLE, "--dim", "64", "--json", "{work}/table_d128.json"),
         "the README table at D=128"),
    # ---------------------------------------------------------------- extras (--only NAME), not in either call
    Step("serving_capture", 0, 150,
         _m("pytest", "{test:test_static_step_cuda.py}", "-q", "-p", "no:cacheprovider", "-rfEs",
            "--junitxml={work}/serving_capture.xml"),
         _m("pytest", "{test:test_static_step_cuda.py}", "-q", "-p", "no:cacheprovider", "--collect-only"),
         "issue 50: a CUDA-graph replay gives the eager step's bits, the compiled step (reduce-overhead) the eager "
         "tokens, AR and k = 4, both caches (inductor compiles: minutes)"),
    Step("sampler", 0, 20, _m("bench", "gpu-script", "sampler"),
         _m("bench", "gpu-script", "sampler", "--dry-run"),
         "the Triton sampler vs float64 (equal on the H200, 13 s)"),
    Step("profile_variants", 0, 120,
         _m("bench", "profile", "--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128",
            "--methods", "triton", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt", "--reps", "5", "--json",
            "{work}/profile_variants.json"),
         _m("bench", "profile", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--methods",
            "triton", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt", "--reps", "5", "--json",
            "{work}/profile_variants.json", "--dry-run"),
         "the profile of every variant too (one shape took 45 s)"),
    Step("grid_d128", 0, 30,
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "4096", "8192", "--k", "2", "4", "8", "--dim",
            "128", "--batch-size", "1", "--heads", "16", "--methods", "triton", "sdpa_flash_causal", "fa2_causal",
            "--triton-tiles", "auto", "base", "--json", "{work}/bench_single_d128.json"),
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "--k", "2", "--dim", "64", "--batch-size", "1",
            "--heads", "2", "--methods", "triton", "sdpa_flash_causal", "fa2_causal", "--triton-tiles", "auto",
            "base", "--json", "{work}/bench_single_d128.json", "--dry-run"),
         "triton (auto and base tiles) vs SDPA flash causal and flash-attn (21 s)"),
    Step("in_tile", 0, 25,
         _m("bench", "gpu", "--layout", "single", "double", "--n", "1024", "8192", "--k", "2", "4", "--dim", "128",
            "--batch-size", "1", "--heads", "16", "--methods", "triton", "--slot-window-max", "0", "--json",
            "{work}/bench_in_tile_d128.json"),
         _m("bench", "gpu", "--layout", "single", "double", "--n", "1024", "--k", "2", "--dim", "64",
            "--batch-size", "1", "--heads", "2", "--methods", "triton", "--slot-window-max", "0", "--json",
            "{work}/bench_in_tile_d128.json", "--dry-run"),
         "every window's intra part in-tile: the slot-step threshold (16 s)"),
    Step("composite_dense", 0, 25,
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "2048", "--k", "4", "--dim", "64", "128",
            "--batch-size", "1", "--heads", "16", "--methods", "triton", "sdpa_flash_causal", "composite",
            "dense_sdpa", "--json", "{work}/bench_composite_dense.json"),
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--batch-size", "1",
            "--heads", "2", "--methods", "triton", "sdpa_flash_causal", "composite", "dense_sdpa", "--json",
            "{work}/bench_composite_dense.json", "--dry-run"),
         "the composite CUDA path and dense-mask SDPA (18 s)"),
)


def steps_of(call: int) -> list[Step]:
    return [s for s in STEPS if s.call == call]


def planned_seconds(call: int) -> int:
    """The sum of a call's step budgets (what its deadline is)."""
    return sum(s.budget_s for s in steps_of(call))


# ---------------------------------------------------------------------- commands


def find_test(name: str, root: str = ROOT) -> str:
    """The path (relative to ``root``) of test file ``name`` under python_tests/ (the tests move into folders)."""
    hits = sorted(glob.glob(os.path.join(root, "python_tests", "**", name), recursive=True))
    if not hits:
        raise FileNotFoundError(f"{name}: no such test file under {root}/python_tests")
    return os.path.relpath(hits[0], root)


def expand(argv: tuple[str, ...], work: str, root: str = ROOT) -> list[str]:
    """``argv`` with ``{work}`` and ``{test:NAME}`` filled in."""
    out = []
    for a in argv:
        while "{test:" in a:
            start = a.index("{test:")
            end = a.index("}", start)
            a = a[:start] + find_test(a[start + 6:end], root) + a[end + 1:]
        out.append(a.replace("{work}", work))
    return out


class _Parsed(Exception):
    def __init__(self, namespace, extras):
        super().__init__("parsed")
        self.namespace, self.extras = namespace, extras


def parse_step_args(argv: list[str], as_if_cuda: bool = False) -> tuple[argparse.Namespace, list[str]]:
    """``(namespace, unknown args)`` of ``python <argv>`` as its module's own argparse reads them: the module runs as
    ``__main__`` (as ``python -m`` would) and is stopped at its first parse. SystemExit when argparse refuses them
    (pytest steps are not handled here: the dry run collects them). ``as_if_cuda``: torch reports one CUDA device
    meanwhile (a CPU machine checking the GPU commands, whose ``--device cuda`` is checked against the machine)."""
    import contextlib
    import runpy
    from unittest import mock

    import torch

    if argv[0] != "-m":
        raise ValueError(f"argv: expected '-m MODULE ...', got {argv[:2]}")
    real = argparse.ArgumentParser.parse_known_args

    def intercept(self, args=None, namespace=None):
        namespace, extras = real(self, args, namespace)
        raise _Parsed(namespace, extras)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(argparse.ArgumentParser, "parse_known_args", intercept))
        stack.enter_context(mock.patch.object(sys, "argv", [argv[1], *argv[2:]]))
        if as_if_cuda:
            stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: True))
            stack.enter_context(mock.patch.object(torch.cuda, "device_count", lambda: 1))
        # runpy warns when the module was imported before (the test process, the runner): harmless here.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        except _Parsed as parsed:
            return parsed.namespace, list(parsed.extras)
    raise RuntimeError(f"{argv[1]}: ran to the end without parsing arguments")


def accepted_pending(step: Step, argv: list[str]) -> tuple[list[str], list[str]]:
    """(the pending args the module accepts here, those it does not) for ``argv`` (the step's expanded command)."""
    if not step.pending:
        return [], []
    try:
        _, extras = parse_step_args([*argv, *step.pending])
    except SystemExit:
        return [], list(step.pending)
    missing = [a for a in step.pending if a in extras]
    return [a for a in step.pending if a not in missing], missing


# ---------------------------------------------------------------------- running


def _child_env(dry: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_PRINT_AUTOTUNING"] = "1"  # the config each autotuned kernel picks, and how long tuning took
    if dry:
        env["TRITON_INTERPRET"] = "1"
    return env


def _run(cmd: list[str], log_path: str, cap_s: float, env: dict) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log_path``, killed (its whole process group) after ``cap_s``: (rc, seconds);
    rc 124 when it timed out."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = 124
    return rc, time.monotonic() - t0


def _tail(path: str, lines: int = 12) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _pack(work: str, tar_path: str) -> None:
    tmp = tar_path + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname=os.path.basename(tar_path).replace(".tar.gz", ""))
    os.replace(tmp, tar_path)


class _Tee:
    def __init__(self, path: str):
        self.file = open(path, "a")

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def _gpu_state(say) -> None:
    if shutil.which("nvidia-smi"):
        query = "name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used,utilization.gpu"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True,
                             timeout=20)
        say(out.stdout.strip())


def run_steps(steps: list[Step], *, label: str, out: str, work: str, dry: bool, budget_s: Optional[float]) -> int:
    """Run ``steps`` in order; their files in ``work``, re-packed into ``out``/gpu_check_<label>.tar.gz after each."""
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    say = _Tee(os.path.join(out, f"gpu_check_{label}.log"))
    tar_path = os.path.join(out, f"gpu_check_{label}.tar.gz")
    deadline = None if dry or budget_s is None else time.monotonic() + budget_s
    env = _child_env(dry)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    say(f"gpu-check {label}: {len(steps)} step(s), planned {sum(s.budget_s for s in steps)} s"
        f"{'' if deadline is None else f', deadline {budget_s:.0f} s'}{', DRY RUN (CPU)' if dry else ''}; "
        f"root {ROOT} at {commit or '(not a git checkout)'}; work {work}; python {sys.executable}")
    if not dry:
        _gpu_state(say)
    summary, banked, failed = [], 0.0, 0
    started = time.monotonic()
    for step in steps:
        argv = expand(step.dry_argv if dry else step.argv, work)
        notes = []
        if step.pending:
            accepted, missing = accepted_pending(step, argv)
            argv += accepted
            if missing:
                notes.append(f"pending args not in this checkout, run without: {' '.join(missing)}")
        if step.placeholder:
            notes.append("placeholder command")
        cap = DRY_CAP_S if dry else step.budget_s + banked
        if deadline is not None:
            cap = min(cap, deadline - time.monotonic())
        log_path = os.path.join(work, f"{step.name}.log")
        say(f"==================== [{step.name}] call {step.call}, budget {step.budget_s} s, cap {cap:.0f} s, "
            f"elapsed {time.monotonic() - started:.0f} s" + "".join(f"; {n}" for n in notes))
        if cap < MIN_STEP_S:
            say(f"[{step.name}] SKIPPED: {cap:.0f} s left")
            summary.append({"step": step.name, "rc": None, "seconds": 0, "skipped": "no time left", "notes": notes})
            failed = failed or dry
            continue
        cmd = [sys.executable, *argv]
        say("$ " + " ".join(cmd))
        rc, seconds = _run(cmd, log_path, cap, env)
        say(_tail(log_path).rstrip())
        say(f"[{step.name}] rc={rc}{' (TIMED OUT)' if rc == 124 else ''}, {seconds:.0f} s")
        if not dry:
            banked = max(0.0, step.budget_s + banked - seconds)
        summary.append({"step": step.name, "rc": rc, "seconds": round(seconds, 1), "budget_s": step.budget_s,
                        "notes": notes})
        failed = failed or rc != 0
        with open(os.path.join(work, f"summary_{label}.json"), "w") as f:
            json.dump({"label": label, "dry_run": dry, "commit": commit, "steps": summary}, f, indent=1)
        _pack(work, tar_path)
    if not dry:
        _gpu_state(say)
    say(f"==================== summary ({time.monotonic() - started:.0f} s; files in {work}, packed in {tar_path})")
    for row in summary:
        state = row.get("skipped") or f"rc={row['rc']}{' TIMED OUT' if row['rc'] == 124 else ''}"
        say(f"  {row['step']}: {state}, {row['seconds']} s" + "".join(f"; {n}" for n in row["notes"]))
    _pack(work, tar_path)
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--call", type=int, choices=sorted(CALL_LIMITS_S), default=1, help="which planned call to run")
    p.add_argument("--only", nargs="+", metavar="STEP", default=None,
                   help="run only these steps (of any call, extras included), in plan order")
    p.add_argument("--dry-run", action="store_true",
                   help="every step of every call and the extras on CPU with its dry_argv (tiny shapes, fp32, the "
                        "Triton interpreter); exit 1 if any fails")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--out", default=None, help="where the log and the tarball go (default: $OUT, else ./gpu-out)")
    p.add_argument("--work", default=None, help="the steps' files (default: a new temporary folder)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the call's deadline in seconds (default: the sum of its steps' budgets)")


def print_plan() -> None:
    for call in (1, 2, 0):
        name = f"call {call}" if call else "extras (--only NAME)"
        total = planned_seconds(call)
        limit = CALL_LIMITS_S.get(call)
        print(f"{name}: {total} s planned" + (f" (limit {limit} s)" if limit else ""))
        for s in steps_of(call):
            flags = (" [PLACEHOLDER]" if s.placeholder else "") + (f" [pending: {' '.join(s.pending)}]" if s.pending
                                                                  else "")
            print(f"  {s.name:17s} {s.budget_s:4d} s  python {' '.join(s.argv)}{flags}")
            print(f"  {'':17s}         {s.note}")


def execute(args) -> int:
    if args.list:
        print_plan()
        return 0
    known = {s.name for s in STEPS}
    unknown = [name for name in args.only or () if name not in known]
    if unknown:
        print(f"gpu-check: --only: unknown step(s) {unknown}; expected names from {sorted(known)}", file=sys.stderr)
        return 2
    if args.only:
        steps, label = [s for s in STEPS if s.name in args.only], "only"
    elif args.dry_run:
        steps, label = [s for s in STEPS if s.call == 1] + [s for s in STEPS if s.call != 1], "dry"
    else:
        steps, label = steps_of(args.call), f"call{args.call}"
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(ROOT, "gpu-out"))
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix=f"gpu_check_{label}_")
    budget = args.budget_s if args.budget_s is not None else sum(s.budget_s for s in steps)
    return run_steps(steps, label=label, out=out, work=work, dry=args.dry_run, budget_s=budget)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return execute(p.parse_args(argv))


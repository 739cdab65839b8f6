"""The GPU check, planned to fit a 15-minute GPU loan: two calls on one machine, steps as data (check_steps.py).

    python -m bench gpu-check                 # call 1 (<= 380 s): the D=128 A/B with its correctness check, the
                                              #   training step, the dispatch table, batch invariance, the CUDA tests
    python -m bench gpu-check --call 2        # call 2 (<= 280 s): serving (capture check first), the vLLM slot, the
                                              #   D=64 A/B with its correctness check
    python -m bench gpu-check --only smoke_d128 sampler   # the steps named (extras included), whatever their call
    python -m bench gpu-check --list          # the plan: every step, its call, budget and command, and the total
    python -m bench gpu-check --dry-run [--call N]   # the steps on CPU with the GPU's arguments at reduced sizes

A loan gives 15 minutes of device time, the machine's start (1-2 min) included, and returns at most 8 files
from $OUT. So the step budgets of both calls sum to <= 660 s (python_tests/bench/test_gpu_check.py holds them to it),
leaving 4 minutes for the start, the transfers and the gap between the calls. Each call is self-sufficient: every
step warms what it times (first calls untimed), so call 2 runs on a fresh machine too. In each call the decisive
measurement comes first: call 1 the D=128 forward + backward A/B (after the correctness of every tile set it times)
and the training step; call 2 the CUDA-graph capture check, AR and k = 4 at each batch size, then k = 2 and the HF
baseline, then the D=64 A/B. Budgets are set from the H200 run's measured step times
(shared/gpu-runs/2026-11-28-h200/gc/gpu_check.log). Each step runs as its own process with its budget as a cap
(plus whatever earlier steps of the call left unused), under the call's deadline (the sum); a failing or timed-out
step does not stop the ones after it, and every measuring step writes its rows as they finish. Steps write their logs
and JSON into a work folder (``--work``, default a temporary folder); after every step the runner re-packs that
folder into ``$OUT/gpu_check_call<N>.tar.gz`` and writes its own log ``$OUT/gpu_check_call<N>.log``: two files per
call, so a call cut short still returns what its finished steps wrote.

Nothing is installed (GPU machines have no network). The dry run (``--dry-run``) runs each step's ``dry_argv``: its
GPU arguments plus its ``dry_extra`` (reduced sizes, the CPU), every step of ``--call N`` (all steps without it), no
budgets (each step capped at 600 s); Triton runs in its interpreter (the correctness and A/B steps) or through the
stub driver with CUDA's rules (the training step: what CUDA refuses fails there too); it must exit 0 on a CPU machine.
"""

from __future__ import annotations

import argparse
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

from .check_steps import STEPS, Step, dry_order, planned_seconds, steps_of  # the plan's data; tests use them here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL_LIMITS_S = {1: 380, 2: 280}  # the planned calls: what their steps' budgets may sum to
TOTAL_LIMIT_S = 660  # both calls' step caps together: 11 of the loan's 15 minutes
DRY_CAP_S = 600  # per step in the dry run (the interpreter, or sm_90a compiles, on 2 busy cores)
MIN_STEP_S = 20  # a step with less time left than this is skipped
# Switches a step must not inherit (the variants set their own; the dry run sets TRITON_INTERPRET itself).
CLEARED_ENV = (
    "TRITON_INTERPRET",
    "KFORCING_BACKEND",
    "KFORCING_TRITON_TILES",
    "KFORCING_TRITON_KERNELS",
    "KFORCING_TRITON_PREFETCH",
    "KFORCING_FLEX_BACKEND",
    "KFORCING_DISPATCH_TABLE",
)


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
            a = a[:start] + find_test(a[start + 6 : end], root) + a[end + 1 :]
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


def _child_env(dry: bool, step: Optional[Step] = None, work: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_PRINT_AUTOTUNING"] = "1"  # the config each autotuned kernel picks, and how long tuning took
    if dry and (step is None or step.dry_triton == "interpret"):
        env["TRITON_INTERPRET"] = "1"
    for name, value in step.env if step is not None else ():
        env[name] = expand((value,), work)[0]
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
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=20
        )
        say(out.stdout.strip())


def run_steps(steps: list[Step], *, label: str, out: str, work: str, dry: bool, budget_s: Optional[float]) -> int:
    """Run ``steps`` in order; their files in ``work``, re-packed into ``out``/gpu_check_<label>.tar.gz after each."""
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    say = _Tee(os.path.join(out, f"gpu_check_{label}.log"))
    tar_path = os.path.join(out, f"gpu_check_{label}.tar.gz")
    deadline = None if dry or budget_s is None else time.monotonic() + budget_s
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    say(
        f"gpu-check {label}: {len(steps)} step(s), planned {sum(s.budget_s for s in steps)} s"
        f"{'' if deadline is None else f', deadline {budget_s:.0f} s'}{', DRY RUN (CPU)' if dry else ''}; "
        f"root {ROOT} at {commit or '(not a git checkout)'}; work {work}; python {sys.executable}"
    )
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
        say(
            f"==================== [{step.name}] call {step.call}, budget {step.budget_s} s, cap {cap:.0f} s, "
            f"elapsed {time.monotonic() - started:.0f} s" + "".join(f"; {n}" for n in notes)
        )
        if cap < MIN_STEP_S:
            say(f"[{step.name}] SKIPPED: {cap:.0f} s left")
            summary.append({"step": step.name, "rc": None, "seconds": 0, "skipped": "no time left", "notes": notes})
            failed = failed or dry
            continue
        cmd = [sys.executable, *argv]
        say("$ " + "".join(f"{n}={expand((v,), work)[0]} " for n, v in step.env) + " ".join(cmd))
        rc, seconds = _run(cmd, log_path, cap, _child_env(dry, step, work))
        say(_tail(log_path).rstrip())
        say(f"[{step.name}] rc={rc}{' (TIMED OUT)' if rc == 124 else ''}, {seconds:.0f} s")
        if not dry:
            banked = max(0.0, step.budget_s + banked - seconds)
        summary.append(
            {"step": step.name, "rc": rc, "seconds": round(seconds, 1), "budget_s": step.budget_s, "notes": notes}
        )
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
    p.add_argument(
        "--call",
        type=int,
        choices=sorted(CALL_LIMITS_S),
        default=None,
        help="which planned call to run (default 1; with --dry-run: every step unless given)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="STEP",
        default=None,
        help="run only these steps (of any call, extras included), in plan order",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the steps of --call N (every step without it) on CPU with their dry_argv (the GPU's arguments at "
        "reduced sizes); exit 1 if any fails",
    )
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--out", default=None, help="where the log and the tarball go (default: $OUT, else ./gpu-out)")
    p.add_argument("--work", default=None, help="the steps' files (default: a new temporary folder)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the call's deadline in seconds (default: the sum of its steps' budgets)",
    )


def print_plan() -> None:
    total = planned_seconds(1) + planned_seconds(2)
    print(f"plan: {total} s of step caps in calls 1 + 2 (limit {TOTAL_LIMIT_S} s of the loan's 900 s)")
    for call in (1, 2, 0):
        name = f"call {call}" if call else "extras (--only NAME)"
        total = planned_seconds(call)
        limit = CALL_LIMITS_S.get(call)
        print(f"{name}: {total} s planned" + (f" (limit {limit} s)" if limit else ""))
        for s in steps_of(call):
            flags = (" [PLACEHOLDER]" if s.placeholder else "") + (
                f" [pending: {' '.join(s.pending)}]" if s.pending else ""
            )
            print(f"  {s.name:17s} {s.budget_s:4d} s  python {' '.join(s.argv)}{flags}")
            print(f"  {'':17s}         {s.note}")
            differs = "".join(f"; {key}: {why}" for key, why in s.dry_differs.items())
            print(f"  {'':17s}         dry run ({s.dry_triton}): python {' '.join(s.dry_argv)}{differs}")


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
        steps, label = (dry_order(), "dry") if args.call is None else (steps_of(args.call), f"dry_call{args.call}")
    else:
        call = args.call or 1
        steps, label = steps_of(call), f"call{call}"
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(ROOT, "gpu-out"))
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix=f"gpu_check_{label}_")
    budget = args.budget_s if args.budget_s is not None else sum(s.budget_s for s in steps)
    return run_steps(steps, label=label, out=out, work=work, dry=args.dry_run, budget_s=budget)

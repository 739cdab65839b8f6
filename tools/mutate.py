"""Mutation check: plant each bug of tools/mutations.py in a scratch copy and run the tests that must catch it.

    python -m tools.mutate                 # every mutation; `make mutate` runs this
    python -m tools.mutate --only composite-prefix-dk-= --only per-position-nll-reversed
    python -m tools.mutate --list

The working tree is copied once to a scratch folder (without .git, build outputs and
caches); each mutation replaces one exact string (it must occur exactly once, else the
harness stops: the list is stale), runs its test selection with a timeout, and restores
the file. C++ mutations rebuild the extension in the scratch copy and restore the built
module afterwards. First each distinct test selection runs unmutated (the baseline): a
selection that fails without a mutation would "catch" everything. The table lists
mutation, caught, the first failing test and seconds; the exit status is 1 when any
mutation survives or any baseline fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.mutations import MUTATIONS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "*.o")
PYTEST = ["-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider"]


class MutationError(RuntimeError):
    pass


def apply(scratch: Path, mutation: dict) -> str:
    """Plants the mutation; returns the original text of the file."""
    path = scratch / mutation["file"]
    text = path.read_text()
    count = text.count(mutation["old"])
    if count != 1:
        raise MutationError(
            f"{mutation['id']}: expected {mutation['old']!r} exactly once in {mutation['file']}, found {count}"
        )
    path.write_text(text.replace(mutation["old"], mutation["new"]))
    return text


def first_failure(output: str) -> str:
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (\S+)", line)
        if m:
            return m.group(2)
    return ""


def run_tests(scratch: Path, python: str, mutation: dict, timeout: float) -> tuple[str, str, float, str]:
    """(status, first failing test, seconds, output tail); status is 'pass', 'fail' or 'timeout'."""
    env = dict(os.environ, PYTHONPATH=str(scratch), **mutation.get("env", {}))
    env.pop("KFORCING_REQUIRE_EXT", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, *PYTEST, *mutation["tests"]], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - t0, ""
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "pass", "", seconds, out[-1500:]
    if proc.returncode == 5:  # nothing collected: the selection is stale
        return "error", "no tests collected", seconds, out[-1500:]
    return "fail", first_failure(out) or f"exit {proc.returncode}", seconds, out[-1500:]


def rebuild(scratch: Path, python: str) -> None:
    proc = subprocess.run(
        [python, "setup.py", "build_ext", "--inplace"],
        cwd=scratch,
        capture_output=True,
        text=True,
        env=dict(os.environ, KFORCING_BUILD_EXT="1"),
    )
    if proc.returncode != 0:
        raise MutationError(f"extension rebuild failed in {scratch}:\n{(proc.stdout + proc.stderr)[-3000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these mutation ids (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs of each test selection")
    parser.add_argument("--baseline-only", action="store_true", help="only the unmutated runs")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs pytest (default: this one)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args(argv)

    ids = [m["id"] for m in MUTATIONS]
    if len(set(ids)) != len(ids):
        raise MutationError("tools/mutations.py: duplicate ids")
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - set(ids))
        if unknown:
            parser.error(f"argument --only: unknown mutation ids {unknown}; see --list")
        chosen = [m for m in MUTATIONS if m["id"] in args.only]
    if args.list:
        for m in chosen:
            print(f"{m['id']:42s} {m['file']}  ->  {' '.join(m['tests'])}")
        return 0

    scratch_root = Path(tempfile.mkdtemp(prefix="kf-mutate-"))
    scratch = scratch_root / "repo"
    shutil.copytree(ROOT, scratch, ignore=IGNORE)
    print(f"scratch copy: {scratch}", flush=True)
    ok = True
    try:
        for m in chosen:  # every mutation applies (and is reverted) before anything runs
            path = scratch / m["file"]
            original = apply(scratch, m)
            path.write_text(original)

        if not args.no_baseline:
            selections = {}
            for m in chosen:
                selections.setdefault((tuple(m["tests"]), tuple(sorted(m.get("env", {}).items()))), m)
            for (tests, _), m in selections.items():
                status, failing, seconds, tail = run_tests(scratch, args.python, m, args.timeout)
                print(f"baseline {' '.join(tests)}: {status} ({seconds:.0f} s)", flush=True)
                if status != "pass":
                    print(tail)
                    ok = False
            if not ok:
                print("baseline failures: fix them before reading the mutation results")
                return 1
        if args.baseline_only:
            return 0

        rows = []
        so = {}
        for m in chosen:
            path = scratch / m["file"]
            original = apply(scratch, m)
            if m.get("rebuild"):
                so = {p: p.read_bytes() for p in (scratch / "kforcing_kernels").glob("_C*.so")}
            try:
                t0 = time.perf_counter()
                if m.get("rebuild"):
                    rebuild(scratch, args.python)
                build_s = time.perf_counter() - t0
                status, failing, seconds, tail = run_tests(scratch, args.python, m, args.timeout)
            finally:
                path.write_text(original)
                if m.get("rebuild"):
                    for p, blob in so.items():
                        p.write_bytes(blob)
            caught = status in ("fail", "timeout")
            ok &= caught and status != "error"
            rows.append(
                (
                    m["id"],
                    "yes" if caught else ("STALE" if status == "error" else "NO"),
                    failing or status,
                    seconds,
                    build_s,
                )
            )
            print(f"{m['id']}: {rows[-1][1]} {rows[-1][2]} ({seconds:.0f} s)", flush=True)
            if not caught:
                print(tail)

        print("\n| mutation | caught | test that caught it | seconds |\n|---|---|---|---|")
        for mid, caught, failing, seconds, build_s in rows:
            extra = f" (+{build_s:.0f} s rebuild)" if build_s > 1 else ""
            print(f"| {mid} | {caught} | {failing} | {seconds:.1f}{extra} |")
        print(f"\n{sum(r[1] == 'yes' for r in rows)}/{len(rows)} mutations caught")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

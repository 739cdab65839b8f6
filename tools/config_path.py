"""How far a training config travels: the package modules `kforcing-train stage2 ...` passes through, from the
command line to the first training step, counted with ``sys.setprofile``.

    python -m tools.config_path            # trains a tiny stage0 and stage1 in a temporary folder first (~1 min)
    python -m tools.config_path --list     # also the modules, and the path as module:function hops

Counted: every call into a function of ``kforcing_kernels`` (imports, i.e. module bodies, are not calls) until
the objectives' first ``compute_loss`` (or the context-parallel loss). "Modules" is how many distinct modules
ran; "returns" is how many times the path came back into a module it had already been in and left (a
measure of back and forth between modules). Deterministic for a given tree (no timing).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import kforcing_kernels
from kforcing_kernels.app.train import main as train_main

PACKAGE = os.path.dirname(kforcing_kernels.__file__)
STEP = ("compute_loss", "context_parallel_loss")


class _Step(Exception):
    pass


def trace(argv: list[str]) -> list[tuple[str, str]]:
    """``[(module path, function)]`` of each move into another module, from ``main(argv)`` to the first step."""
    hops: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(PACKAGE) or code.co_name == "<module>":
            return
        if code.co_name in STEP:
            sys.setprofile(None)
            raise _Step
        module = os.path.relpath(code.co_filename, PACKAGE)
        if not hops or hops[-1][0] != module:
            hops.append((module, code.co_name))

    sys.setprofile(profile)
    try:
        train_main(argv)
    except _Step:
        pass
    finally:
        sys.setprofile(None)
    return hops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.config_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="also print the modules and the hops")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = str(Path(PACKAGE) / "layouts")  # the package's own text: no download, the same on every machine
        common = [
            "--data",
            data,
            "--vocab-size",
            "300",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--no-progress",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--steps",
            "2",
        ]
        train_main(["stage0", "--out", str(work / "s0"), "--preset", "micro", *common])
        train_main(["stage1", "--out", str(work / "s1"), "--teacher", str(work / "s0"), "--k", "1", *common])
        hops = trace(["stage2", "--out", str(work / "s2"), "--teacher", str(work / "s1"), *common])
    modules, returns, seen = sorted({m for m, _ in hops}), 0, set()
    for module, _ in hops:
        returns += module in seen
        seen.add(module)
    print(f"modules passed through: {len(modules)}; returns to a module already left: {returns}; hops: {len(hops)}")
    if args.list:
        print("\n".join(f"  {m}" for m in modules))
        print(" > ".join(f"{m}:{f}" for m, f in hops))


if __name__ == "__main__":
    main()

"""Command-line pieces shared by the bench scripts: common flags, profile defaults, the
echoed command line, default output folders and the JSON/CSV report files."""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
import time

from tqdm import tqdm

from kforcing_kernels.app.cli import add_device, add_preset, add_threads, non_negative_int, positive_float, positive_int


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--preset`` and ``--override`` of the model benchmarks (train, infer)."""
    add_preset(p, "tiny")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="model config override, e.g. n_layer=2 (repeatable)",
    )


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """Repetitions of every measurement; None takes the profile's (quick or full) value."""
    p.add_argument(
        "--warmup", type=non_negative_int, default=None, help="untimed runs before timing (None: the profile's)"
    )
    p.add_argument("--reps", type=positive_int, default=None, help="timed runs (None: the profile's)")
    p.add_argument(
        "--max-seconds",
        type=positive_float,
        default=None,
        help="stop repeating a measurement after this long, keeping >= 3 runs (None: the profile's)",
    )


def add_progress_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.add_argument("--verbose", action="store_true", help="also one line per configuration on stderr")


def progress_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr (count, rate, ETA). Redrawn at most every 10 s when stderr is not a terminal (logs)."""
    live = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit="config",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=live,
        mininterval=0.1 if live else 10.0,
    )


def add_run_args(p: argparse.ArgumentParser, out_prefix: str) -> None:
    """Device, threads, repetitions, output folder and progress of the model benchmarks."""
    add_device(p)
    add_threads(p)
    add_timing_args(p)
    p.add_argument("--out", default=None, help=f"output folder (None: runs/{out_prefix}<UTC time>)")
    add_progress_args(p)


def apply_profile(args: argparse.Namespace, profile: dict, keys) -> None:
    """Options left unset on the command line take the profile's (quick or full) value."""
    for key in keys:
        if getattr(args, key) is None:
            setattr(args, key, profile[key])


def parse_overrides(p: argparse.ArgumentParser, items: list[str]) -> dict[str, int]:
    """``["n_layer=2", ...]`` -> ``{"n_layer": 2}``; anything else is a usage error."""
    overrides = {}
    for item in items:
        field, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            p.error(f"--override: expected FIELD=INT, got {item!r}")
        overrides[field] = int(value)
    return overrides


def default_out(prefix: str) -> str:
    """``runs/<prefix><UTC time>``."""
    return os.path.join("runs", prefix + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))


def command_line(prog: str, argv) -> str:
    """The command as typed (``argv`` None: this process's own arguments), recorded in every report."""
    return " ".join([prog] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])


def write_json(report: dict, path: str, *, indent: int = 1) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=indent)


def write_csv(report: dict, path: str) -> None:
    """``report["rows"]`` as CSV; the columns are the union of the rows' keys."""
    rows = report["rows"]
    fields = list(dict.fromkeys(key for row in rows for key in row))  # union, first-seen order
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_report_files(report: dict, out: str, name: str) -> None:
    """``<out>/<name>.json`` and ``<out>/<name>.csv``, and say so on stdout."""
    os.makedirs(out, exist_ok=True)
    write_json(report, os.path.join(out, f"{name}.json"))
    write_csv(report, os.path.join(out, f"{name}.csv"))
    print(f"\nwrote {out}/{name}.json, {out}/{name}.csv")

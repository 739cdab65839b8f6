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

import torch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--preset`` and ``--override`` of the model benchmarks (train, infer)."""
    p.add_argument("--preset", default="tiny", help="model preset: micro, tiny or paper")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=INT", help="model config override, e.g. n_layer=2")


def add_run_args(p: argparse.ArgumentParser, out_prefix: str) -> None:
    """Device, threads, repetitions, output folder and ``--verbose`` of the model benchmarks."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--out", default=None, help=f"output folder (default runs/{out_prefix}<UTC time>)")
    p.add_argument("--verbose", action="store_true")


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

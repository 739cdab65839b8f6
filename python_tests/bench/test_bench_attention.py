"""The attention benchmark CLI: a tiny --quick run end to end, its JSON against the schema,
and the pieces (exponent fit, validator, configuration list) on inputs with known answers.

Timings from these runs are never asserted: numbers come from the bench scripts."""

import copy
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.__main__ import parse_command
from bench.attention.report import fit_exponents
from bench.attention.schema import check_report, validate_schema
from bench.attention.sweep import METHODS, configurations, method_availability
from helpers import REPO


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``python -m bench attention --quick`` on a tiny shape, from the repo root, in a fresh process."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "attention",
        "--quick",
        "--layouts",
        "single,jacobi",
        "--n",
        "64",
        "--k",
        "1,2",
        "--dims",
        "16",
        "--heads",
        "2",
        "--threads",
        "1",
        "--reps",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "attention.json") as f:
        report = json.load(f)
    return report, out, proc.stdout


def test_quick_json_matches_schema(quick_run):
    report, _, _ = quick_run
    assert check_report(report) == []
    assert set(report["methods"]) == set(METHODS)
    for name, info in report["methods"].items():
        assert info["status"] == "measured" or info["reason"], name
    configs = {(r["layout"], r["k"]) for r in report["rows"]}
    assert configs == {("single", 1), ("single", 2), ("jacobi", None)}  # Jacobi's mask ignores k: measured once


def test_quick_measures_every_present_method_against_the_ideal(quick_run):
    report, _, _ = quick_run
    rows = report["rows"]
    measured = [m for m, info in report["methods"].items() if info["status"] == "measured"]
    assert {"ideal", "dense_sdpa", "composite"} <= set(measured)
    for r in rows:
        if r["method"] == "ideal" and r["status"] == "ok":
            assert r["ratio_to_ideal"] == pytest.approx(1.0)
    dense_fb = [r for r in rows if r["method"] == "dense_sdpa" and r["phase"] == "fwd_bwd"]
    assert dense_fb and all(r["status"] == "ok" for r in dense_fb)
    if report["methods"]["flex_blockmask"]["status"] == "measured" and report["meta"]["device"] == "cpu":
        flex_fb = [r for r in rows if r["method"] == "flex_blockmask" and r["phase"] == "fwd_bwd"]
        assert flex_fb and all(r["status"] == "unsupported" and "backward" in r["reason"] for r in flex_fb)
        builds = {r["method"] for r in rows if r["phase"] == "build" and r["status"] == "ok"}
        assert {"dense_sdpa", "flex_blockmask", "flex_create_block_mask"} <= builds
    single_fits = {(f["method"], f["phase"]) for f in report["fits"] if f["layout"] == "single"}
    assert ("ideal", "fwd") in single_fits and ("composite", "fwd_bwd") in single_fits


def test_quick_writes_csv_plots_and_table(quick_run):
    report, out, stdout = quick_run
    with open(out / "attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(report["rows"])
    for key in ("machine", "torch", "triton", "git_commit", "timestamp"):
        assert rows[0][key] == str(report["meta"][key] or "")
    for name in ("time_vs_k_d16.png", "ratio_to_ideal_d16.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "threads=1 (pinned)" in stdout
    assert "fitted exponents at N=64" in stdout
    for name, info in report["methods"].items():
        if info["status"] == "unavailable":
            assert f"{name}" in stdout and info["reason"] in stdout


def test_check_report_rejects_incomplete_reports(quick_run):
    report, _, _ = quick_run
    missing_row = copy.deepcopy(report)
    missing_row["rows"] = [
        r for r in missing_row["rows"] if not (r["method"] == "composite" and r["phase"] == "fwd_bwd" and r["k"] == 2)
    ]
    assert any("no fwd_bwd row for measured method composite" in e for e in check_report(missing_row))

    no_reason = copy.deepcopy(report)
    no_reason["methods"]["cpp"] = {**no_reason["methods"]["cpp"], "status": "unavailable", "reason": ""}
    no_reason["rows"] = [r for r in no_reason["rows"] if r["method"] != "cpp"]
    assert any("methods.cpp: unavailable without a reason" in e for e in check_report(no_reason))

    dropped = copy.deepcopy(report)
    del dropped["methods"]["triton"]
    assert any("missing required key 'triton'" in e for e in check_report(dropped))

    silent = copy.deepcopy(report)
    row = next(r for r in silent["rows"] if r["status"] == "ok" and r["method"] == "dense_sdpa")
    row.update(status="error", reason=None, median_ms=None, min_ms=None)
    assert any("status error without a reason" in e for e in check_report(silent))


def test_validate_schema_subset():
    schema = {
        "type": "object",
        "required": ["a"],
        "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 1}, "b": {"type": ["string", "null"], "enum": ["x", None]}},
    }
    assert validate_schema({"a": 1, "b": None}, schema) == []
    assert validate_schema({"a": True}, schema) == ["$.a: expected integer, got bool"]
    assert validate_schema({"a": 0, "b": "y", "c": 1}, schema) == [
        "$.a: expected >= 1, got 0",
        "$.b: expected one of ['x', None], got 'y'",
        "$: unexpected key 'c'",
    ]
    assert validate_schema({}, schema) == ["$: missing required key 'a'"]


def _synthetic(times_of_k, pairs_of_k):
    rows = []
    for k in (1, 2, 4, 8):
        t = times_of_k(k)
        rows.append(
            {
                "layout": "single",
                "n": 1024,
                "k": k,
                "d": 64,
                "method": "dense_sdpa",
                "phase": "fwd",
                "status": "ok",
                "median_ms": t,
                "min_ms": 0.9 * t,
                "causal_units": t / (7.0 + k),
                "num_pairs": pairs_of_k(k),
            }
        )
    return {"meta": {"fit_n": 1024}, "rows": rows}


def ks_array():
    return np.array([1.0, 2.0, 4.0, 8.0])


def test_fit_exponents_recovers_known_power_laws():
    # time ~ (1 + k)^2, |M| ~ (1 + k): slope 2 against the work, log(81/4)/log(8) against k.
    fit = fit_exponents(_synthetic(lambda k: 3.0 * (1 + k) ** 2, lambda k: 1000.0 * (1 + k)))[0]
    assert fit["slope_work"] == pytest.approx(2.0)
    assert fit["slope_work_min"] == pytest.approx(2.0)
    # causal_units divide by a causal time that drifted with the machine's load (7 + k): the fit follows the units.
    units = 3.0 * (1 + ks_array()) ** 2 / (7.0 + ks_array())
    assert fit["slope_work_norm"] == pytest.approx(np.polyfit(np.log(1 + ks_array()), np.log(units), 1)[0])
    ks = np.array([1.0, 2.0, 4.0, 8.0])
    # least squares, all k
    assert fit["slope_k"] == pytest.approx(np.polyfit(np.log(ks), np.log(3.0 * (1 + ks) ** 2), 1)[0])
    # Work that does not move with k gives no work exponent rather than a division by ~0.
    flat = fit_exponents(_synthetic(lambda k: 5.0 + k, lambda k: 1000.0))[0]
    assert flat["slope_work"] is None and flat["slope_k"] > 0


def test_configurations_and_availability():
    got = [(name, n, k) for name, n, k, _ in configurations(["single", "jacobi", "sbd"], [64], [1, 4], {"sbd": [2]})]
    assert got == [("single", 64, 1), ("single", 64, 4), ("jacobi", 64, None), ("sbd", 64, 2)]
    args = parse_command("attention", ["--quick", "--backends", "composite", "--device", "cpu"])
    import torch

    avail = method_availability(args, torch.device("cpu"), torch.float32)
    assert set(avail) == set(METHODS)
    assert avail["ideal"] is None and avail["composite"] is None
    assert avail["cpp"] == "not selected (--backends)"
    assert "CUDA" in avail["flash_attn_ideal"]
    args = parse_command("attention", ["--device", "cpu"])
    assert method_availability(args, torch.device("cpu"), torch.float32)["triton"]  # never timed on CPU

"""``python -m bench`` command line: every command answers --help, validate reports bad paths clearly."""

import os
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = str(REPO)


def _bench(*args, entry=("-m", "bench")):
    return subprocess.run([sys.executable, *entry, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_validate_help():
    proc = _bench("validate", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "REPORT.json" in proc.stdout


def test_validate_missing_and_broken_files_are_clear_errors(tmp_path):
    proc = _bench("validate", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "REPORT.json: no such file" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _bench("validate", str(bad))
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
    proc = _bench("validate")
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_validate_a_real_report():
    report = os.path.join(ROOT, "bench", "results", "cpu-n1024-quiet", "attention.json")
    if not os.path.exists(report):
        pytest.skip("no stored report")
    proc = _bench("validate", report)
    assert proc.returncode == 0 and "valid" in proc.stdout, proc.stdout + proc.stderr

"""A pytest plugin for the GPU check's pytest steps: one JSON line per test outcome, written as it happens.

    python -m pytest FILE -p bench.gpu.pytest_rows --rows-jsonl=OUT.jsonl

``--junitxml`` writes its file only when the session ends, so a step the check's cap kills (SIGTERM, then SIGKILL)
leaves none; this file keeps every test that finished: ``{"nodeid", "when", "outcome", "duration_s", "message"}``
for each call phase, and for setup / teardown phases that did not pass (errors, skips).
"""

from __future__ import annotations

import json
from typing import Optional

_path: Optional[str] = None  # --rows-jsonl of this session


def pytest_addoption(parser):
    parser.addoption("--rows-jsonl", default=None, help="append one JSON line per test outcome here, as it happens")


def pytest_configure(config):
    global _path
    _path = config.getoption("--rows-jsonl")
    if _path:
        open(_path, "w").close()


def pytest_runtest_logreport(report):
    if not _path or (report.when != "call" and report.outcome == "passed"):
        return
    message = ""
    if report.longrepr is not None:
        text = str(report.longrepr).strip().splitlines()
        message = text[-1][:500] if text else ""
    row = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration_s": round(report.duration, 3),
        "message": message,
    }
    with open(_path, "a") as f:
        f.write(json.dumps(row) + "\n")

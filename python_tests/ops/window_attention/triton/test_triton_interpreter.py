"""Runs the Triton interpreter tests (test_triton_interpreter_cases.py) in a fresh process.

Triton decides interpreter vs compiled when triton.language is first imported,
and other test modules import triton (torch.compile, the sampler's compile test),
so the interpreter group gets its own process with TRITON_INTERPRET=1 set from
the start. Nothing else in the suite sees the variable.
"""

import os
import subprocess
import sys

import pytest

from helpers import REPO

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = str(REPO)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter process")
def test_interpreter_group_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        os.path.join(HERE, "test_triton_interpreter_cases.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=5",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"interpreter tests failed (rc={result.returncode}):\n{tail}"
    assert " passed" in result.stdout and " skipped" not in result.stdout.splitlines()[-1], tail

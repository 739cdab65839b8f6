"""Timing helpers shared by the bench scripts: warm-up, repetitions, median and min."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch


def pin_threads(n: int | None) -> int:
    """Pin torch's intra-op threads (default: all cores) and return the count used."""
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def measure(fn: Callable[[], object], *, warmup: int = 2, reps: int = 5) -> dict:
    """Run ``fn`` ``warmup`` times, then time ``reps`` runs; milliseconds."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def machine_info() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "git_commit": commit,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

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


def measure(
    fn: Callable[[], object], *, warmup: int = 2, reps: int = 5, max_seconds: float | None = None, min_reps: int = 3
) -> dict:
    """Run ``fn`` ``warmup`` times, then time up to ``reps`` runs; milliseconds.

    ``first_ms`` is the first warm-up call (compilation, caches). With ``max_seconds``
    the timed loop stops early once ``min_reps`` runs are in and that much time has
    passed, so one slow shape cannot eat a whole sweep; ``reps`` is the count timed.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    first_ms = None
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        sync()
        if i == 0:
            first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    start = time.perf_counter()
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if max_seconds is not None and i + 1 >= min_reps and time.perf_counter() - start > max_seconds:
            break
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "reps": len(times),
        "first_ms": first_ms,
    }


def measure_many(
    fns: dict, *, warmup: int = 1, reps: int = 5, max_seconds: float | None = None, min_reps: int = 3
) -> dict:
    """Time several callables round-robin: each round runs every one of them once.

    Interleaving puts every method under the same background load, so ratios
    between them (the numbers this project reports) survive a busy machine far
    better than back-to-back blocks. Returns ``{key: measure()-style dict}``, or
    ``{key: exception}`` for a callable that raised (it leaves the rotation).
    With ``max_seconds`` the rounds stop once ``min_reps`` are in and the rounds
    have taken ``max_seconds`` per callable. ``times_ms[r]`` is round r, so two
    callables can be compared round by round.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    results: dict = {}
    first: dict = {}
    live = list(fns)
    for key in list(live):
        try:
            for i in range(warmup):
                t0 = time.perf_counter()
                fns[key]()
                sync()
                if i == 0:
                    first[key] = (time.perf_counter() - t0) * 1e3
        except Exception as exc:  # noqa: BLE001 - reported to the caller, not swallowed
            results[key] = exc
            live.remove(key)
    times: dict = {key: [] for key in live}
    budget = None if max_seconds is None else max_seconds * max(1, len(live))
    start = time.perf_counter()
    for r in range(reps):
        for key in list(live):
            try:
                t0 = time.perf_counter()
                fns[key]()
                sync()
                times[key].append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001
                results[key] = exc
                live.remove(key)
        if budget is not None and r + 1 >= min_reps and time.perf_counter() - start > budget:
            break
    for key in live:
        ts = times[key]
        results[key] = {
            "median_ms": statistics.median(ts),
            "min_ms": min(ts),
            "reps": len(ts),
            "first_ms": first.get(key),
            "times_ms": ts,
        }
    return results


def paired_ratio(times: list[float], reference_times: list[float]) -> float:
    """Median over rounds of ``times[r] / reference_times[r]`` (two ``measure_many`` series).

    Both ran in the same round, seconds apart, so background load that comes and goes
    between rounds cancels; the ratio of two medians would mix different rounds.
    """
    return statistics.median(t / r for t, r in zip(times, reference_times))


def failure_reason(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 240 characters), for a row that was not timed."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:240]}"


def timing_fields(timing, throughput_key: str, work: float) -> dict:
    """Row fields for one ``measure_many`` result: status, times and ``throughput_key`` = ``work`` per second.

    ``timing`` is the result dict, or the exception the callable raised (an "error" row).
    """
    if isinstance(timing, BaseException):
        return {
            "status": "error",
            "reason": failure_reason(timing),
            "median_ms": None,
            "min_ms": None,
            "reps": 0,
            throughput_key: None,
        }
    return {
        "status": "ok",
        "reason": None,
        "median_ms": timing["median_ms"],
        "min_ms": timing["min_ms"],
        "reps": timing["reps"],
        "times_ms": timing["times_ms"],
        throughput_key: work / (timing["median_ms"] * 1e-3),
    }


def phase_step(fn: Callable[[], object], grad_inputs=None, dout=None) -> Callable[[], None]:
    """Forward under no_grad (``grad_inputs`` None) or forward+backward of ``fn``."""
    if grad_inputs is None:

        def step():
            with torch.no_grad():
                fn()
    else:

        def step():
            torch.autograd.grad(fn(), grad_inputs, dout)

    return step


def busy_cores() -> float | None:
    """The 1-minute load average (None where the OS has none): context for contended timings."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_info() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        # Uncommitted changes to the code being measured (others' work in progress counts too).
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "kforcing_kernels", "csrc", "bench"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = "", None
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
        "git_dirty": dirty,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def row_stamp(meta: dict) -> dict:
    """The ``machine_info`` fields every result row repeats, so a row read alone says where it came from."""
    return {key: meta[key] for key in ("machine", "torch", "triton", "git_commit", "timestamp")}


def commit_label(meta: dict) -> str:
    """``abc1234``, ``abc1234+uncommitted`` or ``?`` for a report's header line."""
    return f"{meta['git_commit'] or '?'}{'+uncommitted' if meta.get('git_dirty') else ''}"

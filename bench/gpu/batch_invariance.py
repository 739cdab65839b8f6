"""Batch invariance: the same bits for a sequence alone and inside a batch (issue #24, step 3).

    python -m bench batch-invariance --json out.json          # cuda when available, else cpu
    python -m bench batch-invariance --device cpu --backend composite
    python -m bench batch-invariance --checks attention teacher --dims 64

K-Forcing (Section 5, "Reproducible AR sampling") names batch-variant kernels as a source of
contradictory teacher targets: one context must give the same bits whatever else shares its batch.
Every check runs one sequence alone (batch 1: the oracle for the bits) and the same sequence at the
first, middle and last position of batches of ``--batch-sizes`` whose other elements are fresh random
sequences, and compares with ``torch.equal``:

  attention  window_attention forward and backward (out, lse, dq, dk, dv) of ``--backend`` (default:
             the dispatcher's choice for the device and dtype) on SingleForward and DoubleForward
             layouts at each ``--dims``; bf16 on CUDA, fp32 on CPU. The batch-1 result is also held to
             the float64 reference (at most 2x the reference's own error in the same dtype, plus a
             floor), so a kernel that is wrong but invariant fails.
  configs    (CUDA, triton) the attention check again with each entry of each launched kernel's
             autotune list (configs.KERNEL_CONFIGS) forced in turn, autotuning off, the other kernels
             at their first entry: invariance must hold under every config the autotuner may pick
             (configs may round differently from each other; that is not checked).
  teacher    a teacher's targets through the reference model (bench/gpu/batch_invariance_teacher.py):
             SingleForward logits, their inverse-CDF tokens, the stage-2 self-forcing targets and the
             stage-1 AR inverse-CDF targets, in the default (batched) mode and in the per-sample mode;
             for the default mode, the first module whose output changes with the batch.

The JSON (``--json``) is rewritten after every check, so a run cut off by a timeout keeps what it did.
Exit status 1 when an attention, configs or per-sample teacher check fails; the default-mode teacher
records are observations (which kernels the BLAS picks by matrix size is the library's business).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
from typing import Iterator, Optional

import torch

from kforcing_kernels import WindowLayout, default_backend, env, window_attention
from kforcing_kernels.app.cli import (
    add_batch_sizes,
    add_device,
    add_seed,
    add_threads,
    apply_threads,
    positive_int,
)
from kforcing_kernels.ops.window_attention import reference

from . import batch_invariance_teacher as teacher
from .batch_invariance_teacher import positions

OUTPUTS = ("out", "lse", "dq", "dk", "dv")
CHECKS = ("attention", "configs", "teacher")
LAYOUTS = ("single", "double")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTOTUNE_ENV = "KFORCING_TRITON_AUTOTUNE"
# Absolute slack over 2x the reference's own error in the same dtype (as bench/gpu/gpu_check.sh's smoke).
ERROR_FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}
# Sizes per device: the shapes on CUDA; small ones on CPU (the whole run takes ~20 s on 2 cores).
DEFAULTS = {
    "cuda": {"n": 1024, "k": 4, "dims": [64, 128], "heads": 4},
    "cpu": {"n": 48, "k": 4, "dims": [32, 64], "heads": 2},
}


class Report:
    """The checks so far, rewritten to ``path`` (atomically) after each one."""

    def __init__(self, path: Optional[str], meta: dict, quiet: bool = False):
        self.path, self.quiet = path, quiet
        self.data = {"meta": meta, "checks": [], "summary": {}, "complete": False}

    def add(self, check: dict) -> dict:
        self.data["checks"].append(check)
        counts = self.data["summary"].setdefault(check["check"], {"pass": 0, "fail": 0})
        verdict = "pass" if check["pass"] else ("differs" if check.get("observation") else "fail")
        counts[verdict] = counts.get(verdict, 0) + 1
        self.write()
        if not self.quiet:
            print(describe(check), flush=True)
        return check

    def failures(self) -> list[dict]:
        return [c for c in self.data["checks"] if not c["pass"] and not c.get("observation")]

    def write(self) -> None:
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def describe(check: dict) -> str:
    keys = ("backend", "config", "layout", "dim", "precision", "mode", "batch", "position")
    where = " ".join(f"{key}={check[key]}" for key in keys if key in check)
    diffs = check.get("max_abs_diff") or check.get("err") or {}
    diff = ", ".join(f"{name} {value:.2e}" for name, value in diffs.items() if value is not None)
    verdict = "PASS" if check["pass"] else ("differs (observation)" if check.get("observation") else "FAIL")
    return f"[{check['check']}] {where}: {verdict}{' | ' + diff if diff else ''}"


def versions() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    return info


def settings(device: torch.device) -> dict:
    """The numerics switches that decide which matmul kernels run."""
    found = {
        "threads": torch.get_num_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        found.update(
            device_name=torch.cuda.get_device_name(device),
            allow_tf32=matmul.allow_tf32,
            allow_bf16_reduced_precision_reduction=matmul.allow_bf16_reduced_precision_reduction,
            allow_fp16_reduced_precision_reduction=matmul.allow_fp16_reduced_precision_reduction,
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        )
    return found


# ---------------------------------------------------------------------- attention


def run_attention(backend: str, layout: WindowLayout, q, k, v, dout) -> list[torch.Tensor]:
    """(out, lse, dq, dk, dv) of one forward + backward."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = window_attention(q, k, v, layout, backend=backend, return_lse=True)
    return [out.detach(), lse, *torch.autograd.grad(out, (q, k, v), dout)]


def run_reference(layout: WindowLayout, q, k, v, dout) -> list[torch.Tensor]:
    """(out, lse, dq, dk, dv) of the dense-mask reference math, called directly (not through the op's dispatch)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(q, k, v, layout, q.shape[-1] ** -0.5)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def layouts(n: int, k: int, names=LAYOUTS) -> dict[str, WindowLayout]:
    """SingleForward (eq. 18) and DoubleForward (eq. 19) layouts at context n and window k, by name."""
    make = {"single": WindowLayout.kforcing_single, "double": WindowLayout.kforcing_double}
    return {name: make[name](n, k) for name in names}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a.double() - b.double()).abs()
    diff = diff.nan_to_num(nan=float("inf")) if not torch.equal(a.isnan(), b.isnan()) else diff.nan_to_num(nan=0.0)
    return diff.max().item() if diff.numel() else 0.0


def oracle_check(backend: str, layout: WindowLayout, one: list[torch.Tensor], alone: list[torch.Tensor]) -> dict:
    """The batch-1 result against the float64 reference: err <= 2 x (reference in the same dtype's err) + floor."""
    dtype = one[0].dtype
    ref64 = run_reference(layout, *(t.double() for t in one))
    ref_same = run_reference(layout, *one)
    err, bound, ok = {}, {}, True
    for name, got, want, same in zip(OUTPUTS, alone, ref64, ref_same):
        err[name] = max_abs_diff(got, want)
        bound[name] = 2 * max_abs_diff(same, want) + ERROR_FLOOR[dtype]
        ok &= bool(torch.isfinite(got).all()) and err[name] <= bound[name]
    return {"pass": ok, "err": err, "bound": bound}


def attention_case(
    report: Report,
    backend: str,
    name: str,
    layout: WindowLayout,
    *,
    dim: int,
    heads: int,
    dtype: torch.dtype,
    device: torch.device,
    batch_sizes: list[int],
    seed: int,
    config: str,
    extra: Optional[dict] = None,
) -> bool:
    """One layout and head dim: the oracle check of the batch-1 result, then one record per (batch, position)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(batch: int, length: int) -> torch.Tensor:
        return torch.randn(batch, heads, length, dim, generator=gen, device=device).to(dtype)

    lq, lk = layout.n_queries, layout.n_keys
    one = [rand(1, lq), rand(1, lk), rand(1, lk), rand(1, lq)]  # q, k, v, dout of the sequence under test
    alone = run_attention(backend, layout, *one)
    base = {
        "backend": backend,
        "config": config,
        "layout": name,
        "n": layout.n_ctx,
        "dim": dim,
        "heads": heads,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        **(extra or {}),
    }
    ok = report.add({"check": "attention_vs_reference", **base, **oracle_check(backend, layout, one, alone)})["pass"]
    for batch in batch_sizes:
        for pos in positions(batch):
            others = [rand(batch - 1, lq), rand(batch - 1, lk), rand(batch - 1, lk), rand(batch - 1, lq)]
            batched = [torch.cat([o[:pos], t, o[pos:]]) for o, t in zip(others, one)]
            got = run_attention(backend, layout, *batched)
            diffs = {out: max_abs_diff(g[pos : pos + 1], a) for out, g, a in zip(OUTPUTS, got, alone)}
            unequal = [out for out, g, a in zip(OUTPUTS, got, alone) if not torch.equal(g[pos : pos + 1], a)]
            shapes = {"q": list(batched[0].shape), "k": list(batched[1].shape), "lse": list(got[1].shape)}
            ok &= report.add(
                {
                    "check": "attention",
                    **base,
                    "batch": batch,
                    "position": pos,
                    "pass": not unequal,
                    "unequal": unequal,
                    "max_abs_diff": diffs,
                    "shapes": shapes,
                }
            )["pass"]
    return ok


def attention_checks(
    report: Report,
    args,
    backend: str,
    dtype: torch.dtype,
    config: str = "dispatcher default",
    extra: Optional[dict] = None,
) -> None:
    for dim in args.dims:
        for name, layout in layouts(args.n, args.k, getattr(args, "layouts", LAYOUTS)).items():
            attention_case(
                report,
                backend,
                name,
                layout,
                dim=dim,
                heads=args.heads,
                dtype=dtype,
                device=args.device,
                batch_sizes=args.batch_sizes,
                seed=args.seed,
                config=config,
                extra=extra,
            )


# ---------------------------------------------------------------------- triton configs


def triton_launch():
    """The triton backend's launcher module (imports triton)."""
    return importlib.import_module("kforcing_kernels.ops.window_attention.triton.launch")


def _clear_launch_caches(launch) -> None:
    with launch._tuned_lock:
        launch._tuned.clear()
    launch._direct.clear()


@contextlib.contextmanager
def autotune_off() -> Iterator[None]:
    """KFORCING_TRITON_AUTOTUNE=0 inside the block (the first entry of each config list runs), with the
    launcher's autotuner and direct-launch caches emptied on entry and exit so no earlier choice is reused."""
    launch = triton_launch()
    saved = os.environ.get(AUTOTUNE_ENV)
    os.environ[AUTOTUNE_ENV] = "0"
    _clear_launch_caches(launch)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(AUTOTUNE_ENV, None)
        else:
            os.environ[AUTOTUNE_ENV] = saved
        _clear_launch_caches(launch)


@contextlib.contextmanager
def forced_config(kernel: str, tile_set: str, head_dim: int, index: int) -> Iterator[tuple[int, int]]:
    """Run ``kernel`` with entry ``index`` of its (tile set, head dim) config list, autotuning off.

    Puts that entry first in ``KERNEL_CONFIGS`` (with autotuning off the first entry is the one that runs)
    inside :func:`autotune_off`, and restores the table on exit. Yields (num_warps, num_stages).
    """
    table = triton_launch().KERNEL_CONFIGS[kernel]
    key = (tile_set, head_dim)
    original = table[key]
    if not 0 <= index < len(original):
        raise ValueError(f"index: expected 0..{len(original) - 1} for {kernel} {key}, got {index}")
    table[key] = [original[index]] + original[:index] + original[index + 1 :]
    try:
        with autotune_off():
            yield original[index]
    finally:
        table[key] = original


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[str, str, int]]]:
    """The (kernel, tile set, head dim) of every triton launch made inside the block, in order, once each."""
    launch = triton_launch()
    real, seen = launch._launch, []

    def recording(kernel_name, grid, tune_key, *args, **kwargs):
        entry = (kernel_name, tune_key[0], tune_key[1])
        if entry not in seen:
            seen.append(entry)
        return real(kernel_name, grid, tune_key, *args, **kwargs)

    launch._launch = recording
    try:
        yield seen
    finally:
        launch._launch = real


def autotuner_choices() -> dict[str, list[int]]:
    """What each autotuner built so far picked: ``{"kernel tile_set D bucket mode autotune": [warps, stages]}``."""
    chosen = {}
    for key, tuner in triton_launch()._tuned.items():
        best = getattr(tuner, "best_config", None)
        if best is not None:
            chosen[" ".join(map(str, key))] = [best.num_warps, best.num_stages]
    return chosen


def config_checks(report: Report, args, dtype: torch.dtype) -> None:
    """The attention check under every config of every kernel the shapes launch (autotuning off)."""
    launch = triton_launch()
    for dim in args.dims:
        for name, layout in layouts(args.n, args.k, getattr(args, "layouts", LAYOUTS)).items():
            case = dict(
                dim=dim, heads=args.heads, dtype=dtype, device=args.device, batch_sizes=args.batch_sizes, seed=args.seed
            )
            with autotune_off(), recorded_launches() as launched:
                attention_case(report, "triton", name, layout, config="autotune off, first entries", **case)
            for kernel, tile_set, head_dim in launched:
                for index, (warps, stages) in enumerate(launch.KERNEL_CONFIGS[kernel][(tile_set, head_dim)]):
                    if index == 0:
                        continue  # the run above
                    with forced_config(kernel, tile_set, head_dim, index):
                        attention_case(
                            report,
                            "triton",
                            name,
                            layout,
                            config=f"{kernel} {tile_set} #{index}",
                            extra={
                                "forced": {
                                    "kernel": kernel,
                                    "tile_set": tile_set,
                                    "index": index,
                                    "num_warps": warps,
                                    "num_stages": stages,
                                }
                            },
                            **case,
                        )


# ---------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument(
        "--backend",
        choices=("triton", "cpp", "composite", "reference"),
        default=None,
        help="window_attention backend (None: the dispatcher's for the device and dtype)",
    )
    p.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="auto", help="q/k/v dtype (auto: bf16 on CUDA, fp32 on CPU)"
    )
    p.add_argument(
        "--checks",
        nargs="+",
        choices=CHECKS,
        default=list(CHECKS),
        help="which checks (configs: CUDA and the triton backend only)",
    )
    add_batch_sizes(p, [2, 4, 8, 16], help="batch sizes the sequence is placed in")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="attention layouts")
    p.add_argument("--n", type=positive_int, default=None, help="context length N (None: 1024 on CUDA, 48 on CPU)")
    p.add_argument("--k", type=positive_int, default=None, help="window k (None: 4)")
    p.add_argument(
        "--dims", type=positive_int, nargs="+", default=None, help="head dims (None: 64 128 on CUDA, 32 64 on CPU)"
    )
    p.add_argument("--heads", type=positive_int, default=None, help="heads (None: 4 on CUDA, 2 on CPU)")
    p.add_argument(
        "--teacher-n", type=positive_int, default=None, help="teacher context length (None: 256 on CUDA, 32 on CPU)"
    )
    p.add_argument("--teacher-k", type=positive_int, default=4, help="teacher window k")
    add_seed(p)
    add_threads(p)
    p.add_argument("--json", default=None, help="write the report here (rewritten after every check)")
    p.add_argument("--quiet", action="store_true", help="no line per check")


def _device_defaults(args) -> argparse.Namespace:
    """Fill the per-device defaults; ``args.device`` becomes a torch.device."""
    args.device = torch.device(args.device)
    sizes = DEFAULTS["cuda" if args.device.type == "cuda" else "cpu"]
    for key in ("n", "k", "dims", "heads"):
        if getattr(args, key) is None:
            setattr(args, key, sizes[key])
    return args


def execute(args) -> int:

    args = _device_defaults(args)
    apply_threads(args.threads)
    device = args.device
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = args.backend or default_backend(device, dtype, args.dims[0])
    meta = {
        "argv": sys.argv,
        "device": str(device),
        "backend": backend,
        "dtype": str(dtype).replace("torch.", ""),
        "n": args.n,
        "k": args.k,
        "dims": args.dims,
        "heads": args.heads,
        "batch_sizes": args.batch_sizes,
        "checks": args.checks,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "settings": settings(device),
        "autotune_env": os.environ.get(AUTOTUNE_ENV),
    }
    report = Report(args.json, meta, quiet=args.quiet)
    report.write()
    if "attention" in args.checks:
        attention_checks(report, args, backend, dtype)
        if backend == "triton":
            meta["autotuner_choices"] = autotuner_choices()
    if "teacher" in args.checks:
        teacher.teacher_checks(
            report,
            device=device,
            dtype=dtype,
            n=args.teacher_n,
            k=args.teacher_k,
            batch_sizes=args.batch_sizes,
            seed=args.seed,
        )
    if "configs" in args.checks:
        if backend == "triton" and (device.type == "cuda" or env.triton_interpret()):
            if device.type != "cuda":
                meta["configs_note"] = (
                    "Triton's interpreter runs every launch with one fixed config: the sweep's "
                    "machinery is exercised, not the configs"
                )
            config_checks(report, args, dtype)
        else:
            meta["configs_skipped"] = f"needs the triton backend on CUDA (here: {backend} on {device})"
    report.data["complete"] = True
    report.write()
    failed = report.failures()
    print(
        f"batch invariance: {len(report.data['checks'])} checks, {len(failed)} failing; "
        f"summary {json.dumps(report.data['summary'])}"
    )
    return 1 if failed else 0

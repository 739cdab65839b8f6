"""The self-forcing training step on a GPU, as the trainer runs it: dense-mask SDPA vs ours vs no attention.

    python -m bench train-gpu                                # paper backbone, B=4, the plan's shapes, every variant
    python -m bench train-gpu --shapes 4096:4 --ac           # N=4096, teacher k 4 -> student 8, checkpointed blocks
    python -m bench train-gpu --variants ours zero --out runs/t
    python -m bench train-gpu --dry-run                      # the same arguments on CPU at reduced sizes

One step is ``compute_loss(Objective.SELF_FORCING)`` (the teacher's SingleForward and DoubleForward on k noises, the
student's SingleForward on 2k; paper Algorithm 3) under ``torch.autocast(dtype=--dtype)`` with fp32 weights, then
the backward and AdamW outside autocast: what ``app/training/loop.py`` does with ``--precision bf16``
(``--dtype float32``: no autocast, fp32 throughout). Variants, each from the same weights and batch:

* ``ours``: the model's ``attention_backend=None``: ``window_attention``'s default (on CUDA the dispatch table's
  row, else the registry's choice); the row counts the backend each call resolved to (``dispatched``);
* ``ours[NAME]``: a candidate backend forced (``ours[triton]``, ``ours[flex]``, ...);
* ``zero``: attention replaced by a zero-cost op returning q (the limit no attention kernel can beat);
* ``dense``: SDPA with the layout's dense boolean mask, the public K-Forcing code's way (skipped above
  ``--dense-max-n``: its mask is (N + N k)^2 per layer call).

Per variant: ``--warmup`` untimed steps (the first one compiles, autotunes and gives the loss), then up to
``--reps`` timed ones (stopping after ``--max-seconds`` once one is in), CUDA-synchronized wall time; the peak
``torch.cuda.max_memory_allocated`` over the variant's steps (weights, AdamW state and gradients included) and above
what was allocated before its first step. A variant that raises (out of memory included) gives an error row and the
run goes on. Every row is appended to ``<out>/train_gpu.jsonl`` as it finishes and ``<out>/train_gpu.json`` is
rewritten, so a run cut short keeps what it measured; after a shape's variants a ``summary`` row gives the ratios
(``speedup_vs_dense`` = dense / ours time, ``vs_zero`` = ours / zero time, 1.0 ideal).

``--dry-run``: the same variants, dtype, autocast, backends and flags on CPU with the sizes reduced (one layer,
width 128 with the preset's head dim, vocab 512, N 32, batch 2, one warm-up and one timed step); the triton backend
runs under bench/gpu/triton_stub_driver.py (kernels compiled for sm_90a, launches no-ops) with CUDA's dtype rules,
so what CUDA refuses (fp32 into the triton backend) fails here too; ``ours`` resolves as the dispatcher would on
CUDA (``--dry-capability``, default 9.0). TRITON_INTERPRET must be unset (the interpreter takes fp32). FlexAttention
has no CPU backward: its rows carry that reason (``status: cpu_limit``) and do not fail the dry run; any other error
row does (exit status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from collections import Counter
from typing import Optional

import torch

from .._cli import command_line, parse_overrides, write_json
from .._timing import machine_info
from .train_step_gpu import dense_sdpa_model, zero_cost_attention

SCHEMA_ID = "kforcing-bench/train-gpu/v1"
# The plan's order: the target shape first (N=4096, k 4 -> 8), then N=1024 and N=8192, then the other k.
DEFAULT_SHAPES = ("4096:4", "1024:2", "8192:4", "1024:4", "4096:2", "8192:2")
DEFAULT_VARIANTS = ("ours", "zero", "dense", "ours[triton]", "ours[flex]")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# --dry-run's sizes: the model's depth, width, vocab and the run's lengths shrink; nothing else changes.
DRY_OVERRIDES = {"n_layer": 1, "vocab_size": 512}
DRY_WIDTH_HEADS = 2  # heads in the dry run's model (its head dim stays the preset's)
DRY_N, DRY_BATCH = 32, 2
CPU_LIMIT = "FlexAttention has no backward on cpu"  # the flex backend's own error text (ops/window_attention/flex.py)


def parse_shape(text: str) -> tuple[int, int]:
    """``"4096:4"`` -> (N, teacher k)."""
    n, sep, k = text.partition(":")
    if not sep or not n.isdigit() or not k.isdigit() or int(n) < 1 or int(k) < 1:
        raise argparse.ArgumentTypeError(f"expected N:K with positive integers (e.g. 4096:4), got {text!r}")
    return int(n), int(k)


def parse_variant(text: str) -> str:
    from kforcing_kernels.ops.window_attention.backends import REGISTRY

    if text in ("ours", "zero", "dense"):
        return text
    if text.startswith("ours[") and text.endswith("]"):
        name = text[5:-1]
        if name in REGISTRY.names:
            return text
        raise argparse.ArgumentTypeError(
            f"ours[NAME]: NAME must be a backend in {sorted(REGISTRY.names)}, got {name!r}"
        )
    raise argparse.ArgumentTypeError(f"expected ours, zero, dense or ours[BACKEND], got {text!r}")


def variant_backend(label: str) -> Optional[str]:
    """The model's ``attention_backend`` for a variant (None: the dispatcher's; dense/zero replace the op)."""
    return label[5:-1] if label.startswith("ours[") else None


# ---------------------------------------------------------------------- the dispatcher, as on CUDA


def cuda_default_backend(dtype: torch.dtype, head_dim: int, layout, capability: str) -> str:
    """What ``window_attention(backend=None)`` picks on a CUDA device of ``capability`` ("9.0") for these inputs:
    the dispatch table's row (``KFORCING_DISPATCH_TABLE`` or the package's), else the registry's CUDA choice.
    The dry run's ``ours``; on a GPU the op's own ``default_backend_for`` answers."""
    from kforcing_kernels.ops.common.registry import pick
    from kforcing_kernels.ops.window_attention import dispatch
    from kforcing_kernels.ops.window_attention.backends import REGISTRY

    rows = tuple(
        (*dispatch.row_key(row), row["backend"])
        for row in dispatch.load(os.environ.get("KFORCING_DISPATCH_TABLE") or None)["rows"]
        if row["capability"] == capability and row["dtype"] == dispatch.dtype_name(dtype)
    )
    measured = dispatch.choose(
        rows, capability, dispatch.dtype_name(dtype), head_dim, layout.n_ctx, dispatch.layout_family(layout)
    )
    return measured or pick(REGISTRY.choices(torch.device("cuda"), dtype), head_dim)


@contextlib.contextmanager
def _counting_dispatch(counts: Counter, dry_capability: Optional[str]):
    """While on, every ``backend=None`` call of the model's attention is counted by the backend it resolves to; in a
    dry run (``dry_capability`` set) it is also *run* with that backend, as CUDA would run it."""
    from kforcing_kernels.model import gpt
    from kforcing_kernels.ops.window_attention.op import default_backend_for

    real = gpt.window_attention

    def counted(q, k, v, layout, backend=None):
        if backend is None:
            if dry_capability is not None:
                backend = cuda_default_backend(q.dtype, q.shape[-1], layout, dry_capability)
                counts[backend] += 1
                return real(q, k, v, layout, backend=backend)
            counts[default_backend_for(q.device, q.dtype, q.shape[-1], layout)] += 1
        return real(q, k, v, layout, backend=backend)

    gpt.window_attention = counted
    try:
        yield
    finally:
        gpt.window_attention = real


@contextlib.contextmanager
def _cuda_rules_on_cpu(on: bool):
    """The dry run's Triton: bench/gpu/triton_stub_driver.py installed (kernels compiled for sm_90a, launches
    no-ops) and the triton backend taking CPU tensors under CUDA's rules (fp16 / bf16 only)."""
    if not on:
        yield
        return
    from kforcing_kernels.ops.common import triton_env

    if triton_env.interpret_requested():
        raise RuntimeError(
            "train-gpu --dry-run: TRITON_INTERPRET=1 is set, but the dry run takes CUDA's rules through the stub "
            "driver (the interpreter accepts fp32, which the triton backend refuses on CUDA); unset it"
        )
    from ..gpu.triton_host_cost import triton_op_on_cpu
    from ..gpu.triton_stub_driver import stub_driver

    with stub_driver(), triton_op_on_cpu():
        yield


# ---------------------------------------------------------------------- one variant


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _models(args, cfg, backend: Optional[str], state: dict, device: torch.device):
    from kforcing_kernels.model import KForcingLM

    cfg = dataclasses.replace(cfg, attention_backend=backend)
    teacher, student = KForcingLM(cfg).to(device), KForcingLM(cfg).to(device)
    teacher.load_state_dict(state)
    student.load_state_dict(state)
    teacher.eval()
    if args.ac:
        from kforcing_kernels.app.training.parallel import checkpoint_blocks

        checkpoint_blocks(student)
    return teacher, student, torch.optim.AdamW(student.parameters(), lr=1e-4)


def run_variant(args, label: str, cfg, state: dict, batch, device: torch.device) -> dict:
    """One variant's row: ``status`` ok (times, loss, memory), error (its reason; ``oom`` when out of memory),
    cpu_limit (a dry run's FlexAttention backward) or skipped."""
    from kforcing_kernels.app.training.objectives import Objective, compute_loss

    n = batch.tokens.shape[1]
    row: dict = {"variant": label, "backend": variant_backend(label)}
    if label == "dense" and n > args.dense_max_n:
        return {**row, "status": "skipped", "reason": f"N={n} > --dense-max-n {args.dense_max_n}"}
    amp = DTYPES[args.dtype]
    autocast = contextlib.nullcontext if amp == torch.float32 else (lambda: torch.autocast(device.type, dtype=amp))
    chunked = not args.unchunked_loss
    counts: Counter = Counter()
    losses: list = []
    models = None
    cuda = device.type == "cuda"
    try:
        models = _models(args, cfg, row["backend"], state, device)
        teacher, student, optimizer = models

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss, _ = compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())

        if cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_cuda_rules_on_cpu(args.dry_run))
            stack.enter_context(_counting_dispatch(counts, args.dry_capability if args.dry_run else None))
            stack.enter_context(dense_sdpa_model(label == "dense"))
            if label == "zero":
                stack.enter_context(zero_cost_attention())
            warm_s = []
            for _ in range(args.warmup):
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                warm_s.append(time.perf_counter() - t0)
            times, started = [], time.perf_counter()
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                times.append((time.perf_counter() - t0) * 1e3)
                if time.perf_counter() - started > args.max_seconds:
                    break
        row.update(
            status="ok",
            reason=None,
            median_ms=statistics.median(times),
            min_ms=min(times),
            times_ms=times,
            warm_s=warm_s,
            loss=float(losses[0]),
            loss_finite=bool(torch.isfinite(losses[0])),
        )
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_mib=peak / 2**20, step_peak_mib=(peak - before) / 2**20)
    except Exception as exc:  # noqa: BLE001 - an error row per failing variant (OOM included); the run goes on
        text = _error_text(exc)
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower()
        status = "cpu_limit" if args.dry_run and CPU_LIMIT in text else "error"
        row.update(status=status, reason=text, oom=oom)
        if cuda:
            row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    finally:
        del models
        losses.clear()
        _free(device)
    row["dispatched"] = dict(counts)
    return row


def summary_row(n: int, k: int, rows: list[dict]) -> dict:
    """Ratios of one shape's ok rows: dense / ours time (``speedup_vs_dense``), ours / zero (``vs_zero``)."""
    ok = {r["variant"]: r["median_ms"] for r in rows if r["status"] == "ok"}
    out: dict = {"kind": "summary", "n": n, "teacher_k": k, "student_k": 2 * k}
    for label, ms in ok.items():
        if label.startswith("ours"):
            if "dense" in ok:
                out[f"{label}_speedup_vs_dense"] = ok["dense"] / ms
            if "zero" in ok:
                out[f"{label}_vs_zero"] = ms / ok["zero"]
    return out


# ---------------------------------------------------------------------- the run


def run(args) -> dict:
    from kforcing_kernels.app.training.objectives import Batch
    from kforcing_kernels.model import PRESETS, KForcingLM

    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    jsonl, json_path = os.path.join(args.out, "train_gpu.jsonl"), os.path.join(args.out, "train_gpu.json")
    open(jsonl, "w").close()
    meta = {
        **machine_info(),
        "schema": SCHEMA_ID,
        "command": args.command,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "preset": args.preset,
        "overrides": args.overrides,
        "batch": args.batch_size,
        "shapes": [list(s) for s in args.shapes],
        "variants": list(args.variants),
        "dtype": args.dtype,
        "autocast": args.dtype != "float32",
        "activation_checkpointing": args.ac,
        "chunked_loss": not args.unchunked_loss,
        "warmup": args.warmup,
        "reps": args.reps,
        "max_seconds": args.max_seconds,
        "dense_max_n": args.dense_max_n,
        "dry_run": args.dry_run,
    }
    report: dict = {"schema": SCHEMA_ID, "meta": meta, "rows": []}

    def emit(row: dict) -> None:
        report["rows"].append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        write_json(report, json_path)

    start = time.perf_counter()
    for n, k in args.shapes:
        cfg = PRESETS[args.preset](seq_len=n, **args.overrides)
        torch.manual_seed(0)
        state = KForcingLM(cfg).state_dict()
        gen = torch.Generator().manual_seed(k)
        batch = Batch(
            tokens=torch.randint(0, cfg.vocab_size, (args.batch_size, n), generator=gen),
            noise=torch.rand(args.batch_size, n, 2 * k, generator=gen),
            tau=0.5 + 0.5 * torch.rand(args.batch_size, generator=gen),
        ).to(device)
        shape_rows = []
        for label in args.variants:
            row = {
                "kind": "variant",
                "n": n,
                "teacher_k": k,
                "student_k": 2 * k,
                "batch": args.batch_size,
                "n_layer": cfg.n_layer,
                "n_embd": cfg.n_embd,
                "head_dim": cfg.head_dim,
                **run_variant(args, label, cfg, state, batch, device),
            }
            shape_rows.append(row)
            emit(row)
            print(format_row(row), flush=True)
        summary = summary_row(n, k, shape_rows)
        emit(summary)
        print(format_summary(summary), flush=True)
        del state, batch
        _free(device)
    meta["wall_s"] = time.perf_counter() - start
    write_json(report, json_path)
    return report


def format_row(r: dict) -> str:
    head = f"train N={r['n']} k {r['teacher_k']}->{r['student_k']} B={r['batch']} {r['variant']:<13}"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r['reason']}"
    mem = f", peak {r['peak_mib']:.0f} MiB (step {r['step_peak_mib']:.0f})" if "peak_mib" in r else ""
    return (
        f"{head} {r['median_ms']:9.1f} ms (min {r['min_ms']:.1f}, {len(r['times_ms'])} reps, first "
        f"{r['warm_s'][0] if r['warm_s'] else float('nan'):.1f} s), loss {r['loss']:.4f}{mem}"
        f"{', dispatched ' + str(r['dispatched']) if r['dispatched'] else ''}"
    )


def format_summary(s: dict) -> str:
    parts = [f"{key} {value:.2f}x" for key, value in s.items() if key.endswith(("_vs_dense", "_vs_zero"))]
    return f"train N={s['n']} k {s['teacher_k']}->{s['student_k']}: " + (", ".join(parts) or "no ratios")


# ---------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kforcing_kernels.app.cli import (
        add_batch_size,
        add_device,
        add_preset,
        non_negative_int,
        positive_float,
        positive_int,
    )

    add_device(p)  # auto: cuda on the GPU machine; --dry-run runs on cpu whatever is given
    add_preset(p, "paper")
    p.add_argument(
        "--override", action="append", default=[], metavar="FIELD=INT", help="model config override (repeatable)"
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=[parse_shape(s) for s in DEFAULT_SHAPES],
        metavar="N:K",
        help=f"N and teacher k (the student gets 2k), in run order (default: {' '.join(DEFAULT_SHAPES)})",
    )
    add_batch_size(p, 4, help="sequences per step")
    p.add_argument(
        "--variants",
        nargs="+",
        type=parse_variant,
        default=list(DEFAULT_VARIANTS),
        help="ours (the dispatcher's), ours[BACKEND] (forced), zero (no attention), dense (dense-mask SDPA)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="autocast dtype (float32: none)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing on the student's blocks")
    p.add_argument("--unchunked-loss", action="store_true", help="every row's [rows, V] logits at once")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (the first compiles)")
    p.add_argument("--reps", type=positive_int, default=3, help="timed steps at most")
    p.add_argument("--max-seconds", type=positive_float, default=10.0, help="stop timing a variant after this")
    p.add_argument("--dense-max-n", type=positive_int, default=4096, help="skip dense above this N")
    p.add_argument("--out", default=None, help="where train_gpu.jsonl / .json go (None: runs/bench-train-gpu-<time>)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the same run on CPU at reduced sizes, triton through the stub driver (CUDA's rules)",
    )
    p.add_argument(
        "--dry-capability", default="9.0", help="the dry run's CUDA capability for the dispatch table's rows"
    )


def dry_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """``--dry-run``: the sizes reduced and the device CPU; every other argument as given."""
    from kforcing_kernels.model import PRESETS

    head_dim = PRESETS[args.preset](**args.overrides).head_dim
    args.device = "cpu"
    args.overrides = {
        **args.overrides,
        **DRY_OVERRIDES,
        "n_head": DRY_WIDTH_HEADS,
        "n_embd": DRY_WIDTH_HEADS * head_dim,
    }
    args.shapes = list(dict.fromkeys((min(n, DRY_N), k) for n, k in args.shapes))
    args.batch_size = min(args.batch_size, DRY_BATCH)
    args.warmup, args.reps = min(args.warmup, 1), 1
    return args


def finish_args(p, args, argv, prog):
    from .._cli import default_out

    args.overrides = parse_overrides(p, args.override)
    args.command = command_line(prog, argv)
    args.out = args.out or default_out("bench-train-gpu-")
    if args.dry_run:
        dry_sizes(args)
    elif torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (--dry-run runs the same arguments on CPU)")
    return args


def execute(args) -> int:
    report = run(args)
    failed = [r for r in report["rows"] if r.get("kind") == "variant" and r["status"] == "error"]
    print(f"\nwrote {args.out}/train_gpu.jsonl, {args.out}/train_gpu.json ({report['meta']['wall_s']:.0f} s)")
    if args.dry_run and failed:
        print(
            f"dry run: {len(failed)} variant(s) failed: " + "; ".join(f"{r['variant']}: {r['reason']}" for r in failed)
        )
        return 1
    return 0

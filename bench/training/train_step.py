"""One self-forcing training step of the reference model: dense-mask attention vs ours.

    python -m bench train --quick
    python -m bench train                         # k = 1, 2, 4, 8 at N=512, B=2, the "tiny" model
    python -m bench train --preset paper --override n_layer=1 --seq-len 256 --k 4 --batch-size 1 --reps 1 --ac
                                                  # one paper-vocabulary step with activation checkpointing

Stage PFLM(k) -> PFLM(2k) (paper Algorithm 3), exactly ``kforcing_kernels.app.training.objectives.compute_loss``
plus the optimizer step: the teacher's SingleForward on k noises and DoubleForward on
k more (no grad), the student's SingleForward on all 2k noises, forward + backward,
then AdamW. The two variants differ only in the model's ``attention_backend``:
``reference`` (the dense (N+Nk)^2 mask handed to SDPA, what the paper's code does)
and ours (``default_backend`` for the device unless ``--ours`` names one). Both run
round-robin in one process from the same weights and batch; the speed-up is the
ratio of their medians. Weights are random: a step costs the same trained or not.

``--ac``: activation checkpointing on the student's blocks (the trainer's ``--activation-checkpointing``).
``--unchunked-loss``: the loss and teacher targets as before issue 45 (every row's ``[rows, V]`` logits at once),
for an A/B in one process. Memory, per variant, from one extra step after the timing: on CUDA the peak
``max_memory_allocated`` above what was allocated before the step; everywhere the bytes autograd saves
(``saved_mib``, parameters excluded) and the peak of the live storages the step makes (``tracked_peak_mib``,
``kforcing_kernels/tools/memory.py``: deterministic; it holds autograd's in-place gradient sums off, so a tied
embedding's gradient is counted twice); and the process's peak RSS so far (CPU; shared by the variants).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from kforcing_kernels import default_backend
from kforcing_kernels.app.cli import add_batch_size, positive_int

from .._cli import (
    add_model_args,
    add_run_args,
    apply_profile,
    command_line,
    default_out,
    parse_overrides,
    progress_bar,
    write_report_files,
)
from .._timing import (
    busy_cores,
    commit_label,
    machine_info,
    measure_many,
    paired_ratio,
    pin_threads,
    row_stamp,
    timing_fields,
)
from ..attention.report import log_log_slope

SCHEMA_ID = "kforcing-bench/train-step/v1"
FULL = {"k": [1, 2, 4, 8], "seq_len": 512, "batch": 2, "reps": 3, "warmup": 1, "max_seconds": 30.0}
QUICK = {"k": [1, 2], "seq_len": 128, "batch": 1, "reps": 3, "warmup": 1, "max_seconds": 2.0}


def build_models(args, backend: str | None, state: dict | None):
    """(teacher, student, optimizer) with ``attention_backend=backend``; weights from ``state`` when given;
    the student's blocks checkpointed with ``args.ac``."""
    from kforcing_kernels.model import PRESETS, KForcingLM

    cfg = PRESETS[args.preset](seq_len=args.seq_len, **args.overrides)
    cfg = dataclasses.replace(cfg, attention_backend=backend)
    torch.manual_seed(0)
    teacher, student = KForcingLM(cfg).to(args.device), KForcingLM(cfg).to(args.device)
    if state is not None:
        teacher.load_state_dict(state["teacher"])
        student.load_state_dict(state["student"])
    teacher.eval()
    if getattr(args, "ac", False):
        from kforcing_kernels.app.training.parallel import checkpoint_blocks

        checkpoint_blocks(student)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    return teacher, student, optimizer


def make_step(teacher, student, optimizer, batch, k: int, chunked: bool = True):
    from kforcing_kernels.app.training.objectives import Objective, compute_loss

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss, _ = compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked)
        loss.backward()
        optimizer.step()

    return step


def first_loss(teacher, student, batch, k: int, chunked: bool = True) -> float:
    """The step's loss before any update (a check that both variants compute the same step)."""
    from kforcing_kernels.app.training.objectives import Objective, compute_loss

    with torch.no_grad():
        return float(compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked)[0])


def step_memory(teacher, student, batch, device: torch.device, chunked: bool = True) -> dict:
    """Memory of one more step (loss + backward; gradients cleared first), in MiB: see the module docstring."""
    from kforcing_kernels.app.training.objectives import Objective, compute_loss
    from kforcing_kernels.tools.memory import AllocationTracker, SavedTensors, peak_rss_bytes

    mib = 2**20
    out = {}
    if device.type == "cuda":
        student.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked)[0].backward()
        torch.cuda.synchronize(device)
        out["cuda_peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / mib
    student.zero_grad(set_to_none=True)
    saved = SavedTensors(exclude=student.parameters())
    with AllocationTracker(device.type) as tracker, saved.context():
        compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked)[0].backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in student.parameters() if p.grad is not None)
    out.update(saved_mib=saved.total / mib, tracked_peak_mib=tracker.peak / mib, grads_mib=grads / mib)
    if device.type == "cpu":
        out["process_peak_rss_mib"] = peak_rss_bytes() / mib
    student.zero_grad(set_to_none=True)
    return out


def run(args) -> dict:
    from kforcing_kernels.app.training.objectives import Batch

    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    ours = args.ours or default_backend(device)
    variants = {"dense": "reference", "ours": ours}
    teacher, student, _ = build_models(args, None, None)
    state = {"teacher": teacher.state_dict(), "student": student.state_dict()}
    cfg = teacher.config
    del teacher, student
    meta = {
        **machine_info(),
        "schema": SCHEMA_ID,
        "command": args.command,
        "quick": args.quick,
        "device": str(device),
        "threads": threads,
        "preset": args.preset,
        "model": cfg.to_dict(),
        "seq_len": args.seq_len,
        "batch": args.batch_size,
        "k": args.k,
        "variants": variants,
        "warmup": args.warmup,
        "reps": args.reps,
        "max_seconds": args.max_seconds,
        "activation_checkpointing": args.ac,
        "chunked_loss": not args.unchunked_loss,
        "loadavg_start": busy_cores(),
    }
    stamp = row_stamp(meta)
    rows = []
    start = time.perf_counter()
    bar = progress_bar(len(args.k), "train step", args.progress)
    for k in args.k:
        bar.set_postfix_str(f"k={k}")
        gen = torch.Generator().manual_seed(k)
        n, b = args.seq_len, args.batch_size
        batch = Batch(
            tokens=torch.randint(0, cfg.vocab_size, (b, n), generator=gen),
            noise=torch.rand(b, n, 2 * k, generator=gen),
            tau=0.5 + 0.5 * torch.rand(b, generator=gen),
        ).to(device)
        steps, losses, models = {}, {}, {}
        chunked = not args.unchunked_loss
        for label, backend in variants.items():
            teacher, student, optimizer = build_models(args, backend, state)
            # same weights and batch: must agree across variants
            losses[label] = first_loss(teacher, student, batch, k, chunked)
            steps[label] = make_step(teacher, student, optimizer, batch, k, chunked)
            models[label] = (teacher, student)
        timings = measure_many(steps, warmup=args.warmup, reps=args.reps, max_seconds=args.max_seconds)
        for label, timing in timings.items():
            row = {
                **stamp,
                "teacher_k": k,
                "student_k": 2 * k,
                "n": n,
                "batch": b,
                "variant": label,
                "backend": variants[label],
                "loss": losses[label],
            }
            row.update(timing_fields(timing, "context_tokens_per_s", b * n))
            if row["status"] == "ok" and not args.no_memory:
                row.update(step_memory(*models[label], batch, device, chunked))
            rows.append(row)
        del steps, models
        if args.verbose:
            bar.write(f"  k={k} {time.perf_counter() - start:6.1f} s", file=sys.stderr)
        bar.update()
    bar.close()
    meta["wall_s"] = time.perf_counter() - start
    meta["loadavg_end"] = busy_cores()
    for k in args.k:
        pair = {r["variant"]: r for r in rows if r["teacher_k"] == k and r["status"] == "ok"}
        if len(pair) == 2:
            pair["ours"]["speedup_vs_dense"] = paired_ratio(pair["dense"]["times_ms"], pair["ours"]["times_ms"])
            pair["ours"]["speedup_vs_dense_min"] = pair["dense"]["min_ms"] / pair["ours"]["min_ms"]
    fits = {}
    for label in variants:
        pts = [(r["teacher_k"], r["median_ms"]) for r in rows if r["variant"] == label and r["status"] == "ok"]
        if len(pts) >= 2:
            fits[label] = log_log_slope([p[0] for p in pts], [p[1] for p in pts])
    return {"schema": SCHEMA_ID, "meta": meta, "rows": rows, "exponent_vs_k": fits}


def format_report(report: dict) -> str:
    meta = report["meta"]
    m = meta["model"]
    lines = [
        f"self-forcing training step: {meta['command']}",
        f"  model {meta['preset']}: {m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocab "
        f"{m['vocab_size']}; "
        f"N={meta['seq_len']}, B={meta['batch']}; {meta['device']}, threads={meta['threads']} (pinned), "
        f"warm-up {meta['warmup']}, up to {meta['reps']} reps",
        f"  dense = attention_backend 'reference' (dense mask + SDPA); ours = {meta['variants']['ours']!r}; "
        f"activation checkpointing {'on' if meta.get('activation_checkpointing') else 'off'}; "
        f"loss {'chunked' if meta.get('chunked_loss', True) else 'unchunked (before issue 45)'}",
        f"  torch {meta['torch']}, commit {commit_label(meta)}, {meta['timestamp']}, {meta['wall_s']:.0f} s, "
        f"load average {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} on {meta['cpus']} cores",
        "",
        f"{'stage':<10}{'dense ms':>12}{'ours ms':>12}{'speed-up':>10}{'(from mins)':>13}"
        f"{'ours ctx tok/s':>16}{'loss dense/ours':>20}",
    ]
    for k in meta["k"]:
        sel = {r["variant"]: r for r in report["rows"] if r["teacher_k"] == k}
        d, o = sel.get("dense"), sel.get("ours")
        cell = lambda r: f"{r['median_ms']:.0f}" if r and r["status"] == "ok" else (r["status"] if r else "-")  # noqa: E731
        speed = f"{o['speedup_vs_dense']:.2f}x" if o and "speedup_vs_dense" in o else "-"
        speed_min = f"{o['speedup_vs_dense_min']:.2f}x" if o and "speedup_vs_dense_min" in o else "-"
        tps = f"{o['context_tokens_per_s']:.0f}" if o and o["status"] == "ok" else "-"
        loss = f"{d['loss']:.4f}/{o['loss']:.4f}" if d and o else "-"
        lines.append(f"{f'{k}->{2 * k}':<10}{cell(d):>12}{cell(o):>12}{speed:>10}{speed_min:>13}{tps:>16}{loss:>20}")
    for label, slope in report["exponent_vs_k"].items():
        lines.append(f"step time ~ k^p, {label}: p = {slope:.2f}")
    memory = [r for r in report["rows"] if "saved_mib" in r]
    if memory:
        lines += [
            "",
            "memory of one step (loss + backward), MiB: saved = autograd's saved tensors; tracked peak = "
            "live storages the step makes (gradients included); CUDA: max_memory_allocated above the start",
            f"{'stage':<10}{'variant':<8}{'saved':>10}{'tracked peak':>14}{'grads':>10}{'CUDA peak':>12}"
            f"{'peak RSS':>10}",
        ]
        for r in memory:
            cuda = f"{r['cuda_peak_mib']:.0f}" if "cuda_peak_mib" in r else "-"
            rss = f"{r['process_peak_rss_mib']:.0f}" if "process_peak_rss_mib" in r else "-"
            stage = f"{r['teacher_k']}->{r['student_k']}"
            lines.append(
                f"{stage:<10}{r['variant']:<8}{r['saved_mib']:>10.0f}{r['tracked_peak_mib']:>14.0f}"
                f"{r['grads_mib']:>10.0f}{cuda:>12}{rss:>10}"
            )
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"k={r['teacher_k']} {r['variant']}: {r['status']}: {r['reason']}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    p.add_argument(
        "--k", default=None, help="comma-separated teacher window sizes k, the student gets 2k (None: the profile's)"
    )
    p.add_argument("--seq-len", type=positive_int, default=None, help="context length N (None: the profile's)")
    add_batch_size(p, None, help="sequences per step (None: the profile's)")
    add_model_args(p)
    p.add_argument("--ours", default=None, help="our backend (None: default_backend for the device)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing on the student's blocks (the trainer's)")
    p.add_argument(
        "--unchunked-loss",
        action="store_true",
        help="the loss and teacher targets with every row's [rows, V] logits at once (before issue 45)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the extra step that measures memory")
    add_run_args(p, "bench-train-")


def finish_args(p, args, argv, prog):
    profile = QUICK if args.quick else FULL
    args.k = [int(x) for x in args.k.split(",")] if args.k else list(profile["k"])
    if args.batch_size is None:
        args.batch_size = profile["batch"]
    apply_profile(args, profile, ("seq_len", "warmup", "reps", "max_seconds"))
    args.overrides = parse_overrides(p, args.override)
    args.out = args.out or default_out("bench-train-")
    args.command = command_line(prog, argv)
    return args


def execute(args) -> dict:
    report = run(args)
    print(format_report(report))
    write_report_files(report, args.out, "train_step")
    return report

"""Inference throughput: AR decoding vs K-Forcing (k tokens per forward pass), KV-cached.

    python -m bench infer --quick
    python -m bench infer                         # k = 1, 2, 4 at batch 4, 16, 128; the "tiny" model

Both use ``kforcing_kernels.inference`` (``generate_ar`` one token per forward,
``generate_kforcing`` k per forward, paper Algorithm 1) on the same random-weight
model and prompts; throughput is generated tokens per second (batch x new tokens /
time), timed round-robin in one process. Weights are random: the work per step
does not depend on training, only the text does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._cli import add_model_args, add_run_args, apply_profile, command_line, default_out, parse_overrides, write_report_files  # noqa: E402
from bench._timing import busy_cores, commit_label, machine_info, measure_many, paired_ratio, pin_threads, row_stamp, timing_fields  # noqa: E402
from kforcing_kernels import default_backend  # noqa: E402

SCHEMA_ID = "kforcing-bench/inference/v1"
FULL = {"k": [1, 2, 4], "batch": [4, 16, 128], "prompt_len": 64, "new_tokens": 64, "reps": 3, "warmup": 1, "max_seconds": 20.0}
QUICK = {"k": [1, 2, 4], "batch": [4, 16], "prompt_len": 32, "new_tokens": 16, "reps": 3, "warmup": 1, "max_seconds": 1.0}


def run(args) -> dict:
    from kforcing_kernels.inference import generate_ar, generate_kforcing
    from kforcing_kernels.model import PRESETS, KForcingLM

    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    backend = args.backend or default_backend(device)
    cfg = PRESETS[args.preset](seq_len=args.prompt_len + args.new_tokens, attention_backend=backend, **args.overrides)
    torch.manual_seed(0)
    model = KForcingLM(cfg).to(device).eval()
    meta = {
        **machine_info(), "schema": SCHEMA_ID, "command": args.command, "quick": args.quick, "device": str(device),
        "threads": threads, "backend": backend, "preset": args.preset, "model": cfg.to_dict(), "k": args.k,
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "warmup": args.warmup,
        "reps": args.reps, "max_seconds": args.max_seconds, "loadavg_start": busy_cores(),
    }
    stamp = row_stamp(meta)
    rows = []
    start = time.perf_counter()
    t = args.new_tokens
    for b in args.batch:
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), generator=gen).to(device)
        runs = {"ar": lambda: generate_ar(model, prompts, t, temperature=1.0, generator=torch.Generator().manual_seed(1))}
        for k in args.k:
            runs[f"kforcing k={k}"] = lambda k=k: generate_kforcing(model, prompts, k, t, generator=torch.Generator().manual_seed(1))
        timings = measure_many(runs, warmup=args.warmup, reps=args.reps, max_seconds=args.max_seconds)
        for label, timing in timings.items():
            k = None if label == "ar" else int(label.split("=")[1])
            row = {**stamp, "batch": b, "method": "ar" if k is None else "kforcing", "k": k,
                   "forward_passes": t if k is None else -(-t // k), "new_tokens": t, "prompt_len": args.prompt_len}
            row.update(timing_fields(timing, "tokens_per_s", b * t))
            rows.append(row)
        if args.verbose:
            print(f"  batch {b}: {time.perf_counter() - start:6.1f} s", file=sys.stderr, flush=True)
    for b in args.batch:
        ar = next((r for r in rows if r["batch"] == b and r["method"] == "ar" and r["status"] == "ok"), None)
        for r in rows:
            if r["batch"] == b:
                r["speedup_vs_ar"] = paired_ratio(ar["times_ms"], r["times_ms"]) if ar and r["status"] == "ok" else None
    meta["wall_s"] = time.perf_counter() - start
    meta["loadavg_end"] = busy_cores()
    return {"schema": SCHEMA_ID, "meta": meta, "rows": rows}


def format_report(report: dict) -> str:
    meta = report["meta"]
    m = meta["model"]
    lines = [
        f"inference throughput: {meta['command']}",
        f"  model {meta['preset']}: {m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocab {m['vocab_size']}; "
        f"prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens; attention backend {meta['backend']!r}",
        f"  {meta['device']}, threads={meta['threads']} (pinned), warm-up {meta['warmup']}, up to {meta['reps']} reps; torch {meta['torch']}, "
        f"commit {commit_label(meta)}, {meta['timestamp']}, {meta['wall_s']:.0f} s, "
        f"load average {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} on {meta['cpus']} cores",
        "",
        f"{'batch':>6}  {'method':<14}{'passes':>8}{'ms':>10}{'tokens/s':>11}{'vs AR':>8}",
    ]
    for r in report["rows"]:
        label = "AR" if r["method"] == "ar" else f"K-Forcing k={r['k']}"
        if r["status"] != "ok":
            lines.append(f"{r['batch']:>6}  {label:<14}{r['forward_passes']:>8}  {r['status']}: {r['reason']}")
            continue
        lines.append(f"{r['batch']:>6}  {label:<14}{r['forward_passes']:>8}{r['median_ms']:>10.0f}{r['tokens_per_s']:>11.0f}{r['speedup_vs_ar']:>7.2f}x")
    return "\n".join(lines)


def parse_args(argv=None, prog="python bench/inference.py"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    p.add_argument("--k", default=None, help="comma-separated K-Forcing k values")
    p.add_argument("--batch", default=None, help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    add_model_args(p)
    p.add_argument("--backend", default=None, help="attention backend (default: default_backend for the device)")
    add_run_args(p, "bench-infer-")
    args = p.parse_args(argv)
    profile = QUICK if args.quick else FULL
    args.k = [int(x) for x in args.k.split(",")] if args.k else list(profile["k"])
    args.batch = [int(x) for x in args.batch.split(",")] if args.batch else list(profile["batch"])
    apply_profile(args, profile, ("prompt_len", "new_tokens", "warmup", "reps", "max_seconds"))
    args.overrides = parse_overrides(p, args.override)
    args.out = args.out or default_out("bench-infer-")
    args.command = command_line(prog, argv)
    return args


def main(argv=None, prog="python bench/inference.py") -> dict:
    args = parse_args(argv, prog)
    report = run(args)
    print(format_report(report))
    write_report_files(report, args.out, "inference")
    return report


if __name__ == "__main__":
    main()

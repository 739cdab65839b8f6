"""The trainer's ``--context-parallel`` end to end: tokens/s with W ranks against one process (CPU, gloo).

    python -m bench cp-throughput                                   # N=512, k=4, world 2, 2 cores
    python -m bench cp-throughput --seq-len 1024 --worlds 2 4 --json out.json

Trains an AR teacher for one step (``kforcing-train stage0``), then times the same Stage-1 run (noise
inversion at window k: a SingleForward over N(1+k) rows, the shape context parallelism splits) once in
one process with ``--threads T`` and once under ``torchrun --nproc_per_node W --context-parallel W``
with ``T / W`` threads per rank (the same cores, so the ratio shows what splitting the attention rows
costs or saves, not extra hardware). Each run's steady rate is the median ``tokens_per_s`` of its
metrics.jsonl after the first step (compiles and caches warm there); "per rank" divides it by W.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kforcing_kernels.app.cli import add_batch_size, add_threads, positive_int

from .._cli import write_json


def _train(args, stage: list[str], out: Path, threads: int, world: int = 1) -> None:
    launcher = (
        [sys.executable, "-m", "kforcing_kernels.app.train"]
        if world == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world),
            "-m",
            "kforcing_kernels.app.train",
        ]
    )
    cmd = [
        *launcher,
        *stage,
        "--out",
        str(out),
        "--threads",
        str(threads),
        "--device",
        "cpu",
        "--no-progress",
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--log-every",
        "1",
        "--eval-batches",
        "1",
    ]
    if world > 1:
        cmd += ["--context-parallel", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steady_tokens_per_s(run: Path) -> tuple[float, list[float]]:
    """Median ``tokens_per_s`` of a run's logged steps after the first, and all of them."""
    rates = [
        m["tokens_per_s"]
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "tokens_per_s" in m
    ]
    if len(rates) < 2:
        raise RuntimeError(f"{run}: expected >= 2 logged steps, got {len(rates)}")
    return statistics.median(rates[1:]), rates


def add_arguments(p) -> None:
    p.add_argument("--seq-len", type=positive_int, default=512, help="context tokens N per sequence")
    p.add_argument("--k", type=positive_int, default=4, help="Stage-1 window k (noise inversion)")
    add_batch_size(p, 2)
    p.add_argument(
        "--steps", type=positive_int, default=6, help="timed run length, >= 2 (the first step is not counted)"
    )
    p.add_argument(
        "--worlds", type=positive_int, nargs="+", default=[2], help="context-parallel world sizes, each >= 2"
    )
    add_threads(p, none="all cores (os.cpu_count()). The count in all: each of W ranks runs threads / W")
    p.add_argument("--json", help="also write the numbers here")


def finish_args(p, args, argv=None, prog=None):
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if args.steps < 2:
        p.error(f"--steps: expected >= 2 (the first step is not counted), got {args.steps}")
    if any(w < 2 or args.threads % w for w in args.worlds):
        p.error(f"--worlds: expected sizes >= 2 that divide --threads {args.threads}, got {args.worlds}")
    return args


def execute(args) -> int:
    stage1 = ["stage1", "--supervision", "noise-inversion", "--k", str(args.k), "--steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _train(args, ["stage0", "--steps", "1"], root / "s0", args.threads)
        stage1 += ["--teacher", str(root / "s0")]
        _train(args, stage1, root / "one", args.threads)
        one, one_rates = steady_tokens_per_s(root / "one")
        rows = [
            {
                "world": 1,
                "threads_per_rank": args.threads,
                "tokens_per_s": one,
                "per_rank": one,
                "vs_one": 1.0,
                "rates": one_rates,
            }
        ]
        for world in args.worlds:
            _train(args, stage1, root / f"cp{world}", args.threads // world, world)
            rate, rates = steady_tokens_per_s(root / f"cp{world}")
            rows.append(
                {
                    "world": world,
                    "threads_per_rank": args.threads // world,
                    "tokens_per_s": rate,
                    "per_rank": rate / world,
                    "vs_one": rate / one,
                    "rates": rates,
                }
            )
    print(
        f"Stage 1 (noise inversion), N={args.seq_len}, k={args.k}, batch {args.batch_size}, {args.threads} threads "
        "in all:"
    )
    print("| world | threads/rank | tokens/s | per rank | vs one process |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['world']} | {r['threads_per_rank']} | {r['tokens_per_s']:.0f} | {r['per_rank']:.0f} | "
            f"{r['vs_one']:.2f} |"
        )
    if args.json:
        write_json({"settings": vars(args), "rows": rows}, args.json)
    return 0

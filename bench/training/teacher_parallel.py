"""The frozen teacher replicated or sharded (``--teacher-parallel replicate`` / ``fsdp``): time per Stage-2 step.

    python -m bench teacher                                   # HF Llama 25m (27.5M + noise embedding), N=128, k=2, W=2
    python -m bench teacher --hf-llama tiny --seq-len 16 --reps 2   # seconds: a check of the script itself

One ``torchrun --nproc_per_node W`` launch (gloo on CPU, one thread per rank unless ``--threads``). Every rank builds
the pair as the trainer does (bench/training/_train_models.py) twice: once with the teacher replicated, once sharded
with
FSDP2 (``kforcing_kernels.app.training.parallel.place_teacher``); the student is FSDP2-sharded (``parallelize``) in
both. It times, round-robin (``bench._timing.measure_many``: each round runs every callable once, so both placements see
the same background load):

* ``step``: one whole Stage-2 step (teacher SingleForward + DoubleForward, the student's forward and loss, backward,
  AdamW) on the same micro-batch of ``--batch-per-rank`` sequences;
* ``teacher``: the teacher's two passes alone (``student_inputs``: what the sharded teacher's all-gathers slow down).

Then one more step of each is counted: the bytes the teacher's passes all-gather (FSDP2's ``all_gather_single``
buffers; a rank sends or receives (W-1)/W of them) and the teacher's bytes per rank. Rank 0's times are reported
(collectives keep the ranks in step). The output is a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kforcing_kernels.app.cli import add_threads, positive_int

from ._train_models import (
    Collectives,
    add_model_arguments,
    build_pair,
    execute_launcher,
    model_argv,
    model_name,
    tensor_bytes,
)

SCHEMA_ID = "kforcing-bench/teacher-parallel/v1"
MIB = 2**20
MODES = ("replicate", "fsdp")


def add_arguments(p) -> None:
    add_model_arguments(p, "tiny", hf_llama="25m")
    p.add_argument("--native", action="store_true", help="the native model of --preset instead of the default HF Llama")
    p.add_argument("--seq-len", type=positive_int, default=128, help="context length N")
    p.add_argument("--k", type=positive_int, default=2, help="student window (twice the teacher's; even)")
    p.add_argument("--batch-per-rank", type=positive_int, default=1, help="sequences per rank")
    p.add_argument("--world", type=positive_int, default=2, help="ranks (one torchrun launch)")
    p.add_argument("--reps", type=positive_int, default=7, help="timed rounds (each: every callable once)")
    p.add_argument("--warmup", type=positive_int, default=1, help="untimed calls of each callable first")
    add_threads(p, none="1 per worker process (OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=None, help="write the report as JSON here (None: only print it)")
    p.add_argument(
        "--worker-out", default=None, help="internal: run as a torchrun worker and write rank 0's numbers here"
    )


def _setup(args, mode: str, device: torch.device):
    from kforcing_kernels.app.training.parallel import parallelize, place_teacher, setup_parallel

    teacher, student = build_pair(args, args.seq_len, args.k, device)
    dims = setup_parallel(device.type, parallel="fsdp")
    place_teacher(teacher, dims, mode)
    parallelize(student, dims)
    return teacher, student, torch.optim.AdamW(student.parameters(), lr=1e-4)


def measure(args, device: torch.device) -> dict:
    """Both placements on this rank (a process group must exist); rank 0's timings and counts."""
    import torch.distributed as dist

    from kforcing_kernels.app.training.objectives import Objective, compute_loss, make_batch, student_inputs

    from .._timing import measure_many

    pairs = {mode: _setup(args, mode, device) for mode in MODES}
    comm = Collectives()
    for teacher, _, _ in pairs.values():
        comm.watch_teacher(teacher)
    vocab = pairs["replicate"][1].config.vocab_size
    stream = torch.randint(0, vocab, (64 * args.seq_len,), generator=torch.Generator().manual_seed(1))
    data = make_batch(
        Objective.SELF_FORCING,
        stream,
        args.batch_per_rank,
        args.seq_len,
        args.k,
        (0.5, 1.0),
        torch.Generator().manual_seed(2 + dist.get_rank()),
    ).to(device)

    def step(teacher, student, optimizer):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = compute_loss(Objective.SELF_FORCING, student, data, teacher)
        loss.backward()
        optimizer.step()
        return loss

    calls = {}
    for mode, (teacher, student, optimizer) in pairs.items():
        calls[f"step/{mode}"] = lambda t=teacher, s=student, o=optimizer: step(t, s, o)
        calls[f"teacher/{mode}"] = lambda t=teacher: student_inputs(Objective.SELF_FORCING, data, t, None)
    times = measure_many(calls, warmup=args.warmup, reps=args.reps)  # no time budget: every rank runs every call
    failed = {key: repr(v) for key, v in times.items() if isinstance(v, BaseException)}
    if failed:
        raise RuntimeError(f"timed calls failed: {failed}")
    rows = []
    for mode, (teacher, student, optimizer) in pairs.items():
        comm.reset()
        with comm:
            loss = step(teacher, student, optimizer)
        rows.append(
            {
                "teacher_parallel": mode,
                "step": _summary(times[f"step/{mode}"]),
                "teacher": _summary(times[f"teacher/{mode}"]),
                "teacher_bytes": tensor_bytes(teacher.parameters()),
                "teacher_all_gather_bytes": comm.teacher_gathered,
                "student_all_gather_bytes": comm.gathered,
                "loss": float(loss.detach()),
            }
        )
    n_teacher = sum(p.numel() for p in pairs["replicate"][0].parameters())
    return {
        "schema": SCHEMA_ID,
        "model": model_name(args),
        "teacher_parameters": n_teacher,
        "world": dist.get_world_size(),
        "seq_len": args.seq_len,
        "k": args.k,
        "batch_per_rank": args.batch_per_rank,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _summary(t: dict) -> dict:
    return {
        "median_ms": t["median_ms"],
        "min_ms": t["min_ms"],
        "max_ms": max(t["times_ms"]),
        "reps": t["reps"],
        "times_ms": t["times_ms"],
    }


def _worker(args) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    report = measure(args, torch.device("cpu"))
    if dist.get_rank() == 0:
        Path(args.worker_out, "report.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.world),
            "-m",
            "bench",
            "teacher",
            "--worker-out",
            folder,
            *model_argv(args),
            *([] if args.hf_llama or args.model_config else ["--native"]),
            "--seq-len",
            str(args.seq_len),
            "--k",
            str(args.k),
            "--batch-per-rank",
            str(args.batch_per_rank),
            "--reps",
            str(args.reps),
            "--warmup",
            str(args.warmup),
        ]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
        result = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"torchrun failed\n{result.stderr[-4000:]}")
        return json.loads(Path(folder, "report.json").read_text())


def format_report(report: dict) -> str:
    w = report["world"]
    lines = [
        f"{report['model']} ({report['teacher_parameters']:,} parameters, teacher = student), stage 2 step, "
        f"N={report['seq_len']}, k={report['k']}, {report['batch_per_rank']} sequence(s) per rank, W={w} (gloo, "
        f"{report['threads']} thread(s) per rank), fp32, student FSDP2; ms: median (min-max) of "
        f"{report['rows'][0]['step']['reps']} rounds on rank 0",
        "",
        "| teacher | step ms | teacher passes ms | teacher MiB per rank | teacher all-gather MiB per step | "
        "on the wire per rank |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        s, t = r["step"], r["teacher"]
        lines.append(
            f"| {r['teacher_parallel']} | {s['median_ms']:.0f} ({s['min_ms']:.0f}-{s['max_ms']:.0f}) | "
            f"{t['median_ms']:.0f} ({t['min_ms']:.0f}-{t['max_ms']:.0f}) | {r['teacher_bytes'] / MIB:.1f} | "
            f"{r['teacher_all_gather_bytes'] / MIB:.1f} | "
            f"{r['teacher_all_gather_bytes'] * (w - 1) / w / MIB:.1f} |"
        )
    return "\n".join(lines)


def execute(args) -> int:
    if args.native:
        args.hf_llama = None
    return execute_launcher(args, _worker, run, format_report, lambda report: report)

"""``make demo``: the whole tiny K-Forcing pipeline on the embedded corpus, end to end, on CPU.

Stage 0 (AR teacher) -> Stage 1 (PFLM k=1) -> Stage 2 (k=2) -> Stage 2 (k=4) on the
Python standard library's source, then the evaluation of ``kforcing_kernels.evaluate``:
a Table-1-style table (tokens/s per batch size, speed-up over AR, teacher-scored
quality) and the per-position NLL table. Writes ``summary.json``, ``tables.md`` and
``plot.png`` to the output folder it prints (default ``runs/demo-<time>``).

    python -m kforcing_kernels.demo [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

# Under CPU contention, OpenMP threads that spin while waiting slow small ops down by
# 10x or more; passive waiting costs nothing when the machine is idle. The policy is
# read when the OpenMP runtime loads (with torch), so it has to be in the environment
# of a fresh process.
if "OMP_WAIT_POLICY" not in os.environ and __name__ == "__main__":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, "-m", "kforcing_kernels.demo", *sys.argv[1:]])

import torch  # noqa: E402

from .checkpoint import write_json, write_text  # noqa: E402
from .evaluate import evaluate_pipeline, format_nll_table, format_table1, plot_summary  # noqa: E402
from .pipeline import PipelineConfig, run_pipeline  # noqa: E402
from .train import TrainConfig  # noqa: E402

# The full demo: ~6-8 minutes on two idle CPU cores (about 30 TFLOP of training).
DEMO = dict(
    train=TrainConfig(preset="tiny", vocab_size=1024, seq_len=64, batch_size=16, warmup_steps=30, log_every=10, ckpt_every=250,
                      eval_batches=4),
    pipeline=PipelineConfig(steps_stage0=1500, steps_stage1=500, steps_stage2=300, lr_stage0=2e-3, lr_distill=2e-3),
    eval=dict(batch_sizes=(4, 16, 128), prompt_len=16, new_tokens=48, reps=5, nll_batches=8, nll_batch_size=16),
)
# --quick: the same pipeline in a minute or two; the numbers only show that it runs.
QUICK = dict(
    train=TrainConfig(preset="tiny", vocab_size=1024, seq_len=32, batch_size=8, warmup_steps=5, log_every=5, ckpt_every=50,
                      eval_batches=2),
    pipeline=PipelineConfig(steps_stage0=60, steps_stage1=20, steps_stage2=20, lr_stage0=2e-3, lr_distill=1e-3),
    eval=dict(batch_sizes=(4, 16, 128), prompt_len=16, new_tokens=32, reps=1, nll_batches=2, nll_batch_size=8),
)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kforcing_kernels.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output folder (default runs/demo-<date>-<time>)")
    parser.add_argument("--quick", action="store_true", help="a much shorter run that only shows the pipeline works")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"argument --threads: expected a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    preset = QUICK if args.quick else DEMO
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"[demo] output folder: {out.resolve()}", flush=True)
    print(f"[demo] torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads", flush=True)

    t0 = time.perf_counter()
    base = dataclasses.replace(preset["train"], device=args.device, progress=None)
    pipe = dataclasses.replace(preset["pipeline"], out=str(out))
    training = run_pipeline(pipe, base)
    t_train = time.perf_counter() - t0
    print(f"[demo] training done in {t_train:.0f}s; evaluating", flush=True)

    summary = evaluate_pipeline(out, device=args.device, temperature=0.8, log=lambda s: print(s, flush=True), **preset["eval"])
    summary["training"] = training
    summary["seconds"] = {"training": t_train, "evaluation": time.perf_counter() - t0 - t_train, "total": time.perf_counter() - t0}
    summary["config"] = {"train": dataclasses.asdict(base), "pipeline": dataclasses.asdict(pipe), "eval": preset["eval"]}

    table1, table2 = format_table1(summary), format_nll_table(summary)
    caption1 = (f"Generation: prompts of {summary['prompt_len']} held-out tokens, {summary['new_tokens']} new tokens, tau={summary['temperature']}, "
                f"KV cache, {summary['threads']} threads, median of {preset['eval']['reps']} timed runs after one warm-up. "
                "K-Forcing k uses the final PFLM(k=4). Quality = the Stage-0 AR teacher's NLL/perplexity of the generated tokens "
                "(teacher-scored, NOT GPT-2-large Gen-PPL); distinct-4 = unique 4-grams / all 4-grams.")
    caption2 = ("Per-position validation NLL of each student against its own teacher's targets (paper Table 2), and how often "
                "the student's argmax equals the target; the AR row is the teacher's next-token NLL on held-out text.")
    text = f"{table1}\n\n{caption1}\n\n{table2}\n\n{caption2}\n"
    write_text(out / "tables.md", text)
    write_json(out / "summary.json", summary)
    why_not = plot_summary(summary, out / "plot.png")

    print()
    print(text)
    print("Sample (prompt + completion, first prompt):")
    for name, sample in summary["samples"].items():
        print(f"--- {name} ---\n{sample}\n")
    print(f"[demo] {summary['seconds']['total']:.0f}s in total ({t_train:.0f}s training)")
    print(f"[demo] wrote {out / 'summary.json'}, {out / 'tables.md'}" + (f", {out / 'plot.png'}" if why_not is None else f" (no plot: {why_not})"))


if __name__ == "__main__":
    main()

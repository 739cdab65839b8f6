"""``make demo``: the whole tiny K-Forcing pipeline on the embedded corpus, end to end (CUDA when torch sees a GPU, else
CPU).

Stage 0 (AR teacher) -> Stage 1 (PFLM k=1) -> Stage 2 (k=2) -> Stage 2 (k=4) on the
Python standard library's source, then the evaluation of ``kforcing_kernels.app.evaluation.evaluate``
with its :data:`~kforcing_kernels.app.evaluation.evaluate.DEMO_EVAL` settings: a Table-1-style table
(tokens/s per batch size, speed-up over AR, quality scored by one fixed judge, with
distinct-4), the same quality over tau in {0.5, 0.8, 1.0}, and the per-position NLL
table. Writes ``summary.json``, ``tables.md`` and ``plot.png`` to the output folder it
prints (default ``runs/demo-<time>``); ``python -m kforcing_kernels.app.evaluation.evaluate DIR``
reproduces the tables from that folder.

    python -m kforcing_kernels.app.demo [--out DIR] [--quick | --long] [--judge STAGE0_DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, TypedDict

# Under CPU contention, OpenMP threads that spin while waiting slow small ops down by
# 10x or more; passive waiting costs nothing when the machine is idle. The policy is
# read when the OpenMP runtime loads (with torch), so it has to be in the environment
# of a fresh process.
if "OMP_WAIT_POLICY" not in os.environ and __name__ == "__main__":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, "-m", "kforcing_kernels.app.demo", *sys.argv[1:]])

import torch  # noqa: E402

from .data import DataError  # noqa: E402
from .evaluation.evaluate import DEMO_EVAL, EvalSettings, evaluate_pipeline  # noqa: E402
from .evaluation.report import format_report, plot_summary  # noqa: E402
from .files import CheckpointError, write_json, write_text  # noqa: E402
from .training.config import ConfigError, TrainConfig  # noqa: E402
from .training.pipeline import PipelineConfig, run_pipeline  # noqa: E402
from .training.run_folder import check_out_folder  # noqa: E402


class DemoPreset(TypedDict):
    """One preset of the demo: the stages' settings, the pipeline's and the evaluation's."""

    train: TrainConfig
    pipeline: PipelineConfig
    eval: EvalSettings


# The model, data and optimizer settings: TrainConfig's defaults (the stage CLIs' too).
_TRAIN = TrainConfig()
# The default demo: about 7-8 minutes on two idle CPU cores (bench/results/demo/). Distillation
# runs at batch 8 (a k=4 self-forcing step at batch 16 costs ~1.1 s there, 6.7x an AR step).
# Stage 1 and the k=4 round share the distillation time (issue 39): an argmax PFLM(1) collapses to
# the teacher's mode until it resolves its noise, and the later rounds copy that collapse, so Stage-1
# steps buy the diversity of every row, while the k=4 round's steps (its slots 3-4 start untrained)
# buy its perplexity (issue 18). Stage 1 / k=4 steps 200 / 240 gave k=4 1.03x the teacher's judge
# perplexity at distinct-4 0.69; 400 / 200: 1.29x, 0.78; 600 / 160: 1.54x, 0.83 (BENCHMARKS.md, issue 39 part 2).
DEMO = DemoPreset(
    train=_TRAIN,
    pipeline=PipelineConfig(
        steps_stage0=600,
        steps_stage1=400,
        steps_stage2=(150, 200),
        lr_stage0=2e-3,
        lr_distill=2e-3,
        batch_size_distill=8,
    ),
    eval=DEMO_EVAL,
)
# --long: about an hour on two idle CPU cores, a few minutes on a GPU. A stronger teacher
# (1000 steps), every distillation stage at batch 16, and 2400 steps in the k=4 round: in the
# allocation sweep more Stage-1 / k=2 steps did not help k=4, k=4-round steps did up to
# 2400-3000 (6000 were no better), so the extra time goes to the round that still learns.
LONG = DemoPreset(
    train=_TRAIN,
    pipeline=PipelineConfig(
        steps_stage0=1000, steps_stage1=450, steps_stage2=(300, 2400), lr_stage0=2e-3, lr_distill=2e-3
    ),
    eval=DEMO_EVAL,
)
# --quick: the same pipeline in a minute or two; the numbers only show that it runs.
QUICK = DemoPreset(
    train=TrainConfig(
        preset="tiny",
        vocab_size=1024,
        seq_len=32,
        batch_size=8,
        warmup_steps=5,
        log_every=5,
        ckpt_every=50,
        eval_batches=2,
    ),
    pipeline=PipelineConfig(steps_stage0=60, steps_stage1=20, steps_stage2=20, lr_stage0=2e-3, lr_distill=1e-3),
    eval=dataclasses.replace(DEMO_EVAL, new_tokens=32, reps=1, nll_batches=2, nll_batch_size=8),
)
PRESETS: dict[str, DemoPreset] = {"demo": DEMO, "long": LONG, "quick": QUICK}


def build_parser() -> argparse.ArgumentParser:
    """The ``kforcing-demo`` command line (shared options from app/cli.py)."""
    from .cli import add_device, add_temperature, add_threads, make_parser

    parser = make_parser("kforcing-demo", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        help="output folder (None: runs/demo-<date>-<time>); its finished stages are reused when trained with this "
        "preset's settings",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a much shorter run that only shows the pipeline works")
    size.add_argument(
        "--long",
        action="store_true",
        help="more training, most of it in the k=4 round (about an hour on 2 idle CPU cores)",
    )
    parser.add_argument(
        "--judge", help="an AR stage folder that scores every method (None: this run's Stage-0 teacher)"
    )
    add_temperature(parser, help_extra=" of the evaluation (the demo's tables)")
    add_threads(parser)
    add_device(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.temperature == 0:
        parser.error("argument --temperature: expected a positive number (K-Forcing samples at tau > 0), got 0")
    if args.judge is not None and not (Path(args.judge) / "model.json").exists():
        parser.error(f"argument --judge: expected a stage folder holding model.json, got {args.judge!r}")
    name = "quick" if args.quick else "long" if args.long else "demo"
    preset = PRESETS[name]
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        check_out_folder(out)
    except ConfigError as exc:
        parser.error(str(exc))
    print(f"[demo] output folder: {out.resolve()}", flush=True)
    print(
        f"[demo] torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, CPU kernels "
        f"{torch.backends.cpu.get_cpu_capability()} (the digits are reproducible on the same torch, instruction set "
        f"and text; not across them), preset {name}",
        flush=True,
    )

    t0 = time.perf_counter()
    base = dataclasses.replace(preset["train"], device=args.device, progress=None)
    pipe = dataclasses.replace(preset["pipeline"], out=str(out))
    try:
        training = run_pipeline(pipe, base)
    # e.g. --long into a folder holding the default demo's stages
    except (ConfigError, CheckpointError, DataError) as exc:
        parser.error(str(exc))
    t_train = time.perf_counter() - t0
    print(f"[demo] training done in {t_train:.0f}s; evaluating", flush=True)

    settings = dataclasses.asdict(dataclasses.replace(preset["eval"], temperature=args.temperature))
    summary = evaluate_pipeline(
        out, device=args.device, judge=args.judge, log=lambda s: print(s, flush=True), **settings
    )
    summary["training"] = training
    summary["seconds"] = {
        "training": t_train,
        "evaluation": time.perf_counter() - t0 - t_train,
        "total": time.perf_counter() - t0,
    }
    summary["config"] = {
        "preset": name,
        "train": dataclasses.asdict(base),
        "pipeline": dataclasses.asdict(pipe),
        "eval": settings,
    }

    text = format_report(summary)
    write_text(out / "tables.md", text)
    write_json(out / "summary.json", summary)
    why_not = plot_summary(summary, out / "plot.png")

    print()
    print(text)
    print("Sample (prompt + completion, first prompt):")
    for method, sample in summary["samples"].items():
        print(f"--- {method} ---\n{sample}\n")
    print(f"[demo] {summary['seconds']['total']:.0f}s in total ({t_train:.0f}s training)")
    print(
        f"[demo] wrote {out / 'summary.json'}, {out / 'tables.md'}"
        + (f", {out / 'plot.png'}" if why_not is None else f" (no plot: {why_not})")
    )


if __name__ == "__main__":
    main()

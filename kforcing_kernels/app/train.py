"""K-Forcing trainer: Stage 0 (AR teacher) -> Stage 1 (AR -> PFLM(1)) -> Stage 2 (PFLM(k) -> PFLM(2k)), repeated.

``kforcing-train``, the command line: one subcommand per stage, ``pipeline`` for all of them.

    python -m kforcing_kernels.app.train stage0 --out runs/x/stage0 --steps 1500
    python -m kforcing_kernels.app.train stage1 --teacher runs/x/stage0 --out runs/x/stage1
    python -m kforcing_kernels.app.train stage2 --teacher runs/x/stage1 --out runs/x/stage2_k2
    python -m kforcing_kernels.app.train pipeline --out runs/x          # 0 -> 1 -> 2 (k=2) -> 2 (k=4)
    torchrun --nproc_per_node 2 -m kforcing_kernels.app.train ...      # data parallel, same flags
    torchrun --nproc_per_node 2 -m kforcing_kernels.app.train ... --context-parallel 2   # one sequence, 2 ranks
    torchrun --nproc_per_node 2 -m kforcing_kernels.app.train ... --parallel fsdp   # FSDP2: sharded over the ranks
    torchrun --nproc_per_node 4 -m kforcing_kernels.app.train ... --parallel fsdp --context-parallel 2   # 2 x 2 mesh

The loop is :mod:`kforcing_kernels.app.training.loop`, the chain of stages
:mod:`kforcing_kernels.app.training.pipeline`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from typing import Optional, Sequence

import torch.distributed as dist

from .. import env
from .cli import (
    add_batch_size,
    add_command,
    add_device,
    add_preset,
    add_seed,
    add_threads,
    apply_threads,
    make_parser,
    non_negative_int,
    positive_int,
)
from .data import DataError
from .files import CheckpointError
from .training.config import PRECISIONS, STAGES, ConfigError, TrainConfig, setting_type
from .training.loop import NonFiniteLoss, train
from .training.parallel import PARALLEL_MODES, TEACHER_MODES
from .training.pipeline import PipelineConfig, per_round_type, run_pipeline

# ---------------------------------------------------------------------- CLI


_positive_int, _non_negative_int = positive_int, non_negative_int


def _add_common(p: argparse.ArgumentParser, defaults: TrainConfig, stage: str) -> None:
    p.add_argument("--out", required=True, help="output folder (checkpoints, metrics.jsonl, model.safetensors)")
    p.add_argument(
        "--data",
        default=defaults.data,
        help="'stdlib' (the interpreter's standard library), a text file or a directory",
    )
    p.add_argument("--vocab-size", type=_positive_int, default=defaults.vocab_size, help="BPE vocabulary size")
    p.add_argument("--seq-len", type=_positive_int, default=defaults.seq_len, help="context length N")
    add_batch_size(
        p, defaults.batch_size, help="global sequences per optimizer step (all ranks, all accumulation steps)"
    )
    p.add_argument(
        "--grad-accum",
        type=_positive_int,
        default=defaults.grad_accum,
        help="gradient accumulation steps per optimizer step",
    )
    p.add_argument(
        "--min-lr-ratio",
        type=setting_type("min_lr_ratio"),
        default=defaults.min_lr_ratio,
        help="cosine schedule floor, as a fraction of --lr",
    )
    p.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        default=defaults.warmup_steps,
        help="linear learning-rate warmup steps",
    )
    p.add_argument(
        "--weight-decay", type=setting_type("weight_decay"), default=defaults.weight_decay, help="AdamW weight decay"
    )
    p.add_argument("--grad-clip", type=setting_type("grad_clip"), default=defaults.grad_clip, help="gradient norm clip")
    p.add_argument(
        "--tau-min",
        type=setting_type("tau_min"),
        default=defaults.tau_min,
        help="lowest training temperature tau (sampled per sequence)",
    )
    p.add_argument(
        "--tau-max", type=setting_type("tau_max"), default=defaults.tau_max, help="highest training temperature tau"
    )
    add_seed(p)
    p.add_argument(
        "--packed-docs",
        action="store_true",
        default=None,
        help="windows keep document boundaries: no attention across documents, positions restart per "
        "document, "
        "no loss on predictions past a document's end",
    )
    p.add_argument(
        "--context-parallel",
        type=_positive_int,
        default=defaults.context_parallel,
        help="ranks that share each sequence (a divisor of the torchrun world size): their query rows are "
        "split by attended pairs and K/V gathered per layer (1: off)",
    )
    p.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default=defaults.parallel,
        help="with torchrun: ddp (a full copy per rank) or fsdp (FSDP2: parameters, gradients and optimizer "
        "state sharded over the ranks; sharded checkpoints)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each decoder layer in backward: less activation memory, same loss and gradients",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each decoder layer (after activation checkpointing, before FSDP2)",
    )
    if stage != "stage0":
        p.add_argument(
            "--teacher-parallel",
            choices=TEACHER_MODES,
            default=defaults.teacher_parallel,
            help="the frozen teacher: replicate (a full copy per rank, no communication) or fsdp (sharded "
            "over "
            "the ranks like the student: 1/W of its memory, an all-gather of its weights per teacher "
            "pass)",
        )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="auto: bf16/fp16 autocast on CUDA, fp32 on CPU",
    )
    add_device(p)
    add_threads(p)
    p.add_argument(
        "--log-every",
        type=_positive_int,
        default=defaults.log_every,
        help="steps between the records of metrics.jsonl (the terminal shows a live bar; without one, a "
        "progress line about every tenth of the run and at least every 30 s)",
    )
    p.add_argument("--ckpt-every", type=_positive_int, default=defaults.ckpt_every, help="steps between checkpoints")
    p.add_argument(
        "--keep-checkpoints", type=_positive_int, default=defaults.keep_checkpoints, help="newest checkpoints kept"
    )
    p.add_argument(
        "--eval-every",
        type=_non_negative_int,
        default=defaults.eval_every,
        help="steps between validation losses (0: only at the end)",
    )
    p.add_argument(
        "--eval-batches", type=_positive_int, default=defaults.eval_batches, help="validation batches per evaluation"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out (bit for bit)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the run already in --out (its files only) and start again"
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no live progress bar (None: a bar when stderr is a terminal)",
    )
    if stage in ("stage1", "pipeline"):
        p.add_argument(
            "--model",
            help="a local Hugging Face causal LM folder (config, weights, tokenizer): the AR teacher, "
            "K-Forced from stage1 on with its own tokenizer (instead of the native model)",
        )
    if stage in ("stage0", "pipeline"):
        p.add_argument(
            "--model-config",
            help="a transformers config file (JSON): a randomly initialised Hugging Face model "
            "that stage0 trains as the AR teacher (instead of the native model)",
        )
        add_preset(
            p,
            defaults.preset,
            help="model size of the AR teacher" if stage == "stage0" else "model size of every stage",
        )
        for dim in ("n_layer", "n_head", "n_embd"):
            p.add_argument(f"--{dim.replace('_', '-')}", type=_positive_int, help=f"override the preset's {dim}")


def _add_decode(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument(
        "--decode",
        choices=("argmax", "residual"),
        default=d.decode,
        help="how the Stage-1 PFLM decodes its slots (the stage2 students inherit it): argmax (the paper's) "
        "or residual "
        "(the inverse CDF of its softmax at the noise's unresolved digits; BENCHMARKS.md, issue 39)",
    )


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    parser = make_parser("kforcing-train", __doc__.split("\n\n")[0])
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{stage0,stage1,stage2,pipeline}",
        help="what to train (`<command> --help` for its options)",
    )
    for name, help_text in (
        ("stage0", "AR teacher on the corpus"),
        ("stage1", "AR -> PFLM(k=1) forward distillation"),
        ("stage2", "PFLM(k) -> PFLM(2k) self-forcing distillation"),
    ):
        p = add_command(sub, name, help=help_text, description=help_text)
        _add_common(p, d, name)
        p.add_argument("--steps", type=_positive_int, default=d.steps, help="optimizer steps")
        p.add_argument(
            "--lr",
            type=setting_type("lr"),
            default=d.lr if name == "stage0" else PipelineConfig.lr_distill,
            help="peak learning rate",
        )
        if name != "stage0":
            p.add_argument(
                "--teacher",
                required=name == "stage2",
                help="the previous stage's output folder" + (" (or --model)" if name == "stage1" else ""),
            )
        if name == "stage1":
            p.add_argument(
                "--supervision",
                choices=("forward", "noise-inversion"),
                default="forward",
                help="forward: Algorithm 2 (k=1); noise-inversion: the PTP baseline on real text (any --k)",
            )
            p.add_argument("--k", type=_positive_int, default=1, help="student window (noise-inversion only)")
            _add_decode(p, d)
        p.add_argument(
            "--stop-at", type=_positive_int, help="stop (with a checkpoint) after this step; --resume continues"
        )
        p.add_argument("--dump-grads", help="debugging: write the first step's averaged gradients (safetensors) here")
    pipeline_help = "all stages: 0 -> 1 -> 2 (k=2) -> ... -> 2 (k=--k-final)"
    pp = add_command(sub, "pipeline", help=pipeline_help, description=pipeline_help)
    _add_common(pp, d, "pipeline")
    pd = PipelineConfig()
    _add_decode(pp, d)
    pp.add_argument(
        "--k-final", type=_positive_int, default=pd.k_final, help="window of the last self-forcing round (a power of 2)"
    )
    pp.add_argument("--steps-stage0", type=_positive_int, default=pd.steps_stage0, help="steps of the AR teacher")
    pp.add_argument(
        "--steps-stage1", type=_positive_int, default=pd.steps_stage1, help="steps of the k=1 forward distillation"
    )
    pp.add_argument(
        "--steps-stage2",
        type=per_round_type(int, "positive integers"),
        default=pd.steps_stage2,
        help="steps of the self-forcing rounds: one value for all, or one per round (k=2,4,...), e.g. 300,450",
    )
    pp.add_argument("--lr-stage0", type=setting_type("lr"), default=pd.lr_stage0, help="peak learning rate of stage0")
    pp.add_argument(
        "--lr-distill",
        type=setting_type("lr"),
        default=pd.lr_distill,
        help="peak learning rate of stage1 (and stage2 unless --lr-stage2)",
    )
    pp.add_argument(
        "--lr-stage2",
        type=per_round_type(float, "positive numbers"),
        default=None,
        help="learning rates of the self-forcing rounds: one value or one per round (None: --lr-distill)",
    )
    pp.add_argument(
        "--evaluate",
        choices=("quick", "demo"),
        default=None,
        help="then evaluate the run (kforcing-evaluate's tables and generated samples; quick: small "
        "settings, demo: "
        "the demo's) and write summary.json and tables.md into --out",
    )
    pp.add_argument(
        "--batch-size-distill",
        type=_positive_int,
        default=None,
        help="global batch of stages 1 and 2 (None: --batch-size)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["model_overrides"] = {
        k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if getattr(args, k, None) is not None
    }
    if args.command in STAGES:
        values["stage"] = args.command
    if "supervision" in values:
        values["supervision"] = values["supervision"].replace("-", "_")
    return TrainConfig(**values)


def pipeline_config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The stages of ``pipeline`` (its TrainConfig: :func:`config_from_args`)."""
    return PipelineConfig(
        out=args.out,
        k_final=args.k_final,
        steps_stage0=args.steps_stage0,
        steps_stage1=args.steps_stage1,
        steps_stage2=args.steps_stage2,
        lr_stage0=args.lr_stage0,
        lr_distill=args.lr_distill,
        lr_stage2=args.lr_stage2,
        batch_size_distill=args.batch_size_distill,
    )


def _evaluate(out: str, which: str, device: str) -> dict:
    """The evaluation of a finished pipeline (generation included), its tables printed and saved beside the stages."""
    from pathlib import Path

    from .evaluation.evaluate import DEMO_EVAL, QUICK_EVAL, evaluate_pipeline
    from .evaluation.report import format_report, timing_report
    from .files import write_json, write_text

    settings = dataclasses.asdict(QUICK_EVAL if which == "quick" else DEMO_EVAL)
    summary = evaluate_pipeline(out, device=device, log=lambda line: print(line, file=sys.stderr), **settings)
    report = format_report(summary) + "\n\n" + timing_report(summary)
    print(report, file=sys.stderr)
    write_json(Path(out) / "summary.json", summary)
    write_text(Path(out) / "tables.md", report)
    return summary


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``, torchrun stopping its ranks) raised as an interrupt in the main thread:
    the run unwinds as for Ctrl-C (the folder's lock released, the checkpoints written so far kept) and says so."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``kforcing-train``; SIGTERM ends it as Ctrl-C does (:class:`Terminated`), exit status 143."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller's own handler (a test, an embedding program) is back


def _main(argv: Optional[Sequence[str]]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if str(a).startswith("--")}
    hf_option = (
        "--model" if getattr(args, "model", None) else "--model-config" if getattr(args, "model_config", None) else None
    )
    native = sorted(given & {"--preset", "--n-layer", "--n-head", "--n-embd"})
    if hf_option and native:
        parser.error(
            f"argument {native[0]}: sizes the native model; {hf_option} gives the model (leave {', '.join(native)} out)"
        )
    if hf_option == "--model" and "--vocab-size" in given:  # it would be recorded, yet the folder's tokenizer decides
        parser.error("argument --vocab-size: --model brings its own tokenizer and vocabulary (leave --vocab-size out)")
    cfg = config_from_args(args)  # every rule a TrainConfig can express is validate_config's, inside train()
    try:
        if args.command == "pipeline":
            # Under torchrun rank 0 (which holds the run's lock) evaluates, before it lets the lock go: a second
            # pipeline into the folder cannot rewrite a stage while it is read. The other ranks are done.
            def evaluate(training):
                return {"training": training, "evaluation": _evaluate(args.out, args.evaluate, args.device)}

            result = run_pipeline(pipeline_config_from_args(args), cfg, then=evaluate if args.evaluate else None)
        else:
            result = train(cfg)
    except (ConfigError, CheckpointError, DataError, ValueError) as exc:
        parser.error(str(exc))
    except NonFiniteLoss as exc:  # not a usage error: the settings were valid, the run diverged
        sys.exit(f"{parser.prog}: error: {exc}")
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: a line, not a traceback; the checkpoints so far are kept
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(
            f"\n{parser.prog}: {what}; the checkpoints written so far are in {args.out}: continue with the same "
            "command and --resume",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGTERM if isinstance(exc, Terminated) else 130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if env.distributed_ranks()[1] != 0:
        return
    # the tables went to stderr and tables.md; the whole summary to summary.json
    if args.command == "pipeline" and args.evaluate:
        result = {"training": result["training"], "evaluation": f"{args.out}/summary.json, {args.out}/tables.md"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Run by ``torchrun --nproc_per_node 2`` from test_pipeline_torchrun.py: the two-rank pipelines of that test in one
launch.

``python pipeline_worker.py ROOT``: ROOT holds ``corpus/`` and ``llama.json``; each case trains ``ROOT/<case>``. A
torchrun
worker can create its default process group once (a second one after destroying the first does not rendezvous), so the
cases call :func:`run_pipeline` with the settings the CLI parses (the first call creates the group, the others reuse it)
rather than ``main()``, which destroys it; the test's second launch runs the CLI itself. Then:

* ``ROOT/locked`` (its lock held by the test) and a missing ``--model-config``: every rank writes the error it got to
  ``ROOT/<name>.rank<r>.txt``;
* ``killed``: the ``ddp`` case, rank 0 killed (SIGKILL) right after stage1's first checkpoint. Last: the launch ends
there."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from kforcing_kernels.app.train import build_parser, config_from_args, pipeline_config_from_args
from kforcing_kernels.app.training import checkpointer
from kforcing_kernels.app.training.pipeline import run_pipeline

HF_FSDP = True  # a Hugging Face model under --parallel fsdp

# Three stages (0, 1, 2 with k=2) of a few steps, checkpoints at step 2 (stage1's is where ``killed`` dies).
SMALL = [
    "--vocab-size",
    "300",
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--k-final",
    "2",
    "--steps-stage0",
    "4",
    "--steps-stage1",
    "3",
    "--steps-stage2",
    "3",
    "--warmup-steps",
    "1",
    "--log-every",
    "1",
    "--ckpt-every",
    "2",
    "--eval-batches",
    "1",
    "--no-progress",
    "--device",
    "cpu",
]
MODELS = {
    "native": ["--preset", "micro"],
    "hf": ["--model-config", "{root}/llama.json"],
    "missing": ["--model-config", "{root}/missing.json"],
}  # refused before any stage
CASES = {
    "ddp": ("native", "ddp"),
    "fsdp": ("native", "fsdp"),
    "hf": ("hf", "ddp"),
    **({"hf_fsdp": ("hf", "fsdp")} if HF_FSDP else {}),
}


def pipeline_argv(root: Path, out: str, model: str, parallel: str, *extra: str) -> list[str]:
    """``pipeline ...`` as the CLI takes it: ``model`` (native or hf) into ``root/out``."""
    return [
        "pipeline",
        "--out",
        str(root / out),
        "--data",
        str(root / "corpus"),
        "--parallel",
        parallel,
        *(a.format(root=root) for a in MODELS[model]),
        *SMALL,
        *extra,
    ]


def run(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return run_pipeline(pipeline_config_from_args(args), config_from_args(args))


def record_error(root: Path, name: str, argv: list[str]) -> None:
    try:
        run(argv)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank got
        message = f"{type(exc).__name__}: {exc}"
    (root / f"{name}.rank{dist.get_rank()}.txt").write_text(message)


def main(root: Path) -> None:
    for case, (model, parallel) in CASES.items():
        run(pipeline_argv(root, case, model, parallel))
    record_error(root, "locked", pipeline_argv(root, "locked", "native", "ddp"))
    record_error(root, "bad_config", pipeline_argv(root, "bad_config", "missing", "ddp"))

    save = checkpointer.save_checkpoint

    def save_then_die(out, step, *args, **kwargs):  # ddp: only rank 0 writes checkpoints
        path = save(out, step, *args, **kwargs)
        if Path(out).name == "stage1":
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    checkpointer.save_checkpoint = save_then_die
    run(pipeline_argv(root, "killed", "native", "ddp"))
    raise SystemExit("killed: the run was not killed in stage1")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The settings of one training stage (:class:`TrainConfig`), the values its fields accept, and the error that
refuses a setting (:class:`ConfigError`).

The rest of a stage's configuration lives beside it, one job a module: the checks of a whole config
(:mod:`.validation`), what a run records of its settings and sources and compares on ``--resume``
(:mod:`.provenance`), and the run folder's lifecycle (:mod:`.run_folder`). The command line that fills a
TrainConfig is :mod:`kforcing_kernels.app.train`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from ...settings import POSITIVE, UNIT, UNIT_OPEN_HIGH, Real, argparse_type, real_error
from ..data import DEFAULT_SOURCE

STAGES = ("stage0", "stage1", "stage2")
SUPERVISIONS = ("forward", "noise_inversion")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


# Real-valued settings: what each accepts (besides being a finite real number), in kforcing_kernels/settings.py's
# one check. The one table for both entry points: validate_config checks TrainConfig with it, and the CLI's argument
# types are made from it (setting_type). grad_clip 0 is refused as the CLI always refused it: clipping is not optional
# here (a huge value turns it off in effect).
FLOAT_SETTINGS: dict[str, Real] = {
    "lr": POSITIVE,
    "min_lr_ratio": UNIT,
    "weight_decay": UNIT,
    "grad_clip": POSITIVE,
    "tau_min": POSITIVE,
    "tau_max": POSITIVE,
    "beta1": UNIT_OPEN_HIGH,
    "beta2": UNIT_OPEN_HIGH,
}


@dataclass
class TrainConfig:
    """One training stage. ``batch_size`` is global (sequences per optimizer step, all ranks together).

    The defaults are the demo's model, data and optimizer settings (``kforcing_kernels.app.demo``
    uses ``TrainConfig()``); the demo's step counts and distillation batch are its own
    (``demo.DEMO["pipeline"]``).
    """

    stage: str = "stage0"
    out: str = "runs/train"
    teacher: Optional[str] = None  # stage folder of the teacher (stage1, stage2)
    data: str = DEFAULT_SOURCE
    vocab_size: int = 1024
    # stage0 only: the model size (later stages inherit the teacher's); recorded None for an HF model
    preset: Optional[str] = "tiny"
    model_overrides: dict = field(default_factory=dict)
    # A Hugging Face causal LM instead of the native model (app/hf_recipe/files.py): `model` is a local HF folder,
    # the AR teacher of stage1 (its tokenizer encodes --data); `model_config` a transformers config file,
    # a random initialisation that stage0 trains as an AR model on --data (the native tokenizer).
    model: Optional[str] = None
    model_config: Optional[str] = None
    seq_len: int = 64
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    tau_min: float = 0.5
    tau_max: float = 1.0
    # stage1 only: "forward" (Algorithm 2, k=1) or "noise_inversion" (the PTP baseline of the
    # paper's ablation: real next-k tokens, z inverted from the AR teacher's CDF bins, any k).
    supervision: str = "forward"
    k: int = 1  # recorded: stage2's own window (twice its teacher's, effective_config)
    # stage1 only: how the PFLM decodes its slots, recorded in its model config and inherited by the stage2
    # students (kforcing_kernels/model/decoding.py): "argmax" (the paper's) or "residual" (issue 39).
    decode: str = "argmax"
    # Packed documents: attention never crosses a document (the corpus's EOS ends each), RoPE
    # positions restart per document, and predictions past a document's end leave the loss.
    packed_docs: bool = False
    seed: int = 0
    # Ranks that share each sequence (context parallelism, app/training/context_parallel.py); a divisor of the world
    # size.
    context_parallel: int = 1
    precision: str = "auto"
    device: str = "auto"
    log_every: int = 10
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    resume: bool = False  # continue the run in `out` from its newest checkpoint
    overwrite: bool = False  # replace the run in `out` (its files only) and start again
    stop_at: Optional[int] = None  # leave (with a checkpoint) once this step is done; --resume continues
    progress: Optional[bool] = None  # None: a live bar when stderr is a terminal
    dump_grads: Optional[str] = None  # debugging: write the first step's averaged gradients here
    # How the student is spread over ranks (kforcing_kernels/app/training/parallel.py): "ddp" (a full copy per rank,
    # whole-model checkpoints) or "fsdp" (FSDP2 fully_shard, sharded DCP checkpoints).
    parallel: str = "ddp"
    activation_checkpointing: bool = False  # recompute each block in backward (same loss and gradients, less memory)
    compile: bool = False  # torch.compile each decoder layer (after activation checkpointing, before FSDP2)
    # The frozen teacher of stages 1 and 2: "replicate" (a full copy per rank) or "fsdp" (sharded like the student).
    teacher_parallel: str = "replicate"

    # Fields that change what a step computes; a resumed run must agree on them (provenance.changed_settings).
    RESUME_KEYS: ClassVar[tuple[str, ...]] = (
        "stage",
        "teacher",
        "data",
        "vocab_size",
        "preset",
        "model_overrides",
        "seq_len",
        "steps",
        "batch_size",
        "grad_accum",
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "weight_decay",
        "beta1",
        "beta2",
        "grad_clip",
        "tau_min",
        "tau_max",
        "supervision",
        "decode",
        "k",
        "packed_docs",
        "seed",
        "precision",
        "parallel",
        "model",
        "model_config",
    )
    # Resume keys added after runs were saved without them: the value those runs used.
    RESUME_DEFAULTS: ClassVar[dict[str, object]] = {
        "packed_docs": False,
        "supervision": "forward",
        "decode": "argmax",
        "k": 1,
        "parallel": "ddp",
        "model": None,
        "model_config": None,
    }

    # The real-valued settings and what each accepts: the one table (FLOAT_SETTINGS) of both entry points.
    REAL_SETTINGS: ClassVar[dict[str, Real]] = FLOAT_SETTINGS

    def to_dict(self) -> dict:
        """The settings as JSON records them (train_config.json, a checkpoint's and model.json's ``train_config``)."""
        return dataclasses.asdict(self)


def float_setting_error(name: str, value: Any) -> Optional[str]:
    """Why ``value`` is not a valid ``name`` (one of FLOAT_SETTINGS), or None when it is."""
    return real_error(value, FLOAT_SETTINGS[name])


def setting_type(name: str):
    """The CLI's argparse ``type`` for the real-valued setting ``name``: the same check as validate_config."""
    return argparse_type(FLOAT_SETTINGS[name])

"""The checks that refuse a training config that cannot work, each rule in one function, each refusal a
:class:`~kforcing_kernels.app.training.config.ConfigError` naming the setting (and the option where the CLI's name
differs), before the run folder is touched.

:func:`validate_config` runs them all, in the order a user best meets them (the values of single settings, then
how settings go together, then the run folder); the command line (:mod:`kforcing_kernels.app.train`) leaves every
rule a TrainConfig can express to it. The options a kind of model reads (``--model``, ``--model-config``) are checked
by the kinds themselves (:meth:`~kforcing_kernels.app.student.ModelKind.check_stage_options` and
:meth:`~kforcing_kernels.app.student.ModelKind.check_options`), through the registry. :func:`check_splits` is the one
check that needs the stage's text, made once the corpus is read.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ...model import PRESETS, ModelConfig
from ...model.decoding import DECODE_RULES
from ...settings import check_reals
from ..cli import resolve_device
from ..data import Corpus
from ..student import CapabilityError, kind_named, kind_names, kind_of_folder
from .config import FLOAT_SETTINGS, PRECISIONS, STAGES, SUPERVISIONS, ConfigError, TrainConfig
from .objectives import Objective, crop_tokens
from .parallel import PARALLEL_MODES, TEACHER_MODES
from .run_folder import check_out_folder

# The settings that take one of a few values, and those values (``stage`` first: later rules depend on it).
CHOICES: dict[str, tuple[str, ...]] = {
    "stage": STAGES,
    "preset": tuple(sorted(PRESETS)),
    "decode": DECODE_RULES,
    "supervision": SUPERVISIONS,
    "precision": PRECISIONS,
    "parallel": PARALLEL_MODES,
    "teacher_parallel": TEACHER_MODES,
}
# Settings the CLI takes as positive / non-negative ints; the Python API (train(TrainConfig(...))) is checked alike.
POSITIVE_INTS = (
    "vocab_size",
    "seq_len",
    "steps",
    "batch_size",
    "grad_accum",
    "log_every",
    "ckpt_every",
    "keep_checkpoints",
    "eval_batches",
)
NON_NEGATIVE_INTS = ("warmup_steps", "eval_every")
# Model settings a native run may override: fields of ModelConfig (the CLI sets n_layer, n_head, n_embd).
MODEL_OVERRIDES = tuple(f.name for f in dataclasses.fields(ModelConfig))


def validate_config(cfg: TrainConfig, world: int = 1) -> None:
    """Clear errors for settings that cannot work, naming the setting; ``world``: the ranks the stage runs on."""
    _check_choices(cfg)
    _check_ints(cfg)
    check_reals(cfg, FLOAT_SETTINGS, ConfigError)
    _check_temperatures(cfg)
    check_device(cfg.device)
    _check_model_sources(cfg)
    _check_teacher(cfg)
    _check_native_model(cfg)
    _check_stage_settings(cfg)
    _check_parallel(cfg, world)
    _check_stop_at(cfg)
    _check_start(cfg)
    check_out_folder(cfg.out)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_choices(cfg: TrainConfig) -> None:
    """Each setting of :data:`CHOICES` is one of its values."""
    for name, values in CHOICES.items():
        if getattr(cfg, name) not in values:
            raise ConfigError(f"{name}: expected one of {values}, got {getattr(cfg, name)!r}")


def _check_ints(cfg: TrainConfig) -> None:
    """:data:`POSITIVE_INTS` are ints >= 1, :data:`NON_NEGATIVE_INTS` ints >= 0, ``seed`` an int (a bool is none)."""
    for name in POSITIVE_INTS:
        if not _is_int(getattr(cfg, name)) or getattr(cfg, name) < 1:
            raise ConfigError(f"{name}: expected a positive int, got {getattr(cfg, name)!r}")
    for name in NON_NEGATIVE_INTS:
        if not _is_int(getattr(cfg, name)) or getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: expected an int >= 0, got {getattr(cfg, name)!r}")
    if not _is_int(cfg.seed):
        raise ConfigError(f"seed: expected an int, got {cfg.seed!r}")


def _check_temperatures(cfg: TrainConfig) -> None:
    """The training temperatures are drawn from ``[tau_min, tau_max]`` (each > 0: FLOAT_SETTINGS)."""
    if cfg.tau_min > cfg.tau_max:
        raise ConfigError(
            f"tau_min: expected <= tau_max (--tau-min <= --tau-max), got tau_min={cfg.tau_min} > tau_max={cfg.tau_max}"
        )


def check_device(name: Any) -> None:
    """``device``: auto, cpu, cuda, cuda:N or mps, as this machine has it (the CLI's check)."""
    try:
        resolve_device(name)
    except (argparse.ArgumentTypeError, TypeError) as exc:
        raise ConfigError(f"device: {exc}") from None


def _check_model_sources(cfg: TrainConfig) -> None:
    """``--model`` / ``--model-config``: every kind checks the options it reads, which stages take them and what they
    exclude (a kind's refusal, a CapabilityError, becomes a ConfigError), then the folder or file itself (a
    CheckpointError naming the option). No kind is loaded for a config without either."""
    if not cfg.model and not cfg.model_config:
        return
    for name in kind_names():
        try:
            kind_named(name).check_stage_options(cfg)
        except CapabilityError as exc:
            raise ConfigError(str(exc)) from None


def _check_teacher(cfg: TrainConfig) -> None:
    """A distilled stage has a teacher (``--teacher``, or stage1's ``--model``) that holds a trained model its kind
    reads, in a folder other than its own."""
    if cfg.teacher and Path(cfg.teacher).resolve() == Path(cfg.out).resolve():
        raise ConfigError(
            f"out: {cfg.out!r} is the teacher's folder (--teacher); a stage writes its own folder "
            "(the teacher would be replaced, or removed by --overwrite)"
        )
    if cfg.stage == "stage0":
        return
    if not cfg.teacher:
        wanted = (
            "--teacher (the stage0 folder) or --model (a Hugging Face model folder)"
            if cfg.stage == "stage1"
            else "--teacher (the previous stage's folder)"
        )
        raise ConfigError(f"teacher: {cfg.stage} needs {wanted}")
    if cfg.model:  # a source folder: its kind checked it (_check_model_sources)
        return
    if not (Path(cfg.teacher) / "model.json").exists():
        raise ConfigError(f"teacher: no trained model in {cfg.teacher!r} (expected {Path(cfg.teacher) / 'model.json'})")
    # Its model.json read by its kind, entry by entry (the identity a --resume compares): a malformed one is refused
    # now, naming the file and the entry, before anything is built.
    kind_of_folder(cfg.teacher).identity(cfg.teacher)


def _check_native_model(cfg: TrainConfig) -> None:
    """``model_overrides`` name fields of ModelConfig, and a native stage0's model (its preset, ``seq_len``,
    ``vocab_size`` and overrides) is one ModelConfig accepts, before any step."""
    unknown = sorted(set(cfg.model_overrides) - set(MODEL_OVERRIDES))
    if unknown:
        raise ConfigError(
            f"model_overrides: {', '.join(unknown)} is not a model setting (ModelConfig's fields: "
            f"{', '.join(MODEL_OVERRIDES)})"
        )
    if cfg.stage == "stage0" and not cfg.model_config:
        assert cfg.preset is not None  # one of PRESETS (_check_choices)
        try:
            PRESETS[cfg.preset](**{"seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, **cfg.model_overrides})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model_overrides: {exc}") from None


def _check_stage_settings(cfg: TrainConfig) -> None:
    """The settings only stage1 chooses: the decoding rule, noise-inversion supervision, and with it the window k."""
    if cfg.decode != "argmax" and cfg.stage != "stage1":
        raise ConfigError(
            "decode: the decoding rule is chosen in stage1 (stage2 students inherit their teacher's), "
            f"got stage {cfg.stage!r}"
        )
    if cfg.supervision == "noise_inversion" and cfg.stage != "stage1":
        raise ConfigError(f"supervision: noise_inversion distils the AR teacher (stage1), got stage {cfg.stage!r}")
    if cfg.k != 1 and not (cfg.stage == "stage1" and cfg.supervision == "noise_inversion"):
        raise ConfigError(
            "k: only stage1 with noise_inversion sets the window (forward distillation has k=1, stage2 "
            f"doubles its teacher's), got {cfg.k}"
        )


def _check_parallel(cfg: TrainConfig, world: int) -> None:
    """How the stage spreads over ``world`` ranks: FSDP2's precisions, a context-parallel size that divides the world,
    and a global batch that divides over the data-parallel ranks and accumulation steps."""
    if cfg.parallel == "fsdp" and cfg.precision == "fp16":
        raise ConfigError(
            "precision: --parallel fsdp trains in fp32 or bf16 (FSDP2 has no loss scaling here); use --precision bf16"
        )
    if not _is_int(cfg.context_parallel) or cfg.context_parallel < 1 or world % cfg.context_parallel:
        raise ConfigError(
            f"context_parallel: expected a divisor of the world size {world}, got {cfg.context_parallel!r}"
        )
    check_batch_divides("batch_size", cfg.batch_size, world, cfg.context_parallel, cfg.grad_accum)


def check_batch_divides(
    name: str, batch: int, world: int, context_parallel: int, grad_accum: int, consequence: str = ""
) -> None:
    """The global batch ``batch`` (the setting ``name``) splits evenly over the data-parallel ranks (the ranks of a
    context-parallel group share their sequences) and the accumulation steps; ``consequence`` ends the message."""
    dp = world // context_parallel
    if batch % (dp * grad_accum):
        raise ConfigError(
            f"{name}: expected a multiple of data-parallel ranks x grad_accum = {dp} x {grad_accum} "
            f"(world size {world} / context_parallel {context_parallel}), got {batch}{consequence}"
        )


def _check_stop_at(cfg: TrainConfig) -> None:
    """``stop_at``: None, or a step of the run."""
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ConfigError(f"stop_at: expected a step in [1, steps={cfg.steps}], got {cfg.stop_at}")


def _check_start(cfg: TrainConfig) -> None:
    """A run either continues (``resume``) or starts again (``overwrite``)."""
    if cfg.resume and cfg.overwrite:
        raise ConfigError("overwrite: --overwrite starts the run again and --resume continues it; pass one of them")


def check_splits(cfg: TrainConfig, corpus: Corpus, objective: Objective, k: int) -> None:
    """Both splits must hold one sequence, or training (or the final evaluation) cannot draw a batch."""
    need = crop_tokens(objective, cfg.seq_len, k) + 1
    for name, stream in (("training", corpus.train), ("validation", corpus.val)):
        if stream.numel() < need:
            raise ConfigError(
                f"data: the {name} split of --data {cfg.data!r} has {stream.numel()} tokens, fewer than one sequence "
                f"({need} tokens at --seq-len {cfg.seq_len}); give more text (the validation split is about 2% of the "
                f"documents, or the tail of a single file) or a smaller --seq-len"
            )

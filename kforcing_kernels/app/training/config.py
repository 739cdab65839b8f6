"""The settings of one training stage, and the checks that refuse settings that cannot work."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ...model import PRESETS, ModelConfig
from ...model.decoding import DECODE_RULES
from ...settings import POSITIVE, UNIT, UNIT_OPEN_HIGH, argparse_type, check_reals, real_error
from ..cli import resolve_device
from ..data import DEFAULT_SOURCE
from ..files import LOCK_NAME
from ..records import read_model_json
from ..student import kind_of_folder, stage_kind
from .checkpoint import checkpoint_dir, clean_run_folder, latest_checkpoint, remove_checkpoints
from .objectives import crop_tokens
from .parallel import PARALLEL_MODES, TEACHER_MODES

STAGES = ("stage0", "stage1", "stage2")
SUPERVISIONS = ("forward", "noise_inversion")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


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

    # Fields that change what a step computes; a resumed run must agree on them.
    RESUME_KEYS = (
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
    RESUME_DEFAULTS = {
        "packed_docs": False,
        "supervision": "forward",
        "decode": "argmax",
        "k": 1,
        "parallel": "ddp",
        "model": None,
        "model_config": None,
    }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def changed_settings(saved: dict, cfg: TrainConfig, ignore: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """``(key, saved value, cfg's value)`` for each of ``RESUME_KEYS`` (less ``ignore``) on which a saved run's config
    differs from ``cfg``.

    ``teacher``, ``data``, ``model`` and ``model_config`` are paths: the same folder written relative or absolute (from
    this working directory) is the same setting; the built-in corpus name compares as a name.
    """
    changed = []
    for key in TrainConfig.RESUME_KEYS:
        if key in ignore:
            continue
        used, wanted = saved.get(key, TrainConfig.RESUME_DEFAULTS.get(key)), getattr(cfg, key)
        if (
            key in ("teacher", "data", "model", "model_config")
            and used is not None
            and wanted is not None
            and DEFAULT_SOURCE not in (used, wanted)
        ):
            same = Path(used).resolve() == Path(wanted).resolve()
        elif key in _LEGACY and _LEGACY[key](saved, used, wanted):
            same = True
        else:
            same = used == wanted
        if not same:
            changed.append((key, used, wanted))
    return changed


# Runs saved before train_config recorded effective values (see effective_config) hold what the option said: a
# Hugging Face stage the --preset default (it sized nothing there), a stage2 k=1 (the unused --k; its window was then,
# as now, twice its teacher's, whose identity the teacher path and teacher_sha256 check). Such a record compares equal
# to the effective value; any other difference is a changed setting.
_LEGACY = {
    "preset": lambda saved, used, wanted: wanted is None and used in PRESETS,
    "k": lambda saved, used, wanted: saved.get("stage") == "stage2" and used == 1,
}


def effective_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the values the stage really uses, as a run records them (train_config.json, checkpoints,
    model.json) and compares them (--resume, a pipeline's reuse of a finished stage); after :func:`validate_config`.

    ``preset`` is None where no preset sizes the model: a Hugging Face stage (--model-config, --model, or a teacher
    that is a Hugging Face model); ``k`` of stage2 is the window it trains, twice its teacher's (model.json);
    ``data``, ``teacher``, ``model`` and ``model_config`` are absolute paths (the built-in corpus name stays a name).
    """
    # Paths are recorded resolved, so a run folder works from any directory (kforcing-evaluate RUN, a later stage's
    # --teacher): --data as typed was relative to the directory the run was started in. The built-in corpus stays a
    # name.
    changes = {
        key: str(Path(value).resolve())
        for key in ("data", "teacher", "model", "model_config")
        if (value := getattr(cfg, key)) is not None and not (key == "data" and value == DEFAULT_SOURCE)
    }
    if not stage_kind(cfg).sized_by_preset:
        changes["preset"] = None
    if cfg.stage == "stage2":
        teacher_k = read_model_json(cfg.teacher)["k"]
        if teacher_k >= 1:  # an AR teacher (k=0) is refused, naming --teacher, when the stage builds its model
            changes["k"] = 2 * teacher_k
    return dataclasses.replace(cfg, **changes)


# What a run records about the text and the teacher it met (model.json and every checkpoint's "info"), and the
# option each belongs to. A run saved before these were recorded has none of them: it is accepted with a
# warning (the settings, vocabulary size and teacher path are still compared), since nothing can tell.
PROVENANCE = {"data_sha256": "--data", "tokenizer_sha256": "--data", "teacher_sha256": "--teacher"}
_PROVENANCE_WHAT = {
    "data_sha256": "the text of --data",
    "tokenizer_sha256": "the tokenizer of --data",
    "teacher_sha256": "the teacher's model file (--teacher)",
}


def changed_provenance(saved: dict, now: dict) -> tuple[list[tuple[str, str]], list[str]]:
    """Compare the provenance entries of ``now`` (only those it has) with a saved run's ``saved``.

    Returns ``([(key, sentence saying what changed)], [keys the saved run did not record])``.
    """
    changed, unknown = [], []
    for key, value in now.items():
        if value is None:
            continue
        if saved.get(key) is None:
            unknown.append(key)
        elif saved[key] != value:
            changed.append(
                (key, f"{_PROVENANCE_WHAT[key]} changed (sha256 {saved[key][:12]}... then, {value[:12]}... now)")
            )
    return changed, unknown


def teacher_sha256(teacher: Optional[str]) -> Optional[str]:
    """The identity of a teacher folder, or None without a teacher: as its kind defines it
    (:meth:`~kforcing_kernels.app.student.ModelKind.identity`: the SHA-256 of a stage's model file, recorded in its
    model.json; of a plain Hugging Face folder, its weights', config.json's and tokenizer files')."""
    if not teacher:
        return None
    return kind_of_folder(teacher).identity(teacher)


def check_out_folder(out, option: str = "--out") -> None:
    """``out`` must be a folder or not exist yet, and no existing part of its path may be a file."""
    path = Path(out)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = f"{str(path)!r} is a file" if part == path else f"{str(part)!r} (in {str(path)!r}) is a file"
                raise ConfigError(f"out: {what}; {option} expects a folder (an existing one or one to create)")
            break


# Settings the CLI takes as positive / non-negative ints; the Python API (train(TrainConfig(...))) is checked alike.
_POSITIVE_INTS = (
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
_NON_NEGATIVE_INTS = ("warmup_steps", "eval_every")
# Model settings a native run may override: fields of ModelConfig (the CLI sets n_layer, n_head, n_embd).
MODEL_OVERRIDES = tuple(f.name for f in dataclasses.fields(ModelConfig))


# Real-valued settings: what each accepts (besides being a finite real number), in kforcing_kernels/settings.py's
# one check. The one table for both entry points: validate_config checks TrainConfig with it, and the CLI's argument
# types are made from it (setting_type). grad_clip 0 is refused as the CLI always refused it: clipping is not optional
# here (a huge value turns it off in effect).
FLOAT_SETTINGS = {
    "lr": POSITIVE,
    "min_lr_ratio": UNIT,
    "weight_decay": UNIT,
    "grad_clip": POSITIVE,
    "tau_min": POSITIVE,
    "tau_max": POSITIVE,
    "beta1": UNIT_OPEN_HIGH,
    "beta2": UNIT_OPEN_HIGH,
}
TrainConfig.REAL_SETTINGS = FLOAT_SETTINGS


def float_setting_error(name: str, value) -> Optional[str]:
    """Why ``value`` is not a valid ``name`` (one of FLOAT_SETTINGS), or None when it is."""
    return real_error(value, FLOAT_SETTINGS[name])


def setting_type(name: str):
    """The CLI's argparse ``type`` for the real-valued setting ``name``: the same check as validate_config."""
    return argparse_type(FLOAT_SETTINGS[name])


def check_device(name) -> None:
    """``device``: auto, cpu, cuda, cuda:N or mps, as this machine has it (the CLI's check)."""
    try:
        resolve_device(name)
    except (argparse.ArgumentTypeError, TypeError) as exc:
        raise ConfigError(f"device: {exc}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_config(cfg: TrainConfig, world: int = 1) -> None:
    """Clear errors for settings that cannot work, naming the setting."""
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage: expected one of {STAGES}, got {cfg.stage!r}")
    for name in _POSITIVE_INTS:
        if not _is_int(getattr(cfg, name)) or getattr(cfg, name) < 1:
            raise ConfigError(f"{name}: expected a positive int, got {getattr(cfg, name)!r}")
    for name in _NON_NEGATIVE_INTS:
        if not _is_int(getattr(cfg, name)) or getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: expected an int >= 0, got {getattr(cfg, name)!r}")
    if not _is_int(cfg.seed):
        raise ConfigError(f"seed: expected an int, got {cfg.seed!r}")
    check_reals(cfg, FLOAT_SETTINGS, ConfigError)
    unknown = sorted(set(cfg.model_overrides) - set(MODEL_OVERRIDES))
    if unknown:
        raise ConfigError(
            f"model_overrides: {', '.join(unknown)} is not a model setting (ModelConfig's fields: "
            f"{', '.join(MODEL_OVERRIDES)})"
        )
    check_device(cfg.device)
    if cfg.stage != "stage0" and not cfg.teacher:
        raise ConfigError(f"teacher: {cfg.stage} needs --teacher (the previous stage's folder)")
    if cfg.teacher and Path(cfg.teacher).resolve() == Path(cfg.out).resolve():
        raise ConfigError(
            f"out: {cfg.out!r} is the teacher's folder (--teacher); a stage writes its own folder "
            "(the teacher would be replaced, or removed by --overwrite)"
        )
    _validate_hf(cfg)
    if cfg.stage != "stage0" and not (Path(cfg.teacher) / "model.json").exists() and not cfg.model:
        raise ConfigError(f"teacher: no trained model in {cfg.teacher!r} (expected {Path(cfg.teacher) / 'model.json'})")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"preset: expected one of {sorted(PRESETS)}, got {cfg.preset!r}")
    if cfg.stage == "stage0" and not cfg.model_config:  # the native model's sizes and reals, before any step
        try:
            PRESETS[cfg.preset](**{"seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, **cfg.model_overrides})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model_overrides: {exc}") from None
    if cfg.decode not in DECODE_RULES:
        raise ConfigError(f"decode: expected one of {DECODE_RULES}, got {cfg.decode!r}")
    if cfg.decode != "argmax" and cfg.stage != "stage1":
        raise ConfigError(
            "decode: the decoding rule is chosen in stage1 (stage2 students inherit their teacher's), "
            f"got stage {cfg.stage!r}"
        )
    if cfg.supervision not in SUPERVISIONS:
        raise ConfigError(f"supervision: expected one of {SUPERVISIONS}, got {cfg.supervision!r}")
    if cfg.supervision == "noise_inversion" and cfg.stage != "stage1":
        raise ConfigError(f"supervision: noise_inversion distils the AR teacher (stage1), got stage {cfg.stage!r}")
    if cfg.k != 1 and not (cfg.stage == "stage1" and cfg.supervision == "noise_inversion"):
        raise ConfigError(
            "k: only stage1 with noise_inversion sets the window (forward distillation has k=1, stage2 "
            f"doubles its teacher's), got {cfg.k}"
        )
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision: expected one of {PRECISIONS}, got {cfg.precision!r}")
    if cfg.parallel not in PARALLEL_MODES:
        raise ConfigError(f"parallel: expected one of {PARALLEL_MODES}, got {cfg.parallel!r}")
    if cfg.parallel == "fsdp" and cfg.precision == "fp16":
        raise ConfigError(
            "precision: --parallel fsdp trains in fp32 or bf16 (FSDP2 has no loss scaling here); use --precision bf16"
        )
    if not 0 < cfg.tau_min <= cfg.tau_max:
        raise ConfigError(f"tau_min: expected 0 < tau_min <= tau_max={cfg.tau_max}, got {cfg.tau_min}")
    if not _is_int(cfg.context_parallel) or cfg.context_parallel < 1 or world % cfg.context_parallel:
        raise ConfigError(
            f"context_parallel: expected a divisor of the world size {world}, got {cfg.context_parallel!r}"
        )
    if cfg.teacher_parallel not in TEACHER_MODES:
        raise ConfigError(f"teacher_parallel: expected one of {TEACHER_MODES}, got {cfg.teacher_parallel!r}")
    dp = world // cfg.context_parallel  # the ranks of a CP group share their sequences
    if cfg.batch_size % (dp * cfg.grad_accum):
        raise ConfigError(
            f"batch_size: expected a multiple of data-parallel ranks x grad_accum = {dp} x "
            f"{cfg.grad_accum} "
            f"(world size {world} / context_parallel {cfg.context_parallel}), got {cfg.batch_size}"
        )
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ConfigError(f"stop_at: expected a step in [1, steps={cfg.steps}], got {cfg.stop_at}")
    check_out_folder(cfg.out)
    if cfg.resume and cfg.overwrite:
        raise ConfigError("overwrite: --overwrite starts the run again and --resume continues it; pass one of them")


def _validate_hf(cfg: TrainConfig) -> None:
    """--model / --model-config: which stages take them and what they exclude."""
    if cfg.model and cfg.model_config:
        raise ConfigError(
            "model_config: --model (a pretrained folder) and --model-config (a random initialisation) "
            "are two "
            "sources of the model; pass one"
        )
    if cfg.model_config:
        if cfg.stage != "stage0":
            raise ConfigError(
                "model_config: only stage0 builds a model from --model-config (later stages inherit "
                "their "
                f"teacher's), got stage {cfg.stage!r}"
            )
        if not Path(cfg.model_config).is_file():
            raise ConfigError(f"model_config: no transformers config file at {cfg.model_config!r}")
    if cfg.model:
        if cfg.stage != "stage1":
            raise ConfigError(
                "model: --model is a pretrained AR teacher, distilled from stage1 on (`stage1 --model "
                "PATH` or "
                f"`pipeline --model PATH`), got stage {cfg.stage!r}"
            )
        if not (Path(cfg.model) / "config.json").exists():
            raise ConfigError(
                "model: expected a local Hugging Face model folder (config.json, weights, tokenizer), "
                f"got {cfg.model!r}"
            )
        if cfg.teacher and Path(cfg.teacher).resolve() != Path(cfg.model).resolve():
            raise ConfigError("teacher: --model is stage1's teacher; pass --model or --teacher, not both")
    if (cfg.model or cfg.model_config) and cfg.model_overrides:
        option = "--model" if cfg.model else "--model-config"
        raise ConfigError(
            f"model_overrides: {option} gives the model; --"
            f"{'/--'.join(k.replace('_', '-') for k in cfg.model_overrides)} size the native model only"
        )


# ---------------------------------------------------------------------- the output folder and the data


RUN_FILES = ("model.json", "model.safetensors", "train_config.json", "metrics.jsonl", "tokenizer.json")


def existing_run(out: Path) -> list[str]:
    """The files of a run (finished or partial) in ``out``; empty when there is none."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if any(checkpoint_dir(out).glob("step_*")):
        found.append("checkpoints/")
    return found


def prepare_out(cfg: TrainConfig, main: bool, log) -> None:
    """Refuse to mix two runs in one folder; with --overwrite remove the old run's files (only those)."""
    out = Path(cfg.out)
    if cfg.resume:
        if main:
            clean_run_folder(out, log)
        if latest_checkpoint(out) is None:
            found = existing_run(out)
            where = (
                f"the run in {out} ({', '.join(found)}) stopped before its first checkpoint"
                if found
                else f"there is no run in {out}"
            )
            raise ConfigError(
                f"resume: no checkpoint to continue from: {where}; start again with --overwrite "
                "(or without --resume), or check --out"
            )
        return
    found = existing_run(out)
    if found and not cfg.overwrite:
        kind = "a finished run" if "model.json" in found else "a partial run"
        raise ConfigError(
            f"out: {out} already holds {kind} ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )
    if found and main:
        log(f"--overwrite: removing the previous run's files in {out}: {', '.join(found)}")
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        remove_checkpoints(out)  # the run's step_* files and folders only: anything else there is the user's


# What a start writes before its first step is trained (the lock when it locks the folder, then the config and the
# tokenizer): left alone after a failed start, they would make the folder "a partial run" that only --overwrite reuses.
START_FILES = (LOCK_NAME, "train_config.json", "tokenizer.json")


def folder_before_start(out: Path) -> tuple[list[Path], Optional[set]]:
    """``(folders of out's path that do not exist yet, deepest first; the names in out, None when it is absent)``,
    taken before a run locks ``out``: what :func:`discard_failed_start` may remove."""
    missing = [part for part in (out, *out.parents) if not part.exists()]
    return missing, (set(os.listdir(out)) if out.is_dir() else None)


def discard_failed_start(out: Path, before: tuple[list[Path], Optional[set]], overwrite: bool) -> None:
    """After a run failed (while it still holds the lock): when it trained nothing, remove what its start left in
    ``out``.

    Only names that were not in ``out`` before (``before``, from :func:`folder_before_start`; with --overwrite the old
    run's files count as gone, as the user asked) are candidates, and only if every one of them is a start file
    (START_FILES): a metrics line, a checkpoint or a model means a step was trained, and then everything stays. The
    folders this start created are removed when empty; a folder that existed keeps whatever it held.
    """
    missing, names = before
    if not out.is_dir():
        return
    kept = (names or set()) - (set(RUN_FILES) if overwrite else set())
    new = set(os.listdir(out)) - kept
    if not new <= set(START_FILES):
        return
    for name in new:  # the lock last: a start that opened it before it goes re-checks it (RunLock.acquire)
        if name != LOCK_NAME:
            (out / name).unlink(missing_ok=True)
    if LOCK_NAME in new:
        (out / LOCK_NAME).unlink(missing_ok=True)
    for folder in missing:
        try:
            folder.rmdir()
        except OSError:  # not empty (another run, or the user's files): it stays
            break


def check_splits(cfg: TrainConfig, corpus, objective, k: int) -> None:
    """Both splits must hold one sequence, or training (or the final evaluation) cannot draw a batch."""
    need = crop_tokens(objective, cfg.seq_len, k) + 1
    for name, stream in (("training", corpus.train), ("validation", corpus.val)):
        if stream.numel() < need:
            raise ConfigError(
                f"data: the {name} split of --data {cfg.data!r} has {stream.numel()} tokens, fewer than one sequence "
                f"({need} tokens at --seq-len {cfg.seq_len}); give more text (the validation split is about 2% of the "
                f"documents, or the tail of a single file) or a smaller --seq-len"
            )

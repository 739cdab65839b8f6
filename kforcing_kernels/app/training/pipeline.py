"""The whole K-Forcing schedule from one config: Stage 0 -> Stage 1 -> Stage 2 (k=2) -> ... -> Stage 2 (k=k_final).

    python -m kforcing_kernels.app.train pipeline --out runs/x
    python -m kforcing_kernels.app.train pipeline --out runs/x --model HF_FOLDER   # no Stage 0: the HF model is the AR
    teacher
    torchrun --nproc_per_node 2 -m kforcing_kernels.app.train pipeline --out runs/x   # every stage data parallel

Under torchrun every rank runs the pipeline: rank 0 alone locks ``--out``, checks the sources and decides each
stage (finished: skip, started: resume, else: train); the other ranks receive its decisions (or its error, the
same message on every rank), then all of them train the stage together.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch.distributed as dist

from ... import env
from ...settings import POSITIVE, check_reals
from ..data import data_sha256
from ..files import RunLock, read_json
from ..records import TRAIN_CONFIG_FIELDS, read_model_json
from ..student import kind_of_folder, stage_kind
from .config import ConfigError, TrainConfig
from .loop import train
from .parallel import init_process_group
from .parallel import resolve_device as rank_device
from .provenance import PROVENANCE, changed_provenance, changed_settings, effective_config, teacher_sha256
from .run_folder import check_out_folder, existing_run
from .validation import check_batch_divides, check_device, validate_config

PerRound = Union[int, float, Sequence]  # one value for every self-forcing round, or one value per round


@dataclass
class PipelineConfig:
    """All stages from one config: 0 -> 1 -> 2 (k=2) -> ... -> 2 (k=k_final).

    ``steps_stage2`` and ``lr_stage2`` are one value for every self-forcing round or a sequence with
    one value per round (k=2, k=4, ...; ``log2(k_final)`` rounds): the slots k+1..2k of PFLM(2k)
    start untrained, so the later rounds usually deserve more steps. ``lr_stage2=None`` uses
    ``lr_distill`` (which is also Stage 1's learning rate).
    """

    out: str = "runs/pipeline"
    k_final: int = 4
    steps_stage0: int = 1000
    steps_stage1: int = 450
    steps_stage2: PerRound = 300
    lr_stage0: float = 2e-3
    lr_distill: float = 2e-3
    lr_stage2: Optional[PerRound] = None
    batch_size_distill: Optional[int] = None  # default: the stage-0 batch size

    # The real-valued settings (kforcing_kernels/settings.py), checked by run_pipeline before anything is trained.
    REAL_SETTINGS = {"lr_stage0": POSITIVE, "lr_distill": POSITIVE, "lr_stage2": POSITIVE}
    OPTIONAL_REALS = ("lr_stage2",)  # None: lr_distill

    def num_rounds(self) -> int:
        """Self-forcing rounds: k = 2, 4, ..., k_final."""
        if not isinstance(self.k_final, int) or self.k_final < 1 or self.k_final & (self.k_final - 1):
            raise ConfigError(
                f"k_final: expected a power of two >= 1 (windows double: 1 -> 2 -> 4 ...), got {self.k_final!r}"
            )
        return self.k_final.bit_length() - 1

    def round_steps(self) -> list[int]:
        """Steps of each self-forcing round, in order (k=2 first)."""
        return [
            int(v)
            for v in _per_round(
                self.steps_stage2,
                self.num_rounds(),
                "steps_stage2",
                "--steps-stage2",
                lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                "positive integers",
            )
        ]

    def round_lrs(self) -> list[float]:
        """Learning rate of each self-forcing round, in order (k=2 first)."""
        value = self.lr_distill if self.lr_stage2 is None else self.lr_stage2
        return [
            float(v)
            for v in _per_round(
                value,
                self.num_rounds(),
                "lr_stage2",
                "--lr-stage2",
                lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
                "positive numbers",
            )
        ]

    def stage_folders(self) -> list[tuple[str, Path]]:
        out = Path(self.out)
        return [("stage0", out / "stage0"), ("stage1", out / "stage1")] + [
            ("stage2", out / f"stage2_k{2 ** (r + 1)}") for r in range(self.num_rounds())
        ]


def _per_round(value, rounds: int, name: str, option: str, accept, expected: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(accept(v) for v in values):
        raise ConfigError(f"{name} ({option}): expected {expected}, got {value!r}")
    if len(values) == 1:
        return values * rounds
    if len(values) != rounds:
        raise ConfigError(
            f"{name} ({option}): expected one value or one per self-forcing round "
            f"({rounds} for k_final={2**rounds}: "
            f"k={', '.join(str(2 ** (r + 1)) for r in range(rounds))}), "
            f"got {len(values)} ({','.join(str(v) for v in values)})"
        )
    return values


def per_round_type(cast, expected: str):
    """An argparse ``type`` for ``300`` or ``300,450``: a tuple of positive values (the count is checked against k_final
    later)."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(cast(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {expected}, comma-separated (one per self-forcing round), got {text!r}"
            ) from None
        if not all(0 < v < math.inf for v in values):
            raise argparse.ArgumentTypeError(
                f"expected {expected}, comma-separated (one per self-forcing round), got {text!r}"
            )
        return values

    return parse


_RETRAIN = (
    "choose another output folder (--out), or retrain every stage of this one (`kforcing-train pipeline --overwrite`)"
)


def _require_same_settings(folder: Path, finished: dict, cfg: TrainConfig, data_hash) -> None:
    """A finished stage (``finished``: its model.json) is reused only when it was trained with the settings asked for
    now, on the same text and from the same teacher (else its numbers would mix in). ``data_hash()``: the current
    --data's."""
    saved = finished.get("train_config") or read_json(folder / "train_config.json", fields=TRAIN_CONFIG_FIELDS)
    # The teacher is always the previous stage folder of this pipeline; its path as typed may differ by working
    # directory.
    for key, used, wanted in changed_settings(saved, cfg, ignore=("teacher",)):
        raise ConfigError(
            f"{key}: {folder} holds a finished {folder.name} trained with {key}={used!r}, this run asks "
            "for "
            f"{wanted!r}; {_RETRAIN}"
        )
    # Its identity, not its path: a teacher retrained in place is another teacher.
    changed, unknown = changed_provenance(
        finished, {"data_sha256": data_hash(), "teacher_sha256": teacher_sha256(cfg.teacher)}
    )
    kind = kind_of_folder(cfg.teacher)  # a folder no kind holds: the default kind's, which notes nothing
    recorded = finished.get("teacher_sha256")
    note = kind.earlier_identity_note(cfg.teacher, recorded) if isinstance(recorded, str) else None
    if note is not None:
        # Saved when the teacher's identity covered less (its kind says what): accepted with a warning, as any run
        # saved before a record existed.
        changed = [(key, what) for key, what in changed if key != "teacher_sha256"]
        print(f"[pipeline] warning: {folder} was saved before {note}", file=sys.stderr)
    source_option = kind.source_option(cfg.teacher)
    for key, what in changed:
        if key == "teacher_sha256" and source_option is not None:  # a source folder (--model), not a stage of this run
            raise ConfigError(
                f"{source_option.lstrip('-')}: {folder} holds a finished {folder.name}, but the "
                f"{source_option} folder {cfg.teacher} changed since it was trained "
                f"({kind.source_files}: {what.split('(', 1)[1].rstrip(')')}); {_RETRAIN}"
            )
        raise ConfigError(
            f"{key.split('_')[0]}: {folder} holds a finished {folder.name}, but {what} since it was "
            "trained "
            f"({PROVENANCE[key]}); {_RETRAIN}"
        )
    if unknown:
        print(
            f"[pipeline] warning: {folder} was saved before {', '.join(unknown)} were recorded; reusing it without "
            f"checking that {' and '.join(sorted({PROVENANCE[k] for k in unknown}))} did not change",
            file=sys.stderr,
        )


def run_pipeline(pipe: PipelineConfig, base: TrainConfig, *, then: Optional[Callable[[dict], object]] = None):
    """Train every stage in turn.

    A finished stage (model.json present) is skipped, unless ``base.overwrite`` (then every stage is
    trained again); one trained with other settings (steps, learning rate, batch size, ...: the keys
    a resume must agree on) is refused with a ConfigError rather than mixed into this run. With
    ``base.resume`` a stage with checkpoints continues and a stage not yet started starts; a partial stage without
    ``--resume`` or ``--overwrite`` is refused by :func:`train`.
    A finished stage whose --data text or teacher (the SHA-256 of the previous stage's model file; of a ``--model``
    folder, of its weights, config.json and tokenizer files) changed
    since it was trained is refused the same way. ``pipe.out`` is locked while the stages run, and while ``then``
    (called with the stages' summaries, on the rank that holds the lock; its result is returned there) reads them:
    ``kforcing-train pipeline --evaluate`` evaluates the run so.

    Under torchrun (``WORLD_SIZE`` > 1) the process group is created here, if none exists yet, and every stage's
    :func:`train` uses it; rank 0 locks ``pipe.out`` and takes every decision above, and every rank raises its error.
    """
    # lr_stage2 (one value or one per round) is checked by round_lrs below, in per-round words.
    check_reals(pipe, PipelineConfig.REAL_SETTINGS, ConfigError, names=("lr_stage0", "lr_distill"))
    _check_distill_batch(pipe, base)
    steps = [pipe.steps_stage0, pipe.steps_stage1, *pipe.round_steps()]  # checks k_final and the per-round lists
    lrs = [pipe.lr_stage0, pipe.lr_distill, *pipe.round_lrs()]
    check_device(base.device)  # before a process group is made on it
    join_process_group(base.device)
    # One pipeline per folder at a time (each stage's train() locks its own folder too): rank 0 holds the lock.
    lock = decided_by_rank0(lambda: _check_and_lock(pipe, base, steps, lrs), share=False)
    try:
        summaries = _run_stages(pipe, base, steps, lrs)
        if then is not None and lock is not None:  # still locked: no other pipeline rewrites a stage while it is read
            return then(summaries)
        return summaries
    finally:
        if lock is not None:
            lock.release()


def _check_and_lock(pipe: PipelineConfig, base: TrainConfig, steps: list, lrs: list) -> RunLock:
    check_out_folder(pipe.out)
    # The first stage's settings (a bad model source among them) are a usage error before the pipeline's folder is
    # made, as its own train() would refuse them; later stages' teachers do not exist yet.
    first = 1 if base.model else 0  # a pretrained --model is the AR teacher: no stage0
    stage, folder = pipe.stage_folders()[first]
    teacher = Path(base.model).resolve() if base.model else None
    validate_config(
        _stage_config(pipe, base, stage, folder, teacher, steps[first], lrs[first]), env.distributed_ranks()[0]
    )
    window = stage_kind(base).sliding_window(base)
    if window is not None:
        _check_sliding_window(pipe, base, window)
    return RunLock(pipe.out).acquire()


def _check_distill_batch(pipe: PipelineConfig, base: TrainConfig) -> None:
    """The distillation stages' batch, as each stage's own check would refuse it (validate_config), before stage0
    trains: it divides over data-parallel ranks x grad_accum like the stage-0 batch."""
    batch = pipe.batch_size_distill
    if batch is None:
        return  # the stage-0 batch, which stage0 checks first
    world, cp = env.distributed_ranks()[0], base.context_parallel
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError(f"batch_size_distill: expected a positive int or None (the stage-0 batch), got {batch!r}")
    accum = base.grad_accum
    if isinstance(cp, int) and cp >= 1 and world % cp == 0 and isinstance(accum, int) and accum >= 1:
        # (a context_parallel or grad_accum that cannot work is refused by stage0's own check, naming it)
        consequence = " (stage1 and every stage2 train with it; nothing was trained)"
        check_batch_divides("batch_size_distill", batch, world, cp, accum, consequence)


def _check_sliding_window(pipe: PipelineConfig, base: TrainConfig, window: int) -> None:
    """Every stage's layouts under the model's sliding window, before the first stage trains: a window shorter than a
    later stage's K-Forcing window would otherwise be refused only when that stage starts, after the earlier ones
    trained. The layouts' own check (WindowLayout.with_sliding_window) decides, for each stage's windows: the student's
    SingleForward at its k, and its teacher's DoubleForward at k / 2."""
    from ...layouts import WindowLayout

    for r in range(pipe.num_rounds() + 1):
        k = 2**r
        stage = "stage1" if k == 1 else f"stage2_k{k}"
        layouts = [WindowLayout.kforcing_single(base.seq_len, k)]
        if k > 1:
            layouts.append(WindowLayout.kforcing_double(base.seq_len, k // 2))
        for layout in layouts:
            try:
                layout.with_sliding_window(window)
            except ValueError as exc:
                raise ConfigError(
                    f"k_final: the model's sliding window ({window} positions) cannot hold the windows "
                    f"of {stage} (k={k}): {exc}; use --k-final <= {window} or a model with a longer "
                    "sliding_window (nothing was trained)"
                ) from None


def _run_stages(pipe: PipelineConfig, base: TrainConfig, steps: list, lrs: list) -> dict:
    data_hash = functools.lru_cache(maxsize=None)(lambda: data_sha256(base.data))  # read the documents once, if needed
    summaries, teacher = {}, None
    for (stage, folder), n_steps, lr in zip(pipe.stage_folders(), steps, lrs):
        if stage == "stage0" and base.model:  # a pretrained Hugging Face model is the AR teacher: no stage0
            # recorded as stage1's teacher: the run folder works from any directory
            teacher = Path(base.model).resolve()
            continue
        cfg = _stage_config(pipe, base, stage, folder, teacher, n_steps, lr)
        done, value = decided_by_rank0(functools.partial(_stage_decision, folder, cfg, base, data_hash))
        # The previous stage's train() ended with every rank past its model.json: all ranks see the same folders.
        summaries[folder.name] = value if done else train(dataclasses.replace(cfg, resume=value))
        teacher = folder
    return summaries


def _stage_config(
    pipe: PipelineConfig, base: TrainConfig, stage: str, folder: Path, teacher: Optional[Path], steps: int, lr: float
) -> TrainConfig:
    """The TrainConfig of one stage (``teacher``: the previous stage's folder, or the --model source)."""
    distill = stage != "stage0"
    return dataclasses.replace(
        base,
        stage=stage,
        out=str(folder),
        teacher=str(teacher) if teacher else None,
        steps=steps,
        lr=lr,
        batch_size=(pipe.batch_size_distill or base.batch_size) if distill else base.batch_size,
        model=base.model if stage == "stage1" else None,
        model_config=base.model_config if stage == "stage0" else None,
        decode=base.decode if stage == "stage1" else "argmax",  # stage2 students inherit their teacher's rule
    )


def _stage_decision(folder: Path, cfg: TrainConfig, base: TrainConfig, data_hash) -> tuple[bool, object]:
    """(True, its summary) for a finished stage to skip; (False, resume) for one to train."""
    if (folder / "model.json").exists() and not base.overwrite:
        finished = read_model_json(folder)
        _require_same_settings(folder, finished, effective_config(cfg), data_hash)  # as train() records it
        print(f"[pipeline] {folder} is done; skipping", file=sys.stderr)
        return True, finished.get("summary", {})
    return False, bool(base.resume and existing_run(folder))  # a stage not started yet has nothing to resume


# ---------------------------------------------------------------------- ranks (torchrun)


def join_process_group(device: str) -> None:
    """Under torchrun (``WORLD_SIZE`` > 1) create the default process group unless one exists, as train() would
    (app/training/parallel.py: gloo on CPU, nccl on CUDA with this rank's ``LOCAL_RANK`` GPU), so the pipeline can share
    decisions before its first stage; every stage's mesh is then built over this group. Nothing outside torchrun."""
    init_process_group(rank_device(device))


def decided_by_rank0(decide: Callable[[], object], share: bool = True):
    """``decide()`` run on rank 0 alone; its value on every rank (``share``; else on rank 0, None elsewhere), or its
    exception raised on every rank (the same type and message), so all ranks take the same branch. Without a
    process group of several ranks: ``decide()``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    value, error = None, None
    if dist.get_rank() == 0:
        try:
            value = decide()
        except Exception as exc:  # noqa: BLE001 - handed to every rank, then raised
            error = exc
    box = [(value if share else None, _portable(error))]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][1] is not None:
        raise box[0][1]
    return value if dist.get_rank() == 0 or not share else box[0][0]


def _portable(error: Optional[Exception]) -> Optional[Exception]:
    """The error as it can travel to the other ranks: itself, or a RuntimeError with its type and message."""
    if error is None:
        return None
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        return RuntimeError(f"{type(error).__name__}: {error}")

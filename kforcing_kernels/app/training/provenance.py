"""What a run records of itself and compares against a saved run: the settings a stage really uses
(:func:`effective_config`), the settings a ``--resume`` or a pipeline's reuse must agree on
(:func:`changed_settings`), and the identity of the text and the teacher it met (:data:`PROVENANCE`,
:func:`changed_provenance`, :func:`teacher_sha256`); and the refusals of a ``--resume`` that differs
(:func:`require_resume_settings`, :func:`require_same_provenance`). A pipeline's reuse of a finished stage words
its own refusals from the same comparisons (``pipeline._require_same_settings``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

from ...model import PRESETS
from ..data import DEFAULT_SOURCE
from ..records import read_model_json
from ..student import kind_of_folder, stage_kind
from .config import ConfigError, TrainConfig

# The settings that are paths: the same folder written relative or absolute (from this working directory) is the same
# setting; the built-in corpus name stays a name.
PATH_SETTINGS = ("data", "teacher", "model", "model_config")


def effective_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the values the stage really uses, as a run records them (train_config.json, checkpoints,
    model.json) and compares them (--resume, a pipeline's reuse of a finished stage); after
    :func:`~kforcing_kernels.app.training.validation.validate_config`.

    ``preset`` is None where no preset sizes the model: a Hugging Face stage (--model-config, --model, or a teacher
    that is a Hugging Face model); ``k`` of stage2 is the window it trains, twice its teacher's (model.json);
    ``data``, ``teacher``, ``model`` and ``model_config`` are absolute paths (the built-in corpus name stays a name).
    """
    # Paths are recorded resolved, so a run folder works from any directory (kforcing-evaluate RUN, a later stage's
    # --teacher): --data as typed was relative to the directory the run was started in.
    changes: dict[str, Any] = {
        key: str(Path(value).resolve())
        for key in PATH_SETTINGS
        if (value := getattr(cfg, key)) is not None and not (key == "data" and value == DEFAULT_SOURCE)
    }
    if not stage_kind(cfg).sized_by_preset:
        changes["preset"] = None
    if cfg.stage == "stage2":
        teacher_k = read_model_json(cfg.teacher)["k"]
        if teacher_k >= 1:  # an AR teacher (k=0) is refused, naming --teacher, when the stage builds its model
            changes["k"] = 2 * teacher_k
    return dataclasses.replace(cfg, **changes)


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
        if key in PATH_SETTINGS and used is not None and wanted is not None and DEFAULT_SOURCE not in (used, wanted):
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
_LEGACY: dict[str, Callable[[dict, Any, Any], bool]] = {
    "preset": lambda saved, used, wanted: wanted is None and used in PRESETS,
    "k": lambda saved, used, wanted: saved.get("stage") == "stage2" and used == 1,
}


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


def require_resume_settings(saved: dict, cfg: TrainConfig, run: str) -> None:
    """--resume continues ``run`` (its saved train_config ``saved``) only with the settings it was trained with."""
    for key, used, wanted in changed_settings(saved, cfg):
        flag = (
            " (twice the k of --teacher)"
            if key == "k" and cfg.stage == "stage2"
            else f" (--{key.replace('_', '-')})"
            if key in TrainConfig.RESUME_DEFAULTS
            else ""
        )
        raise ConfigError(f"{key}: --resume needs the settings of {run}; it used {used!r}, got {wanted!r}{flag}")


def require_same_provenance(saved: dict, now: dict, run: str, log) -> None:
    """--resume continues ``run`` (``saved``: its recorded info) only on the same text and teacher."""
    changed, unknown = changed_provenance(saved, now)
    for key, what in changed:
        raise ConfigError(
            f"{key.split('_')[0]}: --resume needs what {run} was trained on; {what}. Restore it, or "
            "start "
            f"again with --overwrite (or another --out) ({PROVENANCE[key]})"
        )
    if unknown:
        log(
            f"warning: {run} was saved before {', '.join(unknown)} were recorded; cannot check that "
            f"{' and '.join(sorted({PROVENANCE[k] for k in unknown}))} did not change since"
        )

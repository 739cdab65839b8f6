"""The run folder (``--out``) of a stage over its life: whether a path can be one (:func:`check_out_folder`), what a run
there consists of (:data:`RUN_FILES`, :func:`existing_run`), the start that refuses to mix two runs or clears the old
one (:func:`prepare_out`), and the clean-up of a start that failed before it trained anything
(:func:`folder_before_start`, :func:`discard_failed_start`). The folder's lock is
:class:`~kforcing_kernels.app.files.RunLock`; its checkpoints are :mod:`.checkpoint`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Union

from ..files import LOCK_NAME
from .checkpoint import checkpoint_dir, clean_run_folder, latest_checkpoint, remove_checkpoints
from .config import ConfigError, TrainConfig


def check_out_folder(out: Union[str, Path], option: str = "--out") -> None:
    """``out`` must be a folder or not exist yet, and no existing part of its path may be a file (ConfigError naming
    ``option`` otherwise)."""
    path = Path(out)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = f"{str(path)!r} is a file" if part == path else f"{str(part)!r} (in {str(path)!r}) is a file"
                raise ConfigError(f"out: {what}; {option} expects a folder (an existing one or one to create)")
            break


RUN_FILES = ("model.json", "model.safetensors", "train_config.json", "metrics.jsonl", "tokenizer.json")


def existing_run(out: Path) -> list[str]:
    """The files of a run (finished or partial) in ``out``; empty when there is none."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if any(checkpoint_dir(out).glob("step_*")):
        found.append("checkpoints/")
    return found


def prepare_out(cfg: TrainConfig, main: bool, log: Callable[[str], None]) -> None:
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

# What folder_before_start took, for discard_failed_start.
FolderBefore = tuple[list[Path], Optional[set[str]]]


def folder_before_start(out: Path) -> FolderBefore:
    """``(folders of out's path that do not exist yet, deepest first; the names in out, None when it is absent)``,
    taken before a run locks ``out``: what :func:`discard_failed_start` may remove."""
    missing = [part for part in (out, *out.parents) if not part.exists()]
    return missing, (set(os.listdir(out)) if out.is_dir() else None)


def discard_failed_start(out: Path, before: FolderBefore, overwrite: bool) -> None:
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

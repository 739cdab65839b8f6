"""Files of a run: the one atomic writer of the package, checkpoints, final models, metrics.

Every file the package writes goes through :func:`atomic_write_file`: the bytes go to a
temporary file in the target's folder (a random name, created ``O_EXCL | O_NOFOLLOW`` and written
through its descriptor, so no symlink planted in the folder can redirect it), are fsynced, and are
renamed over the target,
so a reader (or a run resumed after a kill or a full disk) sees the old file or the new
one, never half of one. Temporaries are created with mode ``0o666`` and the process
umask applies, as for any ``open(path, "w")``. Their names (``.NAME.<16 random hex digits>.tmp``)
let :func:`clean_run_folder` recognise leftovers of a killed process.

A checkpoint is ``step_XXXXXXXX.safetensors`` (model and optimizer tensors) plus
``step_XXXXXXXX.json`` (configs, optimizer hyper-parameters, the tensors' size and
SHA-256); it exists once its JSON does, so the JSON is written last. Every way a
file can be missing, torn, corrupt or of the wrong shape raises :class:`CheckpointError`
naming the file.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

# The checked readers, tensor files and tokenizer I/O live in app/files.py (one place for every file's bytes);
# read_json, load_tensors and save_tensors stay importable from here, where 0.2 defined them.
from ..files import (
    NON_NEGATIVE_INT,
    TMP_SUFFIX,
    CheckpointError,
    Field,
    load_tensors,
    load_tokenizer,
    read_json,
    save_tensors,
    tokenizer_sha256,
    write_json,
    write_text,
)
from ..records import MODEL_INFO_FIELDS, TRAIN_CONFIG_FIELDS, read_model_json

CHECKPOINT_FORMAT = 1


# ---------------------------------------------------------------------- models


def _tied_keys(model) -> list[str]:
    """state_dict keys that are another key's tensor (tied embeddings): saved once, restored by the tie."""
    return model.tied_keys()  # every Student says which (app/student.py)


def _model_tensors(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    for key in _tied_keys(model):
        sd.pop(key)
    return sd


def _load_model_tensors(model, tensors: dict[str, torch.Tensor], where: Path) -> None:
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"{where}: tensors do not match the model ({exc})") from None
    tied = set(_tied_keys(model))
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{where}: tensors do not match the model (missing {missing}, unexpected {result.unexpected_keys})"
        )


def _model_from_config(json_path: Path, config: dict):
    from ...model import KForcingLM, ModelConfig

    try:
        return KForcingLM(ModelConfig.from_dict(config))
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{json_path}: malformed 'model_config' ({exc})") from None


def save_model(folder: str | Path, model, info: dict) -> None:
    """Final weights of a stage: ``model.safetensors`` + ``model.json`` (config, k, provenance, checksum)."""
    folder = Path(folder)
    record = save_tensors(folder / "model.safetensors", _model_tensors(model))
    write_json(folder / "model.json", {**info, "model_config": model.config.to_dict(), "tensors": record})


def read_model_info(folder: str | Path) -> dict:
    """``model.json`` of a stage folder, checked entry by entry (``app/records.py``'s ``MODEL_JSON_FIELDS``:
    the entries :func:`load_model` needs and every other one the package reads back)."""
    return read_model_json(folder)


def load_model(folder: str | Path, device: str | torch.device = "cpu"):
    """``(model in eval mode, info dict, tokenizer or None)`` from a stage folder written by :func:`save_model`.

    The tokenizer encodes the EOS marker's characters in text as ordinary tokens (:func:`load_tokenizer`)."""
    folder_path = Path(folder)
    json_path = folder_path / "model.json"
    info = read_model_info(folder_path)
    model = _model_from_config(json_path, info["model_config"])
    _load_model_tensors(model, load_tensors(json_path, info["tensors"]), json_path)
    model.k_train = info["k"]  # the window it was trained with (0: AR); generate_kforcing checks k against it
    tok_path = folder_path / "tokenizer.json"
    try:
        tokenizer = load_tokenizer(tok_path) if tok_path.exists() else None
    except Exception as exc:  # tokenizers raises its own Exception type on bad JSON
        raise CheckpointError(f"{tok_path}: unreadable tokenizer ({exc})") from None
    recorded = info.get("tokenizer_sha256")  # absent in models saved before it was recorded: not checked
    if tokenizer is not None and recorded is not None:
        if tokenizer_sha256(tokenizer) != recorded:
            raise CheckpointError(
                f"{tok_path}: not the tokenizer this model was trained with (its SHA-256 differs "
                "from "
                f"{json_path.name}'s tokenizer_sha256); put the run's own tokenizer.json back"
            )
    return model.to(device).eval(), info, tokenizer


# ---------------------------------------------------------------------- checkpoints


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def remove_checkpoints(out: str | Path) -> None:
    """Remove a run's checkpoints (``step_*`` files and sharded ``step_*`` folders) and then the checkpoint
    folder if nothing else is left in it: files a user put there are not the run's and stay."""
    folder = checkpoint_dir(out)
    for path in folder.glob("step_*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # absent, or holds the user's files
        pass


def latest_checkpoint(out: str | Path) -> Optional[Path]:
    """The newest complete checkpoint: a whole-model checkpoint's JSON (it exists once its JSON does), or a
    sharded checkpoint's folder ``step_*.dcp`` (it exists once renamed into place, see sharded_checkpoint.py)."""
    folder = checkpoint_dir(out)
    found = [*folder.glob("step_*.json"), *(p for p in folder.glob("step_*.dcp") if p.is_dir())]
    return max(found, key=lambda p: (p.stem, p.suffix)) if found else None


def config_dict(model) -> dict:
    """The model's config as JSON gives it back, as its kind records it (:meth:`ModelKind.config_dict`)."""
    from ..student import kind_of

    return kind_of(model).config_dict(model)


def save_checkpoint(out, step: int, model, optimizer, scaler, train_config: dict, info: dict, keep: int) -> Path:
    """Model + optimizer + scaler state after ``step``; keeps the newest ``keep`` checkpoints.

    If writing fails (e.g. a full disk) nothing half-written is left: the tensors of a
    checkpoint whose JSON could not be written are removed before the error propagates.
    """
    ckpt = checkpoint_dir(out)
    stem = f"step_{step:08d}"
    opt = optimizer.state_dict()
    tensors = {f"model/{k}": v for k, v in _model_tensors(model).items()}
    for pid, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim/{pid}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    meta = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "train_config": train_config,
        "model_config": config_dict(model),
        "info": info,
        "param_groups": opt["param_groups"],
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
    }
    tensor_path, json_path = ckpt / f"{stem}.safetensors", ckpt / f"{stem}.json"
    try:
        meta["tensors"] = save_tensors(tensor_path, tensors)
        write_json(json_path, meta)  # last: the checkpoint now exists
    except BaseException:
        if not json_path.exists():
            tensor_path.unlink(missing_ok=True)
        raise
    for old in sorted(ckpt.glob("step_*.json"))[:-keep]:
        old.with_suffix(".safetensors").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return json_path


_CHECKPOINT_KEYS = {
    "format": int,
    "step": int,
    "train_config": dict,
    "model_config": dict,
    "info": dict,
    "param_groups": list,
    "scaler": (dict, type(None)),
    "tensors": dict,
}
# What a resume reads of them, entry by entry (app/records.py); load_tensors checks the "tensors" record.
CHECKPOINT_FIELDS = {
    "step": NON_NEGATIVE_INT,
    "train_config": Field(dict, fields=TRAIN_CONFIG_FIELDS),
    "info": Field(dict, fields=MODEL_INFO_FIELDS),
    "param_groups": Field(list, each=Field(dict)),
}


def read_checkpoint_meta(json_path: Path) -> dict:
    """A checkpoint's JSON, checked for format and structure."""
    meta = read_json(json_path, {"format": int})
    if meta["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{json_path}: unknown checkpoint format {meta['format']!r}, expected {CHECKPOINT_FORMAT}"
        )
    return read_json(json_path, _CHECKPOINT_KEYS, CHECKPOINT_FIELDS)


def load_checkpoint(json_path: Path, model, optimizer, scaler) -> dict:
    """Restore model, optimizer and scaler state in place; returns the checkpoint's JSON."""
    json_path = Path(json_path)
    meta = read_checkpoint_meta(json_path)
    tensors = load_tensors(json_path, meta["tensors"])
    _load_model_tensors(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}, json_path)
    state: dict[int, dict] = {}
    try:
        for key, value in tensors.items():
            if key.startswith("optim/"):
                _, pid, name = key.split("/", 2)
                state.setdefault(int(pid), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        if meta["scaler"] is not None:
            scaler.load_state_dict(meta["scaler"])
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{json_path}: optimizer or scaler state does not match the run ({exc})") from None
    return meta


def clean_run_folder(out: str | Path, log=None) -> list[Path]:
    """Remove what an interrupted run can leave behind: temporaries of :func:`atomic_write` (files) and of
    sharded checkpoints (folders), and
    checkpoint tensors without their JSON (a checkpoint whose JSON was never written). Returns them."""
    removed = []
    for folder in (Path(out), checkpoint_dir(out)):
        if not folder.is_dir():
            continue
        for tmp in folder.glob(f".*{TMP_SUFFIX}"):
            if tmp.is_dir() and not tmp.is_symlink():  # a sharded checkpoint that was never renamed into place
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    for tensors in sorted(checkpoint_dir(out).glob("step_*.safetensors")):
        if not tensors.with_suffix(".json").exists():
            tensors.unlink(missing_ok=True)
            removed.append(tensors)
    if removed and log is not None:
        log(f"removed {len(removed)} leftover file(s) of an interrupted run: {', '.join(p.name for p in removed)}")
    return removed


# ---------------------------------------------------------------------- metrics.jsonl


def _parse_metrics(path: Path) -> tuple[list[dict], bool]:
    """(records, whether a torn last line was dropped). A bad line anywhere but last is corruption."""
    text = path.read_text()
    lines = text.split("\n")
    records, torn = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        last = i == len(lines) - 1  # no newline after it: the write of this line never finished
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            if last:
                torn = True
                continue
            raise CheckpointError(f"{path}: line {i + 1} is corrupt ({exc})") from None
        records.append(record)
    return records, torn


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, without a torn last line (the write a kill interrupted)."""
    return _parse_metrics(Path(path))[0]


def recover_metrics(path: str | Path, step: int, log=print) -> None:
    """Before a resume from ``step``: drop a torn last line (saying so) and the records of later steps."""
    path = Path(path)
    if not path.exists():
        return
    records, torn = _parse_metrics(path)
    if torn:
        log(f"{path}: dropped a torn last line (a write that did not finish)")
    keep = [r for r in records if isinstance(r.get("step", 0), int) and r.get("step", 0) <= step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def stderr_log(prefix: str):
    return lambda message: print(f"{prefix} {message}", file=sys.stderr, flush=True)

"""Sharded checkpoints of an FSDP2 run (``--parallel fsdp``), written with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the folder ``checkpoints/step_XXXXXXXX.dcp/``: DCP's files (every rank writes its own
shards of the model and AdamW state, ``.metadata`` maps them) and ``manifest.json`` (rank 0): the step
(the data position: the batches of step s are a function of (seed, s), see trainer.py), the run's
settings and model config, the scaler state, every rank's CPU (and CUDA) RNG state, and the size and
SHA-256 of every file of the folder.

Atomic: the ranks write into ``checkpoints/.step_XXXXXXXX.dcp.<random hex>.tmp/``; DCP fsyncs its files,
rank 0 writes the manifest last (:func:`~kforcing_kernels.app.files.write_json`), fsyncs the folder and
renames it to its final name. A checkpoint exists once that name does, so a killed or failed write leaves
only a hidden temporary that :func:`~kforcing_kernels.app.training.checkpoint.clean_run_folder` removes. Files and
folders are created with the process umask. Loading checks every file against the manifest before DCP
reads it, and refuses another model config; the run's settings are checked by the trainer like those of a
whole-model checkpoint (``parallel`` is one of them). Another world size is allowed: DCP reshards model
and optimizer state; rank r restores saved rank r's RNG state when there was one. The hashes guard against
torn and corrupted files, not against a hostile author: DCP's ``.metadata`` is a pickle, so load only
checkpoints you trust (the exported ``model.safetensors`` is the file to share).

``python -m kforcing_kernels.app.training.sharded_checkpoint CHECKPOINT --out FOLDER`` (or :func:`export_model`)
writes, in one process and without a process group, the model whole (DCP gathers every rank's shards): for the
native model a plain ``model.safetensors`` + ``model.json`` (+ the run's tokenizer.json) that
:func:`~kforcing_kernels.app.training.checkpoint.load_model` loads; another kind's model (a Hugging Face student) as
the stage folder a finished stage of that kind is, written by its kind (:meth:`ModelKind.export_sharded
<kforcing_kernels.app.student.ModelKind.export_sharded>`; for HF: ``save_pretrained`` of the backbone and of the run's
tokenizer, ``noise_embedding.safetensors``, ``model.json``).
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..files import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    TMP_SUFFIX,
    CheckpointError,
    Field,
    fsync_dir,
    read_json,
    sha256_file,
    write_json,
)
from ..records import MODEL_INFO_FIELDS, TRAIN_CONFIG_FIELDS
from ..student import kind_of_config
from .checkpoint import checkpoint_dir, config_dict
from .config import ConfigError
from .parallel import broadcast_value
from .run_folder import check_out_folder

SHARDED_FORMAT = "kforcing-dcp/1"
SHARDED_SUFFIX = ".dcp"
MANIFEST = "manifest.json"
_MANIFEST_KEYS = {
    "format": str,
    "step": int,
    "world_size": int,
    "train_config": dict,
    "model_config": dict,
    "info": dict,
    "scaler": (dict, type(None)),
    "rng": list,
    "files": dict,
}
# What loading and exporting read of them, entry by entry (app/records.py).
_FILE_RECORD = Field(dict, fields={"bytes": Field(int, required=True), "sha256": Field(str, required=True)})
MANIFEST_FIELDS = {
    "step": NON_NEGATIVE_INT,
    "world_size": POSITIVE_INT,
    "train_config": Field(dict, fields=TRAIN_CONFIG_FIELDS),
    "info": Field(dict, fields=MODEL_INFO_FIELDS),
    "rng": Field(list, each=Field(dict, fields={"cpu": Field(str, required=True), "cuda": Field(str)})),
    "files": Field(dict, each=_FILE_RECORD),
}


def is_sharded(path: Path) -> bool:
    return Path(path).suffix == SHARDED_SUFFIX


def _rng_state() -> dict:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _all_gather_objects(value) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _file_records(folder: Path) -> dict:
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- save


def save_sharded_checkpoint(
    out, step: int, model, optimizer, scaler, train_config: dict, info: dict, keep: int
) -> Path:
    """Every rank: write the sharded checkpoint of ``step`` (see the module docstring); keep the newest ``keep``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = checkpoint_dir(out)
    final = ckpt / f"step_{step:08d}{SHARDED_SUFFIX}"
    tmp, error = None, None
    if rank == 0:
        try:
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp = ckpt / f".{final.name}.{secrets.token_hex(8)}{TMP_SUFFIX}"
            tmp.mkdir()  # mode 0o777 less the umask
        except OSError as exc:
            error = f"{ckpt}: cannot write a checkpoint ({exc.strerror or exc})"
    tmp, error = broadcast_value((tmp, error))
    if error:
        raise CheckpointError(error)
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))  # fails on every rank alike
        rngs = _all_gather_objects(_rng_state())  # also: every rank's files are written (DCP fsyncs them)
        if rank == 0:
            try:
                _publish(
                    tmp,
                    final,
                    keep,
                    {
                        "format": SHARDED_FORMAT,
                        "step": step,
                        "world_size": world,
                        "train_config": train_config,
                        "model_config": config_dict(model),
                        "info": info,
                        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                        "rng": rngs,
                    },
                )
            except (OSError, CheckpointError) as exc:
                error = f"{final}: cannot write ({getattr(exc, 'strerror', None) or exc})"
        error = broadcast_value(error)  # rank 0's outcome, on every rank: all raise or none
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if error:
        raise CheckpointError(error)
    return final


def _publish(tmp: Path, final: Path, keep: int, manifest: dict) -> None:
    """Rank 0: fsync DCP's files, write the manifest (their hashes) last, rename the folder into place, prune."""
    for path in tmp.iterdir():
        _fsync_file(path)
    write_json(tmp / MANIFEST, {**manifest, "files": _file_records(tmp)})
    fsync_dir(tmp)
    if final.exists():  # the same step written again (a resumed run): the new one replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)  # the checkpoint now exists
    fsync_dir(final.parent)
    for old in sorted(final.parent.glob(f"step_*{SHARDED_SUFFIX}"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- read, verify, load


def read_sharded_meta(folder: Path) -> dict:
    """A sharded checkpoint's manifest, checked for format and structure."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a sharded checkpoint folder")
    manifest = read_json(folder / MANIFEST, {"format": str})
    if manifest["format"] != SHARDED_FORMAT:
        raise CheckpointError(
            f"{folder / MANIFEST}: unknown checkpoint format {manifest['format']!r}, expected {SHARDED_FORMAT}"
        )
    return read_json(folder / MANIFEST, _MANIFEST_KEYS, MANIFEST_FIELDS)


def verify_sharded(folder: Path) -> dict:
    """The manifest, after checking every file it lists (size, SHA-256) and that DCP's metadata is among them."""
    folder = Path(folder)
    manifest = read_sharded_meta(folder)
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"{folder / MANIFEST}: malformed: no DCP .metadata listed")
    for name, record in manifest["files"].items():
        path = folder / name
        if path.parent != folder or not isinstance(record, dict):
            raise CheckpointError(f"{folder / MANIFEST}: malformed entry {name!r}")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        if path.stat().st_size != record.get("bytes"):
            raise CheckpointError(
                f"{path}: truncated or corrupt: {path.stat().st_size} bytes, expected {record.get('bytes')}"
            )
        if sha256_file(path) != record.get("sha256"):
            raise CheckpointError(f"{path}: corrupt: SHA-256 does not match {MANIFEST}")
    return manifest


def load_sharded_checkpoint(folder: Path, model, optimizer, scaler) -> dict:
    """Every rank: restore model, optimizer, scaler and RNG from ``folder`` (any saved world size); returns the
    manifest.

    Rank 0 verifies the files and the model config; every rank raises the same :class:`CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder, rank = Path(folder), dist.get_rank()
    manifest, error = None, None
    if rank == 0:
        try:
            manifest = verify_sharded(folder)
            saved, current = manifest["model_config"], config_dict(model)
            if "decode" in current and "decode" not in saved:  # saved before ModelConfig had a decoding rule: argmax
                saved = {**saved, "decode": "argmax"}
            if saved != current:
                changed = sorted(k for k, v in current.items() if saved.get(k) != v)
                raise CheckpointError(
                    f"{folder}: saved for another model (config differs in {', '.join(changed)}); "
                    "resume with the run's own model (--preset, --n-layer, ...) or start again"
                )
        except CheckpointError as exc:
            error = str(exc)
    manifest, error = broadcast_value((manifest, error))
    if error:
        raise CheckpointError(error)
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        if manifest["scaler"] is not None:
            scaler.load_state_dict(manifest["scaler"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: model or optimizer state does not match the run ({exc})") from None
    if rank < len(manifest["rng"]):
        _set_rng_state(manifest["rng"][rank])
    return manifest


# ---------------------------------------------------------------------- export


def check_export_out(checkpoint: Path, out: Path) -> None:
    """``out`` must be a folder (or not exist yet) other than the checkpoint's own run folder, whose model.safetensors
    and model.json are the run's final model (an export there would replace them); ConfigError naming --out."""
    check_out_folder(out, "--out")
    run = Path(checkpoint).parent.parent
    if out.resolve() == run.resolve():
        raise ConfigError(
            f"out: {str(out)!r} is the run folder of {str(checkpoint)!r}; exporting there would replace "
            "the "
            "run's own model.safetensors and model.json: choose another --out"
        )


def export_model(checkpoint, out, tokenizer: Optional[Path] = None) -> Path:
    """The model of a sharded checkpoint folder, whole, in ``out`` (one process); returns ``out / "model.json"``.

    Native model: ``model.safetensors`` + ``model.json``; ``tokenizer``: the run's tokenizer.json (default: the one in
    the run folder above ``checkpoints/``), copied beside the model so
    :func:`~kforcing_kernels.app.training.checkpoint.load_model` checks and returns it.

    Hugging Face student: the stage folder (module docstring); ``tokenizer``: a Hugging Face tokenizer folder or a
    ``tokenizer.json`` (default: the run's teacher folder when it is a Hugging Face one, else the run's tokenizer.json
    with the package's EOS, what the finished stage would have saved), refused unless it is the run's tokenizer."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_export_out(checkpoint, out)
    manifest = verify_sharded(checkpoint)
    cfg = manifest["train_config"]
    record = {
        **manifest["info"],
        "stage": cfg.get("stage"),
        "data": cfg.get("data"),
        "train_config": cfg,
        "exported_from": str(checkpoint),
        "step": manifest["step"],
    }
    # The kind whose model it holds writes its stage folder (the native kind's or a Hugging Face student's).
    kind_of_config(manifest["model_config"]).export_sharded(checkpoint, out, manifest, record, tokenizer)
    return out / "model.json"


def main(argv=None) -> None:
    from ..cli import make_parser

    # No console script is installed for it (pyproject.toml): the usage line names the command that runs it.
    parser = make_parser(
        "python -m kforcing_kernels.app.training.sharded_checkpoint",
        "Export a sharded (--parallel fsdp) checkpoint whole: a plain model.safetensors, or for a "
        "Hugging Face student its stage folder (save_pretrained + noise embedding).",
    )
    parser.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX.dcp folder, or a run folder (its newest)")
    parser.add_argument("--out", required=True, help="folder for model.safetensors, model.json and the tokenizer")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the run's tokenizer: its tokenizer.json, or for a Hugging Face student a tokenizer "
        "folder (default: the run folder's tokenizer.json; a Hugging Face student: its "
        "teacher's folder)",
    )
    args = parser.parse_args(argv)

    source = Path(args.checkpoint)
    try:  # before looking for the checkpoint: a wrong --out is the first thing to say
        check_export_out(
            source if is_sharded(source) else checkpoint_dir(source) / f"step{SHARDED_SUFFIX}", Path(args.out)
        )
    except ConfigError as exc:
        parser.error(f"argument --out: {str(exc).removeprefix('out: ')}")
    if not is_sharded(source):
        found = sorted(checkpoint_dir(source).glob(f"step_*{SHARDED_SUFFIX}"))
        if not found:
            parser.error(
                f"checkpoint: no sharded checkpoint in {source} (expected {checkpoint_dir(source)}/step_*.dcp)"
            )
        source = found[-1]
    try:
        print(export_model(source, args.out, args.tokenizer))
    except (CheckpointError, ConfigError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()

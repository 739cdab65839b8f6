"""What a K-Forced Hugging Face stage folder must hold before vLLM serves it (no vLLM, no transformers, no app).

The stage folder format is the HF recipe's (``kforcing_kernels/app/hf_recipe/files.py``, format 1): the backbone
as ``save_pretrained`` writes it, the tokenizer, ``noise_embedding.safetensors`` and ``model.json`` (``k``,
``hf_format``, ``noise_embedding {format, settings, tensors}``, ``files {name: {bytes, sha256}}``). The export of a
native stage (:mod:`.export`) is the same with ``native_export`` in place of ``hf_format`` (and ``decode``, the
native model's decoding rule). The library may not import the app, so the same checks ``load_pflm`` makes are made
here on the folder's JSON: every listed file present with its size and SHA-256, the stage format known, the noise
embedding format 2 and its tensors' record matching the file. The export of a native AR stage (k = 0) has no noise
embedding (and must not: vLLM loads every ``*.safetensors``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ...model.decoding import DECODE_RULES
from ..hf_noise import NOISE_EMBEDDING_FORMAT, NoiseEmbedding
from .export import NATIVE_EXPORT_FORMAT

HF_STAGE_FORMAT = 1  # the HF recipe's HF_FORMAT (python_tests/integrations/vllm checks they agree)
NOISE_FILE = "noise_embedding.safetensors"


class StageError(ValueError):
    """A stage folder vLLM cannot serve as a K-Forced model; the message names the file and what is wrong."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_stage(folder) -> dict:
    """``model.json`` of a K-Forced HF stage folder (or a native stage's export) after checking every file it
    lists (size and SHA-256), the stage format and the noise embedding's format; a :class:`StageError` naming what is
    wrong otherwise."""
    folder = Path(folder)
    json_path = folder / "model.json"
    if not json_path.is_file():
        raise StageError(
            f"{folder}: not a K-Forced stage folder (no model.json); serve a plain model with stock vLLM, "
            "or a stage folder written by kforcing-train / save_pflm"
        )
    try:
        info = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise StageError(f"{json_path}: unreadable ({exc})") from None
    if not isinstance(info, dict):
        raise StageError(f"{json_path}: malformed: expected a JSON object")
    if "native_export" in info:
        if info["native_export"] != NATIVE_EXPORT_FORMAT:
            raise StageError(
                f"{json_path}: unknown native export format {info['native_export']!r}, expected "
                f"{NATIVE_EXPORT_FORMAT}: export the native stage again"
            )
        decode = info.get("decode")
        if decode not in DECODE_RULES:
            raise StageError(f"{json_path}: decode: expected one of {DECODE_RULES}, got {decode!r}")
    elif "hf_format" not in info:
        if "model_config" in info:
            raise StageError(
                f"{json_path}: a native stage folder (the package's own model): vLLM serves its export, "
                f"written by `python -m kforcing_kernels.app.vllm_export {folder} --out FOLDER`"
            )
        raise StageError(f"{json_path}: not a K-Forced stage folder vLLM serves (no hf_format, no native_export)")
    elif info["hf_format"] != HF_STAGE_FORMAT:
        raise StageError(f"{json_path}: unknown Hugging Face stage format {info['hf_format']!r}, expected 1")
    k = info.get("k")
    ar_export = "native_export" in info and type(k) is int and k == 0  # a native AR stage's export
    if not ar_export and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise StageError(f"{json_path}: k: expected the trained window (an int >= 1), got {k!r} (an AR stage?)")
    files = info.get("files")
    if not isinstance(files, dict):
        raise StageError(f"{json_path}: malformed: no 'files' record")
    if ar_export:  # no noise embedding: vLLM would load any *.safetensors of the folder as the model's
        if "noise_embedding" in info or (folder / NOISE_FILE).exists():
            raise StageError(f"{json_path}: an AR stage's export (k = 0) holds no noise embedding ({NOISE_FILE})")
        _check_files(folder, json_path, files)
        return info
    noise = info.get("noise_embedding")
    if not isinstance(noise, dict) or noise.get("format") != NOISE_EMBEDDING_FORMAT:
        got = noise.get("format") if isinstance(noise, dict) else None
        raise StageError(
            f"{json_path}: its noise embedding is format {got!r}, expected {NOISE_EMBEDDING_FORMAT}; it cannot be "
            "loaded rightly: retrain this stage"
        )
    _check_files(folder, json_path, files)
    record = noise.get("tensors")
    if not isinstance(record, dict) or record.get("file") != NOISE_FILE:
        raise StageError(f"{json_path}: malformed noise_embedding.tensors record {record!r}")
    path = folder / NOISE_FILE
    if not path.exists() or path.stat().st_size != record.get("bytes") or _sha256(path) != record.get("sha256"):
        raise StageError(f"{path}: missing, truncated or corrupt (size or SHA-256 differs from {json_path.name})")
    return info


def _check_files(folder: Path, json_path: Path, files: dict) -> None:
    """Every file ``model.json`` lists present with its recorded size and SHA-256."""
    for name, record in files.items():
        path = folder / name
        if not path.exists():
            raise StageError(f"{path}: missing (listed in {json_path.name})")
        if (
            not isinstance(record, dict)
            or path.stat().st_size != record.get("bytes")
            or _sha256(path) != record.get("sha256")
        ):
            raise StageError(f"{path}: truncated or corrupt (size or SHA-256 differs from {json_path.name})")


def is_native_export(info: dict) -> bool:
    """Whether a model.json record is a native stage's vLLM export (its marker; else an HF recipe stage or a model)."""
    return "native_export" in info


def load_noise_embedding(folder, info: dict) -> NoiseEmbedding:
    """The stage's noise embedding (fp32, eval mode), from the file :func:`read_stage` checked."""
    from safetensors.torch import load_file

    settings = info["noise_embedding"].get("settings")
    try:
        embedding = NoiseEmbedding(**settings)
        embedding.load_state_dict(load_file(str(Path(folder) / NOISE_FILE)))
    except (TypeError, RuntimeError, ValueError) as exc:
        path = Path(folder) / NOISE_FILE
        raise StageError(f"{path}: does not match the noise embedding of model.json ({exc})") from None
    return embedding.float().eval().requires_grad_(False)


def noise_tensor_names(folder) -> set[str]:
    """The tensor names in the stage's noise embedding file: vLLM's weight iterator reads every ``*.safetensors``
    of the folder, these are not the backbone's."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / NOISE_FILE), "pt") as f:
        return set(f.keys())

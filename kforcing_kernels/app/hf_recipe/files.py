"""Hugging Face models in a run: where they come from, the stage folder they are saved as, their text. The trainer,
generation and evaluation reach these through the HF kind of the model registry (:mod:`.kind`,
:mod:`kforcing_kernels.app.student`), never directly.

Sources of the model (``kforcing-train --model PATH`` / ``--model-config PATH.json``):

* a plain HF folder (``config.json`` + weights + tokenizer, no ``model.json``): a pretrained AR
  teacher, loaded with ``AutoModelForCausalLM.from_pretrained(PATH, attn_implementation="kforcing",
  dtype=float32)`` and ``AutoTokenizer.from_pretrained(PATH)``; checked first (:func:`check_hf_source`), and known to
  later stages by :func:`hf_source_sha256` (weights, ``config.json`` and tokenizer files) and its resolved path;
* a transformers config file: a random initialisation (seeded by ``--seed``), trained as an AR model
  by Stage 0 on ``--data`` with the package's own BPE tokenizer (its size must be the config's ``vocab_size``).

The stage folder (format :data:`HF_FORMAT`) is what ``from_pretrained`` loads, plus the noise embedding::

    config.json, generation_config.json, model.safetensors (or shards)   save_pretrained of the HF model
    tokenizer.json, tokenizer_config.json, ...                           save_pretrained of the tokenizer
    noise_embedding.safetensors                                          NoiseEmbedding (format 2) tensors
    model.json     k, hf_format, noise_embedding {format, settings, tensors record}, files {name: bytes,
                   sha256}, tensors (the weights' record: the teacher identity), provenance, train config

``AutoModelForCausalLM.from_pretrained(folder)`` gives the backbone; :func:`load_hf_stage` gives the
PFLM (backbone + noise embedding) after checking every file's size and SHA-256. Every file is written
with the package's atomic writer and ``model.json`` last: the folder is a finished stage once it exists.
A stage whose noise embedding is not format 2 is refused with a message (it cannot be loaded rightly).

Text: a run whose teacher is an HF folder encodes ``--data`` with that folder's tokenizer (documents
separated by its ``eos_token``; a marker's characters in the text stay ordinary text), cached like the
native corpus.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ..data import (
    CORPUS_META_FIELDS,
    EOS,
    FORMAT_VERSION,
    Corpus,
    DataError,
    default_cache_dir,
    documents_sha256,
    load_documents,
    split_documents,
    token_streams,
)
from ..files import (
    SHA256,
    CheckpointError,
    Field,
    atomic_write_file,
    hf_literal_specials,
    literal_specials,
    load_tensors,
    read_json,
    save_tensors,
    sha256_file,
    tokenizer_sha256,
    write_json,
)
from ..records import read_model_json

if TYPE_CHECKING:
    from .student import HFStudent

HF_FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin")
NOISE_FILE = "noise_embedding.safetensors"
# Besides the weights, what decides which model a plain HF folder is and which ids its text becomes: a changed
# config.json (rope_theta, ...) or tokenizer file (other merges, same size) is another teacher.
CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)


# ---------------------------------------------------------------------- what a folder holds


def is_hf_stage(folder) -> bool:
    """A stage folder this module wrote (``model.json`` with ``hf_format``)."""
    path = Path(folder) / "model.json"
    if not path.exists():
        return False
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "hf_format" in record


def is_hf_source(folder) -> bool:
    """A plain Hugging Face model folder (``config.json``, no ``model.json``)."""
    return folder is not None and (Path(folder) / "config.json").exists() and not (Path(folder) / "model.json").exists()


def hf_weights_sha256(folder) -> str:
    """The identity of an HF folder's weights: SHA-256 over its weight files' names and SHA-256s."""
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.name != NOISE_FILE)
    if not files:
        raise CheckpointError(f"{folder}: no weight files (*.safetensors, *.bin) in this Hugging Face model folder")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def hf_source_sha256(folder) -> str:
    """The identity of a plain HF folder as a teacher: SHA-256 over its weights' identity (:func:`hf_weights_sha256`)
    and the names and SHA-256s of its ``config.json`` and tokenizer files (:data:`TOKENIZER_FILES` present)."""
    folder = Path(folder)
    h = hashlib.sha256(b"weights\0" + hf_weights_sha256(folder).encode())
    for name in (CONFIG_FILE, *sorted(TOKENIZER_FILES)):
        if (folder / name).is_file():
            h.update(b"\0" + name.encode() + b"\0" + sha256_file(folder / name).encode())
    return h.hexdigest()


def check_hf_source(folder, option: str = "--model") -> None:
    """A plain HF folder given as ``option``: a readable ``config.json`` (a JSON object naming its ``model_type``) and
    tokenizer files; a ``CheckpointError`` naming the option otherwise (before any stage starts)."""
    name = option.lstrip("-").replace("-", "_")
    folder = Path(folder)
    config = folder / CONFIG_FILE
    try:
        values = json.loads(config.read_text())
    except OSError as exc:
        raise CheckpointError(
            f"{name}: cannot read {config} ({exc.strerror or exc}); {option} expects a Hugging Face "
            "model "
            "folder (config.json, weights, tokenizer)"
        ) from None
    except ValueError as exc:
        raise CheckpointError(
            f"{name}: {config} is not valid JSON ({exc}); restore the folder's config.json ({option})"
        ) from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise CheckpointError(
            f'{name}: {config} is not a transformers config (a JSON object with a "model_type"); '
            f"restore the folder's config.json ({option})"
        )
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{name}: {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save "
            "the "
            f"model's tokenizer into it (tokenizer.save_pretrained) ({option})"
        )


def read_model_config(path):
    """A ``--model-config`` file as a transformers config: a JSON object with a known ``model_type``, else a
    ``CheckpointError`` naming the option."""
    tf = import_transformers()
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"model_config: cannot read a transformers config from {str(path)!r} ({exc}) (--model-config)"
        ) from None
    if not isinstance(values, dict):
        raise CheckpointError(
            f"model_config: {str(path)!r} holds a JSON {type(values).__name__}, expected an object "
            "(a "
            "transformers config, e.g. config.to_json_string()) (--model-config)"
        )
    if not isinstance(values.get("model_type"), str):
        raise CheckpointError(
            f'model_config: {str(path)!r} has no "model_type" (e.g. "llama"), so transformers '
            "cannot "
            "tell which model it configures (--model-config)"
        )
    bad = _bad_real(values)
    if bad:
        raise CheckpointError(f"model_config: {str(path)!r}: {bad} (--model-config)")
    # transformers checks a config in several places (its own validators, the model's constructor, the first forward,
    # where a head dim RoPE cannot rotate or a head count GQA cannot group fails), and raises whatever type each uses:
    # every failure to configure, build or run the model is the file's fault here, so each is one usage error.
    try:
        config = tf.AutoConfig.for_model(**values)
        with torch.device("meta"):  # built and run on meta tensors: no memory, whatever the sizes
            model = tf.AutoModelForCausalLM.from_config(config)
            model(torch.zeros(1, 2, dtype=torch.long))
    except Exception as exc:  # noqa: BLE001 (see above)
        raise CheckpointError(
            f"model_config: transformers rejects {str(path)!r} ({type(exc).__name__}: {exc}) (--model-config)"
        ) from None
    return config


def _bad_real(values: dict, prefix: str = "") -> Optional[str]:
    """What is wrong with a real-valued entry of a transformers config (nested ones too), or None: every float must be
    finite (kforcing_kernels/settings.py's rule), and a RoPE base or a normalisation epsilon positive, as a NaN or
    non-positive one makes every logit NaN, which training would only report as a non-finite loss."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found = _bad_real(value, f"{name}.")
            if found:
                return found
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{name}: expected a finite number, got {value!r}"
        elif (
            _must_be_positive(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and not value > 0
        ):
            return f"{name}: expected a positive number, got {value!r}"
    return None


def _must_be_positive(key: str) -> bool:
    # rms_norm_eps, layer_norm_eps, layer_norm_epsilon, ... (not e.g. a step count: "warmup_steps" ends in "eps")
    return key in ("rope_theta", "rope_base", "eps", "epsilon") or key.endswith(("_eps", "_epsilon"))


# ---------------------------------------------------------------------- building and loading


def import_transformers():
    """transformers, imported only when an HF model is used (it is an optional dependency), with "kforcing"
    registered."""
    import transformers

    from ...integrations import hf as _registers_kforcing  # noqa: F401

    return transformers


@contextlib.contextmanager
def quiet_loading():
    """transformers' own loading bars ("Loading checkpoint shards", ...) off while the package loads a model or
    tokenizer (about ten per pipeline log otherwise), back as they were after: a user's own loads keep theirs."""
    logging = import_transformers().utils.logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def build_from_config(path, seed: int) -> "HFStudent":
    """A randomly initialised HF causal LM (``attn_implementation="kforcing"``, fp32) from a config file, seeded by
    ``seed``."""
    tf = import_transformers()
    config = read_model_config(path)
    from .student import HFStudent

    with torch.random.fork_rng(devices=[]):  # the noise embedding too: a stage's files are a function of its seed
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing", dtype=torch.float32)
        return HFStudent(model.float())


def build_like(student: "HFStudent") -> "HFStudent":
    """A fresh (randomly initialised, fp32, CPU) HFStudent of ``student``'s HF config and noise embedding settings:
    the frame a full state dict (an FSDP2 run's final weights) is loaded into."""
    from ...integrations.hf_noise import NoiseEmbedding
    from .student import HFStudent

    model = import_transformers().AutoModelForCausalLM.from_config(
        student.config, attn_implementation="kforcing", dtype=torch.float32
    )
    return HFStudent(model.float(), NoiseEmbedding(**student.noise_encoder.settings()), k_train=student.k_train)


def _from_pretrained(folder, device):
    tf = import_transformers()
    try:
        with quiet_loading():
            model = tf.AutoModelForCausalLM.from_pretrained(
                str(folder), attn_implementation="kforcing", dtype=torch.float32
            )
            tokenizer = tf.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot load the Hugging Face model or tokenizer ({exc})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise CheckpointError(
            f"{folder}: the tokenizer is not a fast (tokenizers-backed) one; save it with tokenizer.json"
        )
    return model, tokenizer


def load_hf_source(folder, device="cpu"):
    """A plain HF folder as an AR teacher: ``(HFStudent in eval mode, info, tokenizer)`` (info: ``k=0`` and the weights'
    identity)."""
    from .student import HFStudent

    check_hf_source(folder)
    model, tokenizer = _from_pretrained(folder, device)
    student = HFStudent(model, k_train=0)
    student.hf_tokenizer = tokenizer
    # "tensors" is the teacher identity every stage compares (teacher_sha256): the weights, config and tokenizer files.
    info = {"k": 0, "tensors": {"sha256": hf_source_sha256(folder)}, "source": str(Path(folder).resolve())}
    return student.to(device).eval(), info, literal_specials(tokenizer.backend_tokenizer)


# A stage folder's own entries of model.json, beside every kind's (app/records.py): what load_hf_stage reads.
_FILE_RECORD = Field(
    dict, fields={"bytes": Field(int, required=True, rule=lambda v: v >= 0, expected="an int >= 0"), "sha256": SHA256}
)
HF_STAGE_FIELDS = {
    "hf_format": Field(int, required=True),
    "noise_embedding": Field(
        dict, required=True, fields={"format": Field(int), "settings": Field(dict), "tensors": Field(dict)}
    ),
    "files": Field(dict, required=True, each=_FILE_RECORD),
}


def read_hf_stage_info(folder) -> dict:
    """``model.json`` of a stage folder of :func:`save_hf_stage`, checked entry by entry (every kind's entries and
    :data:`HF_STAGE_FIELDS`); a ``CheckpointError`` naming the file and the entry otherwise."""
    return read_model_json(folder, HF_STAGE_FIELDS)


def load_hf_stage(folder, device="cpu"):
    """A stage folder of :func:`save_hf_stage`: ``(HFStudent in eval mode, info, tokenizer)``, every file checked
    first."""
    from ...integrations.hf_noise import NOISE_EMBEDDING_FORMAT, NoiseEmbedding
    from .student import HFStudent

    folder = Path(folder)
    json_path = folder / "model.json"
    info = read_hf_stage_info(folder)
    if info["hf_format"] != HF_FORMAT:
        raise CheckpointError(
            f"{json_path}: unknown Hugging Face stage format {info['hf_format']!r}, expected {HF_FORMAT}"
        )
    noise = info["noise_embedding"]
    if noise.get("format") != NOISE_EMBEDDING_FORMAT:
        raise CheckpointError(
            f"{json_path}: its noise embedding is format {noise.get('format')!r}, saved before the "
            "noise features "
            f"became the native encoder's (format {NOISE_EMBEDDING_FORMAT}); it cannot be loaded "
            "rightly: retrain this stage"
        )
    for name, record in info["files"].items():
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{path}: missing (listed in {json_path.name})")
        if path.stat().st_size != record.get("bytes") or sha256_file(path) != record.get("sha256"):
            raise CheckpointError(f"{path}: truncated or corrupt (size or SHA-256 differs from {json_path.name})")
    model, tokenizer = _from_pretrained(folder, device)
    try:
        embedding = NoiseEmbedding(**noise["settings"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{json_path}: malformed: 'noise_embedding.settings' ({exc})") from None
    try:
        embedding.load_state_dict(load_tensors(json_path, noise["tensors"]))
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"{folder / NOISE_FILE}: does not match the noise embedding of {json_path.name} ({exc})"
        ) from None
    student = HFStudent(model, embedding, k_train=info["k"])
    student.hf_tokenizer = tokenizer
    return student.to(device).eval(), info, literal_specials(tokenizer.backend_tokenizer)


def hf_tokenizer_of(corpus: Corpus):
    """The HF tokenizer a stage folder saves: the one the corpus came from, or the native BPE wrapped as one."""
    if corpus.hf_tokenizer is not None:
        return corpus.hf_tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=corpus.tokenizer, eos_token=EOS)


def save_hf_stage(folder, student: "HFStudent", info: dict, tokenizer) -> None:
    """Write a stage folder (see the module docstring); ``model.json`` last."""
    folder = Path(folder)
    staging = folder / f".hf-save.{secrets.token_hex(8)}.tmp"
    try:
        student.hf.save_pretrained(staging)
        # Saved with the package's rule for special-token text (<|eos|> in a prompt is ordinary tokens, as every
        # loader here encodes it: literal_specials), so AutoTokenizer and vLLM read the folder's text as the
        # package does; on a copy: the caller's tokenizer is left as it was.
        hf_literal_specials(copy.deepcopy(tokenizer)).save_pretrained(staging)
        files = {}
        for path in sorted(p for p in staging.iterdir() if p.is_file()):
            with open(path, "rb") as src:
                atomic_write_file(folder / path.name, lambda f: shutil.copyfileobj(src, f, 1 << 22))
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(folder / path.name)}
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot write the Hugging Face model ({exc.strerror or exc})") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    from ...integrations.hf_noise import NOISE_EMBEDDING_FORMAT

    noise = {
        "format": NOISE_EMBEDDING_FORMAT,
        "settings": student.noise_encoder.settings(),
        "tensors": save_tensors(folder / NOISE_FILE, student.noise_encoder.state_dict()),
    }
    weights = {
        "file": "model.safetensors" if "model.safetensors" in files else "*",
        "bytes": 0,
        "sha256": hf_weights_sha256(folder),
    }
    write_json(
        folder / "model.json",
        {
            **info,
            "hf_format": HF_FORMAT,
            "model_config": json.loads(student.config.to_json_string()),
            "noise_embedding": noise,
            "files": files,
            "tensors": weights,
        },
    )


# ---------------------------------------------------------------------- text


def load_hf_corpus(source: Optional[str], tokenizer, *, val_fraction: float = 0.02, verbose: bool = False) -> Corpus:
    """``--data`` encoded with an HF (fast) tokenizer: the split and stream layout of ``load_corpus``, cached."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            "source (--data): the model's tokenizer has no eos_token, so documents cannot be separated; "
            "set one (tokenizer.eos_token) in the model folder"
        )
    backend = literal_specials(tokenizer.backend_tokenizer)
    docs = load_documents(source)
    content = documents_sha256(docs)
    key = hashlib.sha256(
        json.dumps([FORMAT_VERSION, "hf", tokenizer_sha256(backend), eos, val_fraction]).encode() + content.encode()
    ).hexdigest()[:16]
    cache = default_cache_dir() / f"hf-corpus-{key}"
    meta_path = cache / "meta.json"
    if not meta_path.exists():
        train_texts, val_texts = split_documents(docs, val_fraction)
        train, val = token_streams(backend, eos, train_texts, val_texts, val_fraction, progress=verbose)
        atomic_write_file(cache / "train.npy", lambda f: np.save(f, train))
        atomic_write_file(cache / "val.npy", lambda f: np.save(f, val))
        write_json(meta_path, {"source": source or "stdlib", "documents": [len(train_texts), len(val_texts)]})
    meta = read_json(meta_path, fields=CORPUS_META_FIELDS)
    train_ids = torch.from_numpy(np.load(cache / "train.npy").astype(np.int64))
    val_ids = torch.from_numpy(np.load(cache / "val.npy").astype(np.int64))
    if verbose:
        print(
            f"[data] {meta['source']}: {len(train_ids):,} train / {len(val_ids):,} val tokens, the model's "
            f"tokenizer, cache {cache}",
            flush=True,
        )
    corpus = Corpus(
        train_ids, val_ids, backend, eos, meta["source"], tuple(meta["documents"]), content, hf_tokenizer=tokenizer
    )
    return corpus


def hf_corpus(teacher, data: Optional[str], verbose: bool = False) -> Corpus:
    """``data`` encoded with the tokenizer of the HF folder ``teacher`` (a plain source, checked first, or a stage)."""
    if is_hf_source(teacher):
        check_hf_source(teacher)
    tf = import_transformers()
    try:
        with quiet_loading():
            tokenizer = tf.AutoTokenizer.from_pretrained(str(teacher))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{teacher}: cannot load the Hugging Face tokenizer ({exc})") from None
    return load_hf_corpus(data, tokenizer, verbose=verbose)

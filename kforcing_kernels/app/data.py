"""Training data: a corpus that needs no download, a locally trained tokenizer, a fixed split.

The default corpus is the Python standard-library source of the running
interpreter (real code and prose in docstrings, ~10 MB, always present where
Python is). Users point ``source`` at their own text file or directory instead.

A byte-level BPE tokenizer is trained on the corpus with the ``tokenizers``
library; tokenizer and token arrays are cached under ``$KFORCING_CACHE``
(default ``~/.cache/kforcing_kernels``), keyed by the corpus content and the
settings, so the second run starts at once. The train/validation split is by
document (a hash of its name), so it never changes when documents are added.

Identity (what a model records to say which text it met, checked wherever a model meets
text again): :func:`data_sha256` of the corpus source (names and contents of its documents,
the hash the cache key is built from) and :func:`tokenizer_sha256` of the tokenizer (its
serialized JSON, canonicalised).
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from .. import env

if TYPE_CHECKING:
    from tokenizers import Tokenizer

from .files import (
    NON_NEGATIVE_INT,
    Field,
    atomic_write_file,
    literal_specials,
    load_tokenizer,
    read_json,
    tokenizer_sha256,
    write_json,
    write_text,
)

DEFAULT_SOURCE = "stdlib"
EOS = "<|eos|>"
# Part of the cache key: bump it when the tokenizer or the token streams change meaning, so that an
# entry built by older code is never read as if it were current. 2: the EOS marker's characters in
# text encode as ordinary tokens (1 encoded them as the separator).
FORMAT_VERSION = 2
# Directories of the standard library that are not representative source.
_STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "pydoc_data",
}
_TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".c",
    ".h",
    ".cpp",
    ".js",
    ".ts",
    ".rs",
    ".go",
    ".java",
    ".json",
    ".html",
    ".tex",
    ".csv",
}
# Files larger than this are mostly data tables, not text.
_MAX_FILE_BYTES = 512 * 1024


# ---------------------------------------------------------------------- documents


class DataError(ValueError):
    """The training text cannot be used (missing, empty, unreadable, too small); names ``source`` (CLI ``--data``)."""


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"source (--data): cannot read {str(path)!r} ({exc.strerror or exc})") from None


def stdlib_documents() -> list[tuple[str, str]]:
    """``[(relative path, text)]`` of the interpreter's standard-library ``.py`` files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_SKIP.intersection(rel.parts[:-1]) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        docs.append((str(rel), path.read_text(encoding="utf-8", errors="replace")))
    if not docs:
        raise RuntimeError(
            f"source: the standard library at {root} has no .py sources; pass your own text with --data PATH"
        )
    return docs


def file_documents(source: str) -> list[tuple[str, str]]:
    """``[(name, text)]`` from a text file, or from every text file under a directory (sorted).

    Files with nothing but white space are left out; no text at all is an error.
    """
    path = Path(source)
    if path.is_file():
        docs = [(path.name, _read_text(path))]
    elif path.is_dir():
        files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES]
        if not files:
            raise DataError(f"source (--data): no text files ({', '.join(sorted(_TEXT_SUFFIXES))}) under {source!r}")
        docs = [(str(p.relative_to(path)), _read_text(p)) for p in files]
    elif not path.exists():
        raise DataError(
            f"source (--data): expected {DEFAULT_SOURCE!r}, a text file or a directory, got {source!r} (no "
            "such file or directory)"
        )
    else:
        raise DataError(
            f"source (--data): expected {DEFAULT_SOURCE!r}, a text file or a directory, got {source!r} "
            "(not a regular file)"
        )
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        what = "the file" if path.is_file() else "every text file under it"
        raise DataError(f"source (--data): {source!r} holds no text ({what} is empty or white space)")
    return docs


def load_documents(source: Optional[str] = None) -> list[tuple[str, str]]:
    return stdlib_documents() if source in (None, DEFAULT_SOURCE) else file_documents(source)


def documents_sha256(docs: Sequence[tuple[str, str]]) -> str:
    """SHA-256 over the documents' names and contents, in order: the identity of a corpus source."""
    digest = hashlib.sha256()
    for name, text in docs:
        digest.update(name.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()


def data_sha256(source: Optional[str] = None) -> str:
    """:func:`documents_sha256` of ``source`` (``--data``): changes when any document is added, removed or edited."""
    return documents_sha256(load_documents(source))


def is_validation(name: str, val_fraction: float) -> bool:
    """Deterministic document-level split: a stable hash of the name, not Python's salted hash()."""
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big")
    return h < val_fraction * 2**32


def split_documents(docs: Sequence[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str]]:
    """(training texts, validation texts): by a hash of each name (:func:`is_validation`), by position when that
    leaves a side empty (too few documents)."""
    is_val = [is_validation(name, val_fraction) for name, _ in docs]
    if all(is_val) or not any(is_val):  # too few documents to split by name: split by position
        cut = max(1, int(len(docs) * (1 - val_fraction)))
        is_val = [i >= cut for i in range(len(docs))]
    return [t for (_, t), v in zip(docs, is_val) if not v], [t for (_, t), v in zip(docs, is_val) if v]


ENCODE_CHUNK = 64  # documents per encode_batch call: the unit of the encoding's progress bar


def token_streams(
    tok, eos: int, train_texts: list[str], val_texts: list[str], val_fraction: float, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Each split's documents encoded by ``tok`` (a ``tokenizers.Tokenizer``, no special tokens added), each
    followed by the separator ``eos``; a single document holds out its tail. ``progress``: a tqdm bar on stderr
    (documents encoded; minutes for a large corpus on a busy machine)."""
    dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.int32
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(train_texts) + len(val_texts), desc="[data] encoding", unit="doc", file=sys.stderr)

    def stream(texts: list[str]) -> np.ndarray:
        out = []
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                out.append(np.asarray(enc.ids, dtype=dtype))
                out.append(np.asarray([eos], dtype=dtype))
            if bar is not None:
                bar.update(len(chunk))
        return np.concatenate(out) if out else np.zeros(0, dtype=dtype)

    train, val = stream(train_texts), stream(val_texts)
    if bar is not None:
        bar.close()
    if not val_texts:  # one document: hold out its tail
        cut = int(len(train) * (1 - val_fraction))
        train, val = train[:cut], train[cut:]
    return train, val


# ---------------------------------------------------------------------- tokenizer + token arrays


@dataclass
class Corpus:
    """Token streams (documents joined by EOS) and the tokenizer that made them."""

    train: torch.Tensor  # int64 [T_train]
    val: torch.Tensor  # int64 [T_val]
    tokenizer: "Tokenizer"
    eos_id: int
    source: str
    n_documents: tuple[int, int]  # (train, val)
    data_sha256: str = ""  # :func:`data_sha256` of the source
    # The transformers tokenizer an HF teacher's text was encoded with (hf_recipe/files.hf_corpus), else None.
    hf_tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def tokenizer_sha256(self) -> str:
        return tokenizer_sha256(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def __post_init__(self) -> None:
        literal_specials(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the EOS marker's characters in it are ordinary text, never the separator."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def default_cache_dir() -> Path:
    return env.cache_dir()


def _train_tokenizer(texts: list[str], vocab_size: int, progress: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,  # tokenizers' own bars (its merges), minutes on a busy machine
    )
    tok.train_from_iterator(texts, trainer)
    return literal_specials(tok)


def _remove_stale_temporaries(folder: Path, age_s: float = 3600.0) -> None:
    """Temporaries of a build that was killed. Another process may be building the same entry right now,
    so only those untouched for ``age_s`` go (a build writes its files within seconds of each other)."""
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > age_s:
                tmp.unlink()
        except FileNotFoundError:
            pass


def load_corpus(
    source: Optional[str] = None,
    *,
    vocab_size: int = 2048,
    val_fraction: float = 0.02,
    tokenizer_train_bytes: int = 4_000_000,
    cache_dir: Optional[str] = None,
    verbose: bool = False,
    _rebuilt: bool = False,
) -> Corpus:
    """Documents -> tokenizer -> token streams, cached.

    Args:
        source: ``"stdlib"``/None (default corpus), a text file, or a directory of text files.
        vocab_size: BPE vocabulary size including the EOS token (>= 257: the 256 bytes + EOS).
        val_fraction: fraction of documents held out (by a hash of their name).
        tokenizer_train_bytes: the tokenizer learns its merges on the first this-many bytes of
            training documents (all of them are tokenized).
        cache_dir: where tokenizer and tokens are cached (default :func:`default_cache_dir`).
    """
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size: expected an int >= 257 (256 byte tokens + EOS), got {vocab_size!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    from tokenizers import __version__ as tokenizers_version

    docs = load_documents(source)
    content = documents_sha256(docs)
    settings = json.dumps([FORMAT_VERSION, vocab_size, val_fraction, tokenizer_train_bytes, tokenizers_version])
    key = hashlib.sha256(settings.encode() + content.encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    folder = folder / f"corpus-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / f"{name}" for name in ("tokenizer.json", "train.npy", "val.npy", "meta.json")}

    if not paths["meta.json"].exists():
        _remove_stale_temporaries(folder)
        train_texts, val_texts = split_documents(docs, val_fraction)
        sample, size = [], 0
        for text in train_texts:
            if size >= tokenizer_train_bytes:
                break
            sample.append(text)
            size += len(text)
        if verbose:
            print(
                f"[data] training a {vocab_size}-token BPE tokenizer on {size / 1e6:.1f} MB of {len(docs)} documents",
                flush=True,
            )
        tok = _train_tokenizer(sample, vocab_size, progress=verbose)
        eos = tok.token_to_id(EOS)

        train, val = token_streams(tok, eos, train_texts, val_texts, val_fraction, progress=verbose)
        if tok.get_vocab_size() < vocab_size:
            raise DataError(
                f"source (--data): {source or DEFAULT_SOURCE!r} is too small to learn a {vocab_size}-token "
                "vocabulary "
                f"(the tokenizer stopped at {tok.get_vocab_size()}); give more text or a --vocab-size <= "
                f"{tok.get_vocab_size()}"
            )
        write_text(paths["tokenizer.json"], tok.to_str(pretty=True))
        atomic_write_file(paths["train.npy"], lambda f: np.save(f, train))
        atomic_write_file(paths["val.npy"], lambda f: np.save(f, val))
        meta = {
            "source": source or DEFAULT_SOURCE,
            "documents": [len(train_texts), len(val_texts)],
            "vocab_size": tok.get_vocab_size(),
        }
        write_json(paths["meta.json"], meta)  # written last: marks the entry complete

    try:
        meta, tok, train, val = _read_cache(paths)
    except Exception as exc:  # OSError, ValueError, KeyError, and tokenizers' bare Exception
        # A damaged cache entry (disk trouble, a hand edit): rebuild it from the documents, once.
        if _rebuilt:
            raise DataError(
                f"cache: {folder} is unreadable even after rebuilding it ({exc}); set $KFORCING_CACHE elsewhere"
            ) from exc
        if verbose:
            print(f"[data] cache entry {folder} is unreadable ({exc}); rebuilding it", flush=True)
        paths["meta.json"].unlink(missing_ok=True)
        return load_corpus(
            source,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            tokenizer_train_bytes=tokenizer_train_bytes,
            cache_dir=cache_dir,
            verbose=verbose,
            _rebuilt=True,
        )
    if verbose:
        print(
            f"[data] {meta['source']}: {len(train):,} train / {len(val):,} val tokens, vocab {tok.get_vocab_size()}, "
            f"cache {folder}",
            flush=True,
        )
    return Corpus(train, val, tok, tok.token_to_id(EOS), meta["source"], tuple(meta["documents"]), content)


# meta.json of a corpus cache entry (this module's and hf_recipe/files.py's): the source's name and the documents on
# each side of the split.
CORPUS_META_FIELDS = {
    "source": Field(str, required=True),
    "documents": Field(
        list, required=True, rule=lambda v: len(v) == 2, expected="[training, validation] counts", each=NON_NEGATIVE_INT
    ),
}


def _read_cache(paths: dict[str, Path]):
    meta = read_json(paths["meta.json"], fields=CORPUS_META_FIELDS)  # a CheckpointError (a ValueError): rebuilt
    tok = load_tokenizer(paths["tokenizer.json"])
    train = torch.from_numpy(np.load(paths["train.npy"]).astype(np.int64))
    val = torch.from_numpy(np.load(paths["val.npy"]).astype(np.int64))
    return meta, tok, train, val


# ---------------------------------------------------------------------- batches


def sample_crops(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` int64 crops (contiguous runs) at uniformly random offsets of a token stream ``[T]``.

    A crop, not a window: "window" means the k noise slots of a layout everywhere in the package.
    """
    if tokens.numel() < length + 1:
        raise ValueError(f"tokens: the stream has {tokens.numel()} tokens, fewer than one crop of {length} + 1")
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=generator)
    return tokens[starts[:, None] + torch.arange(length)]

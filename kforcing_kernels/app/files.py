"""The files of a run: one atomic writer for every file the package writes, the checked readers (JSON, safetensors
files against their recorded size and SHA-256), the one file hash (:func:`sha256_file`), tokenizer I/O and its
identity (:func:`tokenizer_sha256`), and the lock that keeps one run per output folder. Every model kind
(``app/student.py``) reads and writes its files through here.

Every write goes to a randomly named temporary created with ``O_EXCL | O_NOFOLLOW`` in the target's
folder, written through its descriptor, fsynced and renamed into place, so a torn write is never
mistaken for the file and no symlink planted in the folder can redirect it; the umask applies.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Collection, Mapping, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

TMP_SUFFIX = ".tmp"  # an unfinished write ends in it (what a resume sweeps up after a crash)


class CheckpointError(ValueError):
    """A checkpoint, model or metrics file is missing, truncated, corrupt, malformed or cannot be written."""


# ---------------------------------------------------------------------- the atomic writer


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk; a platform that cannot open folders skips it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A fresh temporary next to ``path``: a random name, ``O_EXCL | O_NOFOLLOW`` (a file or a symlink planted at
    that name is never opened; another name is drawn), mode ``0o666`` less the umask. Returns (name, open fd)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        try:
            # os.open with 0o666 lets the umask decide the mode (tempfile.mkstemp would force 0o600).
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue


def _require_same_file(tmp: Path, created: os.stat_result) -> None:
    """The temporary's name must still be the file created for it: one swapped for a symlink (or anything else)
    by someone who can write the folder is not renamed into place."""
    now = os.lstat(tmp)
    if (now.st_dev, now.st_ino) != (created.st_dev, created.st_ino) or not stat.S_ISREG(now.st_mode):
        raise OSError(
            errno.EEXIST, f"the temporary {tmp.name} was replaced while it was written; not renaming it into place"
        )


def check_writable(path: str | Path, option: str) -> None:
    """Fail early, naming ``option``, when ``path`` cannot be written by :func:`atomic_write_file`: it is a
    folder, its folder is missing or not a folder, or refuses a new file (probed with a temporary, removed)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{option}: {str(path)!r} is a directory; expected a file path")
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(f"{option}: cannot write {str(path)!r}: {str(path.parent)!r} is not a directory")
    try:
        tmp, fd = _create_temporary(path)
    except OSError as exc:
        raise CheckpointError(f"{option}: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp.unlink(missing_ok=True)


def atomic_write_file(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a binary file object on a fresh temporary next to ``path``, fsync, rename over ``path``.

    The writer gets the open file, never the temporary's name, so nothing can redirect the write between
    the temporary's creation (``O_EXCL | O_NOFOLLOW``, random name) and the rename. On any error the
    temporary is removed and ``path`` is untouched; an ``OSError`` (disk full, read-only folder) becomes a
    :class:`CheckpointError` naming ``path``. Every file the package writes goes through here.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, fd = _create_temporary(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            _require_same_file(tmp, os.fstat(f.fileno()))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, SafetensorError) as exc:  # safetensors reports its own errors
        hint = "; free some space, then --resume" if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(f"{path}: cannot write ({getattr(exc, 'strerror', None) or exc}){hint}") from exc
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def atomic_write(path: str | Path, write: Callable[[str], object]) -> None:
    """``write(tmp_path)`` into a fresh temporary next to ``path``, fsync, rename over ``path``.

    For writers that only take a file name (the package's own writers use :func:`atomic_write_file`, which
    never hands out the name). The temporary is created as in :func:`atomic_write_file`; ``write`` reopens
    it by name, and the rename happens only if the name still is the regular file created for it (a
    temporary swapped for a symlink is refused, not renamed into place). Errors as in :func:`atomic_write_file`.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, fd = _create_temporary(path)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # what the umask made of 0o666
        os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from exc
    try:
        write(str(tmp))
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a symlink put in its place is refused
        try:
            _require_same_file(tmp, os.fstat(fd))
            os.fchmod(fd, mode)  # writers that recreate the file (safetensors does, with 0o600) must not change it
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, SafetensorError) as exc:  # safetensors reports its own write errors
        hint = "; free some space, then --resume" if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(f"{path}: cannot write ({getattr(exc, 'strerror', None) or exc}){hint}") from exc
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_file(path, lambda f: f.write(data))


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def append_jsonl(path: str | Path, record: dict) -> None:
    """One JSON line appended. Not atomic (appends cannot be): :func:`recover_metrics` drops a torn last line."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(path, flags, 0o666), "a") as f:  # O_NOFOLLOW: a symlink planted there is refused
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot append ({exc.strerror or exc})") from exc


# ---------------------------------------------------------------------- reading back, checked: JSON, hashes, tensors


@dataclass(frozen=True)
class Field:
    """What one entry of a JSON object the package saved must hold, for :func:`check_fields`.

    ``types``: the type(s) its value may have (``float`` takes an int too; ``int`` and ``float`` never take a bool;
    ``type(None)`` lets it be null). ``required``: it must be present. ``choices``: its allowed values.
    ``rule``/``expected``: a test the value must pass and what it expects, in words (``"an int >= 0"``).
    ``fields``: the entries of an object value, checked the same way; ``each``: what every value of an object (or
    item of a list) must hold.
    """

    types: Union[type, tuple[type, ...]]
    required: bool = False
    choices: Optional[Collection] = None
    rule: Optional[Callable[[Any], bool]] = None
    expected: str = ""
    fields: Optional[Mapping[str, "Field"]] = None
    each: Optional["Field"] = None


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _has_type(value, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types  # a flag where a count or a number belongs is malformed (bool is an int in Python)
    if isinstance(value, int) and float in types:
        return True  # JSON writes 2.0 as 2.0, but a hand-written 2 is the same number
    return isinstance(value, types)


def _check_value(path: Path, name: str, value, spec: Field) -> None:
    types = spec.types if isinstance(spec.types, tuple) else (spec.types,)
    if not _has_type(value, types):
        raise CheckpointError(
            f"{path}: malformed: {name!r} has type {type(value).__name__}, expected {_type_names(types)}"
        )
    if value is None:
        return
    if spec.choices is not None and value not in tuple(spec.choices):
        raise CheckpointError(f"{path}: malformed: {name!r} is {value!r}, expected one of {tuple(spec.choices)}")
    if spec.rule is not None and not spec.rule(value):
        raise CheckpointError(f"{path}: malformed: {name!r} is {value!r}, expected {spec.expected or 'another value'}")
    if spec.fields is not None:
        check_fields(path, value, spec.fields, f"{name}.")
    if spec.each is not None:
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            _check_value(path, f"{name}.{key}" if isinstance(value, dict) else f"{name}[{key}]", item, spec.each)


def check_fields(path: str | Path, obj: dict, fields: Mapping[str, Field], prefix: str = "") -> dict:
    """``obj`` (a JSON object read from ``path``) after checking each of ``fields`` it holds (or must hold): its type
    and allowed values (:class:`Field`). Entries not in ``fields`` are not looked at. A wrong or missing entry raises
    :class:`CheckpointError` naming ``path`` and the entry (dotted below the top: ``'train_config.seq_len'``), so no
    reader of saved metadata meets a value of a type it does not expect."""
    path = Path(path)
    for key, spec in fields.items():
        if key not in obj:
            if spec.required:
                raise CheckpointError(f"{path}: malformed: no {prefix + key!r} entry")
            continue
        _check_value(path, prefix + key, obj[key], spec)
    return obj


def is_sha256(value) -> bool:
    """A SHA-256 as the package records it: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


SHA256 = Field(str, rule=is_sha256, expected="a SHA-256 (64 hex digits)")
NON_NEGATIVE_INT = Field(int, rule=lambda v: v >= 0, expected="an int >= 0")
POSITIVE_INT = Field(int, rule=lambda v: v >= 1, expected="a positive int")


def read_json(path: str | Path, required: Optional[dict] = None, fields: Optional[Mapping[str, Field]] = None) -> dict:
    """A JSON object from ``path``; ``required`` maps keys to the type(s) their values must have; ``fields`` maps keys
    to a :class:`Field` each (type, allowed values; see :func:`check_fields`).

    Missing file, bad JSON, a non-object or a wrong key all raise :class:`CheckpointError` naming ``path``.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path}: corrupt JSON ({exc}); delete it to fall back to an earlier checkpoint"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: malformed: expected a JSON object, got {type(obj).__name__}")
    check_fields(path, obj, {key: Field(kind, required=True) for key, kind in (required or {}).items()})
    return check_fields(path, obj, fields or {})


_RECORD = {"file": str, "bytes": int, "sha256": str}


def sha256_file(path: str | Path) -> str:
    """The SHA-256 (hex) of a file's bytes, read in 4 MiB chunks: the checksum every record of the package keeps."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write ``tensors`` as safetensors; returns the record (file name, size, SHA-256) a JSON keeps."""
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_bytes(path, safetensors_bytes(tensors))
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def load_tensors(json_path: Path, record) -> dict[str, torch.Tensor]:
    """Load the tensors a JSON record points at, after checking size and SHA-256."""
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in _RECORD.items()):
        raise CheckpointError(f"{json_path}: malformed: 'tensors' must hold file, bytes and sha256, got {record!r}")
    path = json_path.parent / record["file"]
    if path.parent != json_path.parent:
        raise CheckpointError(f"{json_path}: malformed: tensor file {record['file']!r} is not in the same folder")
    if not path.exists():
        raise CheckpointError(f"{path}: missing (referenced by {json_path.name})")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise CheckpointError(
            f"{path}: truncated or corrupt: {size} bytes, expected {record['bytes']} (from {json_path.name})"
        )
    if sha256_file(path) != record["sha256"]:
        raise CheckpointError(f"{path}: corrupt: SHA-256 does not match {json_path.name}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


# ---------------------------------------------------------------------- tokenizers


def literal_specials(tok):
    """``tok`` set to encode text containing a special token's characters (``<|eos|>``) as ordinary tokens.

    The separator between documents is inserted by id (``load_corpus``), never parsed from text: a
    document (or prompt) that mentions the marker must not gain a false document boundary. The setting
    is not saved in ``tokenizer.json``, so every load goes through :func:`load_tokenizer`.
    """
    tok.encode_special_tokens = True
    return tok


def hf_literal_specials(tokenizer):
    """An HF (fast) tokenizer set to the rule of :func:`literal_specials`, in memory and in what its
    ``save_pretrained`` writes (``tokenizer_config.json``'s ``split_special_tokens``), so a stage folder's tokenizer,
    read back by ``AutoTokenizer`` or by vLLM, encodes ``<|eos|>`` in text as ordinary tokens, as the package does.
    Set in place; returns ``tokenizer``."""
    tokenizer.split_special_tokens = True
    tokenizer.init_kwargs["split_special_tokens"] = True  # what save_pretrained writes (the attribute alone is not)
    return tokenizer


def load_tokenizer(path):
    """A tokenizer saved by this package (``tokenizer.json``), with :func:`literal_specials` applied."""
    from tokenizers import Tokenizer

    return literal_specials(Tokenizer.from_file(str(path)))


def tokenizer_sha256(tokenizer) -> str:
    """The identity of a tokenizer, recorded beside every model: SHA-256 of a ``tokenizers.Tokenizer``'s serialized
    JSON (keys sorted, no white space): equal ids for equal text."""
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ---------------------------------------------------------------------- one run per folder at a time

LOCK_NAME = ".kforcing.lock"


class RunLock:
    """An exclusive, non-blocking ``fcntl.flock`` on ``FOLDER/.kforcing.lock`` for a run's lifetime.

    The lock file is created (``O_NOFOLLOW``, mode from the umask) and kept: it is empty, and removed only by a
    start that failed before training (``train_config.discard_failed_start``), while it holds the lock; a run that
    opened the file before it was removed sees, once locked, that the path no longer names it and locks the new
    one, so two processes never hold locks on two different files of the same name. The
    kernel drops the lock when the process ends, however it ends. A second run into the folder fails at
    once with a :class:`CheckpointError` naming ``option``. Without ``fcntl`` (Windows) nothing is locked.
    """

    def __init__(self, folder: str | Path, option: str = "--out"):
        self.folder, self.option = Path(folder), option
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        path = self.folder / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags, 0o666)
            except OSError as exc:
                raise CheckpointError(
                    f"out: cannot lock {self.folder} ({path}: {exc.strerror or exc}); check {self.option}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(
                        f"out: {self.folder} is in use by another run (it holds {path}); wait for "
                        "that run "
                        f"to end or choose another {self.option}"
                    ) from None
                raise CheckpointError(
                    f"out: cannot lock {self.folder} ({path}: {exc.strerror or exc}); check {self.option}"
                ) from None
            if self._still_at_path(fd, path):
                self._fd = fd
                return self
            os.close(fd)  # a failed start removed the file while we opened it: lock the one at the path now

    @staticmethod
    def _still_at_path(fd: int, path: Path) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

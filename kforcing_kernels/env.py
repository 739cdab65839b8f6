"""Every environment variable the package reads, in one place (read at call time, so tests may set them;
cheaply: ``_Variable``).

=========================  ==========================================================================
``KFORCING_BACKEND``        force the window-attention backend picked when ``backend=None``
``KFORCING_DISABLE_EXT``    ignore a built C++ extension (anything but ``0``/empty): Python backends only
``KFORCING_CPP_ISA``        force the C++ kernels' instruction set (``generic``, ``avx2``, ``avx512``);
                            the extension reads it too (csrc/dispatch.cpp)
``KFORCING_TRITON_AUTOTUNE`` Triton: ``0`` runs each kernel's first config (no autotuning), ``1`` tunes;
                            unset: tune, except under torch.distributed with more than one rank
``KFORCING_TRITON_TILES``   Triton: force a tile set (``base``, ``hopper``, ``wide``, or the A/B candidates
                            ``hopper128``: 128-key D=64 dK/dV programs; ``wide_n64``: 64-key D=128 dK/dV
                            programs stepping 64 rows, configs.TILE_SETS) where it applies
``KFORCING_TRITON_DIRECT_LAUNCH`` Triton: ``0`` sends every launch through the autotuner and the JIT's
                            binding; unset or ``1``: repeated launches call the cached compiled kernel
``KFORCING_FLEX_BACKEND``   the ``flex`` backend's FlexAttention kernel (``kernel_options["BACKEND"]``):
                            ``FLASH`` (FlashAttention-4, needs ``flash-attn-4``), ``TRITON``, ``AUTO``; unset: torch's
                            default
``KFORCING_DISPATCH_TABLE`` a dispatch table JSON to read instead of the package's ``dispatch_table.json``
``TRITON_INTERPRET``        Triton's own switch: ``1`` (set before triton is imported) runs the kernels
                            in its interpreter on CPU tensors
``KFORCING_CACHE``          the app's cache folder (tokenizers, token arrays); default ``~/.cache/kforcing_kernels``
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``  torchrun's, read by the trainer
=========================  ==========================================================================
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


class _Variable:
    """One variable, read from ``os.environ`` on every call, as ``os.environ.get`` would (so a test's
    ``monkeypatch.setenv`` takes effect at once), in ~0.1 us instead of ~1 us: the Triton launchers read
    their switches on every kernel launch. CPython's ``os.environ`` keeps its values in an encoded dict
    (``_data``) that every ``os.environ[...] =`` / ``del`` through it updates; this reads that dict and
    decodes a value only when its stored object changed. Where ``os.environ`` is not that object
    (replaced, or another implementation), it is plain ``os.environ.get``. ``get`` returns None for an
    empty value too unless ``empty_is_unset`` is False."""

    __slots__ = ("name", "empty_is_unset", "_key", "_last")

    def __init__(self, name: str, empty_is_unset: bool = True):
        self.name = name
        self.empty_is_unset = empty_is_unset
        self._key = _ENVIRON.encodekey(name) if _DATA is not None else None
        self._last: tuple = (None, None)  # (stored encoded value, its result): one tuple, so threads see a pair

    def get(self) -> Optional[str]:
        if os.environ is not _ENVIRON or _DATA is None:
            value = os.environ.get(self.name)
            return None if self.empty_is_unset and not value else value
        raw = _DATA.get(self._key)
        last = self._last
        if raw is last[0]:
            return last[1]
        value = None if raw is None else _ENVIRON.decodevalue(raw)
        if self.empty_is_unset and not value:
            value = None
        self._last = (raw, value)
        return value


_ENVIRON = os.environ
_DATA = (
    getattr(_ENVIRON, "_data", None)
    if all(hasattr(_ENVIRON, attr) for attr in ("_data", "encodekey", "decodevalue"))
    else None
)
_VARIABLES: dict[str, _Variable] = {}


def _get(name: str) -> Optional[str]:
    """The value of ``name``, None when unset or empty."""
    var = _VARIABLES.get(name)
    if var is None:
        var = _VARIABLES.setdefault(name, _Variable(name))
    return var.get()


def backend_override() -> Optional[str]:
    return _get("KFORCING_BACKEND")


def flex_backend() -> Optional[str]:
    return _get("KFORCING_FLEX_BACKEND")


def dispatch_table_path() -> Optional[str]:
    return _get("KFORCING_DISPATCH_TABLE")


def extension_disabled() -> Optional[str]:
    """The value of KFORCING_DISABLE_EXT when it disables the extension, else None."""
    value = _get("KFORCING_DISABLE_EXT")
    return value if value not in (None, "0") else None


def cpp_isa() -> Optional[str]:
    return _get("KFORCING_CPP_ISA")


# Read on every Triton call or kernel launch: each is a bound ``get`` (no wrapper call).
# KFORCING_TRITON_AUTOTUNE: the raw value (an empty string is an error for the caller to report, not "unset").
triton_autotune = _Variable("KFORCING_TRITON_AUTOTUNE", empty_is_unset=False).get
# The others: None when unset or empty (the caller reports a value it cannot parse).
triton_tiles = _Variable("KFORCING_TRITON_TILES").get
triton_direct_launch = _Variable("KFORCING_TRITON_DIRECT_LAUNCH").get


# TRITON_INTERPRET's raw value (an empty string stays ""): part of window_attention's eager cache key.
triton_interpret_value = _Variable("TRITON_INTERPRET", empty_is_unset=False).get


def triton_interpret() -> bool:
    """Whether TRITON_INTERPRET=1 is set (it takes effect only if set before triton's first import)."""
    return triton_interpret_value() == "1"


def cache_dir() -> Path:
    return Path(os.environ.get("KFORCING_CACHE", Path.home() / ".cache" / "kforcing_kernels"))


def distributed_ranks() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) outside torchrun."""
    return (
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )

"""Every environment variable the package reads, in one place (read at call time, so tests may set them).

=========================  ==========================================================================
``KFORCING_BACKEND``        force the window-attention backend picked when ``backend=None``
``KFORCING_DISABLE_EXT``    ignore a built C++ extension (anything but ``0``/empty): Python backends only
``KFORCING_CPP_ISA``        force the C++ kernels' instruction set (``generic``, ``avx2``, ``avx512``);
                            the extension reads it too (csrc/dispatch.cpp)
``KFORCING_TRITON_AUTOTUNE`` Triton: ``0`` runs each kernel's first config (no autotuning), ``1`` tunes;
                            unset: tune, except under torch.distributed with more than one rank
``KFORCING_TRITON_TILES``   Triton: force a tile set (``base``, ``hopper`` or ``wide``) where it applies
``KFORCING_TRITON_KERNELS`` Triton kernel generation, for A/B runs: ``fused`` (default; 3 launches per
                            forward + backward, window slots inline), ``split`` (slot, dQ and dK/dV
                            kernels launched apart: 6), ``legacy`` (split, first-generation dQ, dK/dV)
``KFORCING_TRITON_DIRECT_LAUNCH`` Triton: ``0`` sends every launch through the autotuner and the JIT's
                            binding; unset or ``1``: repeated launches call the cached compiled kernel
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


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value else None


def backend_override() -> Optional[str]:
    return _get("KFORCING_BACKEND")


def extension_disabled() -> Optional[str]:
    """The value of KFORCING_DISABLE_EXT when it disables the extension, else None."""
    value = _get("KFORCING_DISABLE_EXT")
    return value if value not in (None, "0") else None


def cpp_isa() -> Optional[str]:
    return _get("KFORCING_CPP_ISA")


def triton_autotune() -> Optional[str]:
    """The raw value (an empty string is an error for the caller to report, not "unset")."""
    return os.environ.get("KFORCING_TRITON_AUTOTUNE")


def triton_tiles() -> Optional[str]:
    return _get("KFORCING_TRITON_TILES")


def triton_kernels() -> Optional[str]:
    return _get("KFORCING_TRITON_KERNELS")


def triton_direct_launch() -> Optional[str]:
    """The raw value, None when unset or empty (the caller reports anything but ``0``/``1``)."""
    return _get("KFORCING_TRITON_DIRECT_LAUNCH")


def triton_interpret() -> bool:
    """Whether TRITON_INTERPRET=1 is set (it takes effect only if set before triton's first import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpret_value() -> Optional[str]:
    return os.environ.get("TRITON_INTERPRET")


def cache_dir() -> Path:
    return Path(os.environ.get("KFORCING_CACHE", Path.home() / ".cache" / "kforcing_kernels"))


def distributed_ranks() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))

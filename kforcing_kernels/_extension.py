"""Loads the optional C++ extension ``kforcing_kernels._C`` once.

``load()`` returns the module, or None when it is not there: the package was
installed with ``KFORCING_BUILD_EXT=0``, a source checkout was used without
building it, it fails to import (e.g. built against another torch), or it is
disabled with ``KFORCING_DISABLE_EXT=1``. Everything that uses it falls back to
the Python implementations; a missing or broken extension says so in one warning
with the command that builds it, and ``reason()`` gives the why
(``kforcing_kernels.backends_available()['cpp']``). An install never ends up
without it by accident: setup.py fails when it cannot build it.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType
from typing import Optional

from . import env

DISABLE_ENV = "KFORCING_DISABLE_EXT"


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[ModuleType], Optional[str]]:
    disabled = env.extension_disabled()
    if disabled is not None:
        return None, f"disabled by {DISABLE_ENV}={disabled}"
    try:
        module = importlib.import_module("kforcing_kernels._C")
    except ImportError as exc:
        why = f"kforcing_kernels._C is not available ({exc})"
        warnings.warn(
            f"{why}; falling back to the Python backends (composite/reference; the fused "
            "sampler uses torch). To build it, install torch first and then the package with "
            "`pip install --no-build-isolation .` (`-e .` in a checkout); see README, Install.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, why
    isa = env.cpp_isa()
    if isa and module.isa() != isa:
        warnings.warn(
            f"KFORCING_CPP_ISA={isa} is not supported here; using {module.isa()}", RuntimeWarning, stacklevel=3
        )
    return module, None


def load() -> Optional[ModuleType]:
    """The ``_C`` module, or None (warned once) when it is absent or disabled."""
    return _load()[0]


def reason() -> Optional[str]:
    """None when ``_C`` is loaded, else why not."""
    return _load()[1]


def require() -> ModuleType:
    """The ``_C`` module, for callers that checked ``reason()``; RuntimeError naming why when it is absent."""
    module, why = _load()
    if module is None:
        raise RuntimeError(f"kforcing_kernels._C is not available: {why}")
    return module

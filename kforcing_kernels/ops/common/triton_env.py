"""Whether the Triton backends (window and paged attention) can run here: one copy of the rules.

Triton runs compiled on CUDA tensors, or in its interpreter on CPU tensors when ``TRITON_INTERPRET=1`` was
set before triton was first imported (triton.language is built for one or the other at that import).
Importing this module does not import triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import env


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (``env.triton_interpret``): the backends then take CPU tensors."""
    return env.triton_interpret()


def interpreter_active() -> bool:
    """Whether triton.language itself was built for the interpreter (decided when triton is first imported)."""
    import triton
    import triton.language as tl

    return not isinstance(tl.zeros, triton.runtime.JITFunction)


def available() -> Optional[str]:
    """None when a Triton backend can run here, else the reason (triton missing, no CUDA device, or
    ``TRITON_INTERPRET=1`` set after triton was imported)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    if interpret_requested():
        if not interpreter_active():
            return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import of triton"
        return None
    if torch.cuda.is_available():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 is not set"

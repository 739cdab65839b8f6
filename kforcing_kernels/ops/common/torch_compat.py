"""The private torch APIs the package calls, each behind one named function with a fallback.

torch has no public way to ask, cheaply, whether a call runs under a mode or a transform; ``window_attention`` asks
on every plain eager call (its fast path skips the custom op only when nothing could intercept it), so it reads
torch's private C bindings. They exist in the supported torch releases (>= 2.5; the suite checks each answer on the
installed torch, python_tests/ops/common/test_torch_compat.py) but carry no promise, so each is looked up here once,
at import, and a function whose API is missing in some torch gives the conservative answer: "a mode or transform may
be active", which sends the op down its general path (the custom op: correct under any mode, about a millisecond
slower per forward + backward), never the fast path under a mode it cannot see. The stream handle falls back to
torch's public (slower) spelling of the same number.

No other module of the package names ``torch._C`` (python_tests/test_architecture.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def _lookup(owner: Any, dotted: str) -> Optional[Callable]:
    """``owner.a.b.c`` for ``dotted = "a.b.c"``, or None when any step is missing (a torch without that API)."""
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


_function_mode_enabled = _lookup(torch._C, "_is_torch_function_mode_enabled")
_dispatch_stack_len = _lookup(torch._C, "_len_torch_dispatch_stack")
_peek_interpreter_stack = _lookup(torch._C, "_functorch.peek_interpreter_stack")
_raw_cuda_stream = _lookup(torch._C, "_cuda_getCurrentRawStream")


def torch_function_mode_active() -> bool:
    """Whether a ``TorchFunctionMode`` is active (``with torch.device(...)`` included). True when this torch
    lacks the API (a mode may be active)."""
    if _function_mode_enabled is None:
        return True
    return bool(_function_mode_enabled())


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active, user or infrastructure one (``FakeTensorMode``, proxy modes of
    tracing). True when this torch lacks the API (a mode may be active)."""
    if _dispatch_stack_len is None:
        return True
    return _dispatch_stack_len() > 0


def functorch_transform_active() -> bool:
    """Whether the call runs inside a functorch transform (``torch.func.vmap``, ``grad``, ``jvp``, ...). True when
    this torch lacks the API (a transform may be active)."""
    if _peek_interpreter_stack is None:
        return True
    return _peek_interpreter_stack() is not None


def mode_or_transform_active() -> bool:
    """Whether anything could intercept an op call: a torch-function mode, a dispatch mode or a functorch
    transform (each as above, conservative where torch lacks the API). An op's eager fast path runs only when
    this is False."""
    return torch_function_mode_active() or dispatch_mode_active() or functorch_transform_active()


def current_cuda_stream_handle(device_index: int) -> int:
    """The handle of the current CUDA stream on device ``device_index`` (``torch.cuda.current_stream(i)
    .cuda_stream``, without making a Stream object: the Triton launch path asks per call). Where this torch
    lacks the raw binding, the public spelling gives the same number."""
    if _raw_cuda_stream is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return _raw_cuda_stream(device_index)

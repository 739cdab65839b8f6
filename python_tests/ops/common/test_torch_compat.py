"""The private torch APIs behind ops/common/torch_compat.py: each function's answer with and without the mode or
transform it asks about, on the installed torch; and, with the private API made absent (deleted from torch
while the module is re-imported, as in a torch that lacks it), the conservative answer, so that
window_attention takes its general path (the custom op) and still gives the same result."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.common import torch_compat


class _PassThroughFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _inside_vmap(ask):
    seen = []
    torch.vmap(lambda x: seen.append(ask()) or x)(torch.ones(2, 3))
    return seen[0]


def _inside_grad(ask):
    seen = []
    torch.func.grad(lambda x: seen.append(ask()) or x.sum())(torch.ones(3))
    return seen[0]


def _inside_jvp(ask):
    seen = []
    torch.func.jvp(lambda x: seen.append(ask()) or x * 2, (torch.ones(3),), (torch.ones(3),))
    return seen[0]


def _under(context_factory, ask):
    with context_factory():
        return ask()


# What each function asks about, and the ways to put the program under it.
FUNCTION_MODES = {"torch.device": lambda: torch.device("cpu"), "user mode": _PassThroughFunctionMode}
DISPATCH_MODES = {"user mode": _PassThroughDispatchMode, "FakeTensorMode": _fake_mode}
TRANSFORMS = {"vmap": _inside_vmap, "grad": _inside_grad, "jvp": _inside_jvp}


def test_nothing_is_active_in_a_plain_program():
    assert torch_compat.torch_function_mode_active() is False
    assert torch_compat.dispatch_mode_active() is False
    assert torch_compat.functorch_transform_active() is False
    assert torch_compat.mode_or_transform_active() is False


@pytest.mark.parametrize("mode", list(FUNCTION_MODES))
def test_a_torch_function_mode_is_seen(mode):
    assert _under(FUNCTION_MODES[mode], torch_compat.torch_function_mode_active) is True
    assert _under(FUNCTION_MODES[mode], torch_compat.mode_or_transform_active) is True
    assert _under(FUNCTION_MODES[mode], torch_compat.dispatch_mode_active) is False  # the others stay False
    assert _under(FUNCTION_MODES[mode], torch_compat.functorch_transform_active) is False
    assert torch_compat.torch_function_mode_active() is False  # and it ends with the mode


@pytest.mark.parametrize("mode", list(DISPATCH_MODES))
def test_a_dispatch_mode_is_seen(mode):
    assert _under(DISPATCH_MODES[mode], torch_compat.dispatch_mode_active) is True
    assert _under(DISPATCH_MODES[mode], torch_compat.mode_or_transform_active) is True
    assert _under(DISPATCH_MODES[mode], torch_compat.torch_function_mode_active) is False
    assert _under(DISPATCH_MODES[mode], torch_compat.functorch_transform_active) is False
    assert torch_compat.dispatch_mode_active() is False


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_functorch_transform_is_seen(transform):
    inside = TRANSFORMS[transform]
    assert inside(torch_compat.functorch_transform_active) is True
    assert inside(torch_compat.mode_or_transform_active) is True
    assert inside(torch_compat.torch_function_mode_active) is False
    assert inside(torch_compat.dispatch_mode_active) is False
    assert torch_compat.functorch_transform_active() is False


@contextlib.contextmanager
def _compat_without(owner, name):
    """torch_compat re-imported while ``owner.name`` does not exist (as in a torch without that API); torch gets
    the attribute back at once (only the import sees it missing), the module its real lookups on exit."""
    saved = getattr(owner, name)
    delattr(owner, name)
    try:
        importlib.reload(torch_compat)
    finally:
        setattr(owner, name, saved)
    try:
        yield torch_compat
    finally:
        importlib.reload(torch_compat)


# Each private API, and the function of torch_compat that reads it.
PRIVATE_APIS = {
    "_is_torch_function_mode_enabled": (lambda: torch._C, "torch_function_mode_active"),
    "_len_torch_dispatch_stack": (lambda: torch._C, "dispatch_mode_active"),
    "peek_interpreter_stack": (lambda: torch._C._functorch, "functorch_transform_active"),
    "_functorch": (lambda: torch._C, "functorch_transform_active"),  # the whole submodule missing
}


@pytest.mark.parametrize("api", list(PRIVATE_APIS))
def test_a_missing_api_gives_the_conservative_answer(api):
    owner, function = PRIVATE_APIS[api]
    with _compat_without(owner(), api) as compat:
        assert getattr(compat, function)() is True  # "a mode or transform may be active", even in a plain program
        assert compat.mode_or_transform_active() is True
        others = {"torch_function_mode_active", "dispatch_mode_active", "functorch_transform_active"} - {function}
        assert all(getattr(compat, name)() is False for name in others)  # the APIs still present still answer
    assert getattr(torch_compat, function)() is False  # back to the real lookup


LAYOUT = WindowLayout.kforcing_single(6, 3)


def _attention_with_grads():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, LAYOUT.n_queries, 8, requires_grad=True) for _ in range(3))
    out = window_attention(q, k, v, LAYOUT, backend="composite")
    return type(out.grad_fn).__name__, out, torch.autograd.grad(out.square().sum(), (q, k, v))


@pytest.mark.parametrize("api", list(PRIVATE_APIS))
def test_without_the_api_window_attention_takes_the_custom_op_with_the_same_result(api):
    fast_path, out, grads = _attention_with_grads()
    assert "Eager" in fast_path, fast_path  # a plain eager call: the op's autograd.Function
    owner, _ = PRIVATE_APIS[api]
    with _compat_without(owner(), api):
        general_path, out_general, grads_general = _attention_with_grads()
    assert "Eager" not in general_path and "window_attention" in general_path, general_path  # the custom op
    for got, want in zip((out_general, *grads_general), (out, *grads)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream handle is a CUDA stream's")
def test_the_cuda_stream_handle_is_the_current_streams_with_and_without_the_raw_binding():
    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert torch_compat.current_cuda_stream_handle(index) == stream.cuda_stream
            with _compat_without(torch._C, "_cuda_getCurrentRawStream") as compat:
                assert compat.current_cuda_stream_handle(index) == stream.cuda_stream

"""FlexAttention backend: torch's ``flex_attention`` over the layout's analytic ``BlockMask``.

On CUDA tensors the forward is ``torch.compile``d ``flex_attention`` (one static graph per
shape) with ``layout.to_block_mask(128)``, built from the row intervals (``layouts/flex.py``,
no mask_mod sweep) and cached per layout and device (``layouts/derived.py``).

Gradients: a plain eager ``window_attention(backend="flex")`` call (no torch.compile, tensor subclass,
dispatch mode or functorch transform: ``op._plain_eager``) on a device where FlexAttention has a
backward calls :func:`differentiable`: ``flex_attention`` itself under autograd, so FlexAttention's own
autograd saves what its backward needs (q, k, v, out, its LSE) and runs its backward kernel; a forward +
backward costs what compiled ``flex_attention`` called directly costs (``bench/gpu/triton_gpu.py`` methods
``flex`` and ``flex_backend``). Every other call goes through the op's custom-op pair, whose backward
(:func:`backward`) recomputes the forward under autograd and differentiates it: FlexAttention's backward
is reachable only through autograd, so that path costs one extra forward.

On CPU tensors the forward is eager ``flex_attention`` (the same mask_mod math, dense scores:
compiling it for CPU takes about a minute per shape) and the backward is refused, as
FlexAttention has none on CPU; ``backend_limits()["flex"]`` says so (``backends_available()["flex"]``
is None wherever torch has FlexAttention: it is usable, forward only on CPU).

``KFORCING_FLEX_BACKEND`` passes ``kernel_options={"BACKEND": value}`` (``FLASH``: the
FlashAttention-4 route, which needs the ``flash-attn-4`` package; ``TRITON``, ``AUTO``) where this
torch has the option; a value it does not know is refused naming the variable.
"""

from __future__ import annotations

import typing
import warnings
from typing import Optional

import torch

from ... import env
from ...layouts import WindowLayout
from ..common.dtypes import acc_dtype

BLOCK_SIZE = 128  # FlexAttention's own default tile; the BlockMask's granularity on CUDA
# Devices whose FlexAttention has no backward (torch refuses inputs that need grad there): a call on them runs
# the forward on detached inputs and the op's refusing backward. Tests empty it, with torch's own guard lifted,
# to run FlexAttention's math backward on CPU (python_tests/ops/window_attention/test_flex_backend.py).
NO_BACKWARD_DEVICES = ("cpu", "mps")
# None: CPU tensors run eager flex_attention. A torch.compile backend name ("eager"): they run the compiled
# path as CUDA tensors do, compiled with that backend (bench/gpu/gpu_check.sh --dry-run walks the CUDA code on CPU).
CPU_COMPILE_BACKEND: Optional[str] = None
_compiled: dict = {}


def available() -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch.nn.attention.flex_attention is not importable: {exc}"
    return None


def limits() -> Optional[str]:
    """What this backend cannot do although it is usable (``backend_limits()``)."""
    return (
        "no backward on CPU tensors: FlexAttention implements it on CUDA only (CPU: eager forward; "
        "a backward through it raises naming backend 'flex')"
    )


def supports(dtype: torch.dtype, head_dim: Optional[int]) -> bool:
    return dtype in (torch.float16, torch.bfloat16, torch.float32)


def kernel_options() -> Optional[dict]:
    """``{"BACKEND": KFORCING_FLEX_BACKEND}`` when the variable is set, else None; refuses a value this torch lacks."""
    value = env.flex_backend()
    if value is None:
        return None
    from torch.nn.attention import flex_attention as flex_module

    known = typing.get_args(getattr(flex_module, "_Backend", None)) if hasattr(flex_module, "_Backend") else ()
    if value not in known:
        have = f"one of {known}" if known else "unset (this torch's flex_attention has no BACKEND kernel option)"
        raise ValueError(f"KFORCING_FLEX_BACKEND: expected {have}, got {value!r}")
    return {"BACKEND": value}


def block_mask(layout: WindowLayout, device: torch.device):
    """The layout's analytic BlockMask on ``device`` (``BLOCK_SIZE`` tiles), built once per layout content and
    device."""
    device = torch.device(device)
    return layout.derived(
        ("flex_block_mask", BLOCK_SIZE, str(device)), lambda: layout.to_block_mask(BLOCK_SIZE, device=device)
    )


def _compiled_flex(compile_backend: str):
    fn = _compiled.get(compile_backend)
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Static shapes: one graph per shape, as FlexAttention's own benchmarks compile it.
        fn = _compiled[compile_backend] = torch.compile(flex_attention, dynamic=False, backend=compile_backend)
    return fn


def _dynamo_limits():
    """Past dynamo's recompile limit (8 graphs) a compiled flex_attention would fall back to eager
    flex_attention silently (dense scores: out of memory at long sequences); raise the limit for
    our calls and make hitting it an error instead."""
    cfg = torch._dynamo.config
    patch = {}
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            patch[name] = max(getattr(cfg, name), 256)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    return cfg.patch(patch)


def attention(q, k, v, layout: WindowLayout, scale: Optional[float] = None):
    """FlexAttention over ``layout`` as this backend calls it, differentiable by FlexAttention's own autograd
    (CUDA): ``(out [B, H, Lq, D], lse [B, H, Lq])``. The GPU bench times it as "compiled FlexAttention"; it
    shares the backend's compiled graph, so both cost one compile per shape."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _call(q, k, v, layout, scale, with_lse=True)


def _call(q, k, v, layout: WindowLayout, scale: float, with_lse: bool):
    """flex_attention(q, k, v) over the layout: compiled on CUDA, eager on CPU; (out, natural-log lse or None)."""
    from torch.nn.attention import flex_attention as flex_module

    mask = block_mask(layout, q.device)
    gqa = q.shape[1] != k.shape[1]
    options = kernel_options()
    kwargs = dict(block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options)
    if with_lse:
        if hasattr(flex_module, "AuxRequest"):
            kwargs["return_aux"] = flex_module.AuxRequest(lse=True)
        else:  # older torch: the (deprecated later) flag
            kwargs["return_lse"] = True
    compile_backend = "inductor" if q.device.type == "cuda" else CPU_COMPILE_BACKEND
    if compile_backend is not None:
        with _dynamo_limits():
            result = _compiled_flex(compile_backend)(q, k, v, **kwargs)
    else:
        with warnings.catch_warnings():  # eager on CPU is deliberate here (see the module docstring)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = flex_module.flex_attention(q, k, v, **kwargs)
    if not with_lse:
        return result, None
    out, aux = result
    lse = aux.lse if hasattr(aux, "lse") else aux
    return out, lse


def has_own_backward(q: torch.Tensor) -> bool:
    """Whether FlexAttention differentiates inputs on q's device itself (no: CPU and MPS, see NO_BACKWARD_DEVICES)."""
    return q.device.type not in NO_BACKWARD_DEVICES


def differentiable(q, k, v, layout: WindowLayout, scale: float):
    """FlexAttention over ``layout``, differentiated by FlexAttention's own autograd (devices with
    ``has_own_backward``; the op calls it for plain eager calls): ``(out [B, H, Lq, D], lse [B, H, Lq])``,
    ``lse`` natural log, detached, fp32 (fp64 for fp64 inputs) as :func:`forward` returns it."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the same compiled graph as forward's inputs
    out, lse = _call(q, k, v, layout, scale, with_lse=True)
    return out, lse.detach().to(acc_dtype(q.dtype))


def forward(q, k, v, layout: WindowLayout, scale: float):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> (out [B, H, Lq, D], lse [B, H, Lq] natural log, fp32; fp64 for fp64).

    A row that sees no key gets out 0 and lse -inf, as FlexAttention defines it.
    """
    if not has_own_backward(q) and any(t.requires_grad for t in (q, k, v)):
        q, k, v = (t.detach() for t in (q, k, v))  # a forward only: FlexAttention refuses such inputs that need grad
    out, lse = _call(q, k, v, layout, scale, with_lse=True)
    return out.contiguous(), lse.to(acc_dtype(q.dtype)).contiguous()


def backward(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    """Gradients (dq, dk, dv): compiled FlexAttention's backward after recomputing its forward, for the calls
    that go through the op's custom-op pair (compiled, subclass, mode or transform: see the module docstring);
    devices in NO_BACKWARD_DEVICES are refused by name."""
    if not has_own_backward(q):
        raise RuntimeError(
            f"backend 'flex': FlexAttention has no backward on {q.device.type} tensors (torch implements it on CUDA "
            "only); use backend='triton' on CUDA or 'cpp' / 'composite' / 'reference' on CPU for gradients"
        )
    with torch.enable_grad():
        lq, lk, lv = (t.detach().requires_grad_(True) for t in (q, k, v))
        again, _ = _call(lq, lk, lv, layout, scale, with_lse=True)  # the forward's own graph: no second compile
        grads = torch.autograd.grad(again, (lq, lk, lv), dout)
    return tuple(g.contiguous() for g in grads)

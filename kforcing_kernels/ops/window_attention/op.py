"""``window_attention``: the public prefix-window attention op.

Every backend (``reference`` included: no special case) runs behind one
``torch.library.custom_op`` pair (forward and backward), so the op is opaque to
autograd and traceable by torch.compile; the layout travels as its range tensors
(empty ones for defaults) plus a few ints. Plain eager calls (no compile, no
tensor subclass, dispatch mode or functorch transform) take a
``torch.autograd.Function`` over the same two bodies instead: the custom op's
Python dispatch and the layout's round trip through its range tensors cost about
a millisecond per forward + backward on the host, as much as the kernels
themselves at N=1024 on an H100 (bench/gpu/triton_profile.py). One exception: a plain eager
call of backend ``flex`` on a device where FlexAttention has a backward (CUDA) calls
``flex_attention`` under autograd (``flex.differentiable``), so FlexAttention's own autograd
saves what its backward kernel needs instead of the op's backward recomputing the forward.

torch.compile policy (tested in python_tests/ops/window_attention/test_compile.py): ``window_attention``
traces with ``fullgraph=True`` for every backend. A layout enters the graph as its
range tensors (graph inputs of shape ``[M]``/``[B, M]``, ``[C]``/``[B, C]``) and its geometry ints,
which the op schema takes as ``SymInt[]``, so no size is baked into the graph.
Buckets: with ``dynamic=True`` one graph serves every layout with the same intra
mode, query mode and range rank (shared vs per-batch), for all sizes >= 2: N, k,
block and last-window sizes may all change without a recompile. With the default
``dynamic=None`` dynamo compiles the first sizes statically and recompiles once
when a size first changes (marking it dynamic); later changes are free. New graphs
come from another mode or range rank, a size of 0 or 1 (dynamo specialises those),
or sizes that were equal by coincidence at the first trace (duck sizing).
"""

from __future__ import annotations

import math
import threading
from types import ModuleType
from typing import Callable, Literal, NamedTuple, Optional, Union, overload

import torch

from ... import env
from ...layouts import QueryRowsLayout, WindowLayout
from ...layouts.derived import canonical, content_key
from ..common.dtypes import acc_dtype
from ..common.registry import pick
from ..common.saved import autograd_records, own_storage
from ..common.torch_compat import mode_or_transform_active
from . import dispatch
from .backends import REGISTRY, get_backend
from .checks import validate


@overload
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Union[WindowLayout, QueryRowsLayout],
    *,
    scale: Optional[float] = ...,
    backend: Optional[str] = ...,
    return_lse: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Union[WindowLayout, QueryRowsLayout],
    *,
    scale: Optional[float] = ...,
    backend: Optional[str] = ...,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Union[WindowLayout, QueryRowsLayout],
    *,
    scale: Optional[float] = ...,
    backend: Optional[str] = ...,
    return_lse: bool = ...,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...


def window_attention(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    layout: Union[WindowLayout, QueryRowsLayout],
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention under the prefix-window mask ``layout.dense_mask()``.

    Args:
        q: queries ``[B, H, Lq, D]`` with ``Lq == layout.n_queries`` in the layout's
            storage order (``[context | windows]`` or windows only).
        k, v: keys/values ``[B, Hkv, Lk, D]`` with ``Lk == layout.n_keys``
            (``[context | windows]``); ``H % Hkv == 0`` (GQA).
        layout: the mask; a ``QueryRowsLayout`` (some rows of a layout, ``layout.restrict_rows``) runs on the
            backends of :data:`ROW_SUBSET_BACKENDS` (planned from the subset's own row intervals; eager
            only, not a custom op); another ``backend`` is refused by name.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: ``"reference"``, ``"composite"``, ``"cpp"``, ``"triton"``, ``"flex"`` or None (fastest
            available for the device; on CUDA the measured winner of ``dispatch_table.json`` for this GPU,
            dtype, head dim, length bucket and layout family where it has one (``dispatch.py``), else the
            registry's default; env ``KFORCING_BACKEND`` overrides).
        return_lse: also return the natural-log log-sum-exp ``[B, H, Lq]`` (fp32; fp64 for fp64 inputs),
            which is not differentiated through.

    Returns:
        ``out [B, H, Lq, D]`` in q's dtype (and ``lse`` if asked).

    Autocast (one rule for every backend, SDPA's and FlexAttention's): under ``torch.autocast`` enabled for q's
    device, floating q, k, v other than fp64 are cast to the autocast dtype here, at the op's entry, and the op
    runs on them with autocast off (so no backend's internal products are re-cast): the attention computes in
    the autocast dtype (softmax statistics in fp32, as for any low-precision input), ``out`` is in that dtype,
    ``lse`` fp32, and the gradients reach the inputs in their own dtypes through the casts. The backend choice
    never changes the precision of the result.
    """
    device_type = q.device.type
    if _autocast_enabled(device_type):
        q, k, v = _autocast_cast(device_type, q, k, v)
        with torch.autocast(device_type, enabled=False):
            return window_attention(q, k, v, layout, scale=scale, backend=backend, return_lse=return_lse)
    entry = _eager_entry(q, k, v, layout, scale, backend)
    if entry is not None:  # a plain eager call like one validated before (see _eager_entry)
        out, lse = _eager_apply(q, k, v, layout, entry.scale, entry.backend, entry)
        return (out, lse.detach()) if return_lse else out
    validate(q, k, v, layout, scale, backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:  # nothing to attend (q.shape[2]: a subset of no rows)
        out = q * 0.0 + (k.sum() + v.sum()) * 0.0  # empty, yet connected to q, k and v for autograd
        lse = q.new_zeros(q.shape[:3], dtype=acc_dtype(q.dtype))
        return (out, lse) if return_lse else out
    if isinstance(layout, QueryRowsLayout):  # eager only: a subset does not travel through the custom op
        out, lse = _eager_apply(q, k, v, layout, scale, query_rows_backend(q, backend))
        return (out, lse.detach()) if return_lse else out
    name = backend or default_backend_for(q.device, q.dtype, q.shape[-1], layout)
    if name == "flex" and _plain_eager(q, k, v) and get_backend("flex").has_own_backward(q):
        # FlexAttention's own autograd: it saves what its backward kernel needs (no recomputed forward).
        out, lse = get_backend("flex").differentiable(q, k, v, layout, scale)
    elif _plain_eager(q, k, v):
        out, lse = _eager_apply(q, k, v, layout, scale, name)
    else:
        out, lse = torch.ops.kforcing_kernels.window_attention(q, k, v, *layout_args(layout), scale, name)
    return (out, lse.detach()) if return_lse else out


def window_attention_with_bounds(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: WindowLayout,
    *,
    context_lo: Optional[torch.Tensor] = None,
    context_hi: Optional[torch.Tensor] = None,
    prefix_slide_lo: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``window_attention(q, k, v, layout')`` where ``layout'`` is ``layout`` with the given range tensors
    replaced, without building ``layout'``: the custom op's call, for code that torch.compile traces (a layout
    cannot be built in a trace: its constructor checks values). The custom op turns the ranges back into the
    layout outside the graph (``layout_from_args``), where they are checked.

    ``context_lo`` / ``context_hi`` ``[n_ctx]`` replace the context rows' key ranges (``queries="all"`` only),
    ``prefix_slide_lo`` ``[num_windows]`` the windows' prefix lower bounds (``WindowLayout.prefix_slide_lo``);
    None keeps the layout's. Shapes, scale, backend and the autocast rule as :func:`window_attention`; returns
    ``out [B, H, Lq, D]``. The integrations' sliding-window path (``integrations/hf.py``) is the caller: this
    module is the only one that knows the custom op's schema.
    """
    device_type = q.device.type
    if _autocast_enabled(device_type):
        q, k, v = _autocast_cast(device_type, q, k, v)
        with torch.autocast(device_type, enabled=False):
            return window_attention_with_bounds(
                q,
                k,
                v,
                layout,
                context_lo=context_lo,
                context_hi=context_hi,
                prefix_slide_lo=prefix_slide_lo,
                scale=scale,
                backend=backend,
            )
    ranges, geometry, intra_causal, queries_all = layout_args(layout)
    if (context_lo is not None or context_hi is not None) and not queries_all:
        raise ValueError("context_lo / context_hi: the layout has no context rows (queries='windows')")
    replaced = {2: context_lo, 3: context_hi, 5: prefix_slide_lo}  # positions in WindowLayout.range_tensors()
    ranges = [t if replaced.get(i) is None else replaced[i] for i, t in enumerate(ranges)]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    name = backend or default_backend_for(q.device, q.dtype, q.shape[-1], layout)
    out, _ = torch.ops.kforcing_kernels.window_attention(
        q, k, v, ranges, geometry, intra_causal, queries_all, scale, name
    )
    return out


def _autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type``: the one test of the op's autocast rule."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_cast(device_type: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as autocast casts an op of its lower-precision list: floating ones other than fp64 to the
    autocast dtype (others unchanged; a non-tensor is left to validate's error)."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


# The backends that run a row subset (QueryRowsLayout) from its own rows' intervals and tiles: cpp (the
# same kernels), triton (the same kernels over a tile-mode plan of the subset, triton/plan.py), composite
# (query_rows.py), reference (its dense mask). A backend outside this list is refused by name.
ROW_SUBSET_BACKENDS = ("reference", "composite", "cpp", "triton")


def query_rows_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend a row subset (``QueryRowsLayout``) runs on for queries like ``q``: ``backend`` when it can
    (else a ``ValueError`` naming it), or the first default choice for the device and dtype that can."""
    if backend is not None:
        REGISTRY.check_name(backend)
        if backend not in ROW_SUBSET_BACKENDS:
            raise ValueError(
                f"backend: {backend!r} cannot run a QueryRowsLayout (a row subset of a layout); "
                f"expected one of {ROW_SUBSET_BACKENDS}"
            )
        return backend
    forced = env.backend_override()
    if forced is not None and forced not in ROW_SUBSET_BACKENDS:  # the switch is honoured or refused, never ignored
        raise ValueError(
            f"KFORCING_BACKEND: {forced!r} cannot run a QueryRowsLayout (a row subset of a layout); "
            f"expected one of {ROW_SUBSET_BACKENDS}, or pass backend="
        )
    for name, dims in _default_choices(q.device.type, q.dtype):
        if name in ROW_SUBSET_BACKENDS and (dims is None or q.shape[-1] in dims):
            return name
    return "composite"


def _plain_eager(*tensors: torch.Tensor) -> bool:
    """Whether this call can skip the custom op: eager, plain tensors on a real device, no mode or transform."""
    if torch.compiler.is_compiling():
        return False
    if any(type(t) is not torch.Tensor or t.device.type == "meta" for t in tensors):
        return False
    return not mode_or_transform_active()


# ---------------------------------------------------------------------- the eager fast path


class _EagerEntry(NamedTuple):
    """What a validated plain eager call resolved: its scale, backend, and the module and function names of that
    backend's eager forward/backward (looked up per call, so a function replaced later, e.g. by a test, is the
    one that runs)."""

    scale: float
    backend: str
    ops: ModuleType
    forward_name: str
    backward_name: str

    @property
    def forward(self) -> Callable:
        return getattr(self.ops, self.forward_name)

    @property
    def backward(self) -> Callable:
        return getattr(self.ops, self.backward_name)


EAGER_CACHE_MAX = 64
_eager_cache: dict[tuple, _EagerEntry] = {}
_eager_lock = threading.Lock()
_eager_hits = 0  # calls answered by a cached entry since the last clear_eager_cache (eager_cache_info)


def _eager_entry(q, k, v, layout, scale, backend) -> Optional[_EagerEntry]:
    """The cached resolution of a plain eager call, or None when the call takes the general path.

    A training step calls the op with the same layout and tensor shapes every time; validating them, the
    default backend's choice, the registry's ``import_module`` and the backend's own checks cost about as
    much host time as the whole autograd round trip (BENCHMARKS.md "window_attention's host path"). So
    the first such call validates as usual and its outcome is kept under a key holding everything those
    checks read: the layout (by identity: layouts never change), the scale and backend arguments, each
    tensor's shape, dtype, device and strides, and the environment switches the choice and the backends
    read. Whatever is not in the key is checked on every call: the argument types (a hit needs plain
    tensors, a WindowLayout, a float or None scale, a str or None backend), torch.compile, modes and
    functorch transforms (those calls take the custom op). An input that differs in anything a check
    reads misses, and is validated (and refused by name) like a first call.
    """
    global _eager_hits
    if torch.compiler.is_compiling():  # traced: the custom op (first, so that dynamo traces nothing else here)
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if type(layout) is not WindowLayout or (scale is not None and type(scale) is not float):
        return None
    if backend is not None and type(backend) is not str:
        return None
    if mode_or_transform_active():
        return None
    key = (
        layout,
        scale,
        backend,
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        q.stride(),
        k.stride(),
        v.stride(),
        env.backend_override(),
        env.dispatch_table_path(),
        env.triton_interpret_value(),
        env.extension_disabled(),
    )
    entry = _eager_cache.get(key)
    if entry is not None:
        _eager_hits += 1  # a diagnostic count (eager_cache_info): unlocked, so concurrent hits may undercount
        return entry
    if q.device.type == "meta" or k.device.type == "meta" or v.device.type == "meta":
        return None
    validate(q, k, v, layout, scale, backend)  # raises naming the argument, as on the general path
    if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
        return None  # the general path's empty result
    name = backend or default_backend_for(q.device, q.dtype, q.shape[-1], layout)
    module = get_backend(name)
    if name == "flex" and module.has_own_backward(q):
        return None  # FlexAttention's own autograd (window_attention's flex branch), not the op's Function
    eager_ops = getattr(module, "eager_ops", None)
    ops = eager_ops(q, k, v, layout) if eager_ops is not None else (module, "forward", "backward")
    entry = _EagerEntry(1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale), name, *ops)
    with _eager_lock:
        while len(_eager_cache) >= EAGER_CACHE_MAX:  # bounded: the oldest entry goes first
            del _eager_cache[next(iter(_eager_cache))]
        _eager_cache[key] = entry
    return entry


def clear_eager_cache() -> None:
    """Forget every cached eager resolution and reset the hit count (tests; a backend module reloaded)."""
    global _eager_hits
    with _eager_lock:
        _eager_cache.clear()
        _eager_hits = 0


class EagerCacheInfo(NamedTuple):
    """A snapshot of the eager fast path's cache (:func:`eager_cache_info`).

    ``size``: entries held (validated plain eager calls, one per key), at most ``max_size``
    (:data:`EAGER_CACHE_MAX`); ``hits``: calls answered by an entry since the last :func:`clear_eager_cache`;
    ``backends``: the backend each entry resolved to, oldest first (the next one evicted is ``backends[0]``).
    A plain eager call that misses adds an entry; one that takes the general path (torch.compile, a mode or
    functorch transform, a non-plain argument) leaves both ``size`` and ``hits`` as they were."""

    size: int
    max_size: int
    hits: int
    backends: tuple[str, ...]


def eager_cache_info() -> EagerCacheInfo:
    """What the eager fast path holds now (tests, benchmarks: whether calls hit, and what they resolved to)."""
    with _eager_lock:
        return EagerCacheInfo(
            len(_eager_cache), EAGER_CACHE_MAX, _eager_hits, tuple(e.backend for e in _eager_cache.values())
        )


def default_backend_for(device: torch.device, dtype: torch.dtype, head_dim, layout: WindowLayout) -> str:
    """The backend ``window_attention`` runs with ``backend=None`` for these arguments (``KFORCING_BACKEND`` aside):
    on CUDA the measured dispatch table's row for the GPU, dtype, head dim, length and layout family, else the
    registry's default for the device, dtype and head dim."""
    # The registry's choices and the measured rows for the device and dtype are constants; the head dim
    # and the layout's length and family pick among them. Under torch.compile(dynamic=True) head_dim and
    # n_ctx may be SymInts: comparing them guards on them (a change of choice recompiles), where passing
    # them to the constant functions would fail.
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability, dtype_name = _measured_keys(index, dtype)
        measured = dispatch.choose(
            _measured_rows(index, dtype), capability, dtype_name, head_dim, layout.n_ctx, dispatch.layout_family(layout)
        )
        if measured is not None:
            return measured
    return pick(_default_choices(device.type, dtype), head_dim)


@torch.compiler.assume_constant_result
def _measured_rows(device_index: int, dtype: torch.dtype) -> tuple:
    # The dispatch table's rows for this GPU and dtype whose backend is usable here; none under KFORCING_BACKEND.
    if env.backend_override():
        return ()
    return dispatch.measured_rows(
        device_index, dtype, lambda: {name for name in REGISTRY.names if REGISTRY.load(name)[1] is None}
    )


@torch.compiler.assume_constant_result
def _measured_keys(device_index: int, dtype: torch.dtype) -> tuple[str, str]:
    return dispatch.capability_of(device_index), dispatch.dtype_name(dtype)


@torch.compiler.assume_constant_result
def _default_choices(device_type: str, dtype: torch.dtype) -> tuple:
    # Backend discovery imports modules, which dynamo cannot trace; under compile the
    # choices are a trace-time constant (changing KFORCING_BACKEND later does not recompile).
    return REGISTRY.choices(torch.device(device_type), dtype)


# ---------------------------------------------------------------------- custom op


_NONE = torch.zeros(0, dtype=torch.int64)


def layout_args(layout: WindowLayout):
    """The layout as the custom op's arguments ``(ranges, geometry, intra_causal, queries_all)``: its seven
    range tensors (``WindowLayout.range_tensors``, empty int64 [0] for a default one), the geometry ints
    ``[n_ctx, num_windows, window_size, last_window_size, n_streams]`` and two flags; ``layout_from_args``
    turns them back into the layout."""
    ranges = [_NONE if t is None else t for t in layout.range_tensors()]
    geometry = [layout.n_ctx, layout.num_windows, layout.window_size, layout.last_window_size, layout.n_streams]
    return ranges, geometry, layout.intra == "causal", layout.queries == "all"


def layout_from_args(ranges, geometry, intra_causal, queries_all) -> WindowLayout:
    """The layout a custom-op call describes: the registered layout with that content when there is one
    (layouts/derived.py, keyed by the ranges' bytes), so its derived plans are reused; else built and registered."""
    n_ctx, m, w, last, streams = (int(g) for g in geometry)
    intra, queries = "causal" if intra_causal else "full", "all" if queries_all else "windows"
    tensors = []
    for i, t in enumerate(ranges):
        t = t.to(device="cpu", dtype=torch.int64)
        optional = i >= 2  # every range but prefix_lo, prefix_hi may be the default
        tensors.append(None if optional and t.dim() == 1 and t.numel() == 0 else t)
    prefix_lo, prefix_hi, context_lo, context_hi, live, slide_lo, slide_hi = tensors
    assert prefix_lo is not None and prefix_hi is not None  # never optional above
    return canonical(
        content_key(n_ctx, m, w, last, intra, queries, streams, tensors),
        lambda: WindowLayout(
            n_ctx,
            m,
            w,
            prefix_lo,
            prefix_hi,
            last_window_size=last,
            intra=intra,
            queries=queries,
            n_streams=streams,
            context_lo=context_lo,
            context_hi=context_hi,
            live_slots=live,
            prefix_slide_lo=slide_lo,
            prefix_slide_hi=slide_hi,
        ),
    )


@torch.library.custom_op("kforcing_kernels::window_attention", mutates_args=())
def _window_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: list[torch.Tensor],
    geometry: list[int],
    intra_causal: bool,
    queries_all: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, layout_from_args(ranges, geometry, intra_causal, queries_all), scale, backend)


def _forward(q, k, v, layout: WindowLayout, scale: float, backend: str, entry: Optional[_EagerEntry] = None):
    # Every backend gets (and returns) contiguous tensors: the fake below promises contiguous outputs.
    # Non-finite K/V values are the backend's business (backends.Backend): no scan here.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    forward = get_backend(backend).forward if entry is None else entry.forward
    return forward(q, k, v, layout, scale)


@_window_attention_op.register_fake
def _(q, k, v, ranges, geometry, intra_causal, queries_all, scale, backend):
    # Contiguous whatever q's strides (empty_like would copy a transposed q's): what every backend returns.
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("kforcing_kernels::window_attention_backward", mutates_args=())
def _window_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ranges: list[torch.Tensor],
    geometry: list[int],
    intra_causal: bool,
    queries_all: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_body(
        dout, q, k, v, out, lse, layout_from_args(ranges, geometry, intra_causal, queries_all), scale, backend
    )


def _backward_body(
    dout, q, k, v, out, lse, layout: WindowLayout, scale: float, backend: str, entry: Optional[_EagerEntry] = None
):
    backward = get_backend(backend).backward if entry is None else entry.backward
    return backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        lse.contiguous(),
        layout,
        scale,
    )


@_window_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, ranges, geometry, intra_causal, queries_all, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ranges, geometry, intra_causal, queries_all, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(*(own_storage(t) for t in (q, k, v)), out, lse, *ranges)
    ctx.meta = (geometry, intra_causal, queries_all, scale, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *ranges = ctx.saved_tensors
    geometry, intra_causal, queries_all, scale, backend = ctx.meta
    dq, dk, dv = torch.ops.kforcing_kernels.window_attention_backward(
        dout, q, k, v, out, lse, ranges, geometry, intra_causal, queries_all, scale, backend
    )
    return dq, dk, dv, [None] * len(ranges), None, None, None, None, None


_window_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _double_backward(ctx, *grads):
    # Reached only when a graph built with create_graph=True is differentiated again.
    raise RuntimeError(
        f"double backward is not supported by window_attention (backend {ctx.backend!r}): "
        "its backward is itself not differentiable"
    )


def _backward_setup_context(ctx, inputs, output):
    ctx.backend = inputs[-1]


_window_attention_backward_op.register_autograd(_double_backward, setup_context=_backward_setup_context)


def _eager_apply(q, k, v, layout, scale: float, backend: str, entry: Optional[_EagerEntry] = None):
    """A plain eager call (layout: a WindowLayout or QueryRowsLayout): through :class:`_EagerWindowAttention` when
    autograd will record it, else the forward body alone (no_grad, inference_mode, or no input requiring grad: a
    decode step). The Function would save compact copies of view inputs (own_storage: a K/V cache's layer or
    batch slice) that nobody keeps."""
    if autograd_records(q, k, v):
        return _EagerWindowAttention.apply(q, k, v, layout, scale, backend, entry)
    return _forward(q, k, v, layout, scale, backend, entry)


class _EagerWindowAttention(torch.autograd.Function):
    """The custom op's forward and backward bodies for plain eager calls (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: WindowLayout, scale: float, backend: str, entry: Optional[_EagerEntry] = None):
        # entry: the validated call's cached resolution (_eager_entry), None on the general path.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # what _forward hands the backend: save these copies
        out, lse = _forward(q, k, v, layout, scale, backend, entry)
        ctx.save_for_backward(*(own_storage(t) for t in (q, k, v)), out, lse)
        ctx.meta = (layout, scale, backend, entry)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, backend, entry = ctx.meta
        if torch.is_grad_enabled() and isinstance(layout, QueryRowsLayout):
            raise RuntimeError(
                f"double backward is not supported by window_attention (backend {backend!r}) on a "
                "QueryRowsLayout: its backward is itself not differentiable"
            )
        if torch.is_grad_enabled():  # create_graph=True: the backward op, whose own backward says it is unsupported
            ranges, geometry, intra_causal, queries_all = layout_args(layout)
            grads = torch.ops.kforcing_kernels.window_attention_backward(
                dout, q, k, v, out, lse, ranges, geometry, intra_causal, queries_all, scale, backend
            )
        else:  # autograd gives dout the shape, dtype and device of out: the forward's checks still hold
            grads = _backward_body(dout, q, k, v, out, lse, layout, scale, backend, entry)
        return (*grads, None, None, None, None)

"""Launchers of the fused Triton kernels for prefix-window attention: forward and backward.

FlashAttention-2 style: online softmax in base 2 with fp32 accumulators, the
natural-log LSE saved for the backward, which recomputes probabilities. Which
tile products run is decided by :mod:`plan` (a reduction of the layout's row
intervals); boundary tiles are masked with the same row intervals, read from a
tensor, and window slots are located through the layout's slot-to-key table, so
both storage orders (position-major, and the stream-major DoubleForward storage
``[ctx | Future-1 | Future-2]``) are read in place and no kernel re-derives the mask.

Launches per forward + backward (default): ``fwd`` (``jit_forward.py``; window tiles compute their
rows' intra-window part inline), ``delta``, ``bwd`` (``jit_backward.py``: dK/dV, dQ and the window
keys' dK/dV, programs split by id); nothing else (the ``split`` and ``legacy`` kernels of 0.4 were
removed after the H200 run: BENCHMARKS.md). Launchers take contiguous ``[B, H, L, D]`` tensors. Under
``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter on CPU tensors with
a fixed config; on a GPU each kernel is autotuned over its entries in
``configs.KERNEL_CONFIGS``, one autotuner per key (tile set, head dim, length
bucket, mode); once a key has run, the compiled kernel it chose is launched
directly (``direct.py``). The triton backend (``__init__.py``) hands this module out as
``kernels()``, so the names tests and tools use are re-exported here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple, Optional

import torch
import triton
from triton.runtime import driver as _triton_driver

from .... import env
from ....layouts import WindowLayout
from .configs import (
    CANDIDATE_CONFIGS,
    DELTA_BLOCK,
    GPU_DTYPES,
    KERNEL_CONFIGS,
    SUPPORTED_HEAD_DIMS,
    TILE_SETS,
    TILES_BY_HEAD_DIM,
    autotune_enabled,
    check_head_dim,
    length_bucket,
    tile_set_for,
    tiles_for,
)
from .direct import DirectCache, direct_launch_enabled
from .jit_backward import _bwd_kernel, _delta_kernel
from .jit_common import ALIGNED_STRIDES, FLOAT_ARGS, FP32_POINTERS, IO_POINTERS, LOG2E, PLAN_POINTERS, interpreting
from .jit_forward import _fwd_kernel
from .plan import TilePlan, Tiles, tile_plan
from .plan_device import device_plan, stream_id
from .steps import device_steps, step_plan

# The kernels by the names the configs, the autotune cache and the AOT report use.
KERNELS = {"fwd": _fwd_kernel, "delta": _delta_kernel, "bwd": _bwd_kernel}


def _tuned_kernel(kernel_name: str, key: tuple):
    """One autotuner per (kernel, tile set, head dim, length bucket, mode, autotune on/off).
    Triton adds the tensors' dtypes to its own key, so each autotuner times its configs once per dtype."""
    tile_set, head_dim = key[0], key[1]
    configs = KERNEL_CONFIGS[kernel_name][(tile_set, head_dim)]
    if not autotune_enabled():
        configs = configs[:1]
    return triton.autotune([triton.Config({}, num_warps=w, num_stages=s) for w, s in configs], key=["HEAD_DIM"])(
        KERNELS[kernel_name]
    )


_tuned_lock = threading.Lock()
_tuned: dict[tuple, Any] = {}  # triton Autotuner objects
# steady-state launches (direct.py), filled from the autotuner path's results
_direct = DirectCache(trusted=PLAN_POINTERS)


def _launch(kernel_name: str, grid: tuple, tune_key: tuple, *args, **kwargs) -> None:
    """Launch under the interpreter with a fixed config, on a GPU through the autotuner for ``tune_key``
    = (tile set, head dim, length bucket, mode) the first time a (kernel, key, constexprs, argument
    specialisation, device) is seen, then directly (direct.py); the caller holds the device guard."""
    if grid[0] * grid[1] == 0:
        return
    if grid[1] > 65535:  # CUDA's limit on grid dimension y
        raise ValueError(f"q: too long for the triton backend: {grid[1]} tiles of one kind, at most 65535")
    if interpreting():
        KERNELS[kernel_name][grid](*args, **kwargs, num_warps=4, num_stages=1)
        return
    autotune = autotune_enabled()
    direct_key = None
    if direct_launch_enabled():
        active = _triton_driver.active
        device = active.get_current_device()
        direct_key, entry = _direct.lookup(kernel_name, KERNELS[kernel_name], tune_key, autotune, device, args, kwargs)
        if entry is not None:
            entry(grid, args, active.get_current_stream(device))
            return
    key = (kernel_name, *tune_key, autotune)
    with _tuned_lock:
        tuned = _tuned.get(key)
        if tuned is None:
            tuned = _tuned[key] = _tuned_kernel(kernel_name, tune_key)
    kernel = tuned[grid](*args, **kwargs)
    if direct_key is not None:
        _direct.remember(direct_key, KERNELS[kernel_name], kernel, len(args), kwargs)


# ====================================================================== launchers


# Counter slots of an instrumented run (int32 [5]), per (batch, query head) summed over the grid.
COUNTER_NAMES = ("fwd_tiles", "fwd_slot_steps", "dq_tiles", "bwd_slot_steps", "dkdv_tiles")


_no_counters: dict[str, torch.Tensor] = {}


def _counters(device, counters: Optional[torch.Tensor]) -> torch.Tensor:
    if counters is None:  # a valid pointer the uninstrumented kernels never touch (never freed)
        if str(device) not in _no_counters:
            _no_counters[str(device)] = torch.zeros(1, dtype=torch.int32, device=device)
        return _no_counters[str(device)]
    if counters.dtype != torch.int32 or counters.numel() != len(COUNTER_NAMES):
        raise ValueError(
            f"counters: expected int32 [{len(COUNTER_NAMES)}], got {counters.dtype} {tuple(counters.shape)}"
        )
    return counters


# Offsets inside one (batch, head) slice are int32 in the kernels (only the batch/head offset is int64).
# That is safe because the 65535-tile grid limit caps a head at 65535 * 128 rows of <= 128 elements,
# 2^30 < 2^31 elements; this check keeps the bound explicit should the tiles or the limit change.
INT32_LIMIT = 2**31


def _check_shapes(q, k, layout: WindowLayout, *others: torch.Tensor) -> None:
    check_head_dim(q.shape[-1])
    if (q.shape[2], k.shape[2]) != (layout.n_queries, layout.n_keys):
        raise ValueError(
            f"q, k: expected lengths ({layout.n_queries}, {layout.n_keys}) from the layout, "
            f"got ({q.shape[2]}, {k.shape[2]})"
        )
    if layout.batch_size not in (None, q.shape[0]):
        raise ValueError(f"layout: expected per-batch ranges for batch {q.shape[0]}, got {layout.batch_size}")
    for name, t in zip(("k", "v", "dout", "out", "lse"), (k, *others)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} like q, got {t.device}")
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] * t.stride(2) >= INT32_LIMIT:
            raise ValueError(
                f"{name}: one head spans {t.shape[2] * t.stride(2)} elements; the triton backend "
                f"indexes within a head in int32 (< 2^31)"
            )


def _resolve_tiles(tiles: Optional[Tiles], q: torch.Tensor) -> tuple[Tiles, str]:
    """(tiles, tile set name). Explicit tiles outside every set tune over the base set's configs."""
    d = q.shape[-1]
    if tiles is None:
        name = tile_set_for(d, q.shape[2], q.device)
        return TILE_SETS[name][d], name
    return tiles, next((n for n, by_d in TILE_SETS.items() if by_d.get(d) == tiles), "base")


def _tune_key(tile_set: str, q: torch.Tensor, plan: TilePlan) -> tuple:
    """What changes the best config: tile set, head dim, length bucket, mode (slot or tile intra part,
    causal or full intra). Triton's autotuner adds the dtypes itself."""
    mode = ("slot" if plan.intra_blocks else "tile") + ("-causal" if plan.geometry.causal else "-full")
    return (tile_set, q.shape[-1], length_bucket(q.shape[2]), mode)


_NO_GUARD = contextlib.nullcontext()


def _device_guard(t: torch.Tensor):
    """Launch on ``t``'s device: Triton launches on the current device and its current stream (no guard
    needed, and none entered, when that already is ``t``'s)."""
    index = t.get_device()  # -1 on the CPU
    if index < 0 or index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(index)


# The host state of a launch (tiles, tile plan, autotune key, device copies): per layout, head dim, query rows,
# device, stream and the tile switch. Building it reads the layout's derived store (hashing the tiles,
# formatting the device, querying the stream) on every call; a training step repeats one key.
HOST_STATE_MAX = 64


class HostState:
    """What a launch needs besides its tensors: ``tiles`` and ``tile_set`` (the tile choice for q's head dim and
    the ``KFORCING_TRITON_TILES`` switch), ``plan`` (``plan.tile_plan`` of the layout for those tiles), ``key``
    (the autotune key), ``pt`` (the plan's device copies, ``plan_device.device_plan``), ``counters`` and the
    ``layout`` / ``device`` / ``stream`` it was made for."""

    __slots__ = ("tiles", "tile_set", "plan", "key", "pt", "counters", "layout", "device", "stream", "_steps")

    def __init__(self, layout, q, tiles, counters):
        self.tiles, self.tile_set = _resolve_tiles(tiles, q)
        self.plan = tile_plan(layout, self.tiles)
        self.key = _tune_key(self.tile_set, q, self.plan)
        self.layout, self.device, self.stream = layout, q.device, stream_id(q.device)
        self.pt = device_plan(self.plan, layout, self.device)
        self.counters = _counters(self.device, counters)
        self._steps = None

    def steps(self) -> dict:
        """The dK/dV step list's device copies (steps.device_steps), made on first use."""
        if self._steps is None:
            self._steps = device_steps(
                step_plan(self.layout, self.plan), self.layout, self.tiles, self.device, self.stream
            )
        return self._steps


_host_states: dict[tuple, HostState] = {}
_host_lock = threading.Lock()


def host_state(
    layout, q: torch.Tensor, tiles: Optional[Tiles] = None, counters: Optional[torch.Tensor] = None
) -> HostState:
    """The host state a launch for ``layout`` and queries ``q [B, H, Lq, D]`` uses (its device and current
    stream). With the default tiles and no counters it is cached per (layout, D, Lq, device, stream,
    ``KFORCING_TRITON_TILES``): batch and heads are not in the key; at most :data:`HOST_STATE_MAX` states, the
    oldest out (:func:`host_state_info`, :func:`clear_host_states`). Explicit ``tiles`` or ``counters``: a state
    built for the call, never cached."""
    if tiles is not None or counters is not None:
        return HostState(layout, q, tiles, counters)
    device = q.device
    key = (layout, q.shape[-1], q.shape[2], device, stream_id(device), env.triton_tiles())
    state = _host_states.get(key)
    if state is None:
        state = HostState(layout, q, None, None)
        with _host_lock:
            while len(_host_states) >= HOST_STATE_MAX:
                del _host_states[next(iter(_host_states))]
            _host_states[key] = state
    return state


def clear_host_states() -> None:
    """Forget the cached host states (tests; tile tables changed in place)."""
    with _host_lock:
        _host_states.clear()


class HostStateInfo(NamedTuple):
    """A snapshot of the cached host states (:func:`host_state_info`): ``size`` held, at most ``max_size``
    (:data:`HOST_STATE_MAX`); ``tile_sets``: each state's tile set, oldest first."""

    size: int
    max_size: int
    tile_sets: tuple[str, ...]


def host_state_info() -> HostStateInfo:
    """What the host-state cache holds now (tests, benchmarks)."""
    with _host_lock:
        return HostStateInfo(len(_host_states), HOST_STATE_MAX, tuple(s.tile_set for s in _host_states.values()))


def attention_forward(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    layout: WindowLayout,
    scale: float,
    *,
    tiles: Optional[Tiles] = None,  # default: tiles_for(D, Lq, q.device)
    counters: Optional[torch.Tensor] = None,  # int32 [5]: count executed products (interpreter tests)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused forward: ``(out [B, H, Lq, D] in q.dtype, lse [B, H, Lq] fp32, natural log)``.

    Runs on q's device (any ``cuda:i``) and that device's current stream."""
    _check_shapes(q, k, layout, v)
    with _device_guard(q):
        return _forward(q, k, v, layout, scale, tiles, counters)


def check_inputs(q, k, v, layout: WindowLayout) -> None:
    """``attention_forward``'s checks of inputs that the op hands over contiguous (its eager cache runs them once
    per input signature; forward_checked / backward_checked then skip them)."""
    _check_shapes(q.contiguous(), k.contiguous(), layout, v)


def forward_checked(q, k, v, layout: WindowLayout, scale: float):
    """``attention_forward`` without its checks, for inputs ``window_attention`` has validated (triton.eager_ops)."""
    with _device_guard(q):
        return _forward(q, k, v, layout, scale, None, None)


def _forward(q, k, v, layout, scale, tiles, counters):
    bsz, n_heads, lq, d = q.shape
    hs = host_state(layout, q, tiles, counters)
    tiles, plan, key, pt, counters = hs.tiles, hs.plan, hs.key, hs.pt, hs.counters
    g = plan.geometry
    instrument = counters.numel() > 1
    kv_group = n_heads // k.shape[1]
    q_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))

    out = torch.empty_like(q)
    lse = torch.empty(bsz, n_heads, lq, dtype=torch.float32, device=q.device)
    _launch(
        "fwd",
        (bsz * n_heads, plan.num_query_tiles),
        key,
        q,
        k,
        v,
        out,
        lse,
        pt["query_tiles"],
        pt["bounds"],
        pt["order"],
        pt["row_iv"],
        pt["window_keys"],
        pt["row_slot0"],
        counters,
        *q_strides,
        lse.stride(0),
        lse.stride(1),
        pt["bounds_bstride"],
        pt["iv_bstride"],
        n_heads,
        kv_group,
        g.n_keys,
        g.n_ctx,
        g.query_offset,
        g.n_intervals,
        pt["n_iv"],
        g.window_size,
        scale * LOG2E,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        HEAD_DIM=d,
        INSTRUMENT=instrument,
    )
    return out, lse


def attention_backward(
    dout: torch.Tensor,  # [B, H, Lq, D]
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    out: torch.Tensor,  # [B, H, Lq, D]
    lse: torch.Tensor,  # [B, H, Lq] fp32, natural log
    layout: WindowLayout,
    scale: float,
    *,
    tiles: Optional[Tiles] = None,  # default: tiles_for(D, Lq, q.device), as in the forward
    counters: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: ``(dq, dk, dv)`` shaped and typed like ``q, k, v``, on q's device and stream."""
    _check_shapes(q, k, layout, v, dout, out, lse)
    with _device_guard(q):
        return _backward(dout, q, k, v, out, lse, layout, scale, tiles, counters)


def backward_checked(dout, q, k, v, out, lse, layout: WindowLayout, scale: float):
    """``attention_backward`` without its checks, for the backward of a validated call (triton.eager_ops)."""
    with _device_guard(q):
        return _backward(dout, q, k, v, out, lse, layout, scale, None, None)


def _backward(dout, q, k, v, out, lse, layout, scale, tiles, counters):
    bsz, n_heads, lq, d = q.shape
    n_kv = k.shape[1]
    hs = host_state(layout, q, tiles, counters)
    tiles, plan, key, pt, counters = hs.tiles, hs.plan, hs.key, hs.pt, hs.counters
    g = plan.geometry
    instrument = counters.numel() > 1
    lse = lse.to(torch.float32).contiguous()
    kv_group = n_heads // n_kv
    strides = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        lse.stride(0),
        lse.stride(1),
    )

    delta = torch.empty(bsz, n_heads, lq, dtype=torch.float32, device=q.device)
    n_rows = bsz * n_heads * lq
    _launch("delta", (-(-n_rows // DELTA_BLOCK), 1), key, out, dout, delta, n_rows, BLOCK_M=DELTA_BLOCK, HEAD_DIM=d)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    st = hs.steps()
    n_dkdv = bsz * n_kv * plan.num_key_tiles
    n_dq = bsz * n_heads * plan.num_query_tiles
    n_slot = bsz * n_kv * plan.intra_blocks
    _launch(
        "bwd",
        (n_dkdv + n_dq + n_slot, 1),
        key,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        dk,
        dv,
        pt["query_tiles"],
        pt["bounds"],
        pt["order"],
        pt["key_tiles"],
        st["step_ptr"],
        st["step_entries"],
        st["step_order"],
        pt["row_iv"],
        pt["window_keys"],
        pt["row_slot0"],
        counters,
        *strides,
        pt["bounds_bstride"],
        st["stepptr_bstride"],
        pt["iv_bstride"],
        n_heads,
        n_kv,
        kv_group,
        g.n_keys,
        g.n_ctx,
        g.query_offset,
        g.n_intervals,
        pt["n_iv"],
        g.num_windows,
        g.window_size,
        plan.windows_per_block,
        bsz * n_heads,
        bsz * n_kv,
        n_dkdv,
        n_dq,
        scale * LOG2E,
        scale,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_M_STEP=tiles.dkdv_step_rows,
        BLOCK_N_DKDV=tiles.block_n_dkdv,
        BLOCK_T=tiles.block_t,
        HEAD_DIM=d,
        INSTRUMENT=instrument,
    )
    return dq, dk, dv


__all__ = [
    "attention_forward",
    "host_state",
    "host_state_info",
    "clear_host_states",
    "HostState",
    "HostStateInfo",
    "HOST_STATE_MAX",
    "attention_backward",
    "interpreting",
    "check_head_dim",
    "tiles_for",
    "tile_set_for",
    "length_bucket",
    "autotune_enabled",
    "SUPPORTED_HEAD_DIMS",
    "KERNELS",
    "KERNEL_CONFIGS",
    "IO_POINTERS",
    "FP32_POINTERS",
    "FLOAT_ARGS",
    "ALIGNED_STRIDES",
    "CANDIDATE_CONFIGS",
    "TILE_SETS",
    "TILES_BY_HEAD_DIM",
    "COUNTER_NAMES",
    "GPU_DTYPES",
]

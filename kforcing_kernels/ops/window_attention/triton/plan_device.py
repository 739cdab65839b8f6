"""The int32 device copies of a tile plan and of the layout tables the Triton kernels read (``device_plan``),
cached per layout content, device and CUDA stream (``device_copy``), and kept for the process once a CUDA-graph
capture has used them. The host-side plans are plan.py's (this module reads them; plan.py never imports it)."""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import torch

from ....layouts import WindowLayout
from ...common.torch_compat import current_cuda_stream_handle
from .plan import TilePlan


def stream_id(device: torch.device) -> int:
    """The current stream's handle on ``device`` (``torch.cuda.current_stream(device).cuda_stream``, without
    making a Stream object); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return current_cuda_stream_handle(device.index if device.index is not None else torch.cuda.current_device())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Device copies by (layout content, artifact, device): the latest made on any stream, what a CUDA-graph capture
# uses (no host-to-device copy can run while a stream captures), and the ones a capture used, kept for the
# process (a graph holds their addresses and does not keep the tensors alive).
DEVICE_COPIES_MAX = 64
_latest_copies: "collections.OrderedDict[tuple, dict]" = collections.OrderedDict()
_captured_copies: dict[tuple, dict] = {}
_copies_lock = threading.Lock()


def device_copy(layout, name: tuple, device: torch.device, build) -> dict:
    """``build()`` (a dict of device tensors made on the current stream) cached per layout content, ``name``, device
    and current stream (``layout.derived``). Per stream: each copy is made and used on one stream, so the caching
    allocator never hands its memory to another stream while a kernel there may still read it.

    While the current stream captures a CUDA graph, nothing is uploaded: the latest copy made on any stream of
    ``device`` is used (a warm-up call before the capture makes it) and kept alive for the process, since the
    graph reads it at every replay; with no such copy this raises naming the fix. Call under ``device``'s guard."""
    index = (layout.cache_key, name, str(device))
    if _capturing(device):
        with _copies_lock:
            value = _captured_copies.get(index) or _latest_copies.get(index)
            if value is None:
                raise RuntimeError(
                    f"window_attention (triton): {name[0]} of this layout has no copy on {device} yet, and the "
                    "current stream is capturing a CUDA graph, where no host-to-device copy can run; call the op "
                    "once with this layout, shapes and device before the capture (a warm-up)"
                )
            _captured_copies[index] = value
        return value
    value = layout.derived((*name, str(device), stream_id(device)), build)
    with _copies_lock:
        _latest_copies[index] = value
        _latest_copies.move_to_end(index)
        while len(_latest_copies) > DEVICE_COPIES_MAX:
            _latest_copies.popitem(last=False)
    return value


class DeviceCopiesInfo(NamedTuple):
    """A snapshot of the device copies a CUDA-graph capture may read (:func:`device_copies_info`): ``latest``
    (the latest copy per layout content, artifact and device, at most ``max_latest`` = :data:`DEVICE_COPIES_MAX`)
    and ``captured`` (those a capture used, kept for the process)."""

    latest: int
    max_latest: int
    captured: int


def device_copies_info() -> DeviceCopiesInfo:
    """How many device copies this module keeps now (tests, benchmarks)."""
    with _copies_lock:
        return DeviceCopiesInfo(len(_latest_copies), DEVICE_COPIES_MAX, len(_captured_copies))


def clear_device_copies(*, captured: bool = False) -> None:
    """Forget the latest copies (a later capture then needs a new warm-up; the layouts' stores keep theirs), and
    with ``captured=True`` the ones a capture used too: only when no graph captured with them will replay
    (tests)."""
    with _copies_lock:
        _latest_copies.clear()
        if captured:
            _captured_copies.clear()


def device_plan(plan: TilePlan, layout: WindowLayout, device: torch.device) -> dict:
    """The plan, the layout's row intervals and slot-to-key table as int32 tensors on ``device``, with the
    batch strides the kernels take (built once per layout content, device and current stream; under a
    CUDA-graph capture, the copy a warm-up made: ``device_copy``). Call under the device guard of ``device``.
    """
    return device_copy(layout, ("triton.device_plan", plan.tiles), device, lambda: _upload(plan, layout, device))


def _row_slot0(layout: WindowLayout) -> torch.Tensor:
    """int64 [window tokens]: per window row (key - n_ctx), where its window's slot 0 is in the flat
    slot-to-key table: the inverse of ``window_token_keys``, so kernels that walk query tiles find a
    row's window slots without a storage formula."""
    keys = layout.window_token_keys
    valid = keys >= 0
    slot0 = (torch.arange(keys.shape[0]) * keys.shape[1])[:, None].expand_as(keys)
    out = torch.zeros(int(valid.sum()), dtype=torch.int64)
    out[keys[valid] - layout.n_ctx] = slot0[valid]
    return out


def device_int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` flat as a contiguous int32 tensor on ``device``, 16-byte aligned (four zeros when empty: a
    kernel needs a valid pointer). The direct launch (direct.py) trusts the plan tables' dtype and
    alignment instead of checking them per launch, so every table a kernel reads is made here."""
    x = x.reshape(-1) if x.numel() else torch.zeros(4, dtype=torch.int32)
    x = x.to(device=device, dtype=torch.int32).contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()  # a fresh allocation is aligned


def _upload(plan: TilePlan, layout: WindowLayout, device: torch.device) -> dict:
    row_iv = layout.row_intervals_int32

    def dev(x: torch.Tensor) -> torch.Tensor:
        return device_int32(x, device)

    return dict(
        query_tiles=dev(plan.query_tiles),
        bounds=dev(plan.bounds),
        order=dev(plan.order),
        key_tiles=dev(plan.key_tiles),
        row_iv=dev(row_iv),
        window_keys=dev(layout.window_token_keys),
        row_slot0=dev(_row_slot0(layout)),
        bounds_bstride=plan.bounds[0].numel() if plan.bounds.shape[0] > 1 else 0,
        iv_bstride=row_iv[0].numel() if row_iv.shape[0] > 1 else 0,
        n_iv=row_iv.shape[2],
    )

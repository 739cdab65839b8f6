"""The dK/dV kernel's work list: per key tile, the query-row steps that see it, full steps first.

The pipelined dK/dV kernel (``jit_backward._dkdv_kernel``) runs two flat loops per key
tile, one over steps whose rows all see every key of the tile (no mask arithmetic) and
one over the rest. A *step* is ``Tiles.dkdv_step_rows`` consecutive rows of one query
tile of the plan (query tiles never mix context and window rows, so neither do steps).
Which key tiles a step touches, and whether it is full there, is the same reduction of
``layout.row_intervals()`` the plan makes per query tile (``plan.tile_intervals``),
made per step: a step visits only the key tiles its own rows see, so a query tile's
staircase is not paid at the tile's coarser grain.

    key tile t of batch b:   entries[ptr[b, t, 0] : ptr[b, t, 1]]   full steps
                             entries[ptr[b, t, 1] : ptr[b, t, 2]]   masked steps
    entry:                   (row start, rows <= step, interval)

Built once per layout content and tile shape (``layout.derived``), like the plan.
"""

from __future__ import annotations

import dataclasses

import torch

from ....layouts import WindowLayout
from .plan import TilePlan, tile_intervals, transpose_intervals
from .plan_device import device_copy, device_int32


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """The dK/dV work list of one tile plan. All tensors int32 on the CPU; B' as in TilePlan.

    Attributes:
        ptr: [B', KT, 3] ``(begin, first masked, end)`` into ``entries`` per key tile (absolute).
        entries: [E, 3] ``(row start, rows, interval)`` per (key tile, step) product.
        order: [KT] key tiles, most steps first (the launch order).
    """

    ptr: torch.Tensor
    entries: torch.Tensor
    order: torch.Tensor

    def products(self) -> torch.Tensor:
        """int64 [B']: (key tile, step) products the dK/dV kernel runs per (batch, query head)."""
        return (self.ptr[..., 2] - self.ptr[..., 0]).to(torch.int64).sum(1)

    def full_products(self) -> torch.Tensor:
        """int64 [B']: those of them that run without a mask."""
        return (self.ptr[..., 1] - self.ptr[..., 0]).to(torch.int64).sum(1)


def _steps(plan: TilePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, rows) int64 [S] of every step: each query tile cut into dkdv_step_rows pieces."""
    step = plan.tiles.dkdv_step_rows
    starts, lens = plan.query_tiles[:, 0].long(), plan.query_tiles[:, 1].long()
    per_tile = -(-lens // step)
    owner = torch.repeat_interleave(torch.arange(starts.numel()), per_tile)
    index = torch.arange(owner.numel()) - (torch.cumsum(per_tile, 0) - per_tile)[owner]
    return starts[owner] + index * step, torch.clamp(lens[owner] - index * step, max=step)


def _build(layout: WindowLayout, plan: TilePlan) -> StepPlan:
    start, rows = _steps(plan)
    intervals = tile_intervals(layout, plan.geometry, dict(q_start=start, q_len=rows))  # [B', S, J, 4]
    key_ptr, entries = transpose_intervals(intervals, plan.key_tiles.long())  # grouped by (batch, key tile)
    nb, kt = key_ptr.shape[0], plan.num_key_tiles
    counts = (key_ptr[:, 1:] - key_ptr[:, :-1]).reshape(-1)
    group = torch.repeat_interleave(torch.arange(nb * kt), counts)
    full = entries[:, 2]
    # Within each key tile, full steps first (stable: ascending rows within each kind).
    entries = entries[torch.sort(group * 2 + (1 - full), stable=True).indices]
    n_full = torch.zeros(nb * kt, dtype=torch.int64).index_add_(0, group, full).reshape(nb, kt)
    begin = key_ptr[:, :-1]
    ptr = torch.stack([begin, begin + n_full, key_ptr[:, 1:]], -1)
    step = entries[:, 0]
    table = torch.stack([start[step], rows[step], entries[:, 1]], -1)
    order = torch.sort((ptr[..., 2] - ptr[..., 0]).sum(0), descending=True, stable=True).indices
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return StepPlan(ptr=i32(ptr), entries=i32(table), order=i32(order))


def step_plan(layout: WindowLayout, plan: TilePlan) -> StepPlan:
    """The dK/dV step list of ``plan`` (a plan of ``layout``), built once per layout content and tiles."""
    return layout.derived(("triton.step_plan", plan.tiles), lambda: _build(layout, plan))


def device_steps(steps: StepPlan, layout: WindowLayout, tiles, device: torch.device, stream: int = 0) -> dict:
    """``steps`` as int32 tensors on ``device`` (cached as ``plan_device.device_plan``: per device and current
    stream, or a warm-up's copy under a CUDA-graph capture: ``plan_device.device_copy``). ``stream``: unused, kept
    for callers."""

    def upload() -> dict:
        def dev(x: torch.Tensor) -> torch.Tensor:
            return device_int32(x, device)

        return dict(
            step_ptr=dev(steps.ptr),
            step_entries=dev(steps.entries),
            step_order=dev(steps.order),
            stepptr_bstride=steps.ptr[0].numel() if steps.ptr.shape[0] > 1 else 0,
        )

    return device_copy(layout, ("triton.device_steps", tiles), device, upload)


__all__ = ["StepPlan", "step_plan", "device_steps"]

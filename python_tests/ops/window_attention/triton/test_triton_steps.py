"""The pipelined dK/dV kernel's work list (triton/steps.py) against the layout's dense mask.

Independent of the kernels: every attended (query row, key) pair whose key lies in a dK/dV
key tile is visited by exactly one (key tile, step) entry; an entry listed as full has every
pair of its block attended (so skipping the mask there is exact); the
kernel's launch order is a permutation of the key tiles. The interpreter runs the kernel
itself (test_triton_interpreter_cases.py).
"""

import pytest
import torch

from kforcing_kernels import WindowLayout
from kforcing_kernels.layouts import zoo
from kforcing_kernels.ops.window_attention.triton.configs import TILE_SETS
from kforcing_kernels.ops.window_attention.triton.plan import Tiles, tile_plan
from kforcing_kernels.ops.window_attention.triton.steps import step_plan

TILES = {
    "small-steps": Tiles(32, 16, 16, 16, block_m_dkdv=16),
    "one-step": Tiles(16, 16, 32, 16),
    "hopper64": TILE_SETS["hopper"][64],
    "wide": TILE_SETS["wide"][128],
}


def _layouts() -> dict[str, WindowLayout]:
    layouts = dict(zoo.small())
    layouts["packed-single"] = WindowLayout.kforcing_single(90, 2, cu_seqlens=[0, 30, 61, 90])
    layouts["packed-per-batch"] = WindowLayout.causal(150, cu_seqlens=[[0, 70, 150], [0, 33, 150]])
    layouts["double-k8"] = WindowLayout.kforcing_double(70, 8)
    layouts["blank-rows"] = WindowLayout(12, 5, 3, [0, 4, 4, 0, 7], [0, 9, 4, 12, 7], last_window_size=2)
    return layouts


@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
@pytest.mark.parametrize("name", sorted(_layouts()))
def test_steps_visit_every_attended_pair_once(name, tiles):
    layout = _layouts()[name]
    plan = tile_plan(layout, tiles)
    steps = step_plan(layout, plan)
    dense = layout.dense_mask()
    dense = dense if dense.dim() == 3 else dense[None]
    nb = steps.ptr.shape[0]
    assert sorted(steps.order.tolist()) == list(range(plan.num_key_tiles))
    for b in range(dense.shape[0]):
        visits = torch.zeros(dense.shape[1:], dtype=torch.int64)
        in_key_tiles = torch.zeros(dense.shape[2], dtype=torch.bool)
        for kt, (k0, kl) in enumerate(plan.key_tiles.tolist()):
            in_key_tiles[k0 : k0 + kl] = True
            begin, first_masked, end = steps.ptr[b if nb > 1 else 0, kt].tolist()
            assert begin <= first_masked <= end
            for e in range(begin, end):
                r0, rows, interval = steps.entries[e].tolist()
                assert 0 < rows <= tiles.dkdv_step_rows and 0 <= interval < plan.geometry.n_intervals
                block = dense[b, r0 : r0 + rows, k0 : k0 + kl]
                if e < first_masked:
                    assert block.all(), f"entry {e} of key tile {kt} is listed full but has masked pairs"
                visits[r0 : r0 + rows, k0 : k0 + kl] += block.long()
        want = dense[b] & in_key_tiles[None, :]
        assert torch.equal(visits, want.long()), (
            f"batch {b}: pairs visited {int(visits.sum())}, attended {int(want.sum())}"
        )
    assert int(steps.products().sum()) == steps.entries.shape[0]
    assert (steps.full_products() <= steps.products()).all()


def test_full_steps_exist_where_the_mask_is_dense():
    """Causal N = 1024 with 64-key tiles and 64-row steps: T = 16 diagonal blocks are masked, the
    T (T - 1) / 2 below them run mask-free."""
    layout = WindowLayout.causal(1024)
    steps = step_plan(layout, tile_plan(layout, TILE_SETS["hopper"][64]))
    assert (int(steps.full_products().sum()), int(steps.products().sum())) == (16 * 15 // 2, 16 * 17 // 2)


def test_steps_are_derived_once_per_layout_content():
    a, b = WindowLayout.kforcing_single(200, 4), WindowLayout.kforcing_single(200, 4)
    tiles = TILE_SETS["hopper"][64]
    assert step_plan(a, tile_plan(a, tiles)) is step_plan(b, tile_plan(b, tiles))

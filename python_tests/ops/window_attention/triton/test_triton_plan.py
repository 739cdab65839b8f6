"""The analytic tile plan of the Triton kernels, checked against the layout's dense mask (pure torch)."""

import pytest
import torch

from kforcing_kernels import WindowLayout
from kforcing_kernels.ops.window_attention.triton.plan import DEFAULT_TILES, SLOT_WINDOW_MAX, Tiles, tile_plan


def general_layouts():
    """Layouts beyond the named constructors: empty ranges, full intra with streams, long windows."""
    return {
        "empty_ranges": WindowLayout(12, 5, 3, [0, 4, 4, 0, 7], [0, 9, 4, 12, 7], last_window_size=2),
        "full_streams": WindowLayout(9, 4, 6, [0, 2, 3, 1], [3, 5, 9, 9], intra="full", queries="windows", n_streams=2),
        "long_streams": WindowLayout(20, 3, 40, [0, 5, 20], [10, 20, 20], queries="all", n_streams=2),
        "long_short_last": WindowLayout(11, 3, 37, [2, 0, 3], [9, 11, 3], last_window_size=5, intra="full"),
        "no_context": WindowLayout(0, 4, 5, [0, 0, 0, 0], [0, 0, 0, 0]),
        # Rows whose context start moves inside one query tile while the rows still share keys (issue 40): a
        # sliding-window context (each row sees its last 21 tokens) and SpecForge's per-slot sliding blocks.
        "sliding_context": WindowLayout(
            90,
            2,
            5,
            [10, 0],
            [60, 90],
            queries="all",
            context_lo=(torch.arange(90) - 20).clamp(min=0),
            context_hi=torch.arange(1, 91),
        ),
        "anchor_blocks_sliding_slot": WindowLayout.anchor_blocks(100, [40, 90], 24, window=30, window_mode="slot"),
    }


LAYOUTS = {
    "single": WindowLayout.kforcing_single(37, 3),
    "double": WindowLayout.kforcing_double(29, 4),
    "double_long": WindowLayout.kforcing_double(9, 12),  # w = 24 > SLOT_WINDOW_MAX: tile mode with streams
    "sbd": WindowLayout.sbd(45, 4),
    "ptp_batched": WindowLayout.ptp(50, [[10, 30, 50], [0, 7, 44]], 20, [[0, 10, 30], [0, 7, 5]]),
    "jacobi": WindowLayout.jacobi(21, 70),
    "causal": WindowLayout.causal(77),
    **general_layouts(),
}
TILES = [Tiles(16, 16, 16, 16), Tiles(32, 16, 32, 32), DEFAULT_TILES]


def _covered(plan, layout):
    """bool [B', Lq, Lk]: pairs some forward tile product or slot step computes, and pairs of full tiles."""
    nb = plan.bounds.shape[0]
    covered = torch.zeros(nb, layout.n_queries, layout.n_keys, dtype=torch.bool)
    full = torch.zeros_like(covered)
    bn = plan.tiles.block_n
    for t, (q_start, q_len, _) in enumerate(plan.query_tiles.tolist()):
        rows = slice(q_start, q_start + q_len)
        for b in range(nb):
            for key_start, n_tiles, f0, f1 in plan.bounds[b, t].tolist():
                for i in range(n_tiles):
                    keys = slice(key_start + i * bn, min(key_start + (i + 1) * bn, layout.n_keys))
                    covered[b, rows, keys] = True
                    if f0 <= i < f1:
                        full[b, rows, keys] = True
    if plan.intra_blocks:  # slot steps: every window row sees its own window's slots
        keys = layout.window_token_keys  # [M, w]
        for m in range(layout.num_windows):
            own = keys[m][keys[m] >= 0]
            covered[:, (own - layout.query_offset)[:, None], own[None, :]] = True
    return covered, full


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_plan_covers_mask_and_full_tiles_are_full(name, tiles):
    layout = LAYOUTS[name]
    plan = tile_plan(layout, tiles)
    mask = layout.dense_mask().reshape(-1, layout.n_queries, layout.n_keys)
    covered, full = _covered(plan, layout)
    assert not bool((mask & ~covered).any()), "a visible pair is in no visited tile"
    assert bool((mask | ~full).all()), "a tile marked full contains a hidden pair"
    # Query tiles partition the rows, and never mix context and window rows.
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in plan.query_tiles.tolist()])
    assert torch.equal(torch.sort(rows).values, torch.arange(layout.n_queries))
    ctx_rows = layout.n_ctx - layout.query_offset
    for s, n, seeded in plan.query_tiles.tolist():
        assert n <= tiles.block_m
        assert (s + n <= ctx_rows) or (s >= ctx_rows)
        assert seeded == int(s >= ctx_rows and plan.geometry.use_slots)


@pytest.mark.parametrize("tiles", TILES[:2], ids=str)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_transposed_plan_covers_every_key(name, tiles):
    layout = LAYOUTS[name]
    plan = tile_plan(layout, tiles)
    mask = layout.dense_mask().reshape(-1, layout.n_queries, layout.n_keys)
    nb = mask.shape[0]
    covered = torch.zeros_like(mask)
    full = torch.zeros_like(mask)
    for b in range(nb):
        for kt, (k_start, k_len) in enumerate(plan.key_tiles.tolist()):
            e0, e1 = plan.key_ptr[b, kt].item(), plan.key_ptr[b, kt + 1].item()
            for qtile, _, is_full in plan.key_entries[e0:e1].tolist():
                q_start, q_len, _ = plan.query_tiles[qtile].tolist()
                covered[b, q_start : q_start + q_len, k_start : k_start + k_len] = True
                if is_full:
                    full[b, q_start : q_start + q_len, k_start : k_start + k_len] = True
    key_tile_keys = torch.zeros(layout.n_keys, dtype=torch.bool)
    for k_start, k_len in plan.key_tiles.tolist():
        assert not bool(key_tile_keys[k_start : k_start + k_len].any()), "key tiles overlap"
        key_tile_keys[k_start : k_start + k_len] = True
    if plan.intra_blocks:  # the slot kernel owns window keys, which only their own window sees
        assert torch.equal(key_tile_keys, torch.arange(layout.n_keys) < layout.n_ctx)
        mask = mask[:, :, : layout.n_ctx]
        covered, full = covered[:, :, : layout.n_ctx], full[:, :, : layout.n_ctx]
    else:
        assert bool(key_tile_keys.all())
    assert not bool((mask & ~covered).any())
    assert bool((mask | ~full).all())


@pytest.mark.parametrize("tiles", [DEFAULT_TILES, Tiles(64, 64, 64, 32)], ids=str)
@pytest.mark.parametrize("which", ["single", "double"])
def test_tile_waste_at_n1024_k4(which, tiles):
    """visited * BLOCK_M * BLOCK_N / |M| <= 1.10 at the dispatcher's tiles (FlexAttention 128x128: ~1.34)."""
    layout = (WindowLayout.kforcing_single if which == "single" else WindowLayout.kforcing_double)(1024, 4)
    plan = tile_plan(layout, tiles)
    ratio = plan.waste_ratio(layout.num_pairs())
    assert ratio <= 1.10, ratio
    # The slot kernel's work (block_t pairs per step) keeps the total near |M| too.
    assert plan.waste_ratio(layout.num_pairs(), include_slot_steps=True) <= 1.13
    # Exact tile count for SingleForward at 64x64: 136 causal context tiles + sum_i ceil(16(i+1)/64) = 544.
    if which == "single" and tiles.block_m == tiles.block_n == 64:
        assert int(plan.tile_products()) == 136 + 544


def test_flex_blockmask_reference_ratio():
    """The comparison point quoted for the work-accounting contract: FlexAttention's BlockMask at 128x128."""
    layout = WindowLayout.kforcing_single(1024, 4)
    tile_any, _ = layout.block_counts(128, 128)
    ratio = int(tile_any.sum()) * 128 * 128 / layout.num_pairs()
    assert 1.30 < ratio < 1.40
    assert tile_plan(layout).waste_ratio(layout.num_pairs()) < ratio - 0.2


def test_plan_is_cached_per_layout_and_ordered_longest_first():
    layout = WindowLayout.kforcing_single(300, 4)
    plan = tile_plan(layout)
    assert tile_plan(WindowLayout.kforcing_single(300, 4)) is plan  # same cache_key
    cost = plan.bounds[0, :, :, 1].sum(-1)[plan.order.long()]
    assert bool((cost[:-1] >= cost[1:]).all())
    key_cost = (plan.key_ptr[0, 1:] - plan.key_ptr[0, :-1])[plan.key_order.long()]
    assert bool((key_cost[:-1] >= key_cost[1:]).all())


def test_slot_mode_threshold():
    assert tile_plan(WindowLayout.kforcing_single(8, SLOT_WINDOW_MAX)).intra_blocks > 0
    plan = tile_plan(WindowLayout.kforcing_single(8, SLOT_WINDOW_MAX + 1))
    assert plan.intra_blocks == 0 and plan.geometry.n_intervals == 2


def test_a_tile_set_can_lower_the_slot_threshold():
    """The H100 "wide" set takes tile products for windows of 5..16 slots (measured faster there)."""
    lowered = Tiles(128, 64, 128, 32, block_m_dkdv=16, slot_window_max=4)
    assert tile_plan(WindowLayout.kforcing_single(8, 4), lowered).intra_blocks > 0
    assert tile_plan(WindowLayout.kforcing_single(8, 8), lowered).intra_blocks == 0
    assert tile_plan(WindowLayout.kforcing_single(8, 8)).intra_blocks > 0  # the base tiles keep slot steps
    with pytest.raises(ValueError, match="block_m_dkdv <= block_m"):
        tile_plan(WindowLayout.kforcing_single(8, 2), Tiles(32, 32, 32, 32, block_m_dkdv=64))


def test_plan_never_sweeps_the_mask(monkeypatch):
    """The plan is a reduction of the O(Lq) row intervals: no dense mask, mask_mod or block sweep."""

    def forbidden(*args, **kwargs):
        raise AssertionError("tile_plan swept the mask")

    for name in ("dense_mask", "mask_mod", "block_counts"):
        monkeypatch.setattr(WindowLayout, name, forbidden)
    for layout in (
        WindowLayout.kforcing_single(8192, 4),
        WindowLayout.kforcing_double(4096, 8),
        WindowLayout.ptp(4096, torch.randint(0, 4097, (2, 300)), 40),
        WindowLayout.jacobi(2048, 4096),
    ):
        plan = tile_plan(layout, Tiles(64, 64, 32, 64))
        assert plan.key_entries.shape[0] == int(plan.dkdv_tile_products().sum())


@pytest.mark.parametrize("bad", [Tiles(8, 64), Tiles(64, 48), Tiles(64, 64, 32, 8)], ids=str)
def test_bad_tiles_raise(bad):
    with pytest.raises(ValueError, match="tiles"):
        tile_plan(WindowLayout.kforcing_single(8, 2), bad)

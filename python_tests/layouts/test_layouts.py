"""Layouts: dense masks vs element-wise definitions written from the papers."""

import itertools

import pytest
import torch

# ---------------------------------------------------------------- element-wise definitions
from helpers.paper_masks import (  # noqa: E402
    jacobi_elementwise,
    kforcing_double_elementwise,
    kforcing_single_elementwise,
    ptp_elementwise,
    sbd_elementwise,
)
from kforcing_kernels import WindowLayout

SIZES = [(1, 1), (1, 3), (2, 1), (5, 2), (7, 3), (13, 4), (17, 1), (9, 8)]


@pytest.mark.parametrize("n,k", SIZES)
def test_kforcing_single_matches_paper(n, k):
    layout = WindowLayout.kforcing_single(n, k)
    assert torch.equal(layout.dense_mask(), kforcing_single_elementwise(n, k))


@pytest.mark.parametrize("n,k", SIZES)
def test_kforcing_double_matches_paper(n, k):
    layout = WindowLayout.kforcing_double(n, k)
    assert torch.equal(layout.dense_mask(), kforcing_double_elementwise(n, k))


@pytest.mark.parametrize("n,block", [(1, 1), (4, 2), (9, 4), (10, 3), (16, 16), (7, 9), (33, 5)])
def test_sbd_matches_figure9(n, block):
    layout = WindowLayout.sbd(n, block)
    assert torch.equal(layout.dense_mask(), sbd_elementwise(n, block))


@pytest.mark.parametrize(
    "n_ctx,starts,length,doc_starts",
    [(10, [3, 7, 10], 4, [0, 2, 5]), (5, [0, 5], 1, [0, 0]), (12, [12], 6, [4]), (8, [1, 1, 2, 8], 3, [1, 0, 0, 8])],
)
def test_ptp_matches_definition(n_ctx, starts, length, doc_starts):
    layout = WindowLayout.ptp(n_ctx, starts, length, doc_starts)
    assert torch.equal(layout.dense_mask(), ptp_elementwise(n_ctx, starts, length, doc_starts))


@pytest.mark.parametrize("n_prompt,n_noisy", [(1, 1), (3, 5), (8, 2)])
def test_jacobi_matches_definition(n_prompt, n_noisy):
    assert torch.equal(WindowLayout.jacobi(n_prompt, n_noisy).dense_mask(), jacobi_elementwise(n_prompt, n_noisy))


def test_causal_layout_is_tril():
    assert torch.equal(WindowLayout.causal(6).dense_mask(), torch.ones(6, 6, dtype=torch.bool).tril())


def test_per_batch_ranges_stack_per_element():
    starts = [[3, 7], [1, 10]]
    layout = WindowLayout.ptp(10, starts, 3)
    mask = layout.dense_mask()
    assert mask.shape == (2, 6, 16)
    for b in range(2):
        assert torch.equal(mask[b], ptp_elementwise(10, starts[b], 3, [0, 0]))
    assert torch.equal(layout.num_pairs(), mask.flatten(1).sum(1))


def all_layouts():
    return [
        WindowLayout.causal(9),
        WindowLayout.kforcing_single(11, 3),
        WindowLayout.kforcing_double(7, 2),
        WindowLayout.sbd(21, 4),
        WindowLayout.ptp(19, [4, 11, 19], 5, [0, 3, 0]),
        WindowLayout.jacobi(5, 9),
        WindowLayout(10, 4, 6, [0, 2, 5, 10], [3, 2, 9, 10], intra="full", queries="windows", n_streams=3),
    ]


@pytest.mark.parametrize("layout", all_layouts(), ids=repr)
def test_num_pairs_is_mask_count(layout):
    assert layout.num_pairs() == int(layout.dense_mask().sum())


def test_num_pairs_equals_paper_formulas():
    n, k = 37, 4
    single = n * (n + 1) // 2 + k * n * (n + 1) // 2 + n * k * (k + 1) // 2  # eq. 18
    assert WindowLayout.kforcing_single(n, k).num_pairs() == single
    # eq. 19 counts only Future-2 queries; our DoubleForward also computes Future-1 rows.
    f2 = k * n * (n + 1) // 2 + n * k * k + n * k * (k + 1) // 2
    f1 = k * n * (n + 1) // 2 + n * k * (k + 1) // 2
    assert WindowLayout.kforcing_double(n, k).num_pairs() == f1 + f2


@pytest.mark.parametrize("layout", all_layouts(), ids=repr)
@pytest.mark.parametrize("bq,bk", [(4, 4), (8, 2), (3, 5)])
def test_block_counts_match_dense_mask(layout, bq, bk):
    dense = layout.dense_mask()
    lq, lk = dense.shape
    nq, nk = -(-lq // bq), -(-lk // bk)
    tile_any, tile_full = layout.block_counts(bq, bk)
    for i, j in itertools.product(range(nq), range(nk)):
        tile = dense[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        assert bool(tile_any[0, i, j]) == bool(tile.any())
        assert bool(tile_full[0, i, j]) == bool(tile.all())


@pytest.mark.parametrize("layout", all_layouts(), ids=repr)
def test_mask_mod_matches_dense_mask(layout):
    mod = layout.mask_mod()
    qi = torch.arange(layout.n_queries)[:, None]
    ki = torch.arange(layout.n_keys)[None, :]
    assert torch.equal(mod(torch.tensor(0), torch.tensor(0), qi, ki), layout.dense_mask())


@pytest.mark.parametrize("layout", all_layouts(), ids=repr)
def test_to_block_mask_covers_exactly_the_visible_blocks(layout):
    bm = layout.to_block_mask(block_size=4)
    dense_blocks = bm.to_dense()[0, 0].bool()
    tile_any, _ = layout.block_counts(4, 4)
    assert torch.equal(dense_blocks[: tile_any.shape[1], : tile_any.shape[2]], tile_any[0])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(n_ctx=-1, num_windows=0, window_size=1, prefix_lo=[], prefix_hi=[]), "n_ctx"),
        (dict(n_ctx=4, num_windows=2, window_size=0, prefix_lo=[0, 0], prefix_hi=[1, 1]), "window_size"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0, 0], prefix_hi=[1, 5]), "prefix_hi"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[-1, 0], prefix_hi=[1, 1]), "prefix_lo"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[2, 0], prefix_hi=[1, 1]), "prefix_lo <= prefix_hi"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0, 0, 0], prefix_hi=[1, 1, 1]), "prefix_lo"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0, 0], prefix_hi=[1]), "prefix_hi"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0.0, 0.0], prefix_hi=[1, 1]), "prefix_lo"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0, 0], prefix_hi=[1, 1], intra="banded"), "intra"),
        (dict(n_ctx=4, num_windows=2, window_size=2, prefix_lo=[0, 0], prefix_hi=[1, 1], queries="ctx"), "queries"),
        (dict(n_ctx=4, num_windows=2, window_size=4, prefix_lo=[0, 0], prefix_hi=[1, 1], n_streams=3), "n_streams"),
        (
            dict(n_ctx=4, num_windows=2, window_size=4, prefix_lo=[0, 0], prefix_hi=[1, 1], last_window_size=5),
            "last_window_size",
        ),
        (
            dict(
                n_ctx=4,
                num_windows=2,
                window_size=4,
                prefix_lo=[0, 0],
                prefix_hi=[1, 1],
                last_window_size=2,
                n_streams=2,
            ),
            "last_window_size",
        ),
        (dict(n_ctx=0, num_windows=0, window_size=1, prefix_lo=[], prefix_hi=[]), "n_ctx"),
        (dict(n_ctx=3, num_windows=0, window_size=1, prefix_lo=[], prefix_hi=[], queries="windows"), "num_windows"),
    ],
)
def test_layout_validation_names_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        WindowLayout(**kwargs)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: WindowLayout.kforcing_single(0, 2), "n_ctx"),
        (lambda: WindowLayout.kforcing_single(3, 0), "k"),
        (lambda: WindowLayout.kforcing_double(3, -1), "k"),
        (lambda: WindowLayout.sbd(4, 0), "block"),
        (lambda: WindowLayout.ptp(4, [5], 2), "starts"),
        (lambda: WindowLayout.ptp(4, [3], 2, [0, 1]), "doc_starts"),
        (lambda: WindowLayout.ptp(4, [3], 2, [4]), "doc_starts"),  # doc start after the split point
        (lambda: WindowLayout.ptp(4, [], 2), "starts"),
        (lambda: WindowLayout.ptp(4, [3], 2, doc_ends=[2]), "doc_ends"),
        (lambda: WindowLayout.ptp(4, [3], 2, doc_ends=[4, 4]), "doc_ends"),
        (lambda: WindowLayout.kforcing_single(4, 2, cu_seqlens=[0, 2]), "cu_seqlens"),
        (lambda: WindowLayout.kforcing_single(4, 2, cu_seqlens=[1, 4]), "cu_seqlens"),
        (lambda: WindowLayout.kforcing_single(4, 2, cu_seqlens=[0, 3, 2, 4]), "cu_seqlens"),
        (lambda: WindowLayout.kforcing_single(4, 2, cu_seqlens=[0.0, 4.0]), "cu_seqlens"),
        (lambda: WindowLayout.sbd(8, 4, cu_seqlens=[0, 3, 8]), "cu_seqlens"),
        (lambda: WindowLayout.bd3lm(8, 0), "block"),
        (lambda: WindowLayout.causal(8, block=0), "block"),
        (lambda: WindowLayout.kforcing_single(True, 2), "n_ctx"),
        (lambda: WindowLayout.kforcing_single(4.0, 2), "n_ctx"),
        (lambda: WindowLayout.jacobi(0, 3), "n_prompt"),
    ],
)
def test_constructor_validation(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()

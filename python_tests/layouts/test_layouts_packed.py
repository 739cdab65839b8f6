"""Packed documents, block-causal contexts, BD3-LM and blank slots: dense masks vs
element-wise definitions written from the papers / original code, not from the layout."""

import numpy as np
import pytest
import torch

from helpers.paper_masks import (  # noqa: E402
    bd3lm_block_diff_mask,
    causal_packed_elementwise,
    kforcing_double_packed_elementwise,
    kforcing_single_packed_elementwise,
    ptp_truncated_elementwise,
    sbd_packed_elementwise,
)
from kforcing_kernels import WindowLayout

DOCS = [[0, 7], [0, 3, 7], [0, 1, 2, 7], [0, 4, 4, 7], [0, 5, 6, 7]]


@pytest.mark.parametrize("cu", DOCS)
@pytest.mark.parametrize("k", [1, 3])
def test_kforcing_single_packed(cu, k):
    got = WindowLayout.kforcing_single(7, k, cu_seqlens=cu).dense_mask()
    assert torch.equal(got, kforcing_single_packed_elementwise(7, k, cu))


@pytest.mark.parametrize("cu", DOCS)
def test_kforcing_double_packed(cu):
    got = WindowLayout.kforcing_double(7, 2, cu_seqlens=cu).dense_mask()
    assert torch.equal(got, kforcing_double_packed_elementwise(7, 2, cu))


@pytest.mark.parametrize("cu", DOCS)
@pytest.mark.parametrize("block", [None, 1, 2, 3])
def test_causal_packed_and_block_causal(cu, block):
    got = WindowLayout.causal(7, cu_seqlens=cu, block=block).dense_mask()
    assert torch.equal(got, causal_packed_elementwise(7, cu, block))


@pytest.mark.parametrize(
    "n,block,cu",
    [
        (8, 2, [0, 8]),
        (8, 2, [0, 4, 8]),
        (12, 3, [0, 3, 9, 12]),
        (6, 1, [0, 1, 2, 6]),
        (10, 3, [0, 10]),
        (11, 3, [0, 6, 11]),
        (7, 4, [0, 4, 7]),
    ],
)
def test_sbd_packed(n, block, cu):
    """The sequence end need not be a multiple of block (the last block is shorter, as unpacked)."""
    assert torch.equal(WindowLayout.sbd(n, block, cu_seqlens=cu).dense_mask(), sbd_packed_elementwise(n, block, cu))


@pytest.mark.parametrize("make", [WindowLayout.sbd, WindowLayout.bd3lm])
def test_blockwise_one_document_equals_the_unpacked_layout_and_inner_boundaries_stay_aligned(make):
    for n in range(1, 12):
        for block in range(1, 5):
            assert torch.equal(make(n, block, cu_seqlens=[0, n]).dense_mask(), make(n, block).dense_mask()), (n, block)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected document boundaries at multiples of block=3, got 5"):
        make(10, 3, cu_seqlens=[0, 5, 10])


@pytest.mark.parametrize("n,block", [(4, 1), (4, 2), (8, 2), (12, 4), (6, 3), (8, 8)])
def test_bd3lm_equals_block_diff_mask_after_reordering(n, block):
    theirs = bd3lm_block_diff_mask(n, block)
    perm = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])  # ours [x_0 | x_t] from theirs [x_t | x_0]
    assert torch.equal(WindowLayout.bd3lm(n, block).dense_mask(), theirs[perm][:, perm])


def test_bd3lm_packed_keeps_documents_apart():
    n, block, cu = 8, 2, [0, 4, 8]
    mask = WindowLayout.bd3lm(n, block, cu_seqlens=cu).dense_mask()
    single = WindowLayout.bd3lm(4, block).dense_mask()  # one 4-token document
    for a, b in [(0, 4), (4, 8)]:
        rows = list(range(a, b)) + list(range(n + a, n + b))
        assert torch.equal(mask[rows][:, rows], single)
        other = [i for i in range(2 * n) if i not in rows]
        assert not mask[rows][:, other].any()


@pytest.mark.parametrize(
    "n_ctx,starts,length,doc_starts,doc_ends",
    [(6, [2, 4, 6], 3, [0, 0, 4], [5, 4, 6]), (6, [1, 3], 4, [0, 0], [6, 2 + 3]), (5, [5], 2, [0], [5])],
)
def test_ptp_doc_ends_blank_rows(n_ctx, starts, length, doc_starts, doc_ends):
    got = WindowLayout.ptp(n_ctx, starts, length, doc_starts, doc_ends=doc_ends).dense_mask()
    assert torch.equal(got, ptp_truncated_elementwise(n_ctx, starts, length, doc_starts, doc_ends))


def test_per_batch_cu_seqlens_stack_per_element():
    cus = [[0, 7], [0, 2, 7], [0, 3, 5, 7]]
    layout = WindowLayout.kforcing_single(7, 2, cu_seqlens=cus)
    assert layout.range_batch == 3
    mask = layout.dense_mask()
    for b, cu in enumerate(cus):
        assert torch.equal(mask[b], kforcing_single_packed_elementwise(7, 2, cu))
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\]"):
        WindowLayout.kforcing_single(7, 2, cu_seqlens=[[0, 7], [0, 8]])


def test_num_pairs_counts_the_mask_with_documents_and_blanks():
    for layout in (
        WindowLayout.kforcing_single(7, 3, cu_seqlens=[0, 2, 7]),
        WindowLayout.bd3lm(8, 2, cu_seqlens=[0, 4, 8]),
        WindowLayout.ptp(6, [2, 4], 3, [0, 0], doc_ends=[3, 6]),
    ):
        assert layout.num_pairs() == int(layout.dense_mask().sum())


def test_layout_owns_its_numbers():
    lo, hi = torch.zeros(3, dtype=torch.int64), torch.tensor([1, 2, 3])
    layout = WindowLayout(3, 3, 2, lo, hi)
    before = layout.dense_mask().clone()
    hi.fill_(99)  # refilling the caller's buffer must not rewrite (or un-validate) the layout
    lo.fill_(5)
    assert torch.equal(layout.dense_mask(), before)
    layout.prefix_hi.fill_(0)  # nor can the returned tensors
    assert torch.equal(layout.dense_mask(), before)
    arr = np.array([1, 2, 3])
    layout2 = WindowLayout(3, 3, 2, np.zeros(3, dtype=np.int64), arr)
    arr[:] = 0
    assert torch.equal(layout2.dense_mask(), before)


def test_numpy_integers_are_accepted():
    layout = WindowLayout.kforcing_single(np.int64(5), np.int32(2))
    assert torch.equal(layout.dense_mask(), WindowLayout.kforcing_single(5, 2).dense_mask())
    assert WindowLayout.sbd(np.int64(6), np.int16(2)).n_keys == 12


def test_per_batch_cu_seqlens_for_block_layouts():
    cus = [[0, 4, 8], [0, 8]]
    for make in (WindowLayout.bd3lm, WindowLayout.sbd):
        layout = make(8, 2, cu_seqlens=cus)
        assert layout.range_batch == 2
        mask = layout.dense_mask()
        for b, cu in enumerate(cus):
            assert torch.equal(mask[b], make(8, 2, cu_seqlens=cu).dense_mask())


_ONE_ROW_CONSTRUCTORS = {
    "causal": lambda cu: WindowLayout.causal(12, cu_seqlens=cu),
    "causal_block": lambda cu: WindowLayout.causal(12, cu_seqlens=cu, block=4),
    "single": lambda cu: WindowLayout.kforcing_single(12, 2, cu_seqlens=cu),
    "double": lambda cu: WindowLayout.kforcing_double(12, 2, cu_seqlens=cu),
    "sbd": lambda cu: WindowLayout.sbd(12, 4, cu_seqlens=cu),
    "bd3lm": lambda cu: WindowLayout.bd3lm(12, 4, cu_seqlens=cu),
}


@pytest.mark.parametrize("name", sorted(_ONE_ROW_CONSTRUCTORS))
def test_per_batch_cu_seqlens_with_one_row_is_a_batch_of_one(name):
    """Issue #29 item 13: a per-batch [1, D+1] cu_seqlens silently broadcast over any batch size (it became a
    shared 1-D layout). It describes one batch element: the op refuses other batch sizes, naming cu_seqlens;
    a 1-D cu_seqlens stays shared by any batch."""
    from kforcing_kernels import window_attention

    make = _ONE_ROW_CONSTRUCTORS[name]
    shared = make([0, 4, 12])
    assert shared.range_batch is None
    for cu in (torch.tensor([[0, 4, 12]]), [[0, 4, 12]], [torch.tensor([0, 4, 12])]):
        one = make(cu)
        assert one.range_batch == 1
        assert torch.equal(one.dense_mask()[0], shared.dense_mask())
        for b in (2, 3):
            q = torch.randn(b, 1, one.n_queries, 8)
            k = torch.randn(b, 1, one.n_keys, 8)
            with pytest.raises(ValueError, match="cu_seqlens"):
                window_attention(q, k, k, one, backend="reference")
            window_attention(q, k, k, shared, backend="reference")  # shared: any batch
        q, k = torch.randn(1, 1, one.n_queries, 8), torch.randn(1, 1, one.n_keys, 8)
        assert torch.equal(
            window_attention(q, k, k, one, backend="reference"), window_attention(q, k, k, shared, backend="reference")
        )


def test_ptp_negative_starts_names_starts():
    with pytest.raises(ValueError, match=r"^starts: expected values >= 0"):
        WindowLayout.ptp(8, [3, -1], 2)
    with pytest.raises(ValueError, match=r"^starts: expected values >= 0"):
        WindowLayout.ptp(8, [[3, -1]], 2, doc_starts=[[0, 0]])
    with pytest.raises(ValueError, match=r"^doc_starts: expected doc_starts <= starts"):
        WindowLayout.ptp(8, [3, 2], 2, doc_starts=[0, 3])

"""Packed documents, block-causal contexts, BD3-LM and blank slots: dense masks vs
element-wise definitions written from the papers / original code, not from the layout."""

import numpy as np
import pytest
import torch

from kforcing_kernels import WindowLayout


def doc_of(cu, i):
    """Index of the document holding position i (cu: FlashAttention offsets)."""
    return max(d for d in range(len(cu) - 1) if cu[d] <= i < cu[d + 1])


def causal_packed_elementwise(n, cu, block=None):
    """Token i sees token j iff same document and j <= i (block-causal: j's block <= i's block,
    blocks counted from the document start)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            d = doc_of(cu, i)
            if doc_of(cu, j) != d:
                continue
            if block is None:
                mask[i, j] = j <= i
            else:
                mask[i, j] = (j - cu[d]) // block <= (i - cu[d]) // block
    return mask


def kforcing_single_packed_elementwise(n, k, cu):
    """SingleForward with documents: the window after context t sees context j iff j <= t and j is
    in t's document; noise slots causal inside their window; context rows document-causal."""
    size = n + n * k
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:n, :n] = causal_packed_elementwise(n, cu)
    for t in range(n):
        for i in range(k):
            q = n + t * k + i
            for j in range(n):
                mask[q, j] = j <= t and doc_of(cu, j) == doc_of(cu, t)
            for i2 in range(i + 1):
                mask[q, n + t * k + i2] = True
    return mask


def kforcing_double_packed_elementwise(n, k, cu):
    """DoubleForward with documents: queries [F1 | F2], keys [ctx | F1 | F2] (stream-major)."""
    mask = torch.zeros(2 * n * k, n + 2 * n * k, dtype=torch.bool)
    for qi in range(2 * n * k):
        qs, (t, i) = qi // (n * k), divmod(qi % (n * k), k)
        for j in range(n):
            mask[qi, j] = j <= t and doc_of(cu, j) == doc_of(cu, t)
        for ks in range(2):
            for i2 in range(k):
                seen = (ks < qs) or (ks == qs and i2 <= i)
                mask[qi, n + ks * n * k + t * k + i2] = seen
    return mask


def sbd_packed_elementwise(n, block, cu):
    """SBD Figure 9's mask_mod restricted to one document (boundaries at multiples of block)."""
    mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    mask[:n, :n] = causal_packed_elementwise(n, cu)
    for q in range(n):
        for kv in range(2 * n):
            if kv >= n:
                mask[n + q, kv] = q // block == (kv - n) // block
            else:
                mask[n + q, kv] = q // block > kv // block and doc_of(cu, q) == doc_of(cu, kv)
    return mask


def bd3lm_block_diff_mask(n, block_size):
    """kuleshov-group/bd3lms `block_diff_mask`, transcribed, over its [x_t (n) | x_0 (n)] order."""
    size = 2 * n
    mask = torch.zeros(size, size, dtype=torch.bool)
    for q_idx in range(size):
        for kv_idx in range(size):
            x0_flag_q, x0_flag_kv = q_idx >= n, kv_idx >= n
            block_q = (q_idx - n) // block_size if x0_flag_q else q_idx // block_size
            block_kv = (kv_idx - n) // block_size if x0_flag_kv else kv_idx // block_size
            block_diagonal = block_q == block_kv and x0_flag_q == x0_flag_kv
            offset_block_causal = block_q > block_kv and x0_flag_kv and not x0_flag_q
            block_causal = block_q >= block_kv and x0_flag_kv and x0_flag_q
            mask[q_idx, kv_idx] = block_diagonal or offset_block_causal or block_causal
    return mask


def ptp_truncated_elementwise(n_ctx, starts, length, doc_starts, doc_ends):
    """PTP completion pass; aux token j of completion c predicts position starts[c] + j and is blank
    (sees nothing) when that position is at or past its document's end."""
    nc = len(starts)
    mask = torch.zeros(nc * length, n_ctx + nc * length, dtype=torch.bool)
    for qi in range(nc * length):
        c, j = divmod(qi, length)
        if starts[c] + j >= doc_ends[c]:
            continue
        for p in range(doc_starts[c], starts[c]):
            mask[qi, p] = True
        for j2 in range(j + 1):
            mask[qi, n_ctx + c * length + j2] = True
    return mask


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


@pytest.mark.parametrize("n,block,cu", [(8, 2, [0, 8]), (8, 2, [0, 4, 8]), (12, 3, [0, 3, 9, 12]), (6, 1, [0, 1, 2, 6])])
def test_sbd_packed(n, block, cu):
    assert torch.equal(WindowLayout.sbd(n, block, cu_seqlens=cu).dense_mask(), sbd_packed_elementwise(n, block, cu))


@pytest.mark.parametrize("n,block", [(4, 1), (4, 2), (8, 2), (12, 4), (6, 3), (8, 8)])
def test_bd3lm_equals_block_diff_mask_after_reordering(n, block):
    theirs = bd3lm_block_diff_mask(n, block)
    perm = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])  # ours [x_0 | x_t] from theirs [x_t | x_0]
    assert torch.equal(WindowLayout.bd3lm(n, block).dense_mask(), theirs[perm][:, perm])


def test_bd3lm_packed_keeps_documents_apart():
    n, block, cu = 8, 2, [0, 4, 8]
    mask = WindowLayout.bd3lm(n, block, cu_seqlens=cu).dense_mask()
    single = WindowLayout.bd3lm(4, block).dense_mask()  # one 4-token document
    for d, (a, b) in enumerate([(0, 4), (4, 8)]):
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
    for layout in (WindowLayout.kforcing_single(7, 3, cu_seqlens=[0, 2, 7]), WindowLayout.bd3lm(8, 2, cu_seqlens=[0, 4, 8]),
                   WindowLayout.ptp(6, [2, 4], 3, [0, 0], doc_ends=[3, 6])):
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

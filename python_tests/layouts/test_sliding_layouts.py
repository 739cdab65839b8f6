"""``WindowLayout.with_sliding_window``: a layout under a model's sliding window, in position space.

Oracle, written from the definitions and sharing no code with layouts/sliding.py: the paper's
element-wise mask (paper_masks.py) AND the inference rule "the token at position p sees the keys
at positions (p - W, p]", with every token's position written out here (context token i of a document
at i - doc_start; slot o of the window after context token t at pos(t) + 1 + o; SBD's masked copy of
token j at pos(j)).
"""

import pytest
import torch

from helpers import paper_masks as P
from kforcing_kernels import WindowLayout
from kforcing_kernels.ops.window_attention import window_attention


def doc_positions(n, cu=None):
    cu = [0, n] if cu is None else list(cu)
    return [i - max(s for s in cu[:-1] if s <= i) for i in range(n)]


def single_positions(n, k, cu=None):
    ctx = doc_positions(n, cu)
    return ctx + [ctx[t] + 1 + o for t in range(n) for o in range(k)]


def double_positions(n, k, cu=None):
    ctx = doc_positions(n, cu)
    f1 = [ctx[t] + 1 + o for t in range(n) for o in range(k)]
    f2 = [ctx[t] + 1 + k + o for t in range(n) for o in range(k)]
    return ctx, f1 + f2  # keys: ctx + queries; queries: [F1 | F2]


def windowed(mask, query_pos, key_pos, window):
    q, kp = torch.tensor(query_pos)[:, None], torch.tensor(key_pos)[None, :]
    return mask & (kp > q - window)  # the window bounds how far back a key may be; the layout says the rest


CU = [0, 7, 9, 16]
CASES = {
    # name: (layout, paper mask, query positions, key positions)
    "single": lambda: (
        WindowLayout.kforcing_single(16, 4),
        P.kforcing_single_elementwise(16, 4),
        single_positions(16, 4),
        single_positions(16, 4),
    ),
    "single_packed": lambda: (
        WindowLayout.kforcing_single(16, 3, cu_seqlens=CU),
        P.kforcing_single_packed_elementwise(16, 3, CU),
        single_positions(16, 3, CU),
        single_positions(16, 3, CU),
    ),
    "double": lambda: (
        WindowLayout.kforcing_double(12, 2),
        P.kforcing_double_elementwise(12, 2),
        double_positions(12, 2)[1],
        sum(double_positions(12, 2), []),
    ),
    "double_packed": lambda: (
        WindowLayout.kforcing_double(16, 2, cu_seqlens=CU),
        P.kforcing_double_packed_elementwise(16, 2, CU),
        double_positions(16, 2, CU)[1],
        sum(double_positions(16, 2, CU), []),
    ),
    "sbd": lambda: (WindowLayout.sbd(14, 3), P.sbd_elementwise(14, 3), list(range(14)) * 2, list(range(14)) * 2),
    "causal_packed": lambda: (
        WindowLayout.causal(16, cu_seqlens=CU),
        P.causal_packed_elementwise(16, CU),
        doc_positions(16, CU),
        doc_positions(16, CU),
    ),
}


@pytest.mark.parametrize("window", [4, 5, 8, 13, 40])
@pytest.mark.parametrize("case", CASES)
def test_sliding_layout_equals_the_paper_mask_inside_the_position_window(case, window):
    layout, paper, query_pos, key_pos = CASES[case]()
    assert torch.equal(layout.dense_mask(), paper)
    if window < layout.window_size:
        with pytest.raises(ValueError, match="window: a sliding window of"):
            layout.with_sliding_window(window)
        return
    want = windowed(paper, query_pos, key_pos, window)
    got = layout.with_sliding_window(window)
    assert torch.equal(got.dense_mask(), want)
    if window == 40:  # longer than any distance here: the same layout back
        assert got is layout
    elif window <= 5:  # shorter than the documents and sequences here: the window really hides keys
        assert not torch.equal(want, paper)


def test_boundary_key_exactly_w_minus_1_back_is_seen_and_w_back_is_not():
    n, k, w = 24, 4, 8
    layout = WindowLayout.kforcing_single(n, k).with_sliding_window(w)
    mask = layout.dense_mask()
    # Context row 20 (position 20): key 13 is W - 1 = 7 back (seen), key 12 is W back (hidden).
    assert mask[20, 13] and not mask[20, 12]
    # Window t = 15, slot o = 2 sits at position 18: keys 11 (7 back) seen, 10 (8 back) hidden, 15 seen.
    row = n + 15 * k + 2
    assert mask[row, 11] and not mask[row, 10] and mask[row, 15] and not mask[row, 16]
    # ... and its own earlier slots (positions 16, 17) stay in sight.
    assert mask[row, n + 15 * k : n + 15 * k + 3].all() and not mask[row, n + 15 * k + 3]
    # Slot 0 of the same window (position 16): keys 9..15.
    assert mask[n + 15 * k, :n].nonzero().flatten().tolist() == list(range(9, 16))


def test_per_batch_documents_slide_per_batch_element():
    cus = [[0, 10, 16], [0, 3, 16]]
    layout = WindowLayout.kforcing_single(16, 2, cu_seqlens=cus)
    got = layout.with_sliding_window(5).dense_mask()
    for b, cu in enumerate(cus):
        pos = single_positions(16, 2, cu)
        assert torch.equal(got[b], windowed(P.kforcing_single_packed_elementwise(16, 2, cu), pos, pos, 5))


def test_invalid_windows_and_layouts_are_refused_by_name():
    layout = WindowLayout.kforcing_single(8, 2)
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="window: expected a positive int"):
            layout.with_sliding_window(bad)
    drafter = WindowLayout(8, 2, 2, [0, 0], [4, 8], prefix_slide_lo=[1, 5])
    with pytest.raises(ValueError, match="layout: expected a layout without prefix_slide_lo/hi"):
        drafter.with_sliding_window(4)


@pytest.mark.parametrize("backend", ["reference", "composite", "cpp"])
def test_backends_run_the_sliding_layout_like_a_dense_softmax(backend):
    if backend == "cpp":
        from kforcing_kernels.ops.window_attention.backends import REGISTRY

        reason = REGISTRY.available()["cpp"]
        if reason is not None:
            pytest.skip(f"C++ extension: {reason}")
    layout = WindowLayout.kforcing_single(24, 4).with_sliding_window(8)
    gen = torch.Generator().manual_seed(0)
    q, kk, v = (
        torch.randn(2, 4, layout.n_keys, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    out = window_attention(q, kk, v, layout, backend=backend)
    mask = windowed(P.kforcing_single_elementwise(24, 4), single_positions(24, 4), single_positions(24, 4), 8)
    scores = (q @ kk.transpose(-1, -2)) / 4.0
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), (q, kk, v))
    want_grads = torch.autograd.grad(want.sum(), (q, kk, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


def test_bench_sliding_window_counts_the_pairs_of_the_masks():
    from bench.__main__ import run_command

    got = run_command(
        "sliding-window",
        ["--n", "16", "--k", "2", "--window", "8", "--reps", "1", "--backend", "reference", "--threads", "1"],
    )
    full = WindowLayout.kforcing_single(16, 2)
    slid = windowed(P.kforcing_single_elementwise(16, 2), single_positions(16, 2), single_positions(16, 2), 8)
    assert got["layouts"]["global"]["pairs"] == int(full.dense_mask().sum())
    assert got["layouts"]["sliding W=8"]["pairs"] == int(slid.sum()) < int(full.dense_mask().sum())

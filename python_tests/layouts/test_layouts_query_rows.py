"""``WindowLayout.restrict_rows``: a layout restricted to some query rows (context parallelism's sub-layouts).

Oracle: the parent's dense mask (its own derivation from the row intervals); the sub-layout's mask must be
exactly the parent's rows, over the same keys in the same order, and ``window_attention`` on it must equal
the parent's attention at those rows (fp64, reference backend), forward and every gradient.
"""

import pytest
import torch

from kforcing_kernels.layouts import QueryRowsLayout, WindowLayout, zoo
from kforcing_kernels.ops.window_attention import window_attention

ZOO = zoo.small()


def _subsets(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    random_half = torch.randperm(n, generator=g)[: max(1, n // 2)].sort().values
    return [
        torch.arange(n),
        random_half,
        torch.arange(n - 1, n),
        torch.arange(0, n, 3),
        torch.zeros(0, dtype=torch.int64),
    ]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_sub_layout_mask_is_the_parents_rows(name):
    layout = ZOO[name]
    full = layout.dense_mask()
    for rows in _subsets(layout.n_queries, seed=len(name)):
        sub = layout.restrict_rows(rows)
        assert isinstance(sub, QueryRowsLayout)
        assert sub.n_queries == rows.numel() and sub.n_keys == layout.n_keys and sub.range_batch == layout.range_batch
        assert torch.equal(sub.dense_mask(), full[..., rows, :]), (name, rows.tolist())
        want_pairs = full[..., rows, :].sum((-1, -2))
        assert (sub.num_pairs() == want_pairs).all() if layout.range_batch else sub.num_pairs() == int(want_pairs)


def test_sub_layout_of_blank_and_sliding_rows():
    blank = ZOO["blank_full_windows"]  # window 2 has no live slot: its rows see nothing
    empty_rows = torch.nonzero(~blank.dense_mask().any(-1)).flatten()
    assert empty_rows.numel() > 0
    sub = blank.restrict_rows(empty_rows)
    assert sub.num_pairs() == 0 and not sub.dense_mask().any()
    sliding = ZOO["anchor_blocks_sliding_slot"]
    assert sliding.has_sliding_context
    rows = torch.arange(sliding.n_queries - 5, sliding.n_queries)
    assert torch.equal(sliding.restrict_rows(rows).dense_mask(), sliding.dense_mask()[rows])


def test_sub_layout_of_a_sub_layout_is_relative_to_it():
    layout = WindowLayout.kforcing_double(9, 2)
    sub = layout.restrict_rows(torch.arange(3, 20))
    inner = sub.restrict_rows([0, 4, 16])
    assert inner.rows.tolist() == [3, 7, 19] and inner.parent is layout


@pytest.mark.parametrize(
    "rows, message",
    [
        ([3, 1], "strictly increasing"),
        ([2, 2], "strictly increasing"),
        ([0, 50], "parent.n_queries"),
        ([-1], "parent.n_queries"),
        ([0.5], "integers"),
        ([[0, 1]], "shape"),
    ],
)
def test_invalid_rows_are_refused_naming_the_argument(rows, message):
    with pytest.raises(ValueError, match=r"^rows: .*" + message):
        WindowLayout.causal(10).restrict_rows(rows)


def test_rows_are_owned_by_the_sub_layout():
    rows = torch.tensor([1, 4, 6])
    sub = WindowLayout.kforcing_single(5, 2).restrict_rows(rows)
    rows[0] = 0  # refilling the caller's buffer must not change the sub-layout
    assert sub.rows.tolist() == [1, 4, 6]


@pytest.mark.parametrize(
    "name",
    [
        "single_k3_odd",
        "double_k2",
        "double_packed",
        "single_packed_per_batch",
        "anchor_blocks_sliding_slot",
        "blank_full_windows",
        "more_rows_than_a_chunk",
    ],
)
def test_window_attention_on_sub_layout_matches_parent_rows(name):
    # more_rows_than_a_chunk: half of 280 rows is more than ops/window_attention/composite/query_rows.py's GROUP_ROWS
    layout = WindowLayout.kforcing_single(70, 3) if name == "more_rows_than_a_chunk" else ZOO[name]
    torch.manual_seed(0)
    b = layout.range_batch or 2
    q = torch.randn(b, 4, layout.n_queries, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, layout.n_keys, 8, dtype=torch.float64, requires_grad=True)  # GQA: 2 K/V heads for 4 queries
    v = torch.randn(b, 2, layout.n_keys, 8, dtype=torch.float64, requires_grad=True)
    rows = _subsets(layout.n_queries, seed=1)[1]
    out = window_attention(q, k, v, layout, backend="reference")
    weight = torch.randn_like(out)
    want_out = out[:, :, rows].detach()
    want = torch.autograd.grad((out[:, :, rows] * weight[:, :, rows]).sum(), (q, k, v))
    got_out = window_attention(q[:, :, rows], k, v, layout.restrict_rows(rows))
    got = torch.autograd.grad((got_out * weight[:, :, rows]).sum(), (q, k, v))
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=label)


def test_window_attention_on_sub_layout_checks_shapes():
    sub = WindowLayout.causal(8).restrict_rows([1, 2])
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout.n_queries"):
        window_attention(q, k, k, sub)


def test_parent_must_be_a_window_layout():
    sub = WindowLayout.causal(6).restrict_rows([1, 2])
    with pytest.raises(ValueError, match="^parent: "):
        QueryRowsLayout(sub, [0])
    with pytest.raises(ValueError, match="^parent: "):
        QueryRowsLayout("causal", [0])


def test_row_n_queries_is_refused_at_once():
    """The bound itself: row n_queries (one past the last) is refused when the sub-layout is made, not later by an
    IndexError."""
    parent = WindowLayout.causal(10)
    with pytest.raises(ValueError, match=r"^rows: expected query rows in \[0, 10\) \(parent.n_queries\), got 10"):
        parent.restrict_rows([9, 10])
    assert parent.restrict_rows([9]).dense_mask().shape == (1, 10)  # the last row itself is fine
    sub = parent.restrict_rows([1, 3, 5])
    with pytest.raises(ValueError, match=r"^rows: expected rows in \[0, 3\) \(n_queries\)"):
        sub.restrict_rows([2, 3])
    assert torch.equal(sub.restrict_rows([2]).dense_mask(), parent.dense_mask()[[5]])

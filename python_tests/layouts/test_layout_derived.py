"""A layout's derived data lives in one store per layout content (layouts/derived.py)."""

import torch

from kforcing_kernels.layouts import WindowLayout, derived
from kforcing_kernels.ops.window_attention import composite, op


def test_equal_layouts_share_one_store():
    a, b = WindowLayout.kforcing_single(37, 3), WindowLayout.kforcing_single(37, 3)
    built = a.derived("test.artifact", lambda: object())
    assert b.derived("test.artifact", lambda: 1 / 0) is built  # b adopted a's store: nothing rebuilt
    assert b.row_intervals_int32 is a.row_intervals_int32
    other = WindowLayout.kforcing_single(37, 2)
    assert other.derived("test.artifact", lambda: "other") == "other"


def test_a_layout_round_trips_through_the_custom_op_args_to_itself():
    layout = WindowLayout.ptp(40, torch.tensor([[3, 9], [12, 40]]), 5, doc_ends=torch.tensor([[6, 20], [14, 40]]))
    plan = layout.derived("test.plan", lambda: object())
    rebuilt = op.layout_from_args(*op.layout_args(layout))
    assert rebuilt is layout and rebuilt.derived("test.plan", lambda: 1 / 0) is plan
    # Built from the args alone (no registered twin), it registers itself under the same content key.
    fresh = WindowLayout.bd3lm(24, 4)
    args = op.layout_args(fresh)
    first = op.layout_from_args(*args)
    assert op.layout_from_args(*args) is first and first.cache_key == fresh.cache_key


def test_a_store_is_bounded_and_rebuilds_after_emptying():
    layout = WindowLayout.causal(11)
    for i in range(derived.STORE_MAX + 3):
        assert layout.derived(("test.many", i), lambda i=i: i) == i
    assert derived.store_size(layout) <= derived.STORE_MAX
    assert torch.equal(layout.row_intervals(), WindowLayout.causal(11).row_intervals())


def test_per_batch_element_layouts_are_derived_once():
    layout = WindowLayout.ptp(16, torch.tensor([[2, 7], [5, 16]]), 3)
    first = [composite._element_layout(layout, b) for b in range(2)]
    assert [composite._element_layout(layout, b) for b in range(2)] == first
    assert first[0].batch_size is None and torch.equal(first[1].prefix_hi, torch.tensor([5, 16]))


def test_row_intervals_copy_false_is_the_derived_tensor():
    layout = WindowLayout.kforcing_single(37, 3)
    shared = layout.row_intervals(copy=False)
    assert shared is layout.row_intervals(copy=False)  # derived once, read by the backends and parallel/
    copied = layout.row_intervals()
    assert torch.equal(copied, shared) and copied.data_ptr() != shared.data_ptr()
    sub = layout.restrict_rows([1, 5, 30])
    assert sub.row_intervals(copy=False) is sub.row_intervals(copy=False)
    assert torch.equal(sub.row_intervals(), shared[:, sub.rows])

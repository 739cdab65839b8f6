"""SDPA-style entry point and dense-mask routing (kforcing_kernels.sdpa) against SDPA with the dense mask."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa_imported_by_name

import kforcing_kernels.sdpa
from helpers.attention import make_qkv, run_with_grads
from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.sdpa import match_layout, route_dense_masks, scaled_dot_product_attention

LAYOUTS = {
    "causal": WindowLayout.causal(12),
    "single": WindowLayout.kforcing_single(6, 3),
    "single_k1": WindowLayout.kforcing_single(12, 1),
    "double": WindowLayout.kforcing_double(5, 2),
    "sbd_short_last": WindowLayout.sbd(11, 4),
    "jacobi": WindowLayout.jacobi(4, 6),
    "ptp": WindowLayout.ptp(14, [5, 9, 14], 4, [0, 2, 6]),
}


def _dense_4d(layout):
    mask = layout.dense_mask()
    return mask[:, None] if mask.dim() == 3 else mask


def _flip_one(mask: torch.Tensor) -> torch.Tensor:
    """The mask with one window-row element flipped (a hidden key made visible)."""
    out = mask.clone()
    rows, cols = torch.nonzero(~out, as_tuple=True)
    i = len(rows) // 2
    out[rows[i], cols[i]] = True
    return out


@pytest.mark.parametrize("name", [*LAYOUTS, "ptp_per_batch"])
def test_layout_entry_point_matches_sdpa_with_dense_mask(name):
    layout = LAYOUTS.get(name) or WindowLayout.ptp(12, [[3, 12], [8, 1]], 4, [[0, 2], [5, 0]])
    batch = layout.batch_size or 2
    q, k, v = make_qkv(layout, batch=batch, heads=4, kv_heads=2)
    dout = torch.randn(batch, 4, layout.n_queries, 16)
    ours = run_with_grads(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3, layout=layout), q, k, v, dout
    )
    mask = _dense_4d(layout)
    ref = run_with_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3),
        q,
        k,
        v,
        dout,
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"attn_mask": torch.ones(30, 30, dtype=torch.bool)}, "attn_mask"),
        ({"is_causal": True}, "is_causal"),
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"enable_gqa": False}, "enable_gqa"),
    ],
)
def test_layout_entry_point_rejects_conflicting_arguments(kwargs, needle):
    layout = WindowLayout.kforcing_single(6, 4)
    q, k, v = make_qkv(layout, heads=4, kv_heads=2, requires_grad=False)
    kwargs = {"enable_gqa": True, **kwargs}
    with pytest.raises(ValueError, match=needle):
        scaled_dot_product_attention(q, k, v, layout=layout, **kwargs)


def test_layout_argument_is_validated():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="layout"):
        scaled_dot_product_attention(q, q, q, layout="dense")


@pytest.mark.parametrize("name", LAYOUTS)
def test_match_layout_finds_each_family_exactly(name):
    layout = LAYOUTS[name]
    mask = layout.dense_mask()
    found = match_layout(mask)
    assert found is not None and torch.equal(found.dense_mask(), mask)
    # SDPA's broadcastable shapes: [1, 1, Lq, Lk], expanded [B, 1, ...] views and real [B, H, ...] copies.
    assert match_layout(mask[None, None]) is not None
    assert match_layout(mask[None, None].expand(3, 1, -1, -1)) is not None
    assert match_layout(mask[None, None].repeat(2, 3, 1, 1)) is not None


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_element_off_is_not_matched(name):
    mask = LAYOUTS[name].dense_mask()
    assert match_layout(_flip_one(mask)) is None
    hidden = mask.clone()
    hidden[-1, -1] = False  # the last query no longer sees itself
    assert match_layout(hidden) is None
    heads_differ = mask[None, None].repeat(1, 2, 1, 1)
    heads_differ[0, 1] = _flip_one(mask)
    assert match_layout(heads_differ) is None


def test_match_layout_needs_a_bool_mask():
    mask = LAYOUTS["single"].dense_mask()
    assert match_layout(torch.where(mask, 0.0, float("-inf"))) is None
    assert match_layout(mask.to(torch.uint8)) is None


def test_per_batch_masks_match_only_a_per_batch_candidate():
    layout = WindowLayout.ptp(12, [[3, 12], [8, 1]], 4, [[0, 2], [5, 0]])
    mask = layout.dense_mask()[:, None]  # [2, 1, Lq, Lk], differs over the batch
    assert match_layout(mask) is None  # proposals are shared layouts: never accepted
    shared = WindowLayout.ptp(12, [3, 12], 4, [0, 2])
    assert match_layout(mask, [shared, layout]) is layout
    assert match_layout(mask[:1], [layout]) is None  # batch 0 alone is not the per-batch layout
    assert match_layout(mask[:, 0], [layout]) is None  # a 3-D mask varies over heads (SDPA aligns right), not batch


def test_auto_routes_exact_masks_and_falls_back_otherwise(monkeypatch):
    routed_layouts = []

    def counting_window_attention(q, k, v, layout, **kwargs):
        routed_layouts.append(layout)
        return window_attention(q, k, v, layout, **kwargs)

    monkeypatch.setattr(kforcing_kernels.sdpa, "window_attention", counting_window_attention)
    layout = WindowLayout.kforcing_single(6, 3)
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, requires_grad=False)
    mask = layout.dense_mask()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, layout="auto")
    torch.testing.assert_close(out, window_attention(q, k, v, layout, backend="reference"), atol=2e-6, rtol=2e-6)
    assert len(routed_layouts) == 1 and torch.equal(routed_layouts[0].dense_mask(), mask)
    near = _flip_one(mask)
    out = scaled_dot_product_attention(q, k, v, attn_mask=near, enable_gqa=True, layout="auto")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=near, enable_gqa=True))
    assert len(routed_layouts) == 1


def test_context_manager_routes_legacy_sdpa_calls():
    layout = WindowLayout.kforcing_single(6, 3)
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=4)
    mask = layout.dense_mask()
    dout = torch.randn_like(q)
    ref = run_with_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v, dout)
    with route_dense_masks() as router:
        routed = run_with_grads(lambda q, k, v: sdpa_imported_by_name(q, k, v, mask), q, k, v, dout)
        near = F.scaled_dot_product_attention(q, k, v, attn_mask=_flip_one(mask))
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)  # dropout: never routed
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (router.routed, router.passed_through) == (1, 3)
    for a, b in zip(routed, ref):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    assert torch.equal(near, F.scaled_dot_product_attention(q, k, v, attn_mask=_flip_one(mask)))


def test_context_manager_with_explicit_candidates_and_mask_edits():
    layout = WindowLayout.sbd(8, 3)
    q, k, v = make_qkv(layout, heads=2, requires_grad=False)
    mask = layout.dense_mask()
    with route_dense_masks([WindowLayout.kforcing_single(8, 1)]) as other:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (other.routed, other.passed_through) == (0, 1)
    with route_dense_masks([layout]) as router:
        for _ in range(3):  # verified once, then remembered for the same tensor
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask[0, 5] = True  # an in-place edit invalidates the remembered answer
        edited = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (router.routed, router.passed_through) == (3, 1)
    assert torch.equal(edited, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_candidates_must_be_layouts():
    with pytest.raises(ValueError, match="candidates"):
        route_dense_masks([torch.ones(2, 2, dtype=torch.bool)])


def _edit_without_version_bump(mask: torch.Tensor, how: str, row: int, col: int) -> None:
    """Set mask[row, col] = True through a route that leaves mask._version unchanged."""
    before = mask._version
    if how == "data":
        mask.data[row, col] = True
    elif how == "numpy":
        mask.numpy()[row, col] = True
    elif how == "alias":  # a second tensor over the same memory, with its own version counter
        torch.from_numpy(mask.numpy())[row, col] = True
    assert mask._version == before and bool(mask[row, col])


@pytest.mark.parametrize("how", ["data", "numpy", "alias"])
@pytest.mark.parametrize("entry", ["auto", "context"])
def test_edited_mask_is_never_matched_stale(how, entry):
    """A mask edited in place without a version bump must be re-verified: the output follows the edited mask."""
    layout = WindowLayout.kforcing_single(6, 3)
    q, k, v = make_qkv(layout, batch=2, heads=2, requires_grad=False)
    mask = layout.dense_mask()
    row, col = torch.nonzero(~mask)[len(torch.nonzero(~mask)) // 2].tolist()

    def call():
        if entry == "auto":
            return scaled_dot_product_attention(q, k, v, attn_mask=mask, layout="auto")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    with route_dense_masks() as router:
        first = call()  # verified and remembered
        _edit_without_version_bump(mask, how, row, col)
        edited = call()
    torch.testing.assert_close(first, window_attention(q, k, v, layout, backend="reference"), atol=2e-6, rtol=2e-6)
    assert torch.equal(edited, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    if entry == "context":
        assert (router.routed, router.passed_through) == (1, 1)


def test_edited_back_mask_is_routed_again_and_unmatched_masks_stay_unmatched():
    layout = WindowLayout.sbd(8, 3)
    q, k, v = make_qkv(layout, heads=2, requires_grad=False)
    mask = _flip_one(layout.dense_mask())  # not a layout: remembered as "no match"
    with route_dense_masks() as router:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask.data.copy_(layout.dense_mask())  # now exactly the layout, version unchanged
        routed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (router.routed, router.passed_through) == (2, 1)
    torch.testing.assert_close(routed, window_attention(q, k, v, layout, backend="reference"), atol=2e-6, rtol=2e-6)


def test_inference_mode_masks_are_remembered_by_content():
    layout = WindowLayout.kforcing_single(6, 3)
    q, k, v = make_qkv(layout, heads=2, requires_grad=False)
    with torch.inference_mode():
        mask = layout.dense_mask()
        with route_dense_masks() as router:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            mask[3, 5] = True  # inference tensors have no version counter at all
            c = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (router.routed, router.passed_through) == (2, 1)
        assert torch.equal(a, b) and torch.equal(c, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

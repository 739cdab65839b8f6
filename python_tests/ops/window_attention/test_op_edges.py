"""Edge inputs of window_attention: empty batches/heads, head dim 0, scale types, blank rows."""

import numpy as np
import pytest
import torch

from kforcing_kernels import WindowLayout, backends_available, window_attention

BACKENDS = [name for name in ("reference", "composite", "cpp") if backends_available()[name] is None]
LAYOUT = WindowLayout.kforcing_single(5, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,h,hkv", [(0, 2, 1), (2, 0, 0), (0, 0, 0)])
def test_empty_batch_or_heads_give_empty_outputs(backend, b, h, hkv):
    q = torch.randn(b, h, LAYOUT.n_queries, 8, requires_grad=True)
    k = torch.randn(b, hkv, LAYOUT.n_keys, 8, requires_grad=True)
    v = torch.randn(b, hkv, LAYOUT.n_keys, 8, requires_grad=True)
    out, lse = window_attention(q, k, v, LAYOUT, backend=backend, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_head_dim_zero_and_missing_kv_heads_are_refused():
    with pytest.raises(ValueError, match="q: expected head dim >= 1"):
        window_attention(*(torch.randn(1, 2, n, 0) for n in (15, 15, 15)), LAYOUT)
    with pytest.raises(ValueError, match="k: expected at least one kv head"):
        window_attention(torch.randn(1, 2, 15, 8), torch.randn(1, 0, 15, 8), torch.randn(1, 0, 15, 8), LAYOUT)


def test_scale_types():
    q, k, v = (torch.randn(1, 2, 15, 8) for _ in range(3))
    ref = window_attention(q, k, v, LAYOUT, scale=0.25)
    torch.testing.assert_close(window_attention(q, k, v, LAYOUT, scale=np.float32(0.25)), ref)
    torch.testing.assert_close(window_attention(q, k, v, LAYOUT, scale=np.float64(0.25)), ref)
    for bad in (True, float("nan"), 0.0, -1.0, "0.5", torch.tensor([0.5])):
        with pytest.raises(ValueError, match="scale"):
            window_attention(q, k, v, LAYOUT, scale=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_blank_rows_give_zero_output_minus_inf_lse_zero_grad(backend):
    layout = WindowLayout.ptp(6, [2, 4], 3, [0, 0], doc_ends=[3, 4])  # completion 0: 1 live slot, 1: none
    q = torch.randn(2, 2, layout.n_queries, 8, requires_grad=True)
    k = torch.randn(2, 2, layout.n_keys, 8, requires_grad=True)
    v = torch.randn(2, 2, layout.n_keys, 8, requires_grad=True)
    out, lse = window_attention(q, k, v, layout, backend=backend, return_lse=True)
    blank = torch.tensor([False, True, True, True, True, True])
    assert torch.equal(out[:, :, blank], torch.zeros_like(out[:, :, blank]))
    assert torch.isinf(lse[:, :, blank]).all() and (lse[:, :, blank] < 0).all()
    assert torch.isfinite(lse[:, :, ~blank]).all()
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert torch.equal(q.grad[:, :, blank], torch.zeros_like(q.grad[:, :, blank]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["k_nan", "v_inf"])
def test_nonfinite_values_at_masked_keys_do_not_reach_a_row(backend, where):
    """Key 0 of window 2 (the first window slot) holds NaN/inf; rows that cannot see it stay exact."""
    layout = WindowLayout.kforcing_single(6, 3)
    torch.manual_seed(0)
    q = torch.randn(1, 2, layout.n_queries, 8, dtype=torch.float64)
    k = torch.randn(1, 2, layout.n_keys, 8, dtype=torch.float64)
    v = torch.randn(1, 2, layout.n_keys, 8, dtype=torch.float64)
    bad_key = 6 + 2 * 3  # slot 0 of window 2: seen only by window 2's rows
    poisoned_k, poisoned_v = k.clone(), v.clone()
    if where == "k_nan":
        poisoned_k[:, :, bad_key] = float("nan")
    else:
        poisoned_v[:, :, bad_key] = float("inf")
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    dirty = [t.clone().requires_grad_() for t in (q, poisoned_k, poisoned_v)]
    out_clean = window_attention(*clean, layout, backend=backend)
    out_dirty = window_attention(*dirty, layout, backend=backend)
    sees = layout.dense_mask()[:, bad_key]
    assert sees.sum() == 3
    torch.testing.assert_close(out_dirty[:, :, ~sees], out_clean[:, :, ~sees], rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out_clean)
    dout[:, :, sees] = 0  # only rows that do not see the bad key carry gradient
    g_clean = torch.autograd.grad(out_clean, clean, dout)
    g_dirty = torch.autograd.grad(out_dirty, dirty, dout)
    keep = ~layout.dense_mask()[sees].any(0)  # keys no poisoned row touches (those rows' outputs are NaN/inf)
    torch.testing.assert_close(g_dirty[0][:, :, ~sees], g_clean[0][:, :, ~sees], rtol=1e-12, atol=1e-12)
    for a, b in zip(g_dirty[1:], g_clean[1:]):
        torch.testing.assert_close(a[:, :, keep], b[:, :, keep], rtol=1e-12, atol=1e-12)

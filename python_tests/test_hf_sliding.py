"""Sliding-window models under attn_implementation="kforcing" equal sdpa, wherever the window comes from.

transformers 5 lets query i see key j iff ``i - W < j <= i``. The window reaches the attention
call as ``sliding_window=`` (Mistral, Qwen2 with use_sliding_window, Gemma2/3 alternating
layers) or only through the mask (Qwen2-MoE). "kforcing" used to refuse the first (even for
sequences shorter than the window) and silently drop the second.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402

W = 4
FAMILIES = {
    "mistral": lambda: H.mistral(sliding_window=W),
    "qwen2": lambda: H.qwen2(use_sliding_window=True, sliding_window=W, max_window_layers=0),
    "phi3": lambda: H.phi3(sliding_window=W),
    "qwen2_moe_mask_only": lambda: H.qwen2_moe(use_sliding_window=True, sliding_window=W),
    "gemma3_alternating": lambda: H.gemma3(sliding_window=W, layer_types=["sliding_attention", "full_attention"]),
    "gemma2_no_softcap": lambda: transformers.Gemma2Config(
        **{**H._COMMON, "head_dim": 8, "query_pre_attn_scalar": 8}, sliding_window=W, attn_logit_softcapping=None,
        final_logit_softcapping=None),
}


@pytest.mark.parametrize("length", [11, 3], ids=["longer-than-window", "shorter-than-window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_matches_sdpa(family, length):
    oracle = "eager" if family.startswith("gemma2") else "sdpa"  # Gemma2 has no sdpa path in transformers
    ours, sdpa = H.twin_models(FAMILIES[family](), "kforcing", oracle)
    ids = torch.randint(0, H.VOCAB, (2, length), generator=torch.Generator().manual_seed(2))
    got = H.logits_and_grads(ours, input_ids=ids, use_cache=False)
    tol = 1e-4 if family.startswith("gemma") else 1e-5  # Gemma's scaled embeddings give gradients of ~10
    H.assert_same_logits_and_grads(got, H.logits_and_grads(sdpa, input_ids=ids, use_cache=False), tol)
    if length > W + 1 and family == "mistral":  # the window really is in effect: a full-attention twin differs
        (full,) = H.twin_models(H.mistral(sliding_window=None), "kforcing")
        with torch.no_grad():
            assert not torch.allclose(full(input_ids=ids).logits, got[0], atol=1e-3)


def test_packed_documents_inside_a_sliding_window_match_sdpa():
    ours, sdpa = H.twin_models(FAMILIES["qwen2_moe_mask_only"](), "kforcing", "sdpa")
    ids = torch.randint(0, H.VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2]])
    got = H.logits_and_grads(ours, input_ids=ids, position_ids=positions, use_cache=False)
    H.assert_same_logits_and_grads(got, H.logits_and_grads(sdpa, input_ids=ids, position_ids=positions, use_cache=False))


@pytest.mark.parametrize("family", ["mistral", "qwen2_moe_mask_only"])
def test_generation_with_a_sliding_window_matches_sdpa(family):
    ours, sdpa = H.twin_models(FAMILIES[family](), "kforcing", "sdpa")
    ids = torch.randint(3, H.VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    outs = []
    for model in (ours, sdpa):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outs.append((out.sequences, torch.stack(out.logits)))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


def test_softcapping_is_refused_only_where_it_exists():
    config = transformers.Gemma2Config(**{**H._COMMON, "head_dim": 8, "query_pre_attn_scalar": 8}, sliding_window=W)
    assert config.attn_logit_softcapping is not None
    (model,) = H.twin_models(config, "kforcing")
    with torch.no_grad(), pytest.raises(ValueError, match="softcap: not supported by attn_implementation='kforcing'"):
        model(input_ids=torch.randint(0, H.VOCAB, (1, 5)))


def test_layout_with_a_sliding_window_runs_where_the_window_hides_nothing():
    ours, eager = H.twin_models(FAMILIES["mistral"](), "kforcing", "eager")
    ids = torch.randint(0, H.VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    # SBD over 4 tokens with blocks of 2: [clean (4) | masked copy (4)], every row reaches back < 8 keys but not < 4.
    too_wide = WindowLayout.sbd(4, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="sliding_window: the model's window of 4 keys would hide keys"):
        ours(input_ids=ids, position_ids=kf_hf.sbd_position_ids(4)[None], kforcing_layout=too_wide)
    # A layout whose rows stay within the window: the window changes nothing, so it runs (eager with its mask agrees).
    narrow = WindowLayout.sbd(2, 1)  # 4 tokens < W
    positions = kf_hf.sbd_position_ids(2)[None]
    got = H.logits_and_grads(ours, input_ids=ids[:, :4], position_ids=positions, kforcing_layout=narrow)
    want = H.logits_and_grads(eager, input_ids=ids[:, :4], position_ids=positions,
                              attention_mask=kf_hf.additive_mask(narrow, batch=1))
    H.assert_same_logits_and_grads(got, want)


def test_padded_batch_mask_with_a_window_runs_as_interval_layout(monkeypatch):
    """Padding makes transformers materialise the mask (window + padding); its rows are key intervals, so they
    run as a layout (window_attention, not SDPA), equal to sdpa on every real token."""
    import kforcing_kernels.integrations.hf as hf_module

    layouts = []
    original = hf_module.window_attention
    monkeypatch.setattr(hf_module, "window_attention", lambda q, k, v, layout, **kw: layouts.append(layout) or original(q, k, v, layout, **kw))
    ours, sdpa = H.twin_models(FAMILIES["mistral"](), "kforcing", "sdpa")
    ids = torch.randint(1, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, 6:] = 0  # row 1 is right padded
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=padding, use_cache=False).logits
        want = sdpa(input_ids=ids, attention_mask=padding, use_cache=False).logits
    real = padding.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert len(layouts) == 2 and layouts[0].context_lo[0, 8] == 8 - W + 1  # row 8 sees keys 5..8


@pytest.mark.parametrize("name", ["single_k3_odd", "double_k2", "single_large_window", "ptp_per_batch", "blank_full_windows"])
def test_the_window_refusal_is_exact_at_the_boundary(name):
    """check_layout_window refuses a window W iff some attended key j of a query i (key storage order) has
    j <= i - W, transformers' rule; every W from 1 to n_keys, so the row that reaches back exactly W keys is tried.
    Oracle: the layout's dense mask, element by element."""
    from kforcing_kernels.integrations.hf_masks import check_layout_window
    from kforcing_kernels.layouts import zoo

    layout = zoo.small()[name]
    mask = layout.dense_mask()
    mask = mask[None] if mask.dim() == 2 else mask
    i = layout.query_offset + torch.arange(mask.shape[1])[:, None]
    j = torch.arange(mask.shape[2])[None, :]
    reach = int(((i - j) * mask).amax())  # the farthest any query looks back
    assert reach >= 1
    for window in range(1, layout.n_keys + 1):
        hidden = bool((mask & (j <= i - window)).any())
        assert hidden == (window <= reach)
        if hidden:
            with pytest.raises(ValueError, match="^sliding_window: "):
                check_layout_window(layout, window)
        else:
            check_layout_window(layout, window)

"""Sliding-window models under attn_implementation="kforcing" equal sdpa, wherever the window comes from.

transformers 5 lets query i see key j iff ``i - W < j <= i``. The window reaches the attention
call as ``sliding_window=`` (Mistral, Qwen2 with use_sliding_window, Gemma2/3 alternating
layers) or only through the mask (Qwen2-MoE). "kforcing" used to refuse the first (even for
sequences shorter than the window) and silently drop the second.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402

W = 4
FAMILIES = {
    "mistral": lambda: H.mistral(sliding_window=W),
    "qwen2": lambda: H.qwen2(use_sliding_window=True, sliding_window=W, max_window_layers=0),
    "phi3": lambda: H.phi3(sliding_window=W),
    "qwen2_moe_mask_only": lambda: H.qwen2_moe(use_sliding_window=True, sliding_window=W),
    "gemma3_alternating": lambda: H.gemma3(sliding_window=W, layer_types=["sliding_attention", "full_attention"]),
    "gemma2_no_softcap": lambda: transformers.Gemma2Config(
        **{**H._COMMON, "head_dim": 8, "query_pre_attn_scalar": 8},
        sliding_window=W,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    ),
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
    H.assert_same_logits_and_grads(
        got, H.logits_and_grads(sdpa, input_ids=ids, position_ids=positions, use_cache=False)
    )


@pytest.mark.parametrize("family", ["mistral", "qwen2_moe_mask_only"])
def test_generation_with_a_sliding_window_matches_sdpa(family):
    ours, sdpa = H.twin_models(FAMILIES[family](), "kforcing", "sdpa")
    ids = torch.randint(3, H.VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    outs = []
    for model in (ours, sdpa):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        outs.append((out.sequences, torch.stack(out.logits)))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


def test_softcapping_is_refused_only_where_it_exists():
    config = transformers.Gemma2Config(**{**H._COMMON, "head_dim": 8, "query_pre_attn_scalar": 8}, sliding_window=W)
    assert config.attn_logit_softcapping is not None
    (model,) = H.twin_models(config, "kforcing")
    with torch.no_grad(), pytest.raises(ValueError, match="softcap: not supported by attn_implementation='kforcing'"):
        model(input_ids=torch.randint(0, H.VOCAB, (1, 5)))
    # The message names the config field and how to turn it off; the recipe's wrapper refuses before any step.
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"config.attn_logit_softcapping.*attn_logit_softcapping=None"),
    ):
        model(input_ids=torch.randint(0, H.VOCAB, (1, 5)))
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    with pytest.raises(ValueError, match=r"attn_logit_softcapping: not supported.*attn_logit_softcapping=None"):
        HFStudent(model)
    # Turned off as the message says, the model runs and equals eager.
    uncapped = transformers.Gemma2Config(
        **{**H._COMMON, "head_dim": 8, "query_pre_attn_scalar": 8}, sliding_window=W, attn_logit_softcapping=None
    )
    ours, eager = H.twin_models(uncapped, "kforcing", "eager")
    ids = torch.randint(0, H.VOCAB, (1, 9))
    HFStudent(ours)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_layout_under_a_sliding_window_sees_positions_less_than_w_back():
    """A layout whose rows reach back W or more positions used to be refused (distance counted in key storage);
    now the window applies in position space: equal to eager with the layout's mask AND (p - W, p]."""
    ours, eager = H.twin_models(FAMILIES["mistral"](), "kforcing", "eager")
    ids = torch.randint(0, H.VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    layout = WindowLayout.sbd(8, 2)  # [clean (8) | masked copy (8)], token j of either copy at position j
    positions = torch.arange(8).repeat(2)
    mask = layout.dense_mask() & (positions[None, :] > positions[:, None] - W)
    assert not torch.equal(mask, layout.dense_mask())  # e.g. masked token 7 no longer sees clean tokens 0..3
    got = H.logits_and_grads(ours, input_ids=ids, position_ids=positions[None], kforcing_layout=layout, use_cache=False)
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, None]
    want = H.logits_and_grads(
        eager, input_ids=ids, position_ids=positions[None], attention_mask=additive, use_cache=False
    )
    H.assert_same_logits_and_grads(got, want)


def test_layout_positions_and_windows_that_have_no_meaning_are_refused_by_name():
    (ours,) = H.twin_models(FAMILIES["mistral"](), "kforcing")
    ids = torch.randint(0, H.VOCAB, (1, 8 + 8 * 2))
    layout = WindowLayout.kforcing_single(8, 2)
    # Positions 0..23 in storage order: window slots would sit after the whole context, not after their token.
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids: with the model's sliding window"):
        ours(input_ids=ids, position_ids=torch.arange(24)[None], kforcing_layout=layout, use_cache=False)
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids: with the model's sliding window"):
        ours(input_ids=ids, kforcing_layout=layout, use_cache=False)  # the model's default positions: the same
    # A layout over the model's own sliding cache, which dropped all but the last W - 1 keys: the message says what to
    # pass.
    with torch.no_grad():
        cache = ours(input_ids=ids[:, :8], use_cache=True).past_key_values
        windows = WindowLayout(8, 1, 2, [0], [8], queries="windows")
        with pytest.raises(ValueError, match=r"past_key_values=DynamicCache\(\)"):
            ours(
                input_ids=ids[:, 8:10],
                position_ids=torch.arange(8, 10)[None],
                kforcing_layout=windows,
                past_key_values=cache,
            )
        full = transformers.DynamicCache()
        ours(input_ids=ids[:, :8], past_key_values=full, use_cache=True)
        ours(
            input_ids=ids[:, 8:10],
            position_ids=torch.arange(8, 10)[None],
            kforcing_layout=windows,
            past_key_values=full,
        )
    # A window shorter than the layout's windows (k = 6 > W = 4): a slot would lose its own window's first slots.
    wide = WindowLayout.kforcing_single(4, 6)
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError, match="sliding_window: the model's window \\(4\\).*shorter than the layout's windows of 6"
        ),
    ):
        ours(
            input_ids=torch.randint(0, H.VOCAB, (1, 28)),
            position_ids=kf_hf.kforcing_position_ids(4, 6)[None],
            kforcing_layout=wide,
            use_cache=False,
        )


def test_padded_batch_mask_with_a_window_runs_as_interval_layout(monkeypatch):
    """Padding makes transformers materialise the mask (window + padding); its rows are key intervals, so they
    run as a layout (window_attention, not SDPA), equal to sdpa on every real token."""
    import kforcing_kernels.integrations.hf as hf_module

    layouts = []
    original = hf_module.window_attention
    monkeypatch.setattr(
        hf_module,
        "window_attention",
        lambda q, k, v, layout, **kw: layouts.append(layout) or original(q, k, v, layout, **kw),
    )
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


# ---------------------------------------------------------------------- K-Forcing under the model's window

# The window as inference gives it: the token at position p sees positions (p - W, p]. Oracle: for every window t,
# a plain sdpa forward of [tokens 0..t | window t's noise slots] at positions 0..t+k with the model's own sliding mask.
SLIDING = {
    "mistral_w8": lambda: H.mistral(sliding_window=8),
    "gemma3_alternating_w8": lambda: H.gemma3(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
}

NO_WINDOW = {  # the same models with global attention everywhere
    "mistral_w8": lambda: H.mistral(sliding_window=None),
    "gemma3_alternating_w8": lambda: H.gemma3(sliding_window=8, layer_types=["full_attention", "full_attention"]),
    "qwen2_w8": lambda: H.qwen2(),
    "phi3_w8": lambda: H.phi3(sliding_window=None),
    "gemma2_no_softcap_w8": lambda: FAMILIES["gemma2_no_softcap"]().__class__(
        **{**FAMILIES["gemma2_no_softcap"]().to_dict(), "layer_types": ["full_attention", "full_attention"]}
    ),
}
# Every family with a window, for the SingleForward check (Gemma2 has no sdpa path in transformers: eager there).
WINDOWED = {
    **SLIDING,
    "qwen2_w8": lambda: H.qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "phi3_w8": lambda: H.phi3(sliding_window=8),
    "gemma2_no_softcap_w8": lambda: FAMILIES["gemma2_no_softcap"]().__class__(
        **{**FAMILIES["gemma2_no_softcap"]().to_dict(), "sliding_window": 8}
    ),
}


def per_window_recomputation(sdpa, noise_embedding, ids, noise, tau):
    """[B, N, k, V] window logits and [B, N, V] context logits, each window recomputed alone."""
    n, k = noise.shape[1:]
    windows, context = [], []
    for t in range(n):
        x = torch.cat([sdpa.get_input_embeddings()(ids[:, : t + 1]), noise_embedding(noise[:, t], tau)], 1)
        logits = sdpa(inputs_embeds=x, position_ids=torch.arange(t + 1 + k)[None], use_cache=False).logits
        windows.append(logits[:, t + 1 :])
        context.append(logits[:, t])
    return torch.stack(windows, 1), torch.stack(context, 1)


@pytest.mark.parametrize("family", WINDOWED)
def test_single_forward_equals_per_window_recomputation_with_the_models_sliding_mask(family):
    n, k = 24, 4
    ours, sdpa = H.twin_models(WINDOWED[family](), "kforcing", "eager" if family.startswith("gemma2") else "sdpa")
    torch.manual_seed(1)
    noise_embedding = kf_hf.NoiseEmbedding(H.HIDDEN)
    gen = torch.Generator().manual_seed(8)
    ids, noise, tau = (
        torch.randint(0, H.VOCAB, (2, n), generator=gen),
        torch.rand(2, n, k, generator=gen),
        torch.tensor([0.7, 1.1]),
    )
    with torch.no_grad():
        got = ours(**kf_hf.single_forward_inputs(ours, ids, noise, noise_embedding, tau)).logits
        want_windows, want_context = per_window_recomputation(sdpa, noise_embedding, ids, noise, tau)
        (full,) = H.twin_models(NO_WINDOW[family](), "kforcing")
        no_window = full(**kf_hf.single_forward_inputs(full, ids, noise, noise_embedding, tau), use_cache=False).logits
    assert ours.config.sliding_window == 8
    tol = 1e-4 if family.startswith("gemma") else 1e-5  # Gemma's scaled embeddings: logits of ~10
    torch.testing.assert_close(got[:, :n], want_context, atol=tol, rtol=tol)
    torch.testing.assert_close(got[:, n:].reshape(2, n, k, -1), want_windows, atol=tol, rtol=tol)
    # The window is in effect: without it, windows far enough into the sequence see other keys.
    assert not torch.allclose(no_window[:, n:].reshape(2, n, k, -1)[:, -1], want_windows[:, -1], atol=1e-3)


def test_double_forward_and_training_gradients_under_a_sliding_window_equal_recomputation():
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    n, k = 24, 2
    ours, sdpa = H.twin_models(SLIDING["mistral_w8"](), "kforcing", "sdpa")
    student = HFStudent(ours)
    gen = torch.Generator().manual_seed(9)
    ctx, z = torch.randint(0, H.VOCAB, (2, n), generator=gen), torch.rand(2, n, 2 * k, generator=gen)
    logits, cache = student.single_forward(ctx, z[..., :k], 0.9)
    first = logits.argmax(-1)
    second = student.double_forward(cache, first, z[..., k:], 0.9)
    assert cache.get_seq_length() == n
    with torch.no_grad():
        for t in range(n):  # window t's [Future-1 | Future-2] is plain causal over [ctx 0..t | F1 | F2]
            x = torch.cat(
                [
                    sdpa.get_input_embeddings()(torch.cat([ctx[:, : t + 1], first[:, t]], 1)),
                    student.embed_noise(z[:, t, k:], 0.9),
                ],
                1,
            )
            want = sdpa(inputs_embeds=x, position_ids=torch.arange(t + 1 + 2 * k)[None], use_cache=False).logits
            torch.testing.assert_close(second[:, t], want[:, t + 1 + k :], atol=1e-5, rtol=1e-5)
    # Training through the window: gradients of the SingleForward loss equal the recomputation's.
    tokens, noise = ctx[:1, :12], z[:1, :12, :k]
    got = torch.autograd.grad(student(tokens, noise, 0.9).logsumexp(-1).sum(), list(ours.parameters()))
    total = 0
    for t in range(12):
        x = torch.cat([sdpa.get_input_embeddings()(tokens[:, : t + 1]), student.embed_noise(noise[:, t], 0.9)], 1)
        total = (
            total
            + sdpa(inputs_embeds=x, position_ids=torch.arange(t + 1 + k)[None], use_cache=False)
            .logits[:, t + 1 :]
            .logsumexp(-1)
            .sum()
        )
    want = torch.autograd.grad(total, list(sdpa.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", SLIDING)
def test_k_forcing_generation_past_the_window_equals_recomputation(family):
    from kforcing_kernels.app.generation.inference import generate_kforcing
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    k, new_tokens = 4, 20  # prompts of 6 and 9 tokens: generation runs to 26-29 tokens, far past W = 8
    ours, sdpa = H.twin_models(SLIDING[family](), "kforcing", "sdpa")
    student = HFStudent(ours)
    prompts = [torch.randint(0, H.VOCAB, (p,), generator=torch.Generator().manual_seed(p)) for p in (6, 9)]
    noise = torch.rand(2, new_tokens // k, k, generator=torch.Generator().manual_seed(3))
    out, logits = generate_kforcing(student, prompts, k, new_tokens, temperature=0.8, noise=noise, return_logits=True)
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            seq = prompt[None]
            for s in range(new_tokens // k):
                x = torch.cat([sdpa.get_input_embeddings()(seq), student.embed_noise(noise[b : b + 1, s], 0.8)], 1)
                want = sdpa(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None], use_cache=False).logits[
                    :, -k:
                ]
                torch.testing.assert_close(logits[b, s * k : (s + 1) * k], want[0], atol=1e-5, rtol=1e-5)
                assert out[b, s * k : (s + 1) * k].tolist() == want[0].argmax(-1).tolist()
                seq = torch.cat([seq, want.argmax(-1)], 1)


@pytest.mark.parametrize("family", SLIDING)
def test_compiled_single_forward_under_a_sliding_window_equals_eager(family):
    """fullgraph=True: the per-layer intersection's range numbers go to the custom op (no layout is built in the
    trace); logits equal the per-window recomputation, gradients the eager model's."""
    ours, eager, sdpa = H.twin_models(SLIDING[family](), "kforcing", "kforcing", "sdpa")
    noise_embedding = kf_hf.NoiseEmbedding(H.HIDDEN)
    n, k = 12, 2
    gen = torch.Generator().manual_seed(2)
    ids, noise = torch.randint(0, H.VOCAB, (2, n), generator=gen), torch.rand(2, n, k, generator=gen)
    with torch.no_grad():
        batch = kf_hf.single_forward_inputs(ours, ids, noise, noise_embedding, torch.ones(2))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
        got = H.logits_and_grads(compiled, **batch, use_cache=False)
    finally:
        torch._dynamo.reset()
    H.assert_same_logits_and_grads(got, H.logits_and_grads(eager, **batch, use_cache=False), 1e-4)
    with torch.no_grad():
        want_windows, _ = per_window_recomputation(sdpa, noise_embedding, ids, noise, torch.ones(2))
    torch.testing.assert_close(got[0][:, n:].reshape(2, n, k, -1), want_windows, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", SLIDING)
def test_package_ar_generation_past_the_window_equals_transformers_generate(family):
    """The package's AR decoding (the evaluation's baseline) over the full cache: HF generate's tokens, past W."""
    from kforcing_kernels.app.generation.inference import generate_ar
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    ours, sdpa = H.twin_models(SLIDING[family](), "kforcing", "sdpa")
    prompts = torch.randint(3, H.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    want = sdpa.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
    )
    assert generate_ar(HFStudent(ours), prompts, 20, temperature=0).tolist() == want[:, 5:].tolist()

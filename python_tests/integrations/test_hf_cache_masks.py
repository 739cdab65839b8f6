"""The HF integration's documented recipes work on current transformers: cropping the context cache after a
DoubleForward (``Cache.crop`` takes a negative count in transformers 5) and giving HF ``eager`` attention a
layout (it adds its 4-D mask to the scores, so it needs the additive form, never the boolean ``dense_mask()``)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402


def test_crop_cache_returns_to_the_context_and_the_next_double_forward_reuses_it():
    (model,) = H.twin_models(H.llama(), "kforcing")
    emb = kf_hf.NoiseEmbedding(H.HIDDEN)
    n, k = 5, 2
    ids = torch.randint(0, H.VOCAB, (2, n))
    future1, noise, tau = torch.randint(0, H.VOCAB, (2, n, k)), torch.rand(2, n, k), torch.ones(2)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        context_keys = [layer.keys.clone() for layer in cache.layers]
        batch = kf_hf.double_forward_inputs(model, future1, noise, emb, tau)
        first = model(**batch, past_key_values=cache).logits
        assert cache.get_seq_length() == n + 2 * n * k
        assert "cache.crop(N)" not in kf_hf.double_forward_inputs.__doc__  # the old recipe raises on transformers 5
        kf_hf.crop_cache(cache, n)
        assert cache.get_seq_length() == n
        assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, context_keys))
        again = model(**batch, past_key_values=cache).logits  # a second teacher round on the same context
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"length: expected an int in \[0, 25\]"):
        kf_hf.crop_cache(cache, 26)
    with pytest.raises(ValueError, match="length: expected an int"):
        kf_hf.crop_cache(cache, 2.0)


def test_additive_mask_is_what_hf_eager_needs():
    ours, eager = H.twin_models(H.llama(), "kforcing", "eager")
    layout = WindowLayout.sbd(5, 2)
    ids = torch.randint(0, H.VOCAB, (2, layout.n_queries), generator=torch.Generator().manual_seed(2))
    positions = kf_hf.sbd_position_ids(5)[None].expand(2, -1)
    mask = kf_hf.additive_mask(layout, batch=2)
    assert mask.shape == (2, 1, 10, 10) and mask.dtype == torch.float32
    assert torch.equal(mask == 0, layout.dense_mask()[None, None].expand(2, 1, -1, -1))
    assert bool((mask[mask != 0] == torch.finfo(torch.float32).min).all())
    assert kf_hf.additive_mask(layout, dtype=torch.bfloat16).dtype == torch.bfloat16
    with torch.no_grad():
        want = ours(input_ids=ids, position_ids=positions, kforcing_layout=layout).logits
        torch.testing.assert_close(
            eager(input_ids=ids, position_ids=positions, attention_mask=mask).logits, want, atol=1e-5, rtol=1e-5
        )
        # Why the rule exists: eager adds the boolean mask (0/1) to the scores and attends everywhere.
        wrong = eager(
            input_ids=ids, position_ids=positions, attention_mask=layout.dense_mask()[None, None].expand(2, 1, -1, -1)
        )
        assert not torch.allclose(wrong.logits, want, atol=1e-3)
        # "kforcing" (and sdpa) take the boolean form too.
        routed = ours(
            input_ids=ids, position_ids=positions, attention_mask=layout.dense_mask()[None, None].expand(2, 1, -1, -1)
        )
        torch.testing.assert_close(routed.logits, want, atol=1e-5, rtol=1e-5)

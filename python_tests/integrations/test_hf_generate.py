"""HF generate() under attn_implementation="kforcing" vs "sdpa", for every cache type transformers offers.

Each cache type either gives the same greedy tokens (and logits) as sdpa or
raises a clear error. A static cache used to be silently wrong: the all-ones
padding mask was dropped, so the unused cache slots were attended to.
"""

import copy
import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402,F401  (registers "kforcing")
from kforcing_kernels import WindowLayout  # noqa: E402

VOCAB = 48


def llama_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **extra,
    )


def mistral_sliding_config():
    return transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=1,
    )


def twins(config):
    models = []
    for impl in ("sdpa", "kforcing"):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model.eval())
    return models


def generate(model, ids, mask=None, **kwargs):
    torch.manual_seed(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=8,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        min_new_tokens=8,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits)


def assert_same_generation(ours, theirs):
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama_twins():
    torch.manual_seed(0)
    return twins(llama_config())


@pytest.fixture
def prompts():
    return torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("cache", [None, "dynamic", "static"])
def test_generate_matches_sdpa(llama_twins, prompts, cache):
    sdpa, ours = llama_twins
    kwargs = {} if cache is None else {"cache_implementation": cache}
    assert_same_generation(generate(ours, prompts, **kwargs), generate(sdpa, prompts, **kwargs))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_left_padding_matches_sdpa(llama_twins, cache):
    sdpa, ours = llama_twins
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # row 0 is left padded
    assert_same_generation(
        generate(ours, ids, mask, cache_implementation=cache), generate(sdpa, ids, mask, cache_implementation=cache)
    )


def test_static_cache_attends_only_filled_slots(llama_twins, prompts):
    """The decisive check for the old bug: one forward on a static cache equals the same forward without a cache."""
    sdpa, ours = llama_twins
    cache = transformers.StaticCache(config=ours.config, max_cache_len=16)
    with torch.no_grad():
        got = ours(prompts, attention_mask=torch.ones_like(prompts), past_key_values=cache, use_cache=True).logits
        want = sdpa(prompts).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sliding_window_caches_match_sdpa():
    """A sliding-window model (sliding / static caches): the window is honoured, the tokens and logits are sdpa's."""
    torch.manual_seed(0)
    sdpa, ours = twins(mistral_sliding_config())
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    for cache in (None, "static"):
        kwargs = {} if cache is None else {"cache_implementation": cache}
        assert_same_generation(generate(ours, ids, **kwargs), generate(sdpa, ids, **kwargs))


@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_offloaded_caches_match_sdpa_or_fail_alike(llama_twins, prompts, cache):
    sdpa, ours = llama_twins
    try:
        want = generate(sdpa, prompts, cache_implementation=cache)
    except Exception as exc:  # e.g. offloading needs a CUDA device: ours must fail the same way
        with pytest.raises(type(exc)):
            generate(ours, prompts, cache_implementation=cache)
        return
    assert_same_generation(generate(ours, prompts, cache_implementation=cache), want)


@pytest.mark.skipif(
    not any(importlib.util.find_spec(m) for m in ("optimum.quanto", "hqq"))
    if importlib.util.find_spec("optimum")
    else importlib.util.find_spec("hqq") is None,
    reason="no KV-cache quantization backend (optimum-quanto or hqq) installed",
)
def test_quantized_cache_matches_sdpa(llama_twins, prompts):
    sdpa, ours = llama_twins
    backend = "quanto" if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto") else "HQQ"
    kwargs = {"cache_implementation": "quantized", "cache_config": {"backend": backend, "nbits": 4}}
    assert_same_generation(generate(ours, prompts, **kwargs), generate(sdpa, prompts, **kwargs))


def test_layout_call_on_a_static_cache_is_refused(llama_twins):
    """A kforcing_layout describes exactly cache + input tokens; a static cache's unused slots cannot be honoured."""
    _, ours = llama_twins
    n = 4
    ids = torch.randint(3, VOCAB, (1, n))
    cache = transformers.StaticCache(config=ours.config, max_cache_len=32)
    layout = WindowLayout.causal(n)
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask|kforcing_layout"):
        ours(ids, past_key_values=cache, use_cache=True, kforcing_layout=layout)

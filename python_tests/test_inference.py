"""KV-cached generation equals uncached decoding with the same noise (K-Forcing and AR)."""

import math

import pytest
import torch

from kforcing_kernels.inference import generate_ar, generate_kforcing, pad_prompts
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling import inverse_cdf_sample

CFG = ModelConfig.micro(vocab_size=50, n_embd=32, n_head=2, n_layer=2)
LENGTHS = (3, 8, 5)  # ragged prompts in one batch


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return KForcingLM(CFG).double().eval()


@pytest.fixture
def prompts():
    return [torch.randint(0, CFG.vocab_size, (n,)) for n in LENGTHS]


def uncached_kforcing(model, prompt, k, new_tokens, noise, tau):
    """Algorithm 1 without a cache: each step re-runs SingleForward over the whole context
    and decodes the window after its last token (other windows get unrelated noise)."""
    seq, out = prompt.clone(), []
    for step in range(noise.shape[0]):
        z = torch.rand(1, seq.numel(), k, dtype=torch.float64)
        z[0, -1] = noise[step]
        logits, _ = model.single_forward(seq[None], z, tau)
        new = logits[0, -1].argmax(-1)  # [k]
        out += new.tolist()
        seq = torch.cat([seq, new])
    return out[:new_tokens]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_cached_kforcing_equals_uncached_single_forward(model, prompts, k):
    new_tokens = 9  # not a multiple of k for k=2, 4: the last step is cut
    noise = torch.rand(len(prompts), math.ceil(new_tokens / k), k, dtype=torch.float64)
    tau = 0.7
    out = generate_kforcing(model, prompts, k, new_tokens, temperature=tau, noise=noise)
    assert out.shape == (len(prompts), new_tokens)
    expected = [uncached_kforcing(model, p, k, new_tokens, noise[b], tau) for b, p in enumerate(prompts)]
    assert out.tolist() == expected


def test_each_request_is_independent_of_the_batch(model, prompts):
    noise = torch.rand(len(prompts), 3, 2, dtype=torch.float64)
    batched = generate_kforcing(model, prompts, 2, 6, noise=noise)
    for b, p in enumerate(prompts):
        alone = generate_kforcing(model, [p], 2, 6, noise=noise[b: b + 1])
        assert alone[0].tolist() == batched[b].tolist()


def test_cached_ar_equals_uncached(model, prompts):
    new_tokens, tau = 7, 0.9
    noise = torch.rand(len(prompts), new_tokens, dtype=torch.float64)
    out = generate_ar(model, prompts, new_tokens, temperature=tau, noise=noise)
    for b, p in enumerate(prompts):
        seq = p.clone()
        for s in range(new_tokens):
            logits = model(seq[None])[0, -1]
            seq = torch.cat([seq, inverse_cdf_sample(logits, noise[b, s], tau)[None]])
        assert out[b].tolist() == seq[p.numel():].tolist()


def test_generator_makes_runs_reproducible(model, prompts):
    a = generate_kforcing(model, prompts, 2, 5, generator=torch.Generator().manual_seed(3))
    b = generate_kforcing(model, prompts, 2, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    greedy = generate_ar(model, prompts, 4, temperature=0)
    assert torch.equal(greedy, generate_ar(model, prompts, 4, temperature=0))


def test_pad_prompts():
    tokens, lengths = pad_prompts([[1, 2, 3], [4]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1]


def test_bad_inputs_raise_clear_errors(model, prompts):
    with pytest.raises(ValueError, match="noise"):
        generate_kforcing(model, prompts, 2, 4, noise=torch.rand(3, 1, 2))
    with pytest.raises(ValueError, match="k"):
        generate_kforcing(model, prompts, 0, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ar(model, prompts, 0)
    with pytest.raises(ValueError, match="prompts"):
        generate_ar(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="prompts"):
        generate_ar(model, [[1, CFG.vocab_size]], 3)

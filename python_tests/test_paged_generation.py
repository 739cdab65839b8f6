"""Generation on the paged cache equals the contiguous cache (tokens and logits); the step API: early finish, joins, full pool."""

import math

import pytest
import torch

from kforcing_kernels.app.inference import generate_ar, generate_kforcing
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.app.paged_cache import PagedKVCache, PagePoolFull
from kforcing_kernels.app.serving import PagedGenerator, Request

CFG = ModelConfig.micro(vocab_size=40, n_embd=32, n_head=2, n_layer=2)
LENGTHS = (3, 9, 5, 1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(2)
    return KForcingLM(CFG).double().eval()


@pytest.fixture
def prompts():
    return [torch.randint(0, CFG.vocab_size, (n,)) for n in LENGTHS]


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_kforcing_paged_equals_contiguous(model, prompts, k, page_size):
    t = 10
    noise = torch.rand(len(prompts), math.ceil(t / k), k, dtype=torch.float64)
    ref, ref_logits = generate_kforcing(model, prompts, k, t, temperature=0.8, noise=noise, cache="contiguous", return_logits=True)
    out, logits = generate_kforcing(model, prompts, k, t, temperature=0.8, noise=noise, cache="paged", page_size=page_size, return_logits=True)
    assert out.tolist() == ref.tolist()
    assert logits.shape == (len(prompts), t, CFG.vocab_size)
    torch.testing.assert_close(logits, ref_logits, atol=1e-12, rtol=0)


@pytest.mark.parametrize("page_size", [2, 5])
def test_ar_paged_equals_contiguous(model, prompts, page_size):
    t = 9
    noise = torch.rand(len(prompts), t, dtype=torch.float64)
    tau = torch.tensor([0.5, 1.0, 1.5, 0.9])
    ref, ref_logits = generate_ar(model, prompts, t, temperature=tau, noise=noise, cache="contiguous", return_logits=True)
    out, logits = generate_ar(model, prompts, t, temperature=tau, noise=noise, cache="paged", page_size=page_size, return_logits=True)
    assert out.tolist() == ref.tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-12, rtol=0)
    greedy = generate_ar(model, prompts, t, temperature=0, cache="contiguous")
    assert generate_ar(model, prompts, t, temperature=0, cache="paged", page_size=page_size).tolist() == greedy.tolist()


def test_float32_model_same_tokens(prompts):
    torch.manual_seed(5)
    m = KForcingLM(CFG).eval()
    noise = torch.rand(len(prompts), 4, 2)
    ref, ref_logits = generate_kforcing(m, prompts, 2, 8, noise=noise, cache="contiguous", return_logits=True)
    out, logits = generate_kforcing(m, prompts, 2, 8, noise=noise, cache="paged", page_size=4, return_logits=True)
    assert out.tolist() == ref.tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def expected_tokens(model, prompt, k, noise, t):
    return generate_kforcing(model, [prompt], k, t, noise=noise[None], cache="contiguous")[0].tolist()


def test_eos_finishes_early_and_frees_pages(model, prompts):
    k, t = 2, 12
    noise = torch.rand(len(prompts), t // k, k, dtype=torch.float64)
    full = [expected_tokens(model, p, k, noise[i], t) for i, p in enumerate(prompts)]
    eos = full[1][3]  # request 1 produces it at step 1 (and maybe others do too)
    gen = PagedGenerator(model, k, page_size=2, num_pages=64)
    reqs = [Request(p, t, noise=noise[i], eos_id=eos) for i, p in enumerate(prompts)]
    steps, finished_at = 0, {}
    while not all(r.done for r in reqs):
        for r in gen.step(reqs):
            finished_at[id(r)] = steps
            assert r.row is None
        steps += 1
    for i, r in enumerate(reqs):
        cut = full[i].index(eos) + 1 if eos in full[i] else t
        assert r.tokens == full[i][:cut]
    assert finished_at[id(reqs[1])] == 1 and gen.cache.free_pages == 64  # everything went back to the pool


def test_requests_join_a_running_batch(model, prompts):
    """Requests added between steps give exactly what they give alone; the pool is reused as others finish."""
    k = 2
    noise = {i: torch.rand(math.ceil(n / k), k, dtype=torch.float64) for i, n in enumerate((4, 10, 6, 8))}
    max_new = {0: 4, 1: 10, 2: 6, 3: 8}
    gen = PagedGenerator(model, k, page_size=3, num_pages=12)
    reqs = [Request(prompts[0], max_new[0], noise=noise[0]), Request(prompts[1], max_new[1], noise=noise[1])]
    gen.step(reqs)
    reqs.append(Request(prompts[2], max_new[2], noise=noise[2]))  # joins at step 1
    gen.step(reqs)
    gen.step(reqs)
    reqs.append(Request(prompts[3], max_new[3], noise=noise[3]))  # joins at step 3, after request 0 finished
    assert reqs[0].done
    while not all(r.done for r in reqs):
        gen.step(reqs)
    for i, r in enumerate(reqs):
        assert r.tokens == expected_tokens(model, prompts[i], k, noise[i], max_new[i])
    assert gen.cache.free_pages == 12


def test_ar_step_api_matches_generate_ar(model, prompts):
    noise = torch.rand(len(prompts), 5, dtype=torch.float64)
    ref = generate_ar(model, prompts, 5, temperature=0.7, noise=noise, cache="contiguous")
    gen = PagedGenerator(model, None, page_size=4, num_pages=16)
    reqs = [Request(p, 5, noise=noise[i], temperature=0.7) for i, p in enumerate(prompts)]
    while not all(r.done for r in reqs):
        gen.step(reqs)
    assert [r.tokens for r in reqs] == ref.tolist()


def test_full_pool_is_a_clear_error_and_the_cache_stays_usable(model, prompts):
    k = 2
    cache = PagedKVCache.for_model(model, page_size=2, num_pages=9)
    gen = PagedGenerator(model, k, cache=cache)
    noise = torch.rand(2, 5, k, dtype=torch.float64)
    reqs = [Request(prompts[1], 10, noise=noise[0])]  # 9 prompt tokens: 5 pages
    gen.step(reqs)
    state = (cache.free_pages, cache.pages_of(reqs[0].row), cache.length(reqs[0].row), reqs[0].tokens[:])
    pool = [t.clone() for t in cache.k]
    reqs.append(Request(prompts[1], 4, noise=noise[1, :2]))  # 5 more pages (+1 for the running one), 4 free
    with pytest.raises(PagePoolFull, match="page pool full: this step needs 6 more pages of 2 tokens, 4 of 9 free"):
        gen.step(reqs)
    assert (cache.free_pages, cache.pages_of(reqs[0].row), cache.length(reqs[0].row), reqs[0].tokens) == state
    assert all(torch.equal(a, b) for a, b in zip(cache.k, pool))
    reqs.pop()  # drop the newcomer: the running request goes on and gives its usual tokens
    while not reqs[0].done:
        gen.step(reqs)
    assert reqs[0].tokens == expected_tokens(model, prompts[1], k, noise[0], 10)


def test_step_api_bad_requests(model):
    gen = PagedGenerator(model, 2, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="prompt: expected a non-empty"):
        gen.step([Request([], 3)])
    with pytest.raises(ValueError, match="prompt: expected token ids in"):
        gen.step([Request([CFG.vocab_size], 3)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.step([Request([1], True)])
    with pytest.raises(ValueError, match=r"noise: expected shape \(2, 2\)"):
        gen.step([Request([1], 3, noise=torch.rand(3, 2))])
    with pytest.raises(ValueError, match="num_pages"):
        PagedGenerator(model, 2)
    with pytest.raises(ValueError, match="k: expected a positive int or None"):
        PagedGenerator(model, True, num_pages=4)

"""Generation on the paged cache equals the contiguous cache (tokens and logits); the step API: early finish, joins,
full pool."""

import math

import pytest
import torch

from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
from kforcing_kernels.app.generation.paged_cache import PagedKVCache, PagePoolFull
from kforcing_kernels.app.generation.serving import PagedGenerator, Request
from kforcing_kernels.model import KForcingLM, ModelConfig

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
    ref, ref_logits = generate_kforcing(
        model, prompts, k, t, temperature=0.8, noise=noise, cache="contiguous", return_logits=True
    )
    out, logits = generate_kforcing(
        model, prompts, k, t, temperature=0.8, noise=noise, cache="paged", page_size=page_size, return_logits=True
    )
    assert out.tolist() == ref.tolist()
    assert logits.shape == (len(prompts), t, CFG.vocab_size)
    torch.testing.assert_close(logits, ref_logits, atol=1e-12, rtol=0)


@pytest.mark.parametrize("page_size", [2, 5])
def test_ar_paged_equals_contiguous(model, prompts, page_size):
    t = 9
    noise = torch.rand(len(prompts), t, dtype=torch.float64)
    tau = torch.tensor([0.5, 1.0, 1.5, 0.9])
    ref, ref_logits = generate_ar(
        model, prompts, t, temperature=tau, noise=noise, cache="contiguous", return_logits=True
    )
    out, logits = generate_ar(
        model, prompts, t, temperature=tau, noise=noise, cache="paged", page_size=page_size, return_logits=True
    )
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


# ---------------------------------------------------------------------- cancellation (issue 40, item 1)


def test_cancel_returns_the_pages_and_a_refused_request_is_admitted(model, prompts):
    """The PagePoolFull advice works: cancelling the running request frees its pages and the refused one runs."""
    k = 2
    gen = PagedGenerator(model, k, page_size=2, num_pages=9)
    noise = torch.rand(2, 5, k, dtype=torch.float64)
    first = Request(prompts[1], 10, noise=noise[0])  # 9 prompt tokens: 5 pages
    gen.step([first])
    second = Request(prompts[1], 4, noise=noise[1, :2])
    with pytest.raises(PagePoolFull, match="cancel requests"):
        gen.step([first, second])
    produced = first.tokens[:]
    gen.cancel(first)
    assert (first.done, first.cancelled, first.row, first.tokens) == (True, True, None, produced)
    assert gen.cache.free_pages == 9 and gen.running == []
    gen.cancel(first)  # a second cancel changes nothing
    assert gen.cache.free_pages == 9
    while not second.done:
        gen.step([first, second])  # the cancelled request in the list is skipped
    assert not second.cancelled and second.tokens == expected_tokens(model, prompts[1], k, noise[1, :2], 4)
    assert gen.cache.free_pages == 9


@pytest.mark.parametrize("k", [None, 2])
def test_cancel_after_the_end_leaves_a_finished_request_as_it_is(model, prompts, k):
    """Issue 46 (a planted bug the suite let through): cancel() on a request that finished (or hit its eos) is a no-op:
    it is not marked cancelled (its tokens are the whole answer), and the pool is untouched."""
    gen = PagedGenerator(model, k, page_size=2, num_pages=9)
    shape = (3,) if k is None else (2, k)
    r = Request(prompts[0], 3, noise=torch.rand(shape, dtype=torch.float64))
    while not r.done:
        gen.step([r])
    tokens, free = r.tokens[:], gen.cache.free_pages
    assert (r.done, r.cancelled, r.row) == (True, False, None)
    gen.cancel(r)
    assert (r.done, r.cancelled, r.row, r.tokens, gen.cache.free_pages) == (True, False, None, tokens, free)
    assert gen.step([r]) == [] and not r.cancelled  # listed again after its end: skipped, still not cancelled


def test_a_request_marked_done_by_the_caller_gives_its_pages_back(model, prompts):
    gen = PagedGenerator(model, 2, page_size=2, num_pages=9)
    r = Request(prompts[1], 10, noise=torch.rand(5, 2, dtype=torch.float64))
    gen.step([r])
    assert gen.cache.free_pages == 4
    r.done = True  # dropped the way the PagePoolFull message used to suggest
    assert gen.step([r]) == [] and gen.cache.free_pages == 9
    assert (r.row, r.cancelled) == (None, True)


def test_cancel_refuses_a_request_of_another_generator(model, prompts):
    one = PagedGenerator(model, 2, page_size=2, num_pages=9)
    other = PagedGenerator(model, 2, page_size=2, num_pages=9)
    r = Request(prompts[0], 6, noise=torch.rand(3, 2, dtype=torch.float64))
    one.step([r])
    with pytest.raises(ValueError, match="request: holds row 0 of another generator"):
        other.cancel(r)
    with pytest.raises(ValueError, match="requests: a request holds row 0 of another generator"):
        other.step([r])
    assert one.cache.free_pages == 9 - 2 and other.cache.free_pages == 9 and not r.done
    with pytest.raises(ValueError, match="request: expected a Request"):
        one.cancel(r.row)
    r2 = Request(prompts[0], 2, noise=torch.rand(1, 2, dtype=torch.float64))
    one.cancel(r2)  # not started: only marked
    assert (r2.done, r2.cancelled, r2.tokens, one.cache.free_pages) == (True, True, [], 7)


def _pages_held(r: Request, k, page: int) -> int:
    """The model of the pool: a running request holds its context (prompt + what the decode steps appended) in pages."""
    ctx = len(r.prompt) + (r.steps - 1) * (1 if k is None else k)
    return math.ceil(ctx / page)


@pytest.mark.parametrize("k", [None, 2])
def test_the_pool_is_whole_after_any_mix_of_finish_cancel_and_refused_steps(model, k):
    counts = {"refused": 0, "cancelled": 0, "marked done": 0, "finished": 0}
    for seed in range(5):
        _random_serving_run(model, k, seed, counts)
    assert all(counts.values()), counts  # every kind of event happened (the seeds are fixed)


def _random_serving_run(model, k, seed: int, counts: dict) -> None:
    """Random finish / cancel / mark-done / pause / refused steps against a model of the pool.

    After every action: each running request holds exactly the pages its context needs, no page is held twice or
    both held and free, and free + held = the pool; a refused step changes nothing; at the end every page is free.
    Requests that ran to the end (never cancelled) give the tokens they give alone.
    """
    rng = torch.Generator().manual_seed(seed)
    rand = lambda n: int(torch.randint(0, n, (), generator=rng))  # noqa: E731
    page, num_pages = 2, 7
    gen = PagedGenerator(model, k, page_size=page, num_pages=num_pages)
    pending, active, ended = [], [], []

    def check_pool():
        held = [p for r in gen.running for p in gen.cache.pages_of(r.row)]
        assert len(held) == len(set(held)) and not set(held) & set(gen.cache._free)
        assert sorted(held + gen.cache._free) == list(range(num_pages))
        assert {id(r) for r in gen.running} == {id(r) for r in active if r.row is not None}
        for r in gen.running:
            assert len(gen.cache.pages_of(r.row)) == _pages_held(r, k, page)
            assert gen.cache.length(r.row) == len(r.prompt) + (r.steps - 1) * (1 if k is None else k)

    for _ in range(30):
        action = rand(6)
        if action == 0 or not (pending or active):
            n, t = 1 + rand(9), 1 + rand(7)
            shape = (t,) if k is None else (math.ceil(t / k), k)
            pending.append(
                Request(
                    torch.randint(0, CFG.vocab_size, (n,), generator=rng),
                    t,
                    noise=torch.rand(shape, generator=rng, dtype=torch.float64),
                    temperature=0.9,
                )
            )
        elif action == 1 and active:
            r = active.pop(rand(len(active)))
            gen.cancel(r)
            assert r.row is None and r.done and r.cancelled
            ended.append(r)
            counts["cancelled"] += 1
        elif action == 2 and active:
            r = active[rand(len(active))]
            r.done = True  # the caller drops it its own way: the next step it is listed in releases it
            counts["marked done"] += 1
        else:
            listed = [r for r in active + pending if rand(4)]  # some requests paused this step
            released = sum(_pages_held(r, k, page) for r in listed if r.done and r.row is not None)
            state = [(r.row, r.steps, r.tokens[:]) for r in listed if not r.done]
            free = gen.cache.free_pages
            try:
                gen.step(listed)
            except PagePoolFull:  # nothing changed, except that the requests marked done were released
                counts["refused"] += 1
                assert gen.cache.free_pages == free + released
                assert [(r.row, r.steps, r.tokens) for r in listed if not r.done] == state
            for r in listed:
                if r in pending and (r.row is not None or r.done):  # started (a one-step request ends at once)
                    pending.remove(r)
                    active.append(r)
            for r in [r for r in active if r.done]:
                if r.row is None:
                    active.remove(r)
                    ended.append(r)
        check_pool()
    for r in active + pending:
        gen.cancel(r)
    assert gen.cache.free_pages == num_pages and gen.running == []
    for r in [r for r in ended if not r.cancelled][:2]:  # the tokens of two requests that ran to the end (time)
        if r.done:
            counts["finished"] += 1
            prompt = r.prompt.tolist()
            if k is None:
                ref = generate_ar(
                    model, [r.prompt], r.max_new_tokens, temperature=0.9, noise=r.noise[None], cache="contiguous"
                )[0]
            else:
                ref = generate_kforcing(
                    model, [r.prompt], k, r.max_new_tokens, temperature=0.9, noise=r.noise[None], cache="contiguous"
                )[0]
            assert r.tokens == ref.tolist(), prompt

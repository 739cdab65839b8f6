"""The request path refuses what generate_* refuses, a refused step changes nothing, duplicates are
refused, and numpy scalars mean the same on both caches (issue #29, serving path)."""

import numpy as np
import pytest
import torch

from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
from kforcing_kernels.app.generation.paged_cache import PagedKVCache
from kforcing_kernels.app.generation.serving import PagedGenerator, Request
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.paged_attention import paged_attention

CFG = ModelConfig.micro(vocab_size=40, n_embd=32, n_head=2, n_layer=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    m = KForcingLM(CFG).double().eval()
    m.k_train = 2
    return m


@pytest.fixture(scope="module")
def ar_model(model):
    """The same weights recorded as an AR model (k_train=0): what generate_ar takes (it refuses K-Forcing models)."""
    m = KForcingLM(CFG).double().eval()
    m.load_state_dict(model.state_dict())
    m.k_train = 0
    return m


@pytest.mark.parametrize("tau", [float("nan"), float("inf"), 0.0, -1.0])
def test_request_temperature_is_checked_like_generate_kforcing(model, tau):
    with pytest.raises(ValueError, match="temperature"):
        generate_kforcing(model, [[1, 2]], 2, 4, temperature=tau)
    gen = PagedGenerator(model, k=2, num_pages=8)
    with pytest.raises(ValueError, match="temperature"):
        gen.step([Request(torch.tensor([1, 2]), 4, temperature=tau)])
    assert gen.cache.free_pages == 8


def test_k_is_checked_against_the_trained_window(model):
    with pytest.raises(ValueError, match="k_train=2"):
        PagedGenerator(model, k=3, num_pages=8)
    ar = KForcingLM(CFG).double().eval()
    ar.k_train = 0
    with pytest.raises(ValueError, match="AR model"):
        PagedGenerator(ar, k=1, num_pages=8)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan")])
def test_noise_outside_the_unit_interval_is_refused_on_both_paths(model, bad):
    noise = torch.rand(1, 2, 2, dtype=torch.float64)
    noise[0, 1, 0] = bad
    for cache in ("contiguous", "paged"):
        with pytest.raises(ValueError, match="noise: expected values in"):
            generate_kforcing(model, [[1, 2, 3]], 2, 4, noise=noise, cache=cache)


def test_a_refused_step_changes_nothing_and_a_retry_works(model):
    gen = PagedGenerator(model, k=2, num_pages=8)
    good = Request(torch.tensor([1, 2, 3]), 4, noise=torch.rand(2, 2, dtype=torch.float64))
    bad_noise = torch.rand(2, 2, dtype=torch.float64)
    bad_noise[1, 1] = 1.5  # found only when sampling before: now when the step is checked
    bad = Request(torch.tensor([4, 5]), 4, noise=bad_noise)
    with pytest.raises(ValueError, match="noise"):
        gen.step([good, bad])
    assert gen.cache.free_pages == 8 and good.row is None and bad.row is None and good.tokens == []
    bad.noise = torch.rand(2, 2, dtype=torch.float64)
    while not (good.done and bad.done):
        gen.step([good, bad])
    ref = generate_kforcing(model, [[1, 2, 3]], 2, 4, noise=good.noise[None], cache="contiguous")
    assert good.tokens == ref[0].tolist()


def test_a_request_listed_twice_is_refused(model):
    gen = PagedGenerator(model, k=2, num_pages=8)
    r = Request(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="more than once"):
        gen.step([r, r])
    assert gen.cache.free_pages == 8 and r.row is None


def test_append_refuses_a_repeated_row():
    cache = PagedKVCache(1, 2, 4, num_pages=4, page_size=2)
    row = cache.add_row()
    kv = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match="rows: expected distinct rows"):
        cache.append([row, row], [(kv, kv)], [3, 3])
    assert cache.length(row) == 0 and cache.free_pages == 4


def test_numpy_zero_temperature_is_greedy_on_both_caches(ar_model):
    prompts = [[1, 2, 3], [4]]
    want = generate_ar(ar_model, prompts, 5, temperature=0, cache="contiguous").tolist()
    for cache in ("contiguous", "paged"):
        for tau in (np.float32(0), np.float64(0), np.int64(0)):
            assert generate_ar(ar_model, prompts, 5, temperature=tau, cache=cache).tolist() == want


def test_paged_attention_takes_a_numpy_scale_like_window_attention():
    q = torch.randn(1, 2, 2, 8)
    kn = torch.randn(1, 2, 2, 8)
    pages = torch.randn(3, 4, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    a = paged_attention(q, kn, kn, pages, pages, table, [5], scale=np.float32(0.5), backend="reference")
    b = paged_attention(q, kn, kn, pages, pages, table, [5], scale=0.5, backend="reference")
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="scale"):
        paged_attention(q, kn, kn, pages, pages, table, [5], scale=np.float32("nan"))


@pytest.mark.parametrize("kw", [dict(num_pages=3.0), dict(capacity=48.0), dict(num_pages=True)])
def test_page_counts_must_be_ints(kw):
    with pytest.raises(ValueError, match="num_pages|capacity"):
        PagedKVCache(1, 2, 8, **kw)


def test_k_train_given_to_generate_kforcing_counts_on_both_caches(model):
    noise = torch.rand(1, 2, 3, dtype=torch.float64)
    a = generate_kforcing(model, [[1, 2]], 3, 6, noise=noise, k_train=3, cache="contiguous")
    b = generate_kforcing(model, [[1, 2]], 3, 6, noise=noise, k_train=3, cache="paged")
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("bad", [1.0, -3.0, float("nan")])
@pytest.mark.parametrize("tau", [0, 0.8])
def test_ar_noise_is_checked_on_both_caches_greedy_or_not(ar_model, bad, tau):
    """generate_ar's noise: the contiguous cache checks it as the paged one does (it once used it unchecked)."""
    noise = torch.rand(1, 3, dtype=torch.float64)
    noise[0, 1] = bad
    for cache in ("contiguous", "paged"):
        with pytest.raises(ValueError, match="noise: expected values in"):
            generate_ar(ar_model, [[1, 2, 3]], 3, noise=noise, temperature=tau, cache=cache)
    for cache in ("contiguous", "paged"):
        with pytest.raises(ValueError, match="noise: expected a floating tensor"):
            generate_ar(ar_model, [[1, 2, 3]], 3, noise=torch.zeros(1, 3, dtype=torch.int64), cache=cache)


def test_integer_temperature_tensors_run_alike_on_both_caches(ar_model):
    got = [
        generate_ar(
            ar_model,
            [[1, 2, 3], [4, 5]],
            3,
            temperature=torch.tensor([1, 2]),
            cache=cache,
            generator=torch.Generator().manual_seed(0),
        )
        for cache in ("contiguous", "paged")
    ]
    want = generate_ar(
        ar_model,
        [[1, 2, 3], [4, 5]],
        3,
        temperature=torch.tensor([1.0, 2.0]),
        cache="contiguous",
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], want)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda m, ar: generate_kforcing(m, [[1, 2]], 2, 4, noise=[[[0.1, 0.2]] * 2]), "noise"),
        (lambda m, ar: generate_ar(ar, [[1, 2]], 2, noise=[[0.1, 0.2]]), "noise"),
        (lambda m, ar: generate_kforcing(m, None, 2, 4), "prompts"),
        (lambda m, ar: generate_ar(ar, 7, 2), "prompts"),
        (lambda m, ar: generate_ar(ar, [[1, 2]], 2, generator=5), "generator"),
        (lambda m, ar: generate_ar(ar, [[1, 2**70]], 2), "prompts"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_by_name(model, ar_model, call, name):
    with pytest.raises(ValueError, match=f"^{name}: (prompt 0: )?expected"):
        call(model, ar_model)


def test_a_request_prompt_must_be_one_dimensional(model):
    gen = PagedGenerator(model, k=2, num_pages=8)
    with pytest.raises(ValueError, match=r"^prompt: expected a 1-D sequence of token ids, got shape \(2, 2\)"):
        gen.step([Request([[1, 2], [3, 4]], 4)])
    assert gen.cache.free_pages == 8


def test_ar_decoding_refuses_a_k_forcing_model(model, ar_model):
    """generate_ar and an AR PagedGenerator on a K-Forcing model (k_train=2) would decode it without its noise
    window: refused by name on both caches; the AR model with the same weights runs."""
    for cache in ("contiguous", "paged"):
        with pytest.raises(
            ValueError, match=r"^model: this model was trained with K-Forcing \(k_train=2\).*generate_kforcing"
        ):
            generate_ar(model, [[1, 2]], 3, cache=cache)
    with pytest.raises(ValueError, match=r"^model: this model was trained with K-Forcing \(k_train=2\)"):
        PagedGenerator(model, None, num_pages=8)
    assert generate_ar(ar_model, [[1, 2]], 3, temperature=0).shape == (1, 3)
    assert PagedGenerator(ar_model, None, num_pages=8).k is None

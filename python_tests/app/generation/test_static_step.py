"""The static decode step (issue 50): no host work inside a step, the direct blocks' bits, and the compiled step.

* an eager step dispatches no host sync (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``) and
  makes no tensor from host data (``lift_fresh``) nor a copy between devices;
* ``torch.compile(fullgraph=True)`` traces the whole step (all layers, K/V writes, sampling) as one graph:
  a ``.tolist()``, a sync or an untraceable call would break it (and fail here);
* the compiled step gives the eager tokens and logits (``aot_eager``: the same kernels, the same bits;
  inductor: within rounding), for AR and K-Forcing, contiguous and paged caches.
"""

import dataclasses
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from kforcing_kernels.app.generation import static_step
from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
from kforcing_kernels.app.generation.paged_cache import PagedKVCache
from kforcing_kernels.app.generation.serving import PagedGenerator, Request
from kforcing_kernels.app.generation.static_step import StaticDecodeStep
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling.op import inverse_cdf_sample_reference

CFG = ModelConfig.micro(vocab_size=40, n_embd=32, n_head=2, n_layer=2)
LENGTHS = (3, 7, 5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return KForcingLM(CFG).eval()


@pytest.fixture
def prompts():
    return [torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]


def run(model, prompts, k, cache, t=8, **kw):
    gen = torch.Generator().manual_seed(11)
    if k is None:
        noise = torch.rand(len(prompts), t, generator=gen)
        return generate_ar(model, prompts, t, temperature=0.9, noise=noise, cache=cache, return_logits=True, **kw)
    noise = torch.rand(len(prompts), math.ceil(t / k), k, generator=gen)
    return generate_kforcing(model, prompts, k, t, temperature=0.8, noise=noise, cache=cache, return_logits=True, **kw)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((func, args, kwargs))
        return func(*args, **kwargs)


def _step_and_state(model, k):
    cache = PagedKVCache.for_model(model, page_size=4, num_pages=16)
    rows = [cache.add_row() for _ in range(3)]
    cache.reserve(rows, [9, 6, 11])
    index = torch.tensor(rows)
    step = StaticDecodeStep(model, k, cache.k, cache.v, cache.page_size)
    state = step.state(torch.tensor([5, 2, 7]), cache.table_rows(index), [0.9, 0.0, 1.2] if k is None else 0.8)
    count = 1 if k is None else k
    prev = torch.randint(0, CFG.vocab_size, (3, count))
    z = torch.rand(3) if k is None else torch.rand(3, k)
    return step, state, prev, z


@pytest.mark.parametrize("k", [None, 2])
def test_an_eager_step_has_no_host_sync_and_no_host_data(model, k):
    step, state, prev, z = _step_and_state(model, k)
    with torch.no_grad(), _Ops() as seen:
        tokens, logits = step(state, prev, z)
    names = [str(func) for func, _, _ in seen.ops]
    assert not [n for n in names if "_local_scalar_dense" in n or "lift_fresh" in n], names
    for func, args, kwargs in seen.ops:  # no copy between devices (a CUDA step: no host-to-device upload)
        if "_to_copy" in str(func):
            assert "device" not in kwargs or kwargs["device"] == args[0].device, (func, kwargs)
    assert tokens.shape == (3, 1 if k is None else k) and state.lens.tolist() == [
        5 + (1 if k is None else k),
        2 + (1 if k is None else k),
        7 + (1 if k is None else k),
    ]


@pytest.mark.parametrize("k", [None, 2])
def test_the_direct_blocks_give_the_module_path_bits(model, k):
    """PagedPast.direct (decode_paths.direct_block: no module calls, flattened rows, q and k rotated together)
    = the modules."""
    step, state, prev, z = _step_and_state(model, k)
    x = model.wte(torch.randint(0, CFG.vocab_size, (3, step.width)))
    positions = state.lens[:, None] + step.offsets
    with torch.no_grad():
        h, kvs = model.trunk(x, positions, None, past=state.views)
        plain = [dataclasses.replace(v, direct=None) for v in state.views]
        h_ref, kvs_ref = model.trunk(x, positions, None, past=plain)
    assert state.views[0].direct is not None and plain[0].direct is None
    assert torch.equal(h, h_ref)
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kvs, kvs_ref))


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("k", [None, 2])
def test_the_step_compiles_as_one_graph_and_gives_the_eager_bits(model, prompts, k, cache, monkeypatch):
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    ref, ref_logits = run(model, prompts, k, cache)
    out, logits = run(model, prompts, k, cache, compile_step=True)
    again, _ = run(model, prompts, k, cache, compile_step=True)  # new caches and state: the same graph
    assert counter.frame_count == 1  # fullgraph=True: one graph for all the decode steps of both calls, no break
    assert out.tolist() == ref.tolist() == again.tolist()
    assert torch.equal(logits, ref_logits)  # aot_eager runs the same kernels


def test_the_inductor_step_gives_the_eager_tokens_and_logits_within_rounding(model, prompts):
    torch._dynamo.reset()
    ref, ref_logits = run(model, prompts, 2, "paged", t=6)
    out, logits = run(model, prompts, 2, "paged", t=6, compile_step=True)
    assert out.tolist() == ref.tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_a_compiled_generator_serves_joins_and_finishes(model, prompts, monkeypatch):
    """PagedGenerator(compile_step=True): requests joining and finishing at different steps give their eager tokens."""
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    k, gen = 2, torch.Generator().manual_seed(5)
    noise = [torch.rand(math.ceil(t / k), k, generator=gen) for t in (4, 9, 6)]
    results = []
    for compile_step in (False, True):
        server = PagedGenerator(model, k, page_size=3, num_pages=24, compile_step=compile_step)
        reqs = [Request(prompts[0], 4, noise=noise[0]), Request(prompts[1], 9, noise=noise[1])]
        server.step(reqs)
        reqs.append(Request(prompts[2], 6, noise=noise[2]))
        while not all(r.done for r in reqs):
            server.step(reqs)
        results.append([r.tokens for r in reqs])
        assert server.cache.free_pages == 24
    assert results[0] == results[1]


def test_compile_step_is_checked_by_name(model, prompts):
    with pytest.raises(ValueError, match="compile_step: expected False, True or 'cudagraph'"):
        run(model, prompts, 2, "contiguous", compile_step="yes")
    with pytest.raises(ValueError, match="compile_step: 'cudagraph' needs a CUDA model"):
        run(model, prompts, None, "paged", compile_step="cudagraph")
    with pytest.raises(ValueError, match="compile_step"):
        PagedGenerator(model, 2, num_pages=4, compile_step=1)


def test_compile_step_is_refused_for_a_kind_with_its_own_cache(model, prompts, monkeypatch):
    """Only the package's caches have a static step: a model kind that decodes with its own cache (the HF one)
    refuses compile_step by name instead of ignoring it."""
    from kforcing_kernels.app.generation import inference
    from kforcing_kernels.app.native import NativeKind

    class OwnCache(NativeKind):  # the native kind without its compiled step
        summary = "a kind with its own cache"
        compiled_step = False

    monkeypatch.setattr(inference, "kind_of", lambda m: OwnCache())
    with pytest.raises(ValueError, match="compile_step: a kind with its own cache decodes with its own KV cache"):
        run(model, prompts, 2, "paged", compile_step=True)


@pytest.mark.parametrize("backend", ["cpp", "composite"])
def test_the_steps_custom_ops_pass_opcheck(backend):
    """The two ops a compiled step calls opaquely: their fake (meta) results and schemas match the real ones."""
    from kforcing_kernels.ops import sampling  # noqa: F401 - registers kforcing_kernels::inverse_cdf_sample
    from kforcing_kernels.ops.paged_attention import op as paged_op

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=gen) for _ in range(3))
    k_pages, v_pages = torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen)
    table, lens = torch.tensor([[4, 1], [2, 0]]), torch.tensor([5, 3])
    args = (q, k, v, k_pages, v_pages, table, lens, 0.35, backend)
    torch.library.opcheck(torch.ops.kforcing_kernels.paged_attention.default, args)
    ref = paged_op.paged_attention(q, k, v, k_pages, v_pages, table, lens, scale=0.35, backend="reference")
    torch.testing.assert_close(torch.ops.kforcing_kernels.paged_attention(*args), ref, atol=1e-5, rtol=1e-5)
    logits, z = torch.randn(3, 10, generator=gen), torch.rand(3, generator=gen)
    torch.library.opcheck(
        torch.ops.kforcing_kernels.inverse_cdf_sample.default,
        (logits, z, torch.full((3,), 0.8, dtype=torch.float64), "cpp"),
    )


# ---------------------------------------------------------------- the step's own oracles (issue 56 item 6c)
# The contiguous and paged caches share this step, so comparing them cannot catch a bug in it. Here the oracles are
# independent of the step: the uncached model (KForcingLM.ar_forward) for what the cache holds across page
# boundaries, the reference sampler for each row's own temperature, and each request run alone (a batch of one row
# cannot mix up rows) for per-row K-Forcing parameters.


def _interleaved_cache(model, rows, tokens, page_size=3):
    """A paged cache of ``rows`` empty rows with room for ``tokens`` tokens each, their pages interleaved."""
    cache = PagedKVCache.for_model(model, page_size=page_size, num_pages=rows * math.ceil(tokens / page_size) + 1)
    ids = [cache.add_row() for _ in range(rows)]
    for n in range(page_size, tokens + page_size, page_size):  # one page per row per round: row pages interleave
        cache.reserve(ids, [min(n, tokens)] * rows)
    return cache, cache.table_rows(torch.tensor(ids))


@pytest.mark.parametrize("temperatures", [[0.9, 0.0, 1.2], [0.5, 1.5, 1.0]], ids=["mixed", "sample"])
def test_ar_steps_across_page_boundaries_match_the_uncached_model_and_each_rows_temperature(model, temperatures):
    """AR passes fed each row's own tokens from an empty cache (page size 3: every third pass opens a page, the
    rows' pages interleaved): the logits of each pass equal the uncached model's at that position, and each row's
    token is the reference sampler's at that row's temperature (argmax at 0) for that row's z."""
    b, n = 3, 8
    gen = torch.Generator().manual_seed(21)
    seqs = torch.randint(0, CFG.vocab_size, (b, n), generator=gen)
    cache, table = _interleaved_cache(model, b, n)
    step = StaticDecodeStep(model, None, cache.k, cache.v, cache.page_size)
    state = step.state(torch.zeros(b, dtype=torch.int64), table, temperatures)
    with torch.no_grad():
        want_logits = model.ar_forward(seqs)  # [B, N, V]: plain causal attention, no cache
        for t in range(n):
            z = torch.rand(b, generator=gen)
            tokens, logits = step(state, seqs[:, t : t + 1], z)
            torch.testing.assert_close(logits[:, 0], want_logits[:, t], atol=1e-5, rtol=1e-5)
            for row, tau in enumerate(temperatures):
                row_logits = logits[row, 0]
                want = (
                    row_logits.argmax(-1)
                    if tau == 0
                    else inverse_cdf_sample_reference(row_logits[None], z[row : row + 1], tau)[0]
                )
                assert int(tokens[row, 0]) == int(want), (t, row, tau)
    assert state.lens.tolist() == [n] * b


def test_kforcing_step_rows_match_each_request_run_alone(model):
    """K-Forcing passes with per-row tau and rows at different lengths (windows crossing page boundaries): each
    row's tokens and logits are those of the same request run alone (its own state of one row)."""
    k, b, page = 2, 3, 3
    taus, starts = [0.3, 1.0, 0.7], [2, 3, 5]  # window of 2k: 2 -> crosses 3; 3 starts a page; 5 -> crosses 6
    gen = torch.Generator().manual_seed(8)
    cache, table = _interleaved_cache(model, b, 12, page)
    for pool in (*cache.k, *cache.v):  # a context to attend to (any K/V)
        pool.normal_(generator=gen)
    prev, z = torch.randint(0, CFG.vocab_size, (b, k), generator=gen), torch.rand(b, k, generator=gen)

    def run_rows(rows):
        k_pools, v_pools = [p.clone() for p in cache.k], [p.clone() for p in cache.v]
        step = StaticDecodeStep(model, k, k_pools, v_pools, page)
        state = step.state(torch.tensor([starts[r] for r in rows]), table[rows], [taus[r] for r in rows])
        outs = []
        with torch.no_grad():
            for _ in range(2):  # two passes: the second reads what the first wrote
                tokens, logits = step(state, prev[rows], z[rows])
                outs.append((tokens.clone(), logits.clone()))
        return outs

    together = run_rows([0, 1, 2])
    for row in range(b):
        alone = run_rows([row])
        for (tokens, logits), (want_tokens, want_logits) in zip(together, alone):
            torch.testing.assert_close(logits[row], want_logits[0], atol=1e-5, rtol=1e-5)
            assert tokens[row].tolist() == want_tokens[0].tolist(), row

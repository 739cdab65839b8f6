"""torch.compile of an HF model under attn_implementation="kforcing" with a layout, as training uses it.

``use_cache=False`` (the training setting) used to fail with an error about an attention mask the
user never passed (transformers finds "packed documents" in K-Forcing's repeated position ids
while tracing); ``fullgraph=True, dynamic=True`` must give one graph for two sequence lengths.
Graphs use the ``aot_eager`` backend (dynamo + AOTAutograd: where breaks and guards arise) to stay
fast on 2 cores; test_hf.py runs inductor end to end.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def training_loss(model, emb, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids, u = torch.randint(0, H.VOCAB, (2, n), generator=gen), torch.rand(2, n, k, generator=gen)
    targets = torch.randint(0, H.VOCAB, (2, n * k), generator=gen)
    batch = kf_hf.single_forward_inputs(model, ids, u, emb, torch.ones(2))
    logits = model(**batch, use_cache=False).logits[:, n:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def grads_of(loss, params):
    return [g.detach() for g in torch.autograd.grad(loss, params)]


@torch._dynamo.config.patch(error_on_recompile=True)
def test_fullgraph_dynamic_training_step_one_graph_for_two_lengths():
    (model,) = H.twin_models(H.llama(), "kforcing")
    emb = kf_hf.NoiseEmbedding(H.HIDDEN)
    params = [*model.parameters(), *emb.parameters()]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for n, k in ((5, 2), (7, 2)):
        want = training_loss(model, emb, n, k, seed=n)
        got = training_loss(compiled, emb, n, k, seed=n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads_of(got, params), grads_of(want, params)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0]  # the graphs of length 5 served length 7: no recompile


def test_compiled_packed_batch_without_a_layout_matches_sdpa():
    """No layout, restarting position ids, use_cache=False, compiled: documents stay apart (a dense mask in the
    graph)."""
    ours, sdpa = H.twin_models(H.mistral(sliding_window=3), "kforcing", "sdpa")
    ids = torch.randint(0, H.VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1]])
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
        want = sdpa(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

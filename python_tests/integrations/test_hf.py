"""Hugging Face transformers integration: attn_implementation="kforcing" vs "eager" with the equivalent dense mask.

Tiny randomly initialised models built from configs (no downloads). Families
exercised: Llama (GQA, RoPE) for every layout; Qwen2 and GPT-2 (learned absolute
positions) for SingleForward.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
import kforcing_kernels.sdpa  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402
from kforcing_kernels.sdpa import route_dense_masks  # noqa: E402

VOCAB, HIDDEN = 48, 32


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def qwen2_config():
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def twin_models(config, *implementations):
    """One randomly initialised model per attention implementation, all with the same weights."""
    models = []
    for impl in implementations:
        # from_config writes the implementation into the config, so each model gets its own copy.
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model.eval())
    # Each model still runs its own implementation (a shared config would give every one the last).
    assert [m.config._attn_implementation for m in models] == list(implementations)
    return models


def additive_mask(layout, batch):
    """The layout as the 4-D float mask eager attention adds to its scores: [B, 1, Lq, Lk]."""
    dense = layout.dense_mask()
    dense = dense[:, None] if dense.dim() == 3 else dense[None, None].expand(batch, 1, -1, -1)
    return torch.where(dense, 0.0, torch.finfo(torch.float32).min)


def logits_and_grads(model, extra_params, **inputs):
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    params = [*model.parameters(), *extra_params]
    grads = torch.autograd.grad((logits * weights).sum(), params, allow_unused=True)
    return logits, grads


def assert_same_logits_and_grads(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    assert len(ours[1]) == len(theirs[1])
    for a, b in zip(ours[1], theirs[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_config", [llama_config, qwen2_config, gpt2_config], ids=["llama", "qwen2", "gpt2"])
def test_single_forward_matches_eager_with_dense_mask(make_config):
    ours_model, eager_model = twin_models(make_config(), "kforcing", "eager")
    noise_embedding = kf_hf.NoiseEmbedding(HIDDEN)
    ids = torch.randint(0, VOCAB, (2, 6))
    noise, tau = torch.rand(2, 6, 3), torch.rand(2) + 0.5
    batch = kf_hf.single_forward_inputs(ours_model, ids, noise, noise_embedding, tau)
    assert batch["inputs_embeds"].shape == (2, 6 + 18, HIDDEN)
    ours = logits_and_grads(ours_model, noise_embedding.parameters(), **batch)

    layout = batch.pop("kforcing_layout")
    batch["inputs_embeds"] = kf_hf.single_forward_inputs(eager_model, ids, noise, noise_embedding, tau)["inputs_embeds"]
    theirs = logits_and_grads(
        eager_model, noise_embedding.parameters(), attention_mask=additive_mask(layout, 2), **batch
    )
    assert_same_logits_and_grads(ours, theirs)


def test_sbd_matches_eager_with_dense_mask():
    ours_model, eager_model = twin_models(llama_config(), "kforcing", "eager")
    ids = torch.randint(1, VOCAB, (2, 11))
    masked = torch.rand(2, 11) < 0.5
    batch = kf_hf.sbd_inputs(ids, masked, mask_token_id=0, block=4)  # 3 blocks, the last one of 3
    assert torch.equal(batch["input_ids"][:, 11:][masked], torch.zeros(int(masked.sum()), dtype=torch.long))
    ours = logits_and_grads(ours_model, (), **batch)
    layout = batch.pop("kforcing_layout")
    theirs = logits_and_grads(eager_model, (), attention_mask=additive_mask(layout, 2), **batch)
    assert_same_logits_and_grads(ours, theirs)


def test_double_forward_on_a_context_cache_matches_eager():
    ours_model, eager_model = twin_models(llama_config(), "kforcing", "eager")
    noise_embedding = kf_hf.NoiseEmbedding(HIDDEN)
    ids = torch.randint(0, VOCAB, (2, 5))
    future1, noise, tau = torch.randint(0, VOCAB, (2, 5, 2)), torch.rand(2, 5, 2), torch.ones(2)
    results = []
    for model, kind in ((ours_model, "ours"), (eager_model, "eager")):
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values  # the N context tokens
        batch = kf_hf.double_forward_inputs(model, future1, noise, noise_embedding, tau)
        layout = batch.pop("kforcing_layout")
        if kind == "ours":
            batch["kforcing_layout"] = layout
        else:
            batch["attention_mask"] = additive_mask(layout, 2)
        results.append(logits_and_grads(model, noise_embedding.parameters(), past_key_values=cache, **batch))
        assert cache.get_seq_length() == 5 + 2 * 5 * 2  # the windows were appended to the cache
    assert_same_logits_and_grads(*results)


def test_without_a_layout_attention_is_causal_like_sdpa():
    ours_model, sdpa_model = twin_models(llama_config(), "kforcing", "sdpa")
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            ours_model(input_ids=ids).logits, sdpa_model(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
        # A chunk after a cache (bottom-right causal), then one decoding step.
        outs = []
        for model in (ours_model, sdpa_model):
            cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
            chunk = model(input_ids=ids[:, 4:8], past_key_values=cache, use_cache=True)
            step = model(input_ids=ids[:, 8:], past_key_values=chunk.past_key_values)
            outs.append(torch.cat([chunk.logits, step.logits], 1))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        # Padding still works when no layout is given.
        padding = torch.ones(2, 9, dtype=torch.long)
        padding[0, :3] = 0
        got, want = (m(input_ids=ids, attention_mask=padding).logits for m in (ours_model, sdpa_model))
        torch.testing.assert_close(got[padding.bool()], want[padding.bool()], atol=1e-5, rtol=1e-5)


def test_dense_4d_masks_are_routed_by_exact_match(monkeypatch):
    routed = []
    original = kforcing_kernels.sdpa.window_attention
    monkeypatch.setattr(
        kforcing_kernels.sdpa, "window_attention", lambda *a, **kw: routed.append(a[3]) or original(*a, **kw)
    )
    layout = WindowLayout.kforcing_single(6, 2)
    ours_model, sdpa_model = twin_models(llama_config(), "kforcing", "sdpa")
    embeds = torch.randn(2, layout.n_queries, HIDDEN)
    positions = kf_hf.kforcing_position_ids(6, 2).expand(2, -1)
    dense = layout.dense_mask()[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        want = ours_model(inputs_embeds=embeds, position_ids=positions, kforcing_layout=layout).logits
        # "kforcing" given the dense mask instead of the layout recognises it.
        got = ours_model(inputs_embeds=embeds, position_ids=positions, attention_mask=dense).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(routed) == 2 and all(torch.equal(r.dense_mask(), layout.dense_mask()) for r in routed)
        # Unchanged "sdpa" code, inside the routing context: every layer's SDPA call is routed.
        with route_dense_masks() as router:
            got = sdpa_model(inputs_embeds=embeds, position_ids=positions, attention_mask=dense).logits
        assert router.routed == 2 and router.passed_through == 0 and len(routed) == 4
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_layout_calls_reject_what_they_cannot_honour():
    (model,) = twin_models(llama_config(), "kforcing")
    ids = torch.randint(0, VOCAB, (2, 8))
    layout = WindowLayout.sbd(4, 2)
    with pytest.raises(ValueError, match="attention_mask"):
        padding = torch.ones(2, 8, dtype=torch.long)
        padding[0, 0] = 0
        model(input_ids=ids, attention_mask=padding, kforcing_layout=layout)
    with pytest.raises(ValueError, match="kforcing_layout: expected 10 input tokens"):
        model(input_ids=ids, kforcing_layout=WindowLayout.sbd(5, 2))
    with pytest.raises(ValueError, match="kforcing_layout: expected a WindowLayout"):
        model(input_ids=ids, kforcing_layout=layout.dense_mask())
    model.config.attention_dropout = 0.1
    model.model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        model.train()(input_ids=ids, kforcing_layout=layout)
    # all-ones masks (what generate() passes) are fine
    model.eval()(input_ids=ids, attention_mask=torch.ones(2, 8, dtype=torch.long), kforcing_layout=layout)


def test_position_ids_and_noise_embedding():
    assert kf_hf.kforcing_position_ids(3, 2).tolist() == [0, 1, 2, 1, 2, 2, 3, 3, 4]
    assert kf_hf.double_forward_position_ids(2, 2).tolist() == [1, 2, 2, 3, 3, 4, 4, 5]
    assert kf_hf.sbd_position_ids(3).tolist() == [0, 1, 2, 0, 1, 2]
    embed = kf_hf.NoiseEmbedding(HIDDEN)
    u = torch.rand(2, 5, 3)
    out = embed(u, torch.tensor([0.7, 1.2]))
    assert out.shape == (2, 5, 3, HIDDEN)
    assert not torch.allclose(out[0], embed(u, torch.tensor([1.2, 1.2]))[0])  # tau is used
    with pytest.raises(ValueError, match="tau"):
        embed(u)
    with pytest.raises(ValueError, match="noise"):
        kf_hf.single_forward_inputs(
            twin_models(llama_config(), "kforcing")[0],
            torch.zeros(2, 5, dtype=torch.long),
            u[:, :4],
            embed,
            torch.ones(2),
        )


def test_transformers_is_imported_only_by_the_integration():
    code = (
        "import sys, kforcing_kernels, kforcing_kernels.sdpa, kforcing_kernels.integrations\n"
        "assert 'transformers' not in sys.modules, 'transformers imported eagerly'\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    import kforcing_kernels.integrations.hf\n"
        "except ImportError as exc:\n"
        "    assert 'pip install transformers' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no ImportError without transformers')\n"
    )
    root = str(REPO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_compiled_training_step_matches_eager():
    """torch.compile(model, fullgraph=True) (inductor) on the README's SingleForward training step: loss and every grad
    equal eager.

    HF's q/k/v are transposed views; the custom op's fake kernels must report the
    contiguous outputs the kernels really return or Inductor's stride asserts fire.
    Inductor's caches are off so that a graph compiled against other fake kernels is not reused.
    """
    import torch._dynamo
    import torch._inductor.config
    import torch.nn.functional as F

    torch._dynamo.reset()
    (model,) = twin_models(llama_config(), "kforcing")
    emb = kf_hf.NoiseEmbedding(HIDDEN)
    b, n, k = 2, 6, 2
    ids, u, tgt = torch.randint(0, VOCAB, (b, n)), torch.rand(b, n, k), torch.randint(0, VOCAB, (b, n, k))
    tau = torch.empty(b).uniform_(0.5, 1.5)

    def step(forward):
        model.zero_grad()
        emb.zero_grad()
        batch = kf_hf.single_forward_inputs(model, ids, u, emb, tau)
        logits = forward(**batch).logits[:, n:].reshape(b, n, k, -1)
        loss = F.cross_entropy(logits.flatten(0, 2), tgt.flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in (*model.parameters(), *emb.parameters())]

    want = step(model)
    with torch._inductor.config.patch(force_disable_caches=True):
        got = step(torch.compile(model, fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for a, w in zip(got[1], want[1]):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)

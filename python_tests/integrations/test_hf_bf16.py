"""attn_implementation="kforcing" in bf16: under torch.autocast and with bf16 weights, as accurate as sdpa.

Under ``torch.autocast(bfloat16)`` Llama and Qwen2 leave q/k in fp32 after RoPE (cos/sin are fp32)
while v comes out of a bf16 linear; SDPA's autocast rule casts all three to bf16. "kforcing" used to
refuse the mix wherever it ran ``window_attention`` (a layout, packed ``position_ids``). Oracle: the
same weights under ``sdpa`` in fp32 with the same mask. "kforcing" in bf16 must be as close to it as
``sdpa`` in bf16 is (both round to bf16), the attention itself must see bf16 q, k, v (no silent
upcast), and the bound must be tight enough that a wrong mask (plain causal) falls outside it.
"""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402

FAMILIES = {
    "llama": H.llama,
    "qwen2": H.qwen2,
    "mistral": H.mistral,
    "phi3": H.phi3,
    "gpt2": H.gpt2,
    "gemma": lambda: transformers.GemmaConfig(**{**H._COMMON, "head_dim": 8}),
    # Alternating local/global layers; the window (32) is longer than these sequences: windows are test_hf_sliding.py's.
    "gemma3": lambda: H.gemma3(sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
}
BF16 = (torch.bfloat16,) * 3 + (False,)  # q, k, v dtypes and autocast state inside window_attention


def precision(mode: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()


def bf16_twins(family: str, mode: str):
    """(kforcing, sdpa) in the precision ``mode`` and an fp32 sdpa oracle, all with the same weights."""
    ours, sdpa, oracle = H.twin_models(FAMILIES[family](), "kforcing", "sdpa", "sdpa")
    if mode == "bf16-weights":
        ours.to(torch.bfloat16)
        sdpa.to(torch.bfloat16)
    return ours, sdpa, oracle


def bf16_bound(sdpa_logits: torch.Tensor, oracle: torch.Tensor) -> float:
    """How far from fp32 a bf16 computation may land: sdpa's own bf16 error, with a margin of bf16 rounding."""
    return 1.5 * float((sdpa_logits.float() - oracle).abs().max()) + 1e-3


@pytest.fixture
def attention_dtypes(monkeypatch):
    """The dtypes of q, k, v (and whether autocast is on) at every window_attention call of "kforcing"."""
    seen = []
    original = kf_hf.window_attention

    def spy(q, k, v, layout, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return original(q, k, v, layout, **kw)

    monkeypatch.setattr(kf_hf, "window_attention", spy)
    return seen


@pytest.mark.parametrize("mode", ["autocast", "bf16-weights"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_forward_layout_in_bf16_is_as_accurate_as_sdpa(family, mode, attention_dtypes):
    ours, sdpa, oracle = bf16_twins(family, mode)
    gen = torch.Generator().manual_seed(3)
    ids, noise = torch.randint(0, H.VOCAB, (2, 5), generator=gen), torch.rand(2, 5, 2, generator=gen)
    with torch.no_grad():
        batch = kf_hf.single_forward_inputs(oracle, ids, noise, kf_hf.NoiseEmbedding(H.HIDDEN), torch.ones(2))
        layout = batch.pop("kforcing_layout")
        mask = layout.dense_mask()[None, None].expand(2, 1, -1, -1)
        want = oracle(attention_mask=mask, **batch).logits
        if mode == "bf16-weights":
            batch["inputs_embeds"] = batch["inputs_embeds"].to(torch.bfloat16)
        with precision(mode):
            got = ours(kforcing_layout=layout, **batch).logits
            theirs = sdpa(attention_mask=mask, **batch).logits
            causal = sdpa(**batch).logits
    assert got.dtype == theirs.dtype == torch.bfloat16
    bound = bf16_bound(theirs, want)
    assert float((got.float() - want).abs().max()) <= bound
    assert float((causal.float() - want).abs().max()) > bound  # the bound sees a wrong mask
    assert attention_dtypes and all(d == BF16 for d in attention_dtypes)


@pytest.mark.parametrize("mode", ["autocast", "bf16-weights"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_position_ids_in_bf16_are_as_accurate_as_sdpa_with_gradients(family, mode, attention_dtypes):
    ours, sdpa, oracle = bf16_twins(family, mode)
    ids = torch.randint(1, H.VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
    inputs = dict(input_ids=ids, position_ids=positions, use_cache=False)
    want = H.logits_and_grads(oracle, **inputs)
    with precision(mode):
        got = H.logits_and_grads(ours, **inputs)
        theirs = H.logits_and_grads(sdpa, **inputs)
    assert got[0].dtype == theirs[0].dtype == torch.bfloat16
    assert float((got[0].float() - want[0]).abs().max()) <= bf16_bound(theirs[0], want[0])
    for a, b, w in zip(got[1], theirs[1], want[1]):
        assert (a is None) == (b is None) == (w is None)
        if a is not None:
            assert a.dtype == b.dtype
            # Gradients sum over tokens and heads in bf16: compare norms of the error against fp32.
            assert (a.float() - w).norm() <= 1.5 * (b.float() - w).norm() + 1e-2 * w.norm() + 1e-4
    if family != "gpt2":  # GPT-2 has no position_ids-driven packing in transformers: plain causal SDPA there
        assert attention_dtypes and all(d == BF16 for d in attention_dtypes)


def test_mixed_dtypes_outside_autocast_are_refused_naming_the_arguments():
    module = torch.nn.Module()
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"key, value: expected dtype torch.float32 \(query's\).*value torch.bfloat16"):
        kf_hf.kforcing_attention_forward(module, q, k, v, None, kforcing_layout=WindowLayout.causal(4))
    with pytest.raises(RuntimeError, match="same dtype"):  # sdpa refuses the same mix
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # Under autocast the same call runs in bf16, as sdpa does.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = kf_hf.kforcing_attention_forward(module, q, k, v, None, kforcing_layout=WindowLayout.causal(4))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-2, rtol=1e-2)

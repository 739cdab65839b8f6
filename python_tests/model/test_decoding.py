"""The PFLM decoding rules (issue 39, kforcing_kernels/model/decoding.py) on hand-made cases: argmax and
residual agree on a confident student; on a student that resolves its noise only coarsely, argmax
emits the modes (collapse) while the residual rule keeps the teacher's distribution; cached, paged
and uncached generation and the Stage-2 teacher targets all decode by the model's rule."""

import dataclasses
import math

import pytest
import torch

from kforcing_kernels.app.generation.inference import generate_kforcing
from kforcing_kernels.app.training.objectives import self_forcing_targets
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.model.decoding import RESIDUAL_SCALE, decode_rule, decode_slots, residual_noise

CHI2_3DOF = 21.1  # chi-square critical value, 3 degrees of freedom, p = 1e-4


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_residual_noise_is_uniform_and_forgets_the_coarse_digits():
    z = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    r = residual_noise(z)
    assert r.dtype == z.dtype and bool(((r >= 0) & (r < 1)).all())
    assert r.mean().item() == pytest.approx(0.5, abs=0.01)
    # Within a coarse cell of z (here: z < 0.5 or not), r is still uniform: the cell says nothing about r.
    for cell in (z < 0.5, z >= 0.5):
        assert torch.histc(r[cell], 4, 0, 1).div(int(cell.sum())).tolist() == pytest.approx([0.25] * 4, abs=0.01)
    assert float(residual_noise(torch.tensor([3 / RESIDUAL_SCALE]))) == 0.0  # a multiple of 1/scale: no residual left


def test_argmax_rule_is_the_argmax_and_bad_rules_are_refused():
    logits = torch.randn(3, 5, 7)
    noise = torch.rand(3, 5)
    assert torch.equal(decode_slots(logits, noise, "argmax"), logits.argmax(-1))
    with pytest.raises(ValueError, match="rule: expected one of"):
        decode_slots(logits, noise, "sample")
    with pytest.raises(ValueError, match="noise: expected shape"):
        decode_slots(logits, noise[:, :4], "residual")


def test_a_confident_student_decodes_the_same_under_both_rules():
    # A converged PFLM's posterior is one-hot: the residual rule is the paper's argmax.
    logits = torch.full((4, 6, 9), -30.0)
    target = torch.randint(0, 9, (4, 6))
    logits.scatter_(-1, target[..., None], 30.0)
    noise = torch.rand(4, 6)
    assert torch.equal(decode_slots(logits, noise, "residual"), target)
    assert torch.equal(decode_slots(logits, noise, "argmax"), target)


def test_a_coarse_calibrated_student_collapses_under_argmax_not_under_residual():
    # Teacher p over 4 tokens; a student that only knows whether z < 0.5 outputs the calibrated posterior of
    # the inverse-CDF target given that half. Its argmax emits one token per half (tokens 0 and 2 only: the
    # collapse of issue 39); the residual rule decodes the posterior at z's unresolved digits and gives p.
    p = torch.tensor([0.4, 0.2, 0.3, 0.1])
    # (p restricted to a half) * 2
    lower, upper = torch.tensor([0.8, 0.2, 0.0, 0.0]), torch.tensor([0.0, 0.2, 0.6, 0.2])
    assert torch.allclose((lower + upper) / 2, p)
    z = torch.rand(100_000, generator=torch.Generator().manual_seed(1))
    posterior = torch.where((z < 0.5)[:, None], lower, upper)
    logits = posterior.clamp_min(1e-12).log()
    greedy = decode_slots(logits, z, "argmax")
    assert set(greedy.tolist()) == {0, 2}
    assert _chi2(greedy, p) > 1000
    assert _chi2(decode_slots(logits, z, "residual"), p) < CHI2_3DOF


CFG = ModelConfig.micro(vocab_size=40, n_embd=32, n_head=2, n_layer=2)


@pytest.fixture(scope="module")
def residual_model():
    torch.manual_seed(3)
    model = KForcingLM(dataclasses.replace(CFG, decode="residual")).double().eval()
    with torch.no_grad():
        model.head.weight.mul_(0.2)  # a broad softmax: the residual rule's tokens differ from the argmax's
    return model


def test_model_config_records_the_rule():
    assert ModelConfig().decode == "argmax"  # the paper's decoding is the default
    old = {k: v for k, v in CFG.to_dict().items() if k != "decode"}
    assert ModelConfig.from_dict(old).decode == "argmax"  # checkpoints saved before the field decode by argmax
    with pytest.raises(ValueError, match="decode: expected 'argmax' or 'residual'"):
        ModelConfig.micro(decode="sample")
    assert decode_rule(KForcingLM(CFG)) == "argmax"
    assert decode_rule(object()) == "argmax"


@pytest.mark.parametrize("k", [1, 2])
def test_generation_decodes_by_the_models_rule_in_every_cache(residual_model, k):
    prompts = [torch.randint(0, CFG.vocab_size, (n,)) for n in (3, 7)]
    new_tokens = 6
    noise = torch.rand(2, math.ceil(new_tokens / k), k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    paged = generate_kforcing(residual_model, prompts, k, new_tokens, temperature=0.8, noise=noise)
    contiguous = generate_kforcing(
        residual_model, prompts, k, new_tokens, temperature=0.8, noise=noise, cache="contiguous"
    )
    assert paged.tolist() == contiguous.tolist()
    # Uncached: SingleForward over the whole context, the last window decoded by the residual rule.
    for b, p in enumerate(prompts):
        seq, out = p.clone(), []
        for s in range(noise.shape[1]):
            z = torch.rand(1, seq.numel(), k, dtype=torch.float64)
            z[0, -1] = noise[b, s]
            logits, _ = residual_model.single_forward(seq[None], z, 0.8)
            new = decode_slots(logits[0, -1], noise[b, s], "residual")
            out += new.tolist()
            seq = torch.cat([seq, new])
        assert paged[b].tolist() == out[:new_tokens]
    argmax_model = KForcingLM(CFG).double().eval()
    argmax_model.load_state_dict(residual_model.state_dict())
    greedy = generate_kforcing(argmax_model, prompts, k, new_tokens, temperature=0.8, noise=noise)
    assert greedy.tolist() != paged.tolist()  # the rule is what changed


def test_self_forcing_targets_decode_by_the_teachers_rule(residual_model):
    context = torch.randint(0, CFG.vocab_size, (2, 5))
    z = torch.rand(2, 5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tau = torch.tensor([0.7, 0.9])
    targets = self_forcing_targets(residual_model, context, z, tau)
    logits1, kv = residual_model.single_forward(context, z[..., :1], tau)
    first = decode_slots(logits1, z[..., :1], "residual")
    second = decode_slots(residual_model.double_forward(kv, first, z[..., 1:], tau), z[..., 1:], "residual")
    assert torch.equal(targets, torch.cat([first, second], -1))

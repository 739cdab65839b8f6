"""The reference model: every forward through window_attention equals the dense-mask (reference) model."""

import dataclasses

import pytest
import torch

from kforcing_kernels.model import KForcingLM, ModelConfig, double_positions, single_positions

CFG = ModelConfig.micro(vocab_size=40, n_embd=32, n_head=4, n_layer=2)


def _pair(cfg=CFG):
    """The same weights twice: default backend (fastest available) and the dense-mask reference."""
    fast = KForcingLM(cfg).double()
    ref = KForcingLM(dataclasses.replace(cfg, attention_backend="reference")).double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _inputs(b=2, n=7, k=3):
    tokens = torch.randint(0, CFG.vocab_size, (b, n))
    noise = torch.rand(b, n, k, dtype=torch.float64)
    tau = torch.tensor([0.6, 1.0])[:b]
    return tokens, noise, tau


def test_ar_forward_matches_reference():
    fast, ref = _pair()
    tokens, _, _ = _inputs()
    torch.testing.assert_close(fast(tokens), ref(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_single_forward_matches_reference_with_gradients(k):
    fast, ref = _pair()
    tokens, noise, tau = _inputs(k=k)
    out_f, kv_f = fast.single_forward(tokens, noise, tau)
    out_r, kv_r = ref.single_forward(tokens, noise, tau)
    torch.testing.assert_close(out_f, out_r, rtol=1e-10, atol=1e-10)
    for (kf, vf), (kr, vr) in zip(kv_f, kv_r):
        torch.testing.assert_close(kf, kr, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(vf, vr, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out_f)
    (out_f * weights).sum().backward()
    (out_r * weights).sum().backward()
    for (name, pf), pr in zip(fast.named_parameters(), ref.parameters()):
        assert pf.grad is not None, name
        torch.testing.assert_close(pf.grad, pr.grad, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("k", [1, 2])
def test_double_forward_matches_reference(k):
    fast, ref = _pair()
    tokens, noise, tau = _inputs(k=2 * k)
    _, kv = fast.single_forward(tokens, noise[..., :k], tau)
    first = torch.randint(0, CFG.vocab_size, (2, tokens.shape[1], k))
    out_f = fast.double_forward(kv, first, noise[..., k:], tau)
    out_r = ref.double_forward(kv, first, noise[..., k:], tau)
    assert out_f.shape == (2, tokens.shape[1], k, CFG.vocab_size)
    torch.testing.assert_close(out_f, out_r, rtol=1e-10, atol=1e-10)


def test_positions_follow_the_paper_convention():
    # noise slot i of the window after context token t sits at RoPE position t + 1 + i
    assert single_positions(3, 2).tolist() == [0, 1, 2, 1, 2, 2, 3, 3, 4]
    # DoubleForward, stream-major [Future-1 | Future-2]: slot i of the 2k-window of t at t + 1 + i
    assert double_positions(2, 2).tolist() == [1, 2, 2, 3, 3, 4, 4, 5]


def test_window_t_sees_only_its_prefix_and_own_noise():
    model = KForcingLM(CFG).double()
    tokens, noise, tau = _inputs(k=2)
    base, _ = model.single_forward(tokens, noise, tau)
    t = 3
    later = tokens.clone()
    later[:, t + 1] = (later[:, t + 1] + 1) % CFG.vocab_size  # a context token after t
    other = noise.clone()
    other[:, t + 1] = torch.rand(2, 2, dtype=torch.float64)  # another window's noise
    second_slot = noise.clone()
    second_slot[:, t, 1] = 1.0 - second_slot[:, t, 1]  # slot 1 of window t
    for changed_tokens, changed_noise in ((later, noise), (tokens, other)):
        out, _ = model.single_forward(changed_tokens, changed_noise, tau)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-12)
    out, _ = model.single_forward(tokens, second_slot, tau)
    torch.testing.assert_close(out[:, t, 0], base[:, t, 0], rtol=0, atol=1e-12)  # slot 0 does not see slot 1
    assert not torch.allclose(out[:, t, 1], base[:, t, 1])


def test_temperature_conditions_the_noise_tokens():
    model = KForcingLM(CFG).double()
    tokens, noise, _ = _inputs(k=1)
    a, _ = model.single_forward(tokens, noise, 0.5)
    b, _ = model.single_forward(tokens, noise, torch.tensor([0.5, 0.9]))
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])


def test_bad_inputs_raise_clear_errors():
    model = KForcingLM(CFG)
    tokens, noise, _ = _inputs(k=2)
    with pytest.raises(ValueError, match="noise"):
        model.single_forward(tokens, noise[:, :-1].float(), 1.0)
    with pytest.raises(ValueError, match="tau"):
        model.single_forward(tokens, noise.float(), torch.ones(3))
    with pytest.raises(ValueError, match="tokens"):
        model(tokens + CFG.vocab_size)
    with pytest.raises(ValueError, match="n_embd"):
        ModelConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig(n_layer=0)


def test_paper_backbone_preset():
    cfg = ModelConfig.paper_backbone()
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.seq_len) == (12, 768, 12, 1024)
    with torch.device("meta"):
        model = KForcingLM(cfg)
    backbone = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("noise_encoder"))
    assert 120e6 < backbone < 130e6  # GPT-2-small size with a GPT-2 vocabulary (~85M without embeddings)


def test_config_round_trip():
    cfg = ModelConfig.micro(n_layer=3)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layers": 3})

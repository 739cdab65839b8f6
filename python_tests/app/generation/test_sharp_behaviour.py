"""KV-cached generation vs a full recompute without cache, compared on logits of a sharp model (issue 17, item 1).

The oracle for every step is the training-time forward over the whole sequence so far
(``model(seq)`` for AR; SingleForward's last window for K-Forcing): no cache, no
inference layouts, no inference positions. Each test also proves it can fail: moving
the positions of the path under test by one (prefill noise slots, K-Forcing decode, AR
decode) changes the logits far beyond the tolerance.
"""

import contextlib

import pytest
import torch

from helpers.sharp_model import VOCAB, attention_entropy, sharp_model
from kforcing_kernels.app.generation import inference

TOL = 2e-4  # fp32 cache-vs-recompute agreement on logits of order 10
PROMPTS = [[3, 17, 5, 40, 22, 9, 31], [8, 1, 44, 12]]  # ragged: per-request ranges in every step
K, T = 3, 7
TAU = 0.7


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@contextlib.contextmanager
def recorded_logits(model):
    """Collects every ``model.head`` output during the block."""
    seen = []
    handle = model.head.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    try:
        yield seen
    finally:
        handle.remove()


@contextlib.contextmanager
def shifted_positions(model, monkeypatch, *, prefill_noise: int = 0, decode: int = 0, k: int = K):
    """Moves positions given to ``model.trunk``: the last ``k`` (noise) slots of the uncached
    call by ``prefill_noise``, every slot of the cached (decode) calls by ``decode``."""
    trunk = model.trunk

    def patched(x, positions, layout, past=None):
        positions = positions.clone()
        if past is None:
            positions[..., positions.shape[-1] - k :] += prefill_noise
        else:
            positions += decode
        return trunk(x, positions, layout, past=past)

    with monkeypatch.context() as m:
        m.setattr(model, "trunk", patched)
        yield


def run_kforcing(model, noise, cache="paged"):
    with recorded_logits(model) as seen:
        out = inference.generate_kforcing(model, PROMPTS, K, T, temperature=TAU, noise=noise, cache=cache)
    return out, torch.cat(seen, 1)  # [B, steps * K, V]


def recompute_kforcing(model, out, noise):
    """Per request and step: SingleForward over prompt + tokens so far; its last window's k logits."""
    rows = []
    for b, prompt in enumerate(PROMPTS):
        steps = []
        for s in range(noise.shape[1]):
            ctx = torch.tensor(prompt + out[b, : s * K].tolist())[None]
            z = torch.rand(1, ctx.shape[1], K, generator=torch.Generator().manual_seed(s))  # other windows: irrelevant
            z[0, -1] = noise[b, s]
            steps.append(model(ctx, z, TAU)[0, -1])  # [K, V]
        rows.append(torch.cat(steps))
    return torch.stack(rows)


def run_ar(model, noise, cache="paged"):
    with recorded_logits(model) as seen:
        out = inference.generate_ar(model, PROMPTS, T, temperature=0.8, noise=noise, cache=cache)
    return out, torch.stack(seen, 1)  # [B, T, V]


def recompute_ar(model, out):
    return torch.stack(
        [
            torch.stack([model(torch.tensor(prompt + out[b, :s].tolist())[None])[0, -1] for s in range(T)])
            for b, prompt in enumerate(PROMPTS)
        ]
    )


def kforcing_noise():
    return torch.rand(len(PROMPTS), -(-T // K), K, generator=torch.Generator().manual_seed(7))


def test_the_model_is_sharp(model):
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    assert attention_entropy(model, tokens) < 1.0  # uniform over ~12 keys would be ~2.5


def test_kforcing_cached_logits_match_a_full_recompute(model):
    noise = kforcing_noise()
    out, logits = run_kforcing(model, noise)
    assert out.shape == (2, T) and logits.shape == (2, noise.shape[1] * K, VOCAB)
    expected = recompute_kforcing(model, out, noise)
    assert (logits - expected).abs().max() < TOL
    assert torch.equal(out, expected.argmax(-1)[:, :T])


@pytest.mark.parametrize("where", ["prefill_noise", "decode"])
def test_kforcing_shifted_positions_are_caught(model, monkeypatch, where):
    noise = kforcing_noise()
    # The patch moves the positions given to model.trunk, which the contiguous-cache path calls for
    # every step (the paged path decodes through model.trunk over PagedKVCache.views; the recompute tests above cover
    # it).
    out, logits = run_kforcing(model, noise, cache="contiguous")
    with shifted_positions(model, monkeypatch, **{where: 1}):
        out_shifted, shifted = run_kforcing(model, noise, cache="contiguous")
    first = slice(0, K) if where == "prefill_noise" else slice(K, 2 * K)  # the first step the shift reaches
    assert (shifted[:, first] - logits[:, first]).abs().max() > 100 * TOL
    # and the recompute oracle sees it on the tokens the shifted run produced
    assert (shifted - recompute_kforcing(model, out_shifted, noise)).abs().max() > 100 * TOL


def test_ar_cached_logits_match_a_full_recompute(model):
    noise = torch.rand(len(PROMPTS), T, generator=torch.Generator().manual_seed(3))
    out, logits = run_ar(model, noise)
    expected = recompute_ar(model, out)
    assert (logits - expected).abs().max() < TOL


def test_ar_shifted_decode_positions_are_caught(model, monkeypatch):
    noise = torch.rand(len(PROMPTS), T, generator=torch.Generator().manual_seed(3))
    _, logits = run_ar(model, noise, cache="contiguous")
    with shifted_positions(model, monkeypatch, decode=1):
        out_shifted, shifted = run_ar(model, noise, cache="contiguous")
    assert (shifted[:, 0] - logits[:, 0]).abs().max() < TOL  # the prefill is untouched
    assert (shifted[:, 1] - logits[:, 1]).abs().max() > 100 * TOL
    assert (shifted - recompute_ar(model, out_shifted)).abs().max() > 100 * TOL


def double_vs_single(model, monkeypatch=None, shift=0):
    """Max |DoubleForward window t - SingleForward's last window over context[:t+1] + first[t]|."""
    from kforcing_kernels.model import gpt

    gen = torch.Generator().manual_seed(4)
    n, k = 6, 2
    ctx = torch.randint(0, VOCAB, (1, n), generator=gen)
    z1, z2 = torch.rand(1, n, k, generator=gen), torch.rand(1, n, k, generator=gen)
    logits1, kv = model.single_forward(ctx, z1, TAU)
    first = logits1.argmax(-1)
    if shift:
        double_positions = gpt.double_positions
        monkeypatch.setattr(gpt, "double_positions", lambda *a, **kw: double_positions(*a, **kw) + shift)
    second = model.double_forward(kv, first, z2, TAU)  # [1, n, k, V]
    worst = 0.0
    for t in range(n):
        ext = torch.cat([ctx[:, : t + 1], first[:, t]], 1)
        z = torch.rand(1, ext.shape[1], k, generator=gen)
        z[0, -1] = z2[0, t]
        worst = max(worst, float((model(ext, z, TAU)[0, -1] - second[0, t]).abs().max()))
    return worst


def test_double_forward_matches_single_forward_on_the_extended_context(model, monkeypatch):
    """DoubleForward's window t = SingleForward's last window after appending round one's tokens (Algorithm 3)."""
    assert double_vs_single(model) < TOL
    assert double_vs_single(model, monkeypatch, shift=1) > 100 * TOL

"""KV-cached generation equals uncached decoding with the same noise (K-Forcing and AR)."""

import math

import pytest
import torch

from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing, pad_prompts
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling import inverse_cdf_sample

CFG = ModelConfig.micro(vocab_size=50, n_embd=32, n_head=2, n_layer=2)
LENGTHS = (3, 8, 5)  # ragged prompts in one batch


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return KForcingLM(CFG).double().eval()


@pytest.fixture
def prompts():
    return [torch.randint(0, CFG.vocab_size, (n,)) for n in LENGTHS]


def uncached_kforcing(model, prompt, k, new_tokens, noise, tau):
    """Algorithm 1 without a cache: each step re-runs SingleForward over the whole context
    and decodes the window after its last token (other windows get unrelated noise)."""
    seq, out = prompt.clone(), []
    for step in range(noise.shape[0]):
        z = torch.rand(1, seq.numel(), k, dtype=torch.float64)
        z[0, -1] = noise[step]
        logits, _ = model.single_forward(seq[None], z, tau)
        new = logits[0, -1].argmax(-1)  # [k]
        out += new.tolist()
        seq = torch.cat([seq, new])
    return out[:new_tokens]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_cached_kforcing_equals_uncached_single_forward(model, prompts, k):
    new_tokens = 9  # not a multiple of k for k=2, 4: the last step is cut
    noise = torch.rand(len(prompts), math.ceil(new_tokens / k), k, dtype=torch.float64)
    tau = 0.7
    out = generate_kforcing(model, prompts, k, new_tokens, temperature=tau, noise=noise)
    assert out.shape == (len(prompts), new_tokens)
    expected = [uncached_kforcing(model, p, k, new_tokens, noise[b], tau) for b, p in enumerate(prompts)]
    assert out.tolist() == expected


def test_each_request_is_independent_of_the_batch(model, prompts):
    noise = torch.rand(len(prompts), 3, 2, dtype=torch.float64)
    batched = generate_kforcing(model, prompts, 2, 6, noise=noise)
    for b, p in enumerate(prompts):
        alone = generate_kforcing(model, [p], 2, 6, noise=noise[b : b + 1])
        assert alone[0].tolist() == batched[b].tolist()


def test_cached_ar_equals_uncached(model, prompts):
    new_tokens, tau = 7, 0.9
    noise = torch.rand(len(prompts), new_tokens, dtype=torch.float64)
    out = generate_ar(model, prompts, new_tokens, temperature=tau, noise=noise)
    for b, p in enumerate(prompts):
        seq = p.clone()
        for s in range(new_tokens):
            logits = model(seq[None])[0, -1]
            seq = torch.cat([seq, inverse_cdf_sample(logits, noise[b, s], tau)[None]])
        assert out[b].tolist() == seq[p.numel() :].tolist()


def test_generator_makes_runs_reproducible(model, prompts):
    a = generate_kforcing(model, prompts, 2, 5, generator=torch.Generator().manual_seed(3))
    b = generate_kforcing(model, prompts, 2, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    greedy = generate_ar(model, prompts, 4, temperature=0)
    assert torch.equal(greedy, generate_ar(model, prompts, 4, temperature=0))


def test_pad_prompts():
    tokens, lengths = pad_prompts([[1, 2, 3], [4]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1]


def test_bad_inputs_raise_clear_errors(model, prompts):
    with pytest.raises(ValueError, match="noise"):
        generate_kforcing(model, prompts, 2, 4, noise=torch.rand(3, 1, 2))
    with pytest.raises(ValueError, match="k"):
        generate_kforcing(model, prompts, 0, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ar(model, prompts, 0)
    with pytest.raises(ValueError, match="prompts"):
        generate_ar(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="prompts"):
        generate_ar(model, [[1, CFG.vocab_size]], 3)


# ---------------------------------------------------------------------- issue 12 items 5 and 17: refuse nonsense


@pytest.mark.parametrize(
    "tau", [0, 0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, float("nan"), 1.0]), True, "1"]
)
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_kforcing_refuses_bad_temperature(model, prompts, tau, cache):
    with pytest.raises(ValueError, match="temperature: expected a finite number > 0"):
        generate_kforcing(model, prompts, 2, 4, temperature=tau, cache=cache)


@pytest.mark.parametrize("tau", [-0.5, float("nan"), float("inf"), float("-inf")])
def test_ar_refuses_bad_temperature(model, prompts, tau):
    with pytest.raises(ValueError, match="temperature: expected a finite number >= 0"):
        generate_ar(model, prompts, 3, temperature=tau)


@pytest.mark.parametrize(
    "tau, row",
    [(torch.tensor([1.0, 0.0, 1.0]), " (row 1)"), (torch.tensor(0.0), ""), (torch.tensor([1, 1, -2]), " (row 2)")],
)
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_ar_tensor_temperature_with_a_zero_says_what_greedy_is(model, prompts, tau, row, cache):
    """Greedy is a number 0 for the whole batch (is_greedy); a 0 (or a negative) inside a tensor is refused with a
    message that is true of it: not "expected >= 0 (0 = greedy), got 0.0" (issue 56 item 4)."""
    with pytest.raises(ValueError) as caught:
        generate_ar(model, prompts, 3, temperature=tau, cache=cache)
    message = str(caught.value)
    assert "expected a tensor of finite numbers > 0 (0 = greedy only as a number, temperature=0" in message
    bad = float(tau.flatten()[(tau.flatten() <= 0).nonzero()[0, 0]])
    assert message.endswith(f"got {bad}{row}"), message
    assert ">= 0" not in message


def test_temperature_shape_is_checked(model, prompts):
    with pytest.raises(ValueError, match=r"temperature: expected a scalar or shape \[3\]"):
        generate_kforcing(model, prompts, 2, 4, temperature=torch.ones(2))


def test_k_beyond_the_trained_window_is_refused(model, prompts):
    with pytest.raises(ValueError, match="k: expected 1 <= k <= k_train=2"):
        generate_kforcing(model, prompts, 3, 4, k_train=2)
    model.k_train = 2  # what train.load_model records (model.json "k")
    try:
        with pytest.raises(ValueError, match="k: expected 1 <= k <= k_train=2"):
            generate_kforcing(model, prompts, 4, 4)
        assert generate_kforcing(model, prompts, 2, 4).shape == (3, 4)
        model.k_train = 0
        with pytest.raises(ValueError, match="k: this model was trained as an AR model"):
            generate_kforcing(model, prompts, 1, 4)
    finally:
        del model.k_train


@pytest.mark.parametrize("k", [True, 2.0, "2", -1])
def test_k_must_be_a_positive_int_and_the_error_names_k(model, prompts, k):
    with pytest.raises(ValueError, match=r"^k: expected a positive int"):
        generate_kforcing(model, prompts, k, 4)


@pytest.mark.parametrize("fn", ["ar", "kforcing"])
def test_a_flat_list_is_one_prompt(model, fn):
    """[5, 6, 7, 8] is one four-token prompt (as documented), not four one-token prompts."""
    flat = [5, 6, 7, 8]
    if fn == "ar":
        noise = torch.rand(1, 3, dtype=torch.float64)
        out = generate_ar(model, flat, 3, noise=noise)
        assert out.tolist() == generate_ar(model, [flat], 3, noise=noise).tolist()
        assert generate_ar(model, torch.tensor(flat), 3, noise=noise).tolist() == out.tolist()
    else:
        noise = torch.rand(1, 2, 2, dtype=torch.float64)
        out = generate_kforcing(model, flat, 2, 4, noise=noise)
        assert out.tolist() == generate_kforcing(model, [flat], 2, 4, noise=noise).tolist()
    assert out.shape[0] == 1
    tokens, lengths = pad_prompts(flat)
    assert tokens.tolist() == [flat] and lengths.tolist() == [4]


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "prompts: expected at least one prompt, got an empty batch"),
        (torch.zeros(0, 3, dtype=torch.int64), "prompts: expected a"),
        ([5, [6, 7]], "prompts: expected one flat list of ids .* a mix"),
        ([[1.5, 2]], "prompts: prompt 0: expected integer token ids"),
        ([[1, 2], [3, True]], "prompts: prompt 1: expected integer token ids"),
        (torch.tensor([[1.0, 2.0]]), "prompts: expected integer token ids"),
        ("hello", "prompts: expected token ids"),
    ],
)
def test_bad_prompt_batches(model, bad, match):
    with pytest.raises(ValueError, match=match):
        generate_ar(model, bad, 2)
    with pytest.raises(ValueError, match=match):
        generate_kforcing(model, bad, 1, 2)


def test_max_new_tokens_and_cache_are_checked(model, prompts):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_kforcing(model, prompts, 1, True)
    with pytest.raises(ValueError, match="cache: expected one of"):
        generate_kforcing(model, prompts, 1, 2, cache="ring")
    with pytest.raises(ValueError, match="page_size: expected a positive int"):
        generate_ar(model, prompts, 2, page_size=0)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """A K-Forcing stage folder (k=2) with a byte-level tokenizer, as train.save_model writes it."""
    from kforcing_kernels.app.data import _train_tokenizer
    from kforcing_kernels.app.training.checkpoint import save_model

    folder = tmp_path_factory.mktemp("stage")
    tok = _train_tokenizer(["def f(x): return x"], 257)
    torch.manual_seed(0)
    save_model(folder, KForcingLM(ModelConfig.micro(vocab_size=tok.get_vocab_size())), {"kind": "pflm", "k": 2})
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_cli_writes_out_and_loaded_model_knows_its_k(stage, tmp_path, capsys):
    import json

    from kforcing_kernels.app.generation.inference import main
    from kforcing_kernels.app.training.checkpoint import load_model

    assert load_model(str(stage))[0].k_train == 2
    out = tmp_path / "gen.jsonl"
    main([str(stage), "--prompt", "def", "--prompt", "x", "--new-tokens", "3", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def", "x"] and all(len(r["tokens"]) == 3 for r in rows)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("where", ["under_a_file", "missing_dir", "a_directory"])
def test_cli_unwritable_out_is_a_clear_error(stage, tmp_path, capsys, where):
    from kforcing_kernels.app.generation.inference import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    out = {
        "under_a_file": blocker / "gen.jsonl",
        "missing_dir": tmp_path / "nope" / "gen.jsonl",
        "a_directory": tmp_path,
    }[where]
    with pytest.raises(SystemExit):
        main([str(stage), "--prompt", "def", "--new-tokens", "2", "--out", str(out)])
    assert "argument --out:" in capsys.readouterr().err


def test_cli_read_only_out_dir(stage, tmp_path, capsys):
    """A read-only folder (skipped when running as root, who can write anyway)."""
    import os

    from kforcing_kernels.app.generation.inference import main

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write a 0500 folder (root)")
        with pytest.raises(SystemExit):
            main([str(stage), "--prompt", "def", "--new-tokens", "2", "--out", str(ro / "gen.jsonl")])
        assert "argument --out: cannot write" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("tau", ["nan", "inf", "-1"])
def test_cli_bad_temperature(stage, capsys, tau):
    from kforcing_kernels.app.generation.inference import main

    with pytest.raises(SystemExit):
        main([str(stage), "--prompt", "def", "--temperature", tau])
    assert "argument --temperature: expected a finite number >= 0" in capsys.readouterr().err

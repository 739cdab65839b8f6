"""Trainer: distillation targets, checkpoints, bit-for-bit resume, clear errors."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from helpers.train_helpers import VOCAB, micro_config, write_json_package
from kforcing_kernels.app.data import load_corpus
from kforcing_kernels.app.train import main
from kforcing_kernels.app.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_model,
    read_metrics,
    save_checkpoint,
)
from kforcing_kernels.app.training.config import TrainConfig
from kforcing_kernels.app.training.loop import learning_rate, train
from kforcing_kernels.app.training.objectives import (
    forward_distillation_targets,
    noise_inversion_supervision,
    self_forcing_targets,
)
from kforcing_kernels.app.training.stage import _optimizer
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling import inverse_cdf_sample


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A few real source files (the json package), small enough to tokenize in a moment."""
    return write_json_package(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module", autouse=True)
def _cache(isolated_cache):
    yield


micro = micro_config


@pytest.fixture(scope="module")
def chain(tmp_path_factory, corpus_dir):
    """A trained stage0 (AR) and stage1 (PFLM k=1) to serve as teachers."""
    root = tmp_path_factory.mktemp("chain")
    train(micro(root / "stage0", corpus_dir, steps=4))
    train(micro(root / "stage1", corpus_dir, stage="stage1", teacher=str(root / "stage0"), steps=2))
    return root


# ---------------------------------------------------------------------- targets


def naive_window(model, context, prefix_tokens, noise, tau):
    """Decode one window the slow, obvious way: one causal pass over the explicit sequence
    [context ; prefix_tokens ; noise tokens] with a dense mask, argmax of the last k outputs."""
    x = torch.cat([model.wte(context), model.wte(prefix_tokens), model.embed_noise(noise[None], tau)[0]], 0)[None]
    n = x.shape[1]
    h, _ = model.trunk(x, torch.arange(n), WindowLayout.causal(n))
    return model.head(h[0, -noise.numel() :]).argmax(-1)


def test_self_forcing_targets_equal_two_sequential_teacher_passes():
    cfg = ModelConfig.micro(vocab_size=37, n_embd=32, attention_backend="reference")
    teacher = KForcingLM(cfg).double().eval()
    b, n, k = 2, 6, 2
    context = torch.randint(0, cfg.vocab_size, (b, n))
    z = torch.rand(b, n, 2 * k, dtype=torch.float64)
    tau = torch.tensor([0.5, 0.9])
    fast = self_forcing_targets(_with_default_backend(teacher), context, z, tau)  # fused: Single + DoubleForward
    assert fast.shape == (b, n, 2 * k)
    with torch.no_grad():
        for i in range(b):
            for t in range(n):
                ctx = context[i, : t + 1]
                first = naive_window(teacher, ctx, ctx[:0], z[i, t, :k], tau[i])  # round 1: k tokens after x_<=t
                second = naive_window(teacher, ctx, first, z[i, t, k:], tau[i])  # round 2: after x_<=t + round 1
                assert fast[i, t].tolist() == first.tolist() + second.tolist(), (i, t)


def _with_default_backend(model):
    fast = KForcingLM(dataclasses.replace(model.config, attention_backend=None)).double().eval()
    fast.load_state_dict(model.state_dict())
    return fast


def test_stage1_targets_follow_the_tempered_teacher_distribution():
    v, n = 6, 40_000
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -0.5])
    gen = torch.Generator().manual_seed(0)
    taus = torch.tensor([0.5, 1.0, 2.0])
    z = torch.rand(len(taus), n, generator=gen)
    targets = forward_distillation_targets(logits.expand(len(taus), n, v), z, taus)  # [3, n]

    def chi2(counts, probs):
        expected = probs * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    critical = 25.74  # chi-square, 5 degrees of freedom, p = 1e-4
    for i, tau in enumerate(taus):
        counts = torch.bincount(targets[i], minlength=v).double()
        assert chi2(counts, torch.softmax(logits.double() / tau, -1)) < critical
        # The same test rejects the untempered distribution: it can fail.
        if tau != 1.0:
            assert chi2(counts, torch.softmax(logits.double(), -1)) > critical


def test_stage1_targets_use_the_sampler_convention():
    # token = min{v : F(v) > z}. Away from the CDF steps: z just below F(v) gives v, just above gives v + 1.
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    tau = torch.tensor([0.8])
    cdf = torch.softmax(logits.double() / 0.8, -1).cumsum(-1)[0]
    zs, expected = [0.0], [0]
    for v in range(3):
        zs += [float(cdf[v]) - 1e-4, float(cdf[v]) + 1e-4]
        expected += [v, v + 1]
    z = torch.tensor([zs])
    got = forward_distillation_targets(logits.expand(1, len(zs), 4), z, tau)
    assert got[0].tolist() == expected
    assert torch.equal(got, inverse_cdf_sample(logits.expand(1, len(zs), 4), z, 0.8))
    # On the steps: with probabilities [0, 1/2, 0, 1/2] (exact in floating point) F = [0, 1/2, 1/2, 1];
    # "> z" (not ">= z") never returns a token of zero probability, even at z = 0 or z = F(v).
    sparse = torch.tensor([[-1e4, 1.0, -1e4, 1.0]])
    z = torch.tensor([[0.0, 0.25, 0.5, 0.75]])
    assert forward_distillation_targets(sparse.expand(1, 4, 4), z, tau)[0].tolist() == [1, 1, 3, 3]
    # rounding can leave F(V-1) < 1: z close to 1 (the largest float32 below 1) still gives a valid id
    assert forward_distillation_targets(logits[None], torch.tensor([[1.0 - 2**-24]]), tau).item() == 3


def test_noise_inversion_baseline_recovers_the_real_tokens():
    teacher = KForcingLM(ModelConfig.micro(vocab_size=29)).eval()
    b, n, k = 2, 5, 3
    tokens = torch.randint(0, 29, (b, n + k))
    tau = torch.tensor([0.7, 1.0])
    with torch.no_grad():
        context, z, targets = noise_inversion_supervision(teacher, tokens, k, tau, torch.Generator().manual_seed(0))
        logits = teacher(tokens[:, :-1])
    assert torch.equal(context, tokens[:, :n])
    for t in range(n):
        for j in range(k):
            assert torch.equal(targets[:, t, j], tokens[:, t + 1 + j])  # the real next-k tokens
            # the teacher's inverse-CDF sampler maps the inverted noise back to the real token
            assert torch.equal(inverse_cdf_sample(logits[:, t + j], z[:, t, j], tau), targets[:, t, j])
    assert bool(((z >= 0) & (z < 1)).all())


def test_stage1_records_the_cdf_order_of_its_targets(chain):
    # noise_diagnosis and any later evaluation rebuild the targets in the order the student learned.
    from kforcing_kernels.app.training.targets import STAGE1_CDF_ORDER

    _, info, _ = load_model(str(chain / "stage1"))
    assert info["cdf_order"] == STAGE1_CDF_ORDER == "vocab"
    _, ar_info, _ = load_model(str(chain / "stage0"))
    assert "cdf_order" not in ar_info


def test_stage1_records_its_decoding_rule_and_stage2_inherits_it(tmp_path, corpus_dir, chain):
    # The rule (model/decoding.py) is a Stage-1 choice saved in the model config; the stage2 student decodes,
    # and builds its teacher's targets, by the rule its teacher was saved with. Argmax (the paper's) by default.
    from kforcing_kernels.app.training.config import ConfigError

    train(micro(tmp_path / "s1", corpus_dir, stage="stage1", teacher=str(chain / "stage0"), steps=2, decode="residual"))
    train(micro(tmp_path / "s2", corpus_dir, stage="stage2", teacher=str(tmp_path / "s1"), steps=2))
    for folder in ("s1", "s2"):
        assert load_model(str(tmp_path / folder))[0].config.decode == "residual"
    assert load_model(str(chain / "stage1"))[0].config.decode == "argmax"
    with pytest.raises(ConfigError, match="decode: the decoding rule is chosen in stage1"):
        train(
            micro(
                tmp_path / "bad", corpus_dir, stage="stage2", teacher=str(tmp_path / "s1"), steps=2, decode="residual"
            )
        )


def test_noise_inversion_stage_trains_any_k(tmp_path, corpus_dir, chain):
    train(
        micro(
            tmp_path / "ni",
            corpus_dir,
            stage="stage1",
            teacher=str(chain / "stage0"),
            steps=2,
            supervision="noise_inversion",
            k=3,
        )
    )
    _, info, _ = load_model(str(tmp_path / "ni"))
    assert info["k"] == 3 and info["supervision"] == "noise_inversion"
    val = [m for m in read_metrics(tmp_path / "ni" / "metrics.jsonl") if "val_loss_pos" in m][-1]
    assert len(val["val_loss_pos"]) == 3
    with pytest.raises(ValueError, match="k: only stage1 with noise_inversion"):
        train(micro(tmp_path / "bad", corpus_dir, stage="stage1", teacher=str(chain / "stage0"), k=2))


# ---------------------------------------------------------------------- checkpoints and resume


@pytest.mark.parametrize("stage", ["stage0", "stage2"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, corpus_dir, chain, stage):
    extra = {} if stage == "stage0" else {"stage": "stage2", "teacher": str(chain / "stage1")}
    whole = micro(tmp_path / "whole", corpus_dir, **extra)
    train(whole)
    parts = micro(tmp_path / "parts", corpus_dir, stop_at=3, **extra)
    train(parts)
    assert not (tmp_path / "parts" / "model.json").exists()  # stopped early: no final model yet
    train(dataclasses.replace(parts, stop_at=None, resume=True))

    losses = lambda folder: [(m["step"], m["loss"]) for m in read_metrics(folder / "metrics.jsonl") if "loss" in m]  # noqa: E731
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts")
    assert len(losses(tmp_path / "whole")) == 6
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_checkpoint_round_trip(tmp_path):
    model = KForcingLM(ModelConfig.micro())
    cfg = TrainConfig(out=str(tmp_path))
    opt = _optimizer(model, cfg, fused_ok=False)
    tokens = torch.randint(0, 64, (2, 9))
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = save_checkpoint(tmp_path, 2, model, opt, scaler, cfg.to_dict(), {"kind": "ar", "k": 0}, keep=2)
    assert latest_checkpoint(tmp_path) == path

    model2 = KForcingLM(ModelConfig.micro())
    opt2 = _optimizer(model2, cfg, fused_ok=False)
    meta = load_checkpoint(path, model2, opt2, scaler)
    assert meta["step"] == 2
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[p2][key]), (name, key)
    assert model2.head.weight is model2.wte.weight  # tied weights stay tied


def test_truncated_or_corrupt_checkpoints_give_clear_errors(tmp_path):
    model = KForcingLM(ModelConfig.micro())
    cfg = TrainConfig(out=str(tmp_path))
    opt = _optimizer(model, cfg, fused_ok=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = save_checkpoint(tmp_path, 1, model, opt, scaler, cfg.to_dict(), {"kind": "ar", "k": 0}, keep=2)
    tensors = path.with_suffix(".safetensors")
    data = tensors.read_bytes()

    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path, model, opt, scaler)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    tensors.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path, model, opt, scaler)
    tensors.write_bytes(data)
    path.write_text(path.read_text()[:40])
    with pytest.raises(CheckpointError, match="corrupt JSON"):
        load_checkpoint(path, model, opt, scaler)
    with pytest.raises(CheckpointError, match="not found"):
        load_model(str(tmp_path / "nowhere"))


def test_no_temporary_files_are_left_behind(tmp_path, corpus_dir):
    train(micro(tmp_path / "run", corpus_dir, steps=3, ckpt_every=1, keep_checkpoints=2))
    names = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    assert not [n for n in names if n.endswith(".tmp")]
    assert [n for n in names if n.startswith("step_")] == [
        "step_00000002.json",
        "step_00000002.safetensors",
        "step_00000003.json",
        "step_00000003.safetensors",
    ]
    model, info, tokenizer = load_model(str(tmp_path / "run"))
    assert info["k"] == 0 and tokenizer.get_vocab_size() == VOCAB and not model.training


# ---------------------------------------------------------------------- configuration errors


def test_learning_rate_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, steps=104, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0) == pytest.approx(0.25)
    assert learning_rate(cfg, 3) == pytest.approx(1.0)
    assert learning_rate(cfg, 54) == pytest.approx(0.55)  # half-way down the cosine
    assert learning_rate(cfg, 104) == pytest.approx(0.1)
    assert all(learning_rate(cfg, s) >= learning_rate(cfg, s + 1) for s in range(4, 104))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["stage0", "--out", "x", "--steps", "0"], "--steps: expected a positive integer"),
        (["stage0", "--out", "x", "--lr", "abc"], "--lr: expected a positive number"),
        (["stage0", "--out", "x", "--tau-min", "0.9", "--tau-max", "0.5"], "--tau-min"),
        (["stage0", "--out", "x", "--batch-size", "6", "--grad-accum", "4"], "batch_size"),
        (["stage1", "--out", "x"], "--teacher"),
        (["stage1", "--out", "x", "--teacher", "no/such/folder"], "teacher: no trained model"),
        (["stage0", "--out", "x", "--precision", "fp8"], "--precision"),
        (["pipeline", "--out", "x", "--k-final", "3"], "k_final"),
    ],
)
def test_bad_cli_input_names_the_argument(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_refuses_other_settings_and_fresh_runs_refuse_old_checkpoints(tmp_path, corpus_dir):
    cfg = micro(tmp_path / "run", corpus_dir, steps=4, stop_at=2)
    train(cfg)
    with pytest.raises(ValueError, match="--resume"):
        train(dataclasses.replace(cfg, stop_at=None))
    with pytest.raises(ValueError, match="batch_size"):
        train(dataclasses.replace(cfg, stop_at=None, resume=True, batch_size=8))


def test_stage_teachers_must_have_the_right_kind(tmp_path, corpus_dir, chain):
    with pytest.raises(ValueError, match="stage2 needs a PFLM teacher"):
        train(micro(tmp_path / "a", corpus_dir, stage="stage2", teacher=str(chain / "stage0")))
    with pytest.raises(ValueError, match="stage1 distils an AR teacher"):
        train(micro(tmp_path / "b", corpus_dir, stage="stage1", teacher=str(chain / "stage1")))


def test_corpus_split_is_deterministic(corpus_dir):
    a = load_corpus(str(corpus_dir), vocab_size=VOCAB)
    b = load_corpus(str(corpus_dir), vocab_size=VOCAB)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.val.numel() > 0 and a.train.numel() > 10 * a.val.numel() / 2
    assert a.decode(a.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(str(corpus_dir), vocab_size=100)
    with pytest.raises(ValueError, match="source"):
        load_corpus(str(corpus_dir / "missing"), vocab_size=VOCAB)

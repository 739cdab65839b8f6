"""K-Forcing a Hugging Face causal LM with the package's own recipe (issue 27): adapter, CLI, files, generation.

Tiny random models built from configs in the test (no hub): a Llama from a config file (``--model-config``:
Stage 0 trains it as the AR teacher) and a Qwen2 saved as a pretrained folder (``--model PATH``: the AR
teacher as loaded). Oracles: the same HF model under SDPA (``from_pretrained`` of the saved folder,
``generate()``), documents computed alone, SingleForward recomputed without a cache, the checkpoint's tensors.
"""

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from helpers.train_helpers import write_json_package  # noqa: E402
from kforcing_kernels.app import train as train_cli  # noqa: E402
from kforcing_kernels.app.data import EOS, load_corpus  # noqa: E402
from kforcing_kernels.app.generation import inference  # noqa: E402
from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing  # noqa: E402
from kforcing_kernels.app.hf_recipe.files import load_hf_stage  # noqa: E402
from kforcing_kernels.app.hf_recipe.student import HFStudent  # noqa: E402
from kforcing_kernels.app.training.checkpoint import CheckpointError, latest_checkpoint, read_metrics  # noqa: E402
from kforcing_kernels.app.training.config import ConfigError, TrainConfig  # noqa: E402
from kforcing_kernels.app.training.loop import train  # noqa: E402
from kforcing_kernels.integrations.hf_noise import NoiseEmbedding  # noqa: E402

VOCAB = 300
FAMILIES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}


def tiny_config(family: str, vocab: int = VOCAB):
    return FAMILIES[family](
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def tiny_student(family: str, seed: int = 0, vocab: int = 48) -> HFStudent:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, vocab), attn_implementation="kforcing")
    return HFStudent(model).double().eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_recipe")
    write_json_package(root / "corpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        # A "pretrained" Qwen2 folder as a user has one: weights, config and a fast tokenizer with an EOS.
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=load_corpus(str(root / "corpus"), vocab_size=VOCAB).tokenizer, eos_token=EOS
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2")).save_pretrained(root / "qwen2")
        tokenizer.save_pretrained(root / "qwen2")
        (root / "llama.json").write_text(tiny_config("llama").to_json_string())
        yield root


SMALL = [
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--steps-stage1",
    "2",
    "--steps-stage2",
    "2",
    "--warmup-steps",
    "1",
    "--eval-batches",
    "1",
    "--packed-docs",
    "--threads",
    "1",
    "--no-progress",
    "--device",
    "cpu",
]


def source_args(root, family):
    """Llama from a config file (Stage 0 trains it); Qwen2 from a pretrained folder (no Stage 0)."""
    if family == "llama":
        return ["--model-config", str(root / "llama.json"), "--vocab-size", str(VOCAB), "--steps-stage0", "4"]
    return ["--model", str(root / "qwen2")]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def run(request, root):
    """One command: Stage (0,) 1, Stage 2 k=2 and k=4, then the quick evaluation (its generations included)."""
    family = request.param
    out = root / f"run_{family}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        train_cli.main(
            [
                "pipeline",
                "--out",
                str(out),
                "--data",
                str(root / "corpus"),
                *source_args(root, family),
                *SMALL,
                "--evaluate",
                "quick",
            ]
        )
        yield family, out


def test_one_command_k_forces_the_model_end_to_end(run, capsys):
    family, out = run
    stages = ["stage1", "stage2_k2", "stage2_k4"] + (["stage0"] if family == "llama" else [])
    for name in stages:
        info = json.loads((out / name / "model.json").read_text())
        assert info["hf_format"] == 1 and info["noise_embedding"]["format"] == 2
        losses = [m["loss"] for m in read_metrics(out / name / "metrics.jsonl") if "loss" in m]
        assert losses and all(math.isfinite(x) for x in losses)
    assert not (out / "stage0").exists() or family == "llama"
    summary = json.loads((out / "summary.json").read_text())
    assert [row["k"] for row in summary["per_position_nll"]] == [0, 1, 2, 4]
    assert set(summary["throughput"]) == {"AR", "K-Forcing k=1", "K-Forcing k=2", "K-Forcing k=4"}
    assert all(text for text in summary["samples"].values())
    # Generation from the CLI, with the stage's own tokenizer.
    capsys.readouterr()
    inference.main(
        [str(out / "stage2_k4"), "--prompt", "def dumps(", "--new-tokens", "8", "--threads", "1", "--device", "cpu"]
    )
    assert capsys.readouterr().out.startswith("def dumps(")


def test_hf_stages_record_no_preset_and_reuse_stages_saved_with_one(run, root, capsys, monkeypatch):
    """Issue 38: --preset sizes no Hugging Face model, so HF stages record none (and stage2 its own k); stages saved
    before, with the --preset default and k 1 recorded, are still reused; a recorded k that is not the window is
    refused."""
    family, out = run
    names = (["stage0"] if family == "llama" else []) + ["stage1", "stage2_k2", "stage2_k4"]
    for name in names:
        info = json.loads((out / name / "model.json").read_text())
        for recorded in (json.loads((out / name / "train_config.json").read_text()), info["train_config"]):
            assert recorded["preset"] is None
            assert recorded["k"] == (info["k"] if name.startswith("stage2") else 1)
    copy = root / f"old_records_{family}"
    shutil.copytree(out, copy)

    def record(name, **values):
        info = json.loads((copy / name / "model.json").read_text())
        info["train_config"].update(values)
        (copy / name / "model.json").write_text(json.dumps(info))

    for name in names:
        record(name, preset="tiny", **({"k": 1} if name.startswith("stage2") else {}))
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    argv = ["pipeline", "--out", str(copy), "--data", str(root / "corpus"), *source_args(root, family), *SMALL]
    capsys.readouterr()
    train_cli.main(argv)
    assert capsys.readouterr().err.count("skipping") == len(names)
    record("stage2_k4", k=2)
    with pytest.raises(SystemExit):
        train_cli.main(argv)
    assert (
        "k: " + str(copy / "stage2_k4") + " holds a finished stage2_k4 trained with k=2, this run asks for 4"
        in capsys.readouterr().err
    )


def test_the_stage_folder_loads_with_from_pretrained(run):
    _, out = run
    folder = out / "stage2_k4"
    student, info, _ = load_hf_stage(folder)
    assert info["k"] == 4 and student.k_train == 4
    # the independent oracle
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(student(ids), plain(ids).logits, atol=1e-5, rtol=1e-5)
    # The saved tensors are the last checkpoint's, bit for bit (HF weights and the noise embedding).
    saved = load_file(str(latest_checkpoint(folder).with_suffix(".safetensors")))
    state = student.state_dict()
    for key in student.tied_keys():
        state.pop(key)
    assert {k[len("model/") :] for k in saved if k.startswith("model/")} == set(state)
    assert all(torch.equal(saved[f"model/{k}"], v) for k, v in state.items())


def test_a_damaged_or_old_stage_folder_is_refused(run, tmp_path):
    import shutil

    _, out = run
    folder = tmp_path / "stage"
    shutil.copytree(out / "stage1", folder)
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff")
    with pytest.raises(CheckpointError, match="model.safetensors: truncated or corrupt"):
        load_hf_stage(folder)
    shutil.copy(out / "stage1" / "model.safetensors", folder / "model.safetensors")
    info = json.loads((folder / "model.json").read_text())
    info["noise_embedding"]["format"] = 1
    (folder / "model.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="noise embedding is format 1.*retrain"):
        load_hf_stage(folder)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_for_bit(root, tmp_path, monkeypatch, precision):
    """fp32, and bf16 autocast (fp32 weights and AdamW state; CPU autocast is deterministic) alike."""
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    cfg = TrainConfig(
        stage="stage1",
        model=str(root / "qwen2"),
        out=str(tmp_path / "whole"),
        data=str(root / "corpus"),
        seq_len=16,
        batch_size=4,
        steps=4,
        warmup_steps=1,
        log_every=1,
        eval_batches=1,
        progress=False,
        packed_docs=True,
        device="cpu",
        precision=precision,
    )
    torch.set_num_threads(1)
    train(cfg)
    parts = dataclasses.replace(cfg, out=str(tmp_path / "parts"), stop_at=2)
    train(parts)
    assert not (tmp_path / "parts" / "model.json").exists()
    # The checkpoint as a run saved before issue 38 recorded it: the --preset default, which sizes no HF model.
    ckpt = latest_checkpoint(tmp_path / "parts")
    meta = json.loads(ckpt.read_text())
    assert meta["train_config"]["preset"] is None
    ckpt.write_text(json.dumps({**meta, "train_config": {**meta["train_config"], "preset": "tiny"}}))
    train(dataclasses.replace(parts, stop_at=None, resume=True))

    def losses(name):
        return [(m["step"], m["loss"]) for m in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in m]

    assert losses("whole") == losses("parts") and len(losses("whole")) == 4
    for file in ("model.safetensors", "noise_embedding.safetensors"):
        a, b = load_file(str(tmp_path / "whole" / file)), load_file(str(tmp_path / "parts" / file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["pipeline", "--model", "M", "--preset", "micro"],
            "argument --preset: sizes the native model; --model gives the model",
        ),
        (
            ["pipeline", "--model-config", "C.json", "--n-layer", "2"],
            "argument --n-layer: sizes the native model; --model-config",
        ),
        (["stage1"], "teacher: stage1 needs --teacher .* or --model"),
    ],
)
def test_cli_refusals_name_the_setting(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_cli.main([argv[0], "--out", str(tmp_path / "out"), *argv[1:]])
    assert message.split(".*")[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(stage="stage0", model="qwen2"), "model: --model is a pretrained AR teacher"),
        (dict(stage="stage0", model="qwen2", model_config="llama.json"), "model_config: --model .* and --model-config"),
        (dict(stage="stage1", model_config="llama.json", teacher="x"), "model_config: only stage0"),
        (
            dict(stage="stage0", model_config="llama.json", vocab_size=257),
            "vocab_size: --model-config .* has 300 tokens .* has 257",
        ),
    ],
)
def test_config_refusals_name_the_setting(root, tmp_path, monkeypatch, change, message):
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    change = {k: str(root / v) if k in ("model", "model_config") else v for k, v in change.items()}
    cfg = TrainConfig(
        out=str(tmp_path / "out"),
        data=str(root / "corpus"),
        seq_len=16,
        batch_size=4,
        steps=1,
        progress=False,
        device="cpu",
        **change,
    )
    with pytest.raises(ConfigError, match=message):
        train(cfg)


def test_format_1_noise_weights_are_refused():
    old = {
        "mlp.0.weight": torch.zeros(32, 64),
        "mlp.0.bias": torch.zeros(32),
        "mlp.2.weight": torch.zeros(32, 32),
        "mlp.2.bias": torch.zeros(32),
    }
    with pytest.raises(ValueError, match="format 1"):
        NoiseEmbedding(32).load_state_dict(old)
    emb = NoiseEmbedding(32)
    state = emb.state_dict()
    state._metadata[""]["version"] = 1  # a format-1 module's state dict carries version 1
    with pytest.raises(ValueError, match="format 1"):
        NoiseEmbedding(32).load_state_dict(state)
    NoiseEmbedding(32).load_state_dict(emb.state_dict())  # its own format loads


def test_noise_features_are_the_native_encoders():
    from kforcing_kernels.model import ModelConfig
    from kforcing_kernels.model.gpt import NoiseEncoder

    emb = NoiseEmbedding(32, noise_features=32, tau_features=8)
    native = NoiseEncoder(ModelConfig.micro(n_embd=32, noise_features=32, tau_features=8))
    assert torch.equal(emb.freqs, native.freqs) and torch.equal(emb.tau_freqs, native.tau_freqs)
    assert 2 * math.pi / float(emb.freqs.max()) < 0.01  # the shortest z period resolves narrow CDF bins
    native.load_state_dict(emb.state_dict())
    z, tau = torch.rand(3, 5, 2), torch.tensor([0.5, 0.8, 1.2])
    torch.testing.assert_close(emb(z, tau), native(z, tau[:, None, None]))


# ---------------------------------------------------------------------- the adapter's forwards and decoding


def uncached_kforcing(model, prompt, k, noise, tau):
    """Algorithm 1 without a cache: SingleForward over the whole context at each step (other windows get unrelated
    noise)."""
    seq, out = prompt.clone(), []
    for step in range(noise.shape[0]):
        z = torch.rand(1, seq.numel(), k, dtype=torch.float64)
        z[0, -1] = noise[step]
        new = model.single_forward(seq[None], z, tau, keep_cache=False)[0][0, -1].argmax(-1)
        out += new.tolist()
        seq = torch.cat([seq, new])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_cached_decoding_equals_uncached_single_forward(family, k):
    model = tiny_student(family)
    prompts = [torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)]
    new_tokens = 9
    noise = torch.rand(3, math.ceil(new_tokens / k), k, dtype=torch.float64)
    out = generate_kforcing(model, prompts, k, new_tokens, temperature=0.7, noise=noise)
    for b, p in enumerate(prompts):
        assert out[b].tolist() == uncached_kforcing(model, p, k, noise[b], 0.7)[:new_tokens]


def test_ar_decoding_equals_transformers_generate():
    model = tiny_student("llama", seed=3).float()
    oracle = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", 48), attn_implementation="sdpa").eval()
    oracle.load_state_dict(model.hf.state_dict())
    prompts = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    want = oracle.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )
    assert generate_ar(model, prompts, 6, temperature=0).tolist() == want[:, 5:].tolist()


def test_double_forward_equals_single_forward_on_the_extended_context():
    model = tiny_student("qwen2")
    ctx, z = torch.randint(0, 48, (2, 6)), torch.rand(2, 6, 4, dtype=torch.float64)
    logits, cache = model.single_forward(ctx, z[..., :2], 0.9)
    first = logits.argmax(-1)
    second = model.double_forward(cache, first, z[..., 2:], 0.9)
    assert cache.get_seq_length() == 6  # cropped back: the cache can be reused
    for t in range(6):
        ext = torch.cat([ctx[:, : t + 1], first[:, t]], 1)
        zz = torch.rand(2, ext.shape[1], 2, dtype=torch.float64)
        zz[:, -1] = z[:, t, 2:]
        torch.testing.assert_close(model.single_forward(ext, zz, 0.9, keep_cache=False)[0][:, -1], second[:, t])


def test_packed_documents_equal_documents_alone():
    model = tiny_student("llama")
    tokens, z = torch.randint(0, 48, (1, 10)), torch.rand(1, 10, 2, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10])
    ar, single = model(tokens, cu_seqlens=cu), model(tokens, z, 0.8, cu_seqlens=cu)
    for lo, hi in ((0, 4), (4, 10)):
        torch.testing.assert_close(ar[:, lo:hi], model(tokens[:, lo:hi]))
        torch.testing.assert_close(single[:, lo:hi], model(tokens[:, lo:hi], z[:, lo:hi], 0.8))


def test_stage1_targets_at_low_tau_are_the_teachers_greedy_tokens():
    """The Stage-1 target of an HF teacher at tau -> 0 is its greedy next token (transformers' own generate, SDPA)."""
    from kforcing_kernels.app.training.objectives import forward_distillation_targets

    teacher = tiny_student("qwen2", seed=5).float()
    oracle = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", 48), attn_implementation="sdpa").eval()
    oracle.load_state_dict(teacher.hf.state_dict())
    ctx = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        targets = forward_distillation_targets(teacher(ctx), torch.rand(2, 7), torch.full((2,), 1e-4))
    for t in range(7):
        prefix = ctx[:, : t + 1]
        want = oracle.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, do_sample=False)[:, -1]
        assert targets[:, t].tolist() == want.tolist()


def test_the_hf_corpus_cache_keeps_each_tokenizers_ids(tmp_path, monkeypatch):
    """Two tokenizers over the same --data: the second gets its own ids, not the first one's cached streams
    (oracle: the second tokenizer's corpus built in an empty cache)."""
    from kforcing_kernels.app.hf_recipe.files import load_hf_corpus

    write_json_package(tmp_path / "corpus")
    data = str(tmp_path / "corpus")
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "native"))
    tokenizers = [
        transformers.PreTrainedTokenizerFast(tokenizer_object=load_corpus(data, vocab_size=v).tokenizer, eos_token=EOS)
        for v in (280, 320)
    ]
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "shared"))
    first, second = (load_hf_corpus(data, tok) for tok in tokenizers)
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "alone"))
    alone = load_hf_corpus(data, tokenizers[1])
    assert not torch.equal(first.train[: len(alone.train)], alone.train[: len(first.train)])  # the two really differ
    assert torch.equal(second.train, alone.train) and torch.equal(second.val, alone.val)

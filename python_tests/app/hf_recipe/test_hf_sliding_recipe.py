"""The K-Forcing recipe on a sliding-window model (issue 38 section 1): a Mistral-style model with W = 8 trains
every stage at N = 24 (three times the window) to k = 4 and generates K-Forcing past the window.

It used to be refused when Stage 2 at k = 4 started (the window was counted in key storage order, so
K-Forcing needed N * (1 + k) <= W), and K-Forcing generation past the window ended in a traceback
(the model's own sliding cache drops keys and cannot be cropped back). Exactness against per-window
recomputation is test_hf_sliding.py's; this runs the one command a user runs, in fp32 and under bf16
autocast (``--precision bf16``, issue 37: the HF route used to fail there at its first step).
"""

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from helpers.train_helpers import write_json_package  # noqa: E402
from kforcing_kernels.app import train as train_cli  # noqa: E402
from kforcing_kernels.app.generation.inference import generate_kforcing  # noqa: E402
from kforcing_kernels.app.hf_recipe.files import load_hf_stage  # noqa: E402
from kforcing_kernels.app.training.checkpoint import read_metrics  # noqa: E402

VOCAB, W = 300, 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: autocast, where q/k leave RoPE in fp32 and v is bf16
def test_mistral_with_a_window_of_8_trains_and_generates_at_n_24_k_4(tmp_path, monkeypatch, precision):
    write_json_package(tmp_path / "corpus")
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=W,
    )
    (tmp_path / "mistral.json").write_text(config.to_json_string())
    out = tmp_path / "run"
    train_cli.main(
        [
            "pipeline",
            "--out",
            str(out),
            "--data",
            str(tmp_path / "corpus"),
            "--model-config",
            str(tmp_path / "mistral.json"),
            "--vocab-size",
            str(VOCAB),
            "--steps-stage0",
            "2",
            "--seq-len",
            "24",
            "--batch-size",
            "2",
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
            "--precision",
            precision,
        ]
    )
    for name in ("stage0", "stage1", "stage2_k2", "stage2_k4"):
        losses = [m["loss"] for m in read_metrics(out / name / "metrics.jsonl") if "loss" in m]
        assert losses and all(math.isfinite(x) for x in losses), name
    assert json.loads((out / "stage2_k4" / "model.json").read_text())["k"] == 4
    student, _, _ = load_hf_stage(out / "stage2_k4")
    assert student.config.sliding_window == W
    # K-Forcing generation to 5 + 24 tokens, far past the window, over the cache; then the same tokens from a
    # per-step recomputation by the model under sdpa (its own sliding mask).
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    noise = torch.rand(1, 6, 4, generator=torch.Generator().manual_seed(1))
    tokens = generate_kforcing(student, prompt, 4, 24, temperature=0.8, noise=noise)
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(out / "stage2_k4", attn_implementation="sdpa").eval()
    seq = prompt
    with torch.no_grad():
        for s in range(6):
            x = torch.cat([sdpa.get_input_embeddings()(seq), student.embed_noise(noise[:, s], 0.8)], 1)
            logits = sdpa(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None], use_cache=False).logits[:, -4:]
            seq = torch.cat([seq, logits.argmax(-1)], 1)
    assert tokens.tolist() == seq[:, 5:].tolist()


def test_a_window_too_short_for_a_later_stage_is_refused_before_the_first_trains(tmp_path, monkeypatch, capsys):
    """Issue 46: a sliding window of 2 holds stage1's k = 1 and stage2_k2's windows but not stage2_k4's: the pipeline
    refuses it (naming --k-final and the stage) before stage0 trains, instead of when stage2_k4 starts."""
    write_json_package(tmp_path / "corpus")
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=2,
    )
    (tmp_path / "mistral.json").write_text(config.to_json_string())
    argv = [
        "pipeline",
        "--out",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "corpus"),
        "--model-config",
        str(tmp_path / "mistral.json"),
        "--vocab-size",
        str(VOCAB),
        "--steps-stage0",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--steps-stage1",
        "1",
        "--steps-stage2",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--device",
        "cpu",
    ]
    with pytest.raises(SystemExit):
        train_cli.main(argv + ["--k-final", "4"])
    err = capsys.readouterr().err
    assert "k_final: the model's sliding window (2 positions) cannot hold the windows of stage2_k4" in err, err
    assert "Traceback" not in err and not (tmp_path / "run" / "stage0").exists()

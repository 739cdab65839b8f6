"""bench memory-model (issue 45): its calibration predicts the bytes a Stage-2 step saves at other shapes."""

import dataclasses

import pytest
import torch

from bench.training import memory_model
from kforcing_kernels.app.training.objectives import Batch, Objective, compute_loss
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.tools.memory import SavedTensors


@pytest.mark.parametrize("n_layer, n, teacher_k, batch", [(3, 12, 3, 2), (2, 20, 2, 1)])
def test_prediction_matches_measured_saved_bytes(n_layer, n, teacher_k, batch):
    width, heads, vocab = 32, 2, 300
    cal = memory_model.calibrate(width, heads, torch.float32, n=8, k=4)
    cfg = ModelConfig(
        vocab_size=vocab, n_layer=n_layer, n_head=heads, n_embd=width, seq_len=n, noise_features=128, tau_features=16
    )
    torch.manual_seed(0)
    student, teacher = KForcingLM(cfg), KForcingLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    data = Batch(
        torch.randint(0, vocab, (batch, n), generator=gen),
        torch.rand(batch, n, 2 * teacher_k, generator=gen),
        torch.full((batch,), 0.9),
    )
    saved = SavedTensors(exclude=student.parameters())
    with saved.context():
        compute_loss(Objective.SELF_FORCING, student, data, teacher)
    predicted = memory_model.predicted_saved_bytes(
        n_layer=n_layer, n_embd=width, vocab=vocab, n=n, batch=batch, teacher_k=teacher_k, calibration=cal
    )
    assert abs(predicted - saved.total) <= 0.02 * saved.total, (predicted, saved.total)


def test_parts_and_paper_targets():
    cal = memory_model.Calibration(layer_row=29448.0, attention_row=6192.0, base_row=10472.0)  # bf16, width 768 (CPU)
    paper = dict(n_layer=12, n_embd=768, n_head=12, vocab=50258, batch=4, teacher_k=4, calibration=cal)
    assert memory_model.parameter_count(n_layer=12, n_embd=768, n_head=12, vocab=50258) > 120_000_000
    no_ac = memory_model.predict(n=4096, ac=False, **paper)
    with_ac = memory_model.predict(n=8192, ac=True, **paper)
    assert set(memory_model.PARTS) <= set(no_ac)
    assert no_ac["peak"] < 80e9 and with_ac["peak"] < 80e9  # the targets, by the model
    assert memory_model.predict(n=8192, ac=False, **paper)["peak"] > 80e9
    assert no_ac["loss"] < 0.01 * no_ac["unchunked_loss"]
    assert dataclasses.asdict(cal)


def test_bench_train_with_ac_reports_memory(tmp_path, capsys):
    """bench train --ac: the same loss as without it, and the memory fields of every variant (CPU)."""
    from bench.__main__ import run_command

    base = [
        "--preset",
        "micro",
        "--k",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
    ]
    plain = run_command("train", base + ["--out", str(tmp_path / "plain")])
    ac = run_command("train", base + ["--ac", "--out", str(tmp_path / "ac")])
    unchunked = run_command("train", base + ["--unchunked-loss", "--out", str(tmp_path / "unchunked")])
    assert ac["meta"]["activation_checkpointing"] and not plain["meta"]["activation_checkpointing"]
    for a, b, c in zip(plain["rows"], ac["rows"], unchunked["rows"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["loss"] == pytest.approx(c["loss"], rel=1e-5)
        for row in (a, b, c):
            assert row["saved_mib"] > 0 and row["tracked_peak_mib"] > 0 and row["process_peak_rss_mib"] > 0
        assert b["saved_mib"] < a["saved_mib"]  # checkpointed blocks keep only their inputs
    assert "activation checkpointing on" in capsys.readouterr().out

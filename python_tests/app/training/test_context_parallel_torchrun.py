"""Context parallelism with two processes (torchrun; gloo on CPU, nccl when two CUDA GPUs are present).

Oracles: single-process ``window_attention`` (reference backend, fp64) and a single-process model for
python_tests/workers/cp_worker.py; a single-process trainer step for the ``--context-parallel 2`` run.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers import REPO
from helpers.train_helpers import torchrun
from kforcing_kernels.app.training.checkpoint import read_metrics
from kforcing_kernels.app.training.config import TrainConfig
from kforcing_kernels.app.training.loop import train

ROOT = REPO
GLOO = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


def _torchrun(args, timeout=120):
    return torchrun(2, *args, timeout=timeout).stdout


@GLOO
def test_cp_attention_and_model_match_one_process_gloo():
    out = _torchrun([str(ROOT / "python_tests" / "workers" / "cp_worker.py"), "gloo"])
    for case in (
        "single",
        "double",
        "packed",
        "packed_per_batch",
        "gqa",
        "causal",
        "model ar_packed",
        "model single_packed",
    ):
        assert out.count(f" {case}: ok") == 2, out  # both ranks checked it


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs two CUDA GPUs and nccl",
)
def test_cp_attention_and_model_match_one_process_nccl():
    out = _torchrun([str(ROOT / "python_tests" / "workers" / "cp_worker.py"), "nccl"], timeout=300)
    assert out.count(" gqa: ok") == 2 and out.count("model single_packed: ok") == 2, out


@GLOO
def test_trainer_step_with_context_parallel_2_matches_one_process(tmp_path, monkeypatch):
    """Stage 1 noise inversion with k=3 windows over packed documents: the first step's gradients and the
    losses of ``--context-parallel 2`` equal one process's. Tolerance: fp32 summation order only (the CP
    path sums attention over other chunks and the loss in another order): gradients rtol 1e-4 / atol 1e-7
    (as the DDP test), the first loss rel 1e-5."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted(Path(json.__file__).parent.glob("*.py")):
        (corpus / path.name).write_text(path.read_text())
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    base = TrainConfig(
        data=str(corpus),
        vocab_size=300,
        preset="micro",
        seq_len=16,
        batch_size=4,
        log_every=1,
        eval_batches=1,
        progress=False,
        packed_docs=True,
    )
    train(dataclasses.replace(base, stage="stage0", out=str(tmp_path / "s0"), steps=1))
    stage1 = dataclasses.replace(
        base, stage="stage1", teacher=str(tmp_path / "s0"), steps=2, supervision="noise_inversion", k=3, lr=1e-3
    )
    train(dataclasses.replace(stage1, out=str(tmp_path / "one"), dump_grads=str(tmp_path / "one.safetensors")))
    _torchrun(
        [
            "-m",
            "kforcing_kernels.app.train",
            "stage1",
            "--teacher",
            str(tmp_path / "s0"),
            "--steps",
            "2",
            "--supervision",
            "noise-inversion",
            "--k",
            "3",
            "--packed-docs",
            "--data",
            str(corpus),
            "--vocab-size",
            "300",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--log-every",
            "1",
            "--eval-batches",
            "1",
            "--no-progress",
            "--lr",
            "1e-3",
            "--out",
            str(tmp_path / "two"),
            "--dump-grads",
            str(tmp_path / "two.safetensors"),
            "--context-parallel",
            "2",
        ],
        timeout=180,
    )
    one, two = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert one.keys() == two.keys() and len(one) > 5
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in one.values())
    losses = lambda run: [m["loss"] for m in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in m]  # noqa: E731
    assert len(losses("one")) == len(losses("two")) == 2
    assert losses("two")[0] == pytest.approx(losses("one")[0], rel=1e-5)
    assert losses("two") == pytest.approx(losses("one"), rel=1e-3)

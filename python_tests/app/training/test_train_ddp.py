"""Data parallel through torchrun (gloo on CPU): the same gradients as one process."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers import REPO
from kforcing_kernels.app.training.checkpoint import read_metrics
from kforcing_kernels.app.training.config import TrainConfig
from kforcing_kernels.app.training.loop import train


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)
def test_two_process_torchrun_matches_single_process(tmp_path, monkeypatch):
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
        batch_size=8,
        log_every=1,
        eval_batches=1,
        progress=False,
    )
    # A k=1 PFLM teacher, so the distributed run is a Stage-2 step (teacher Single+DoubleForward, student k=2).
    train(dataclasses.replace(base, stage="stage0", out=str(tmp_path / "s0"), steps=2))
    train(dataclasses.replace(base, stage="stage1", out=str(tmp_path / "s1"), teacher=str(tmp_path / "s0"), steps=2))
    stage2 = dataclasses.replace(base, stage="stage2", teacher=str(tmp_path / "s1"), steps=3)
    train(dataclasses.replace(stage2, out=str(tmp_path / "one"), dump_grads=str(tmp_path / "one.safetensors")))

    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "kforcing_kernels.app.train",
        "stage2",
        "--teacher",
        str(tmp_path / "s1"),
        "--steps",
        "3",
        "--data",
        str(corpus),
        "--vocab-size",
        "300",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--log-every",
        "1",
        "--eval-batches",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "two"),
        "--dump-grads",
        str(tmp_path / "two.safetensors"),
        "--lr",
        repr(stage2.lr),
    ]  # the CLI's stage-2 default differs from TrainConfig's: same settings in both runs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The log states the layout once, at the start (rank 0 logs): issue 56 item 5.
    layout = [line for line in result.stderr.splitlines() if "parallel layout:" in line]
    assert layout == [
        "[stage2] parallel layout: 2 ranks = dp 2 x cp 1, student DDP (a full copy per rank), precision fp32 "
        "(--precision auto), teacher replicated on every rank"
    ], result.stderr[-3000:]

    one, two = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert one.keys() == two.keys() and len(one) > 5
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in one.values())
    losses = lambda run: [m["loss"] for m in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in m]  # noqa: E731
    assert len(losses("one")) == len(losses("two")) == 3
    first_one, first_two = losses("one")[0], losses("two")[0]
    assert first_two == pytest.approx(first_one, rel=1e-5)  # same weights, same batch: only summation order differs
    # Later steps: Adam's first updates ~ lr * sign(g) amplify rounding differences in tiny gradient entries.
    assert losses("two") == pytest.approx(losses("one"), rel=1e-3)


def test_an_explicit_gpu_under_a_multi_process_torchrun_node_is_refused(monkeypatch):
    from kforcing_kernels.app.training.parallel import resolve_device

    # Outside torchrun, or one process per node, cuda:N is the user's choice (no CUDA needed to resolve it).
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    # Two processes on this node: both would take cuda:1.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        ValueError, match=r"device: 'cuda:1' puts all 2 torchrun processes of this node on one GPU; pass 'cuda'"
    ):
        resolve_device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")

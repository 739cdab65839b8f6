"""The pipeline under torchrun (2 ranks, gloo on CPU) against single-process pipelines of the same settings.

Two launches (each costs seconds of start-up):

1. python_tests/workers/pipeline_worker.py: native ``--parallel ddp``, native ``fsdp`` and a Hugging Face Llama from
   ``--model-config`` with ``ddp``; a pipeline into a folder whose lock this test holds and one with a missing
   ``--model-config`` (each rank records its error); last, a ``ddp`` pipeline whose rank 0 is killed (SIGKILL) right
   after stage1's first checkpoint, which ends the launch.
2. The command line, ``torchrun -m kforcing_kernels.app.train pipeline --resume`` into the killed run.

Oracles: every stage's model.json; two ranks == one process within test_train_ddp.py's / test_train_fsdp.py's
tolerances (losses rel 1e-3: the gradients differ only in reduction order, which Adam's first updates amplify);
the resumed run == the uninterrupted ``ddp`` run, bitwise (losses, summaries, weights); one error message on every rank.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from helpers.train_helpers import REPO, torchrun, write_json_package  # noqa: E402
from kforcing_kernels.app import train as train_cli  # noqa: E402
from kforcing_kernels.app.files import RunLock  # noqa: E402
from kforcing_kernels.app.training.checkpoint import read_json, read_metrics  # noqa: E402
from workers.pipeline_worker import CASES, pipeline_argv  # noqa: E402

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)

STAGES = ("stage0", "stage1", "stage2_k2")
LOSS_TOL = dict(rel=1e-3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The folder of every run, the killed run's files before the resume and the resume launch's result."""
    root = tmp_path_factory.mktemp("pipeline_torchrun")
    write_json_package(root / "corpus")
    (root / "llama.json").write_text(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ).to_json_string()
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KFORCING_CACHE", str(root / "cache"))
        for model in ("native", "hf"):  # the single-process references
            train_cli.main(pipeline_argv(root, f"one_{model}", model, "ddp"))
        with RunLock(root / "locked"):  # another run holds this folder while the launch runs
            first = torchrun(
                2, REPO / "python_tests" / "workers" / "pipeline_worker.py", root, timeout=240, check=False
            )
        assert (root / "killed" / "stage1" / "checkpoints").is_dir(), first.stdout[-3000:] + first.stderr[-5000:]
        assert first.returncode != 0  # rank 0 was killed
        killed = {stage: sorted(p.name for p in (root / "killed" / stage).glob("*")) for stage in STAGES}
        resumed = torchrun(
            2,
            "-m",
            "kforcing_kernels.app.train",
            *pipeline_argv(root, "killed", "native", "ddp", "--resume"),
            timeout=240,
            check=False,
        )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    return root, killed, resumed


def losses(run: Path) -> list:
    return [m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m]


def summary(run: Path) -> dict:
    return read_json(run / "model.json")["summary"]


def weights(run: Path) -> dict:
    return {
        f"{path.name}/{name}": t
        for path in sorted(run.glob("*.safetensors"))
        for name, t in load_file(str(path)).items()
    }


def test_every_stage_finishes(runs):
    root, _, _ = runs
    for case in (*CASES, "killed", "one_native", "one_hf"):
        for stage in STAGES:
            assert (root / case / stage / "model.json").is_file(), (case, stage)
            assert len(losses(root / case / stage)) == read_json(root / case / stage / "train_config.json")["steps"]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(runs, case):
    root, _, _ = runs
    model, parallel = CASES[case]
    for stage in STAGES:
        two, one = root / case / stage, root / f"one_{model}" / stage
        assert read_json(two / "train_config.json")["parallel"] == parallel
        assert losses(two) == pytest.approx(losses(one), **LOSS_TOL), stage
        assert summary(two)["val_loss"] == pytest.approx(summary(one)["val_loss"], **LOSS_TOL), stage
        assert weights(two).keys() == weights(one).keys() and weights(two)


def test_resume_after_a_kill_equals_the_uninterrupted_run(runs):
    root, killed, resumed = runs
    # Killed in the middle of stage1: stage0 finished, stage1 has its step-2 checkpoint and no model, stage2 not
    # started.
    assert (
        "model.json" in killed["stage0"] and "model.json" not in killed["stage1"] and "checkpoints" in killed["stage1"]
    )
    assert killed["stage2_k2"] == []
    for stage in STAGES:
        again, ddp = root / "killed" / stage, root / "ddp" / stage
        assert losses(again) == losses(ddp), stage
        assert summary(again)["val_loss"] == summary(ddp)["val_loss"], stage
        a, b = weights(again), weights(ddp)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage
    # One line per decision (rank 0 prints), the JSON summary once.
    assert resumed.stderr.count("stage0 is done; skipping") == 1
    assert resumed.stderr.count("resumed from") == 1, resumed.stderr[-3000:]
    assert set(json.loads(resumed.stdout[resumed.stdout.index("{") :])) == set(STAGES)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("locked", ["CheckpointError: out:", "is in use by another run", "--out"]),
        ("bad_config", ["model_config", "--model-config", "missing.json"]),
    ],
)
def test_every_rank_fails_with_the_same_message(runs, name, expected):
    root, _, _ = runs
    messages = [(root / f"{name}.rank{rank}.txt").read_text() for rank in (0, 1)]
    assert messages[0] == messages[1]
    assert all(part in messages[0] for part in expected), messages[0]
    assert not (root / name / "stage0").exists()

"""bench/training/train_memory.py counts what a rank holds: checked against the model's own sizes in one process."""

import json
import types

import pytest
import torch
import torch.distributed as dist

from bench.training._train_models import HF_LLAMA
from bench.training.train_memory import format_report, measure
from kforcing_kernels.app.training.parallel import setup_parallel
from kforcing_kernels.model import ModelConfig

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


def _spec(preset="micro", hf_llama=None, model_config=None):
    return types.SimpleNamespace(preset=preset, hf_llama=hf_llama, model_config=model_config)


def _one_rank(spec, runs, seq_len=16):
    dims = setup_parallel("cpu", parallel="fsdp")  # a one-rank process group
    try:
        return [measure(spec, seq_len, 2, 2, ac, torch.device("cpu"), teacher) for ac, teacher in runs]
    finally:
        dims.close()


@needs_gloo
def test_one_rank_counts_match_the_model():
    rows = _one_rank(_spec(), [(False, "replicate"), (True, "replicate")])
    n_params = sum(p.numel() for p in torch.nn.Module.parameters(_micro()))
    for row in rows:
        assert row["parameters"] == n_params
        # one rank: nothing sharded
        assert row["param_bytes"] == row["grad_bytes"] == row["teacher_bytes"] == 4 * n_params
        n_tensors = len(list(_micro().parameters()))
        assert row["optimizer_bytes"] == 2 * 4 * n_params + 4 * n_tensors  # exp_avg, exp_avg_sq, one fp32 step each
        assert row["all_gather_forward_bytes"] == row["reduce_scatter_bytes"] == row["teacher_all_gather_bytes"] == 0
    plain, checkpointed = rows
    assert plain["loss"] == checkpointed["loss"]
    # Without checkpointing the 2 blocks save at least their inputs and attention outputs: more than with it.
    hidden = 2 * 16 * 3 * 16 * 4  # batch x N(1+k) tokens x width x 4 bytes
    assert plain["activation_bytes"] > checkpointed["activation_bytes"] + 2 * 2 * hidden
    assert "| 1 | replicate | on |" in format_report(rows)


@needs_gloo
def test_one_rank_hf_llama_counts_match_the_model(tmp_path):
    """A tiny Hugging Face Llama from a config file (as --model-config), built by transformers here as the oracle."""
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(HF_LLAMA["tiny"]))
    rows = _one_rank(
        _spec(model_config=str(config)), [(False, "replicate"), (True, "replicate"), (False, "fsdp")], seq_len=8
    )
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**HF_LLAMA["tiny"]))
    n_hf = sum(p.numel() for p in hf.parameters())  # the tied head counted once
    n_tensors_hf = len(list(hf.parameters()))
    # embedding (tied head) + 2 layers x (q, o 32 x 32; k, v 32 x 16: 2 KV heads of 4; MLP 3 x 32 x 64; 2 norms) + norm
    assert n_hf == 48 * 32 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32 == 20128
    hidden = 32
    noise = [p for p in _noise_embedding(hidden).parameters()]
    n_params, n_tensors = n_hf + sum(p.numel() for p in noise), n_tensors_hf + len(noise)
    for row in rows:
        assert row["parameters"] == row["teacher_parameters"] == n_params
        # one rank: nothing sharded
        assert row["param_bytes"] == row["grad_bytes"] == row["teacher_bytes"] == 4 * n_params
        assert row["optimizer_bytes"] == 2 * 4 * n_params + 4 * n_tensors
        assert row["all_gather_forward_bytes"] == row["reduce_scatter_bytes"] == row["teacher_all_gather_bytes"] == 0
        assert row["activation_bytes"] > 0 and row["peak_rss_bytes"] >= row["rss_bytes"] > 0
    plain, checkpointed, sharded_teacher = rows
    assert plain["loss"] == checkpointed["loss"] == sharded_teacher["loss"]  # the same pair and batch each time
    assert plain["activation_bytes"] > checkpointed["activation_bytes"]
    assert "| 1 | fsdp | off |" in format_report(rows)


def _noise_embedding(hidden):
    from kforcing_kernels.integrations.hf_noise import NoiseEmbedding

    return NoiseEmbedding(hidden)


def _micro():
    from kforcing_kernels.model import KForcingLM

    return KForcingLM(ModelConfig.micro(seq_len=16))


@needs_gloo
def test_two_ranks_shard_the_student_and_the_teacher():
    """torchrun, 2 ranks, a tiny HF Llama (every sharded dim even: no padding): the student's state and a sharded
    teacher are halves of the unsharded bytes, and the sharded teacher gathers all of its parameters in each of its
    two passes, its root included (place_teacher must free the root after a pass: a frozen teacher has no backward)."""
    pytest.importorskip("transformers")
    from bench.training.train_memory import run

    args = types.SimpleNamespace(
        preset="micro",
        hf_llama="tiny",
        model_config=None,
        worlds=[2],
        seq_len=8,
        k=2,
        batch_per_rank=1,
        teacher_parallel=["replicate", "fsdp"],
        ac=["off"],
        threads=1,
    )
    rows = run(args)
    assert [(r["teacher_parallel"], r["rank"]) for r in rows] == [
        ("replicate", 0),
        ("replicate", 1),
        ("fsdp", 0),
        ("fsdp", 1),
    ]
    n = rows[0]["parameters"]
    for row in rows:
        assert row["param_bytes"] == row["grad_bytes"] == 4 * n // 2
        replicated = row["teacher_parallel"] == "replicate"
        assert row["teacher_bytes"] == (4 * n if replicated else 4 * n // 2)
        assert row["teacher_all_gather_bytes"] == (0 if replicated else 2 * 4 * n)  # SingleForward + DoubleForward
        assert row["all_gather_forward_bytes"] == row["reduce_scatter_bytes"] == 4 * n  # the student: all of it, once
    assert len({r["loss"] for r in rows if r["rank"] == 0}) == 1  # the teacher's placement changes no number

"""bench/train_memory.py counts what a rank holds: checked against the model's own sizes in one process."""

import pytest
import torch
import torch.distributed as dist

from bench.train_memory import format_report, measure
from kforcing_kernels.app.training.parallel import setup_parallel
from kforcing_kernels.model import ModelConfig


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")
def test_one_rank_counts_match_the_model():
    dims = setup_parallel("cpu", parallel="fsdp")  # a one-rank process group
    try:
        rows = [measure("micro", 16, 2, 2, ac, torch.device("cpu")) for ac in (False, True)]
    finally:
        dims.close()
    n_params = sum(p.numel() for p in torch.nn.Module.parameters(_micro()))
    for row in rows:
        assert row["parameters"] == n_params
        assert row["param_bytes"] == row["grad_bytes"] == row["teacher_bytes"] == 4 * n_params  # one rank: nothing sharded
        n_tensors = len(list(_micro().parameters()))
        assert row["optimizer_bytes"] == 2 * 4 * n_params + 4 * n_tensors  # exp_avg, exp_avg_sq, one fp32 step each
        assert row["all_gather_forward_bytes"] == row["reduce_scatter_bytes"] == 0  # one rank: nothing to exchange
    plain, checkpointed = rows
    assert plain["loss"] == checkpointed["loss"]
    # Without checkpointing the 2 blocks save at least their inputs and attention outputs: more than with it.
    hidden = 2 * 16 * 3 * 16 * 4  # batch x N(1+k) tokens x width x 4 bytes
    assert plain["activation_bytes"] > checkpointed["activation_bytes"] + 2 * 2 * hidden
    assert "| 1 | on |" in format_report(rows)


def _micro():
    from kforcing_kernels.model import KForcingLM

    return KForcingLM(ModelConfig.micro(seq_len=16))

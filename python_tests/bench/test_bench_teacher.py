"""bench/training/teacher_parallel.py: both teacher placements run the same step (same loss), counted in one process."""

import types

import pytest
import torch
import torch.distributed as dist

from bench.training.teacher_parallel import format_report, measure
from kforcing_kernels.app.training.parallel import setup_parallel


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)
def test_one_rank_replicated_and_sharded_teachers_agree():
    pytest.importorskip("transformers")
    args = types.SimpleNamespace(
        preset="micro", hf_llama="tiny", model_config=None, seq_len=8, k=2, batch_per_rank=1, reps=2, warmup=1
    )
    dims = setup_parallel("cpu", parallel="fsdp")  # a one-rank process group
    try:
        report = measure(args, torch.device("cpu"))
    finally:
        dims.close()
    replicate, fsdp = report["rows"]
    assert (replicate["teacher_parallel"], fsdp["teacher_parallel"]) == ("replicate", "fsdp")
    n = report["teacher_parameters"]
    assert n == 24704  # the tiny Llama (20,128) + its noise embedding (4,576)
    # one rank: the sharded teacher holds all of itself and gathers nothing; both took 1 + 2 identical steps
    assert replicate["teacher_bytes"] == fsdp["teacher_bytes"] == 4 * n
    assert replicate["teacher_all_gather_bytes"] == fsdp["teacher_all_gather_bytes"] == 0
    assert replicate["loss"] == fsdp["loss"]
    for row in (replicate, fsdp):
        for timing in (row["step"], row["teacher"]):
            assert timing["reps"] == len(timing["times_ms"]) == 2
            assert timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]
    table = format_report(report)
    assert "| replicate |" in table and "| fsdp |" in table and "24,704 parameters" in table

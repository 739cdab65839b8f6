"""The training-step and inference benchmarks on the micro model: complete rows, like-for-like
comparisons (same loss for dense and ours), files written. Timings are never asserted."""

import json

import pytest

pytest.importorskip(
    "kforcing_kernels.model", reason="the reference model (kforcing_kernels.model) is not in this checkout"
)

from bench.__main__ import parse_command, run_command
from bench.inference import serving as inference

TINY = ["--preset", "micro", "--threads", "1", "--warmup", "0", "--reps", "1"]


@pytest.fixture(autouse=True)
def _keep_thread_count():
    # The benches pin torch's thread count; give the rest of the suite its own back.
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_train_step_bench_compares_the_same_step(tmp_path, capsys):
    report = run_command("train", TINY + ["--k", "1,2", "--seq-len", "16", "--batch-size", "2", "--out", str(tmp_path)])
    rows = report["rows"]
    assert [(r["teacher_k"], r["variant"]) for r in rows] == [(1, "dense"), (1, "ours"), (2, "dense"), (2, "ours")]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows)
    assert {r["backend"] for r in rows if r["variant"] == "dense"} == {"reference"}
    assert all(r["backend"] != "reference" for r in rows if r["variant"] == "ours")
    for k in (1, 2):
        dense, ours = (next(r for r in rows if r["teacher_k"] == k and r["variant"] == v) for v in ("dense", "ours"))
        assert ours["loss"] == pytest.approx(dense["loss"], rel=1e-4)  # dense mask vs ours: one computation
        paired = sorted(d / o for d, o in zip(dense["times_ms"], ours["times_ms"]))  # round by round
        assert ours["speedup_vs_dense"] == pytest.approx(paired[len(paired) // 2])
    assert set(report["exponent_vs_k"]) == {"dense", "ours"}
    with open(tmp_path / "train_step.json") as f:
        assert json.load(f)["meta"]["git_commit"] == report["meta"]["git_commit"]
    assert (tmp_path / "train_step.csv").read_text().count("\n") == 1 + len(rows)
    assert "1->2" in capsys.readouterr().out


def test_inference_bench_rows(tmp_path, capsys):
    report = run_command(
        "infer",
        TINY + ["--k", "1,2", "--batch-sizes", "2,3", "--prompt-len", "5", "--new-tokens", "4", "--out", str(tmp_path)],
    )
    rows = report["rows"]
    expected = [
        (b, m, k, c)
        for b in (2, 3)
        for c in ("contiguous", "paged")
        for m, k in (("ar", None), ("kforcing", 1), ("kforcing", 2))
    ]
    assert sorted((r["batch"], r["method"], r["k"] or 0, r["cache"]) for r in rows) == sorted(
        (b, m, k or 0, c) for b, m, k, c in expected
    )
    assert [r["forward_passes"] for r in rows[:3]] == [4, 4, 2]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["speedup_vs_ar"] == pytest.approx(1.0) for r in rows if r["method"] == "ar")
    assert all((r["paged_speedup"] is None) == (r["cache"] == "contiguous") for r in rows)
    # Both caches are read in place by the static decode step (issue 50): the same K/V bytes per step.
    for r in rows:
        if r["cache"] == "paged":
            twin = next(
                o
                for o in rows
                if (o["batch"], o["method"], o["k"], o["cache"]) == (r["batch"], r["method"], r["k"], "contiguous")
            )
            assert r["kv_bytes_per_step"] == twin["kv_bytes_per_step"]
    assert (tmp_path / "inference.json").exists() and (tmp_path / "inference.csv").exists()
    assert "K-Forcing k=2" in capsys.readouterr().out


def test_inference_bench_runs_the_model_in_bfloat16(tmp_path):
    """--dtype sets the weights and so the KV caches (the paper's serving table runs bf16)."""
    report = run_command(
        "infer",
        TINY
        + [
            "--k",
            "2",
            "--batch-sizes",
            "2",
            "--prompt-len",
            "5",
            "--new-tokens",
            "4",
            "--dtype",
            "bfloat16",
            "--out",
            str(tmp_path),
            "--no-progress",
        ],
    )
    assert report["meta"]["dtype"] == "bfloat16"
    assert len(report["rows"]) == 4 and all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in report["rows"])
    # 2 bytes per element: the cache holds half the bytes of the same shapes in float32.
    from kforcing_kernels.model import PRESETS

    cfg = PRESETS["micro"](seq_len=9)
    for r in report["rows"]:
        fp32 = inference.kv_traffic(cfg, 2, 5, 4, r["k"], r["cache"], report["meta"]["paged_backend"], 4)
        assert 2 * r["cache_bytes"] == fp32["cache_bytes"], r


def test_gpu_check_serving_step_follows_the_papers_protocol(tmp_path):
    """`bench gpu-check`'s serving steps (bench/gpu/check_steps.py) pass `bench infer` arguments it accepts, and
    together they are K-Forcing's Table 1 protocol (issue 50): paper backbone, bf16, 64-token prompts to 1,024
    tokens, batch 4 / 16 / 128, 3 timed runs after a warm-up, the step captured in a CUDA graph. The decisive
    comparison first (issue 53): `serving` runs AR and k = 4 on the paged cache; `serving_more` then k = 2 and the
    HF baseline row."""
    from unittest import mock

    import torch

    from bench.gpu import check

    def parsed(name):
        step = next(s for s in check.STEPS if s.name == name)
        argv = check.expand(step.argv, str(tmp_path))
        assert argv[:4] == ["-m", "bench", "infer", "--paper"]
        with (
            mock.patch.object(torch.cuda, "is_available", lambda: True),
            mock.patch.object(torch.cuda, "device_count", lambda: 1),
        ):  # parsing checks the device exists
            return parse_command("infer", argv[3:])

    first, more = parsed("serving"), parsed("serving_more")
    for args in (first, more):
        assert (args.preset, args.dtype, args.batch_sizes) == ("paper", "bfloat16", [4, 16, 128])
        assert [p + args.new_tokens for p in args.prompt_len] == [1024] and args.prompt_len == [64]
        assert (args.warmup, args.reps) == (1, 3) and args.cache == ["paged"]
        assert (args.compile, args.device) == ("cudagraph", "cuda")
        assert args.out.startswith(str(tmp_path))
    assert (first.k, first.hf) == ([4], None)
    assert (more.k, more.hf) == ([2], "eager")

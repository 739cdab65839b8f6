"""bench/training/train_gpu.py (``python -m bench train-gpu``): the training step's GPU bench, run on CPU here.

Its rows (one per variant, then a summary per shape) are written as they finish, a failing variant (out of memory
included) is an error row and the run goes on, the ratios come from the rows' medians, and ``ours`` in a dry run
resolves as the dispatcher would on CUDA. The dry run against CUDA's dtype rules: test_gpu_check.py (the planted
fp32 step).
"""

import argparse
import json

import pytest
import torch

from bench.training import train_gpu


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--preset", "micro", "--batch-size", "2", "--out", str(out), *extra]
    p = argparse.ArgumentParser()
    train_gpu.add_arguments(p)
    args = train_gpu.finish_args(p, p.parse_args(argv), argv, "bench train-gpu")
    rc = train_gpu.execute(args)
    lines = [json.loads(line) for line in (out / "train_gpu.jsonl").read_text().splitlines()]
    return rc, lines, json.loads((out / "train_gpu.json").read_text())


def test_every_variant_gives_a_row_written_as_it_finishes_and_a_failing_one_does_not_end_the_run(tmp_path):
    rc, lines, report = _run(
        tmp_path,
        "--shapes",
        "16:1",
        "8:2",
        "--variants",
        "ours",
        "ours[triton]",
        "zero",
        "dense",
        "--dtype",
        "float32",
        "--reps",
        "2",
    )
    assert rc == 0  # a GPU run reports its errors in rows; only the dry run fails on them
    assert lines == report["rows"] and len(lines) == 2 * (4 + 1)
    assert [r.get("variant", r["kind"]) for r in lines[:5]] == ["ours", "ours[triton]", "zero", "dense", "summary"]
    rows = {r["variant"]: r for r in lines[:4]}
    # The triton backend cannot run on this CPU (no GPU, no interpreter): its error is the row, the run went on.
    assert rows["ours[triton]"]["status"] == "error" and "triton" in rows["ours[triton]"]["reason"]
    assert not rows["ours[triton]"]["oom"]
    for label in ("ours", "zero", "dense"):
        assert rows[label]["status"] == "ok" and 1 <= len(rows[label]["times_ms"]) <= 2
    # Same weights and batch: ours and the dense mask compute the same loss; zero attention does not.
    assert rows["ours"]["loss"] == pytest.approx(rows["dense"]["loss"], abs=1e-4)
    assert rows["zero"]["loss"] != pytest.approx(rows["ours"]["loss"], abs=1e-4)
    assert sum(rows["ours"]["dispatched"].values()) > 0 and not rows["zero"]["dispatched"]
    summary = lines[4]
    assert summary["ours_speedup_vs_dense"] == pytest.approx(rows["dense"]["median_ms"] / rows["ours"]["median_ms"])
    assert summary["ours_vs_zero"] == pytest.approx(rows["ours"]["median_ms"] / rows["zero"]["median_ms"])
    assert not any(key.startswith("ours[triton]") for key in summary)
    assert (lines[5]["n"], lines[5]["teacher_k"], lines[5]["student_k"]) == (8, 2, 4)
    assert report["meta"]["autocast"] is False and report["meta"]["shapes"] == [[16, 1], [8, 2]]


def test_out_of_memory_is_an_error_row(tmp_path, monkeypatch):
    from kforcing_kernels.app.training import objectives

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.54 GiB")

    monkeypatch.setattr(objectives, "compute_loss", out_of_memory)
    rc, lines, _ = _run(tmp_path, "--shapes", "16:1", "--variants", "zero", "dense")
    assert rc == 0
    assert [(r["variant"], r["status"], r["oom"]) for r in lines[:2]] == [
        ("zero", "error", True),
        ("dense", "error", True),
    ]
    assert "24.54 GiB" in lines[0]["reason"] and lines[2] == {
        "kind": "summary",
        "n": 16,
        "teacher_k": 1,
        "student_k": 2,
    }


def test_dense_above_its_limit_is_a_skipped_row(tmp_path):
    _, lines, _ = _run(tmp_path, "--shapes", "16:1", "--variants", "dense", "--dense-max-n", "8")
    assert lines[0]["status"] == "skipped" and "--dense-max-n 8" in lines[0]["reason"]


def test_the_dry_run_resolves_ours_as_the_cuda_dispatcher_would(tmp_path, monkeypatch):
    from kforcing_kernels import WindowLayout
    from kforcing_kernels.ops.window_attention import dispatch

    table = dispatch.empty_table()
    row = {
        "capability": "9.0",
        "dtype": "bfloat16",
        "head_dim": 64,
        "length_bucket": 1024,
        "family": "single",
        "backend": "flex",
        "fwd_bwd_ms": {"triton": 2.0, "flex_backend": 1.0},
        "provenance": {"gpu": "test", "torch": "-", "triton": "-", "date": "-", "command": "-"},
    }
    path = tmp_path / "table.json"
    path.write_text(json.dumps(dispatch.merge(table, [row])))
    monkeypatch.setenv("KFORCING_DISPATCH_TABLE", str(path))
    layout = WindowLayout.kforcing_single(512, 4)
    assert train_gpu.cuda_default_backend(torch.bfloat16, 64, layout, "9.0") == "flex"
    assert train_gpu.cuda_default_backend(torch.bfloat16, 128, layout, "9.0") != "flex"  # no row: the registry's
    assert train_gpu.cuda_default_backend(torch.bfloat16, 64, layout, "8.0") != "flex"  # another GPU's row


def test_arguments_are_checked_by_name():
    assert train_gpu.parse_shape("4096:4") == (4096, 4)
    for bad in ("4096", "a:4", "0:4", "4096:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="N:K"):
            train_gpu.parse_shape(bad)
    assert train_gpu.parse_variant("ours[flex]") == "ours[flex]" and train_gpu.variant_backend("ours[flex]") == "flex"
    assert train_gpu.variant_backend("ours") is None
    with pytest.raises(argparse.ArgumentTypeError, match="NAME must be a backend"):
        train_gpu.parse_variant("ours[nope]")
    with pytest.raises(argparse.ArgumentTypeError, match="expected ours, zero, dense"):
        train_gpu.parse_variant("sparse")

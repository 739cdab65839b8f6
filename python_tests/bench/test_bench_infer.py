"""`bench infer` (issue 50): rows written as they finish, the paper's protocol as a profile, the HF baseline row,
the compile flag and the host-cost mode, on the micro model in seconds. Timings are never asserted."""

import json

import pytest

pytest.importorskip("kforcing_kernels.model", reason="the reference model is not in this checkout")

from bench import _cli  # noqa: E402
from bench.__main__ import parse_command, run_command  # noqa: E402
from bench.inference import serving as inference  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_thread_count():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


SMALL = [
    "--quick",
    "--threads",
    "1",
    "--no-progress",
    "--batch-sizes",
    "2",
    "--new-tokens",
    "4",
    "--warmup",
    "1",
    "--reps",
    "1",
]


def test_quick_run_writes_each_row_as_it_finishes(tmp_path, monkeypatch, capsys):
    written = []
    real = _cli.write_json

    def spy(report, path, **kw):
        written.append(len(report["rows"]))
        real(report, path, **kw)

    monkeypatch.setattr(inference, "write_json", spy)
    report = run_command("infer", SMALL + ["--hf", "eager", "--hf-reps", "1", "--out", str(tmp_path)])
    rows = report["rows"]
    methods = [(r["method"], r["k"], r["cache"]) for r in rows]
    assert methods == [
        ("ar", None, "contiguous"),
        ("kforcing", 2, "contiguous"),
        ("kforcing", 4, "contiguous"),
        ("ar", None, "paged"),
        ("kforcing", 2, "paged"),
        ("kforcing", 4, "paged"),
        ("hf_generate", None, "static"),
    ]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    assert written[: len(rows)] == list(range(1, len(rows) + 1))  # one write per finished row
    assert all(r["peak_bytes"] is None and r["compile_s"] >= 0 and r["reps"] == 1 for r in rows)  # CPU: no stats
    assert rows[-1]["speedup_vs_ar"] is not None and rows[4]["paged_speedup"] is not None
    with open(tmp_path / "inference.json") as f:
        assert len(json.load(f)["rows"]) == len(rows)
    assert "HF generate" in capsys.readouterr().out


def test_the_paper_profile_is_table_1(tmp_path):
    args = parse_command("infer", ["--paper", "--device", "cpu", "--out", str(tmp_path)])
    assert (args.preset, args.dtype, args.k) == ("paper", "bfloat16", [2, 4])
    assert (args.batch_sizes, args.prompt_len) == ([4, 16, 128], [64])
    assert args.prompt_len[0] + args.new_tokens == 1024 and (args.warmup, args.reps) == (1, 3)
    assert set(args.cache) == {"contiguous", "paged"}
    args = parse_command("infer", ["--paper", "--device", "cpu", "--dtype", "float32", "--reps", "5"])
    assert (args.dtype, args.reps) == ("float32", 5)  # the command line wins over the profile


def test_compile_flag(tmp_path, monkeypatch):
    from kforcing_kernels.app.generation import static_step

    with pytest.raises(SystemExit):
        parse_command("infer", ["--compile", "cudagraph", "--device", "cpu"])
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "aot_eager")  # inductor would take minutes here
    report = run_command(
        "infer", SMALL + ["--k", "2", "--cache", "paged", "--compile", "compile", "--out", str(tmp_path)]
    )
    assert report["meta"]["compile"] == "compile"
    assert [(r["status"], r["compile"]) for r in report["rows"]] == [("ok", "compile")] * 2


def test_host_cost_mode(tmp_path, capsys):
    report = run_command(
        "infer",
        [
            "--host-cost",
            "--threads",
            "1",
            "--new-tokens",
            "8",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--cache",
            "paged",
            "--no-progress",
            "--out",
            str(tmp_path),
        ],
    )
    rows = report["rows"]
    assert [(r["method"], r["k"], r["forward_passes"]) for r in rows] == [("ar", None, 8), ("kforcing", 4, 2)]
    assert all(r["host_ms_per_pass"] > 0 and r["python_calls_per_pass"] > 0 for r in rows)
    assert all(r["aten_ops_per_pass"] > 0 for r in rows)
    assert report["meta"]["model"]["n_layer"] == 12 and report["meta"]["model"]["n_embd"] == 16
    assert (tmp_path / "host_cost.json").exists() and "py calls" in capsys.readouterr().out

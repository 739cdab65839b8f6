"""bench/training/stage1_curve.py: trains the stages through the CLI, measures each student, and reuses what it finished."""

import json
import types

import pytest

from bench.training.stage1_curve import execute, format_table, measure_student


@pytest.mark.slow
def test_the_curve_trains_measures_and_resumes(tmp_path, capsys):
    args = types.SimpleNamespace(out=str(tmp_path), widths=[32], steps=[6], stage0_steps=6, taus=[0.5, 1.0], batches=1,
                                 new_tokens=4, threads=2)
    assert execute(args) == 0
    report = json.loads((tmp_path / "stage1_curve.json").read_text())
    (row,) = report["rows"]
    assert (row["width"], row["steps"], row["stage0_steps"]) == (32, 6, 6)
    stage0, stage1 = tmp_path / "w32" / "stage0_6", tmp_path / "w32" / "s1_6_from6"
    model = json.loads((stage1 / "model.json").read_text())
    assert model["k"] == 1 and model["model_config"]["n_embd"] == 32
    # The row is what the measurement gives on the saved folders (deterministic on the CPU).
    again = measure_student(stage0, stage1, [0.5, 1.0], 1, 4)
    assert again == {k: v for k, v in row.items() if k not in ("width", "steps", "stage0_steps")}
    assert row["nats_of_u_used"] < row["teacher_entropy"] and set(row["samples"]) == {"0.5", "1.0"}
    assert set(row["samples"]["0.5"]) == {"AR teacher", "student, argmax", "student, residual"}
    table = capsys.readouterr().out
    assert table.strip() == format_table(report["rows"]) and "| 32 (" in table
    # A second run reuses the finished stages and the measured row: nothing retrained, no row twice.
    weights = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.safetensors")}
    assert weights and execute(args) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.safetensors")} == weights
    assert len(json.loads((tmp_path / "stage1_curve.json").read_text())["rows"]) == 1

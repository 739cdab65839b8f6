"""bench/training/stage1_curve.py: trains the stages through the CLI, measures each student, and reuses what it
finished."""

import json
import types
from pathlib import Path

import pytest

from bench.training.stage1_curve import execute, format_table, measure_student


@pytest.mark.slow
def test_the_curve_trains_measures_and_resumes(tmp_path, capsys):
    args = types.SimpleNamespace(
        out=str(tmp_path), widths=[32], steps=[6], stage0_steps=6, taus=[0.5, 1.0], batches=1, new_tokens=4, threads=2
    )
    assert execute(args) == 0
    report = json.loads((tmp_path / "stage1_curve.json").read_text())
    (row,) = report["rows"]
    assert (row["width"], row["steps"], row["stage0_steps"]) == (32, 6, 6)
    stage0, stage1 = tmp_path / "w32" / "stage0_6", tmp_path / "w32" / "s1_6_from6"
    model = json.loads((stage1 / "model.json").read_text())
    assert model["k"] == 1 and model["model_config"]["n_embd"] == 32
    # The row is what the measurement gives on the saved folders (deterministic on the CPU).
    again = measure_student(stage0, stage1, [0.5, 1.0], 1, 4)
    assert again == {k: v for k, v in row.items() if k not in ("width", "steps", "stage0_steps", "settings")}
    assert row["nats_of_u_used"] < row["teacher_entropy"] and set(row["samples"]) == {"0.5", "1.0"}
    assert set(row["samples"]["0.5"]) == {"AR teacher", "student, argmax", "student, residual"}
    table = capsys.readouterr().out
    assert table.strip() == format_table(report["rows"]) and "| 32 (" in table
    # A second run reuses the finished stages and the measured row: nothing retrained, no row twice.
    weights = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.safetensors")}
    assert weights and execute(args) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.safetensors")} == weights
    assert len(json.loads((tmp_path / "stage1_curve.json").read_text())["rows"]) == 1


# ---------------------------------------------------------------------- what is reused (issue 46), without training


class _FakeRuns:
    """bench.stage1_curve's training and measuring replaced: ``_train`` writes a stage's files as the CLI would
    (model.json last, with its train_config and a fresh weights hash), ``measure_student`` returns the settings it was
    given."""

    def __init__(self, monkeypatch):
        import itertools

        from bench.training import stage1_curve

        self.trained, self.measured, counter = [], [], itertools.count()

        def train(argv, threads):
            opts = {a: b for a, b in zip(argv[1:], argv[2:]) if a.startswith("--")}
            out = Path(opts["--out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "model.safetensors").write_bytes(b"w")
            cfg = {"steps": int(opts["--steps"]), "lr": float(opts["--lr"])}
            if argv[0] == "stage0":
                cfg["model_overrides"] = {"n_embd": int(opts["--n-embd"])}
            else:
                cfg["batch_size"] = int(opts["--batch-size"])
            teacher = json.loads((Path(opts["--teacher"]) / "model.json").read_text()) if "--teacher" in opts else None
            info = {
                "train_config": cfg,
                "tensors": {"sha256": f"sha{next(counter)}"},
                "teacher_sha256": teacher and teacher["tensors"]["sha256"],
            }
            (out / "model.json").write_text(json.dumps(info))
            self.trained.append((argv[0], out.name))

        def measure(stage0, stage1, taus, batches, new_tokens):
            self.measured.append(stage1.name)
            return {
                "parameters": 1,
                "val_loss": 1.0,
                "teacher_entropy": 2.0,
                "nats_of_u_used": 1.0,
                "noise_sensitivity": 0.1,
                "teacher_noise_sensitivity": 0.2,
                "accuracy_narrow_intervals": [0.5, None],
                "samples": {
                    str(t): {
                        name: {"ppl": 2.0, "distinct4": 0.5}
                        for name in ("AR teacher", "student, argmax", "student, residual")
                    }
                    for t in taus
                },
            }

        monkeypatch.setattr(stage1_curve, "_train", train)
        monkeypatch.setattr(stage1_curve, "measure_student", measure)

    def take(self):
        got = (self.trained, self.measured)
        self.trained, self.measured = [], []
        return got


def _args(tmp_path, **changes):
    base = dict(
        out=str(tmp_path),
        widths=[32],
        steps=[6],
        stage0_steps=6,
        taus=[0.5, 1.0],
        batches=1,
        new_tokens=4,
        threads=None,
    )
    return types.SimpleNamespace(**{**base, **changes})


def test_a_reused_row_matches_every_setting_that_changes_it(tmp_path, monkeypatch, capsys):
    runs = _FakeRuns(monkeypatch)
    assert execute(_args(tmp_path)) == 0
    assert runs.take() == ([("stage0", "stage0_6"), ("stage1", "s1_6_from6")], ["s1_6_from6"])
    assert execute(_args(tmp_path)) == 0
    assert runs.take() == ([], [])  # the same command: everything reused
    capsys.readouterr()
    # Each setting that changes the measurement measures again (the stages stay), and the row is replaced, not added.
    for change in (dict(taus=[0.8]), dict(batches=2), dict(new_tokens=8), dict(taus=[0.5, 1.0])):
        assert execute(_args(tmp_path, **change)) == 0, change
        assert runs.take() == ([], ["s1_6_from6"]), change
        report = json.loads((tmp_path / "stage1_curve.json").read_text())
        assert len(report["rows"]) == 1 and report["rows"][0]["settings"]["taus"] == [
            float(t) for t in change.get("taus", [0.5, 1.0])
        ]
    table = capsys.readouterr().out
    assert "tau 0.8" in table  # printed from the rows of each command, without a KeyError on mixed taus


def test_rows_of_other_points_with_other_taus_do_not_break_the_table(tmp_path, monkeypatch, capsys):
    _FakeRuns(monkeypatch)
    assert execute(_args(tmp_path, widths=[32], taus=[0.5])) == 0
    assert execute(_args(tmp_path, widths=[16], taus=[0.8])) == 0  # the report now holds two points measured otherwise
    out = capsys.readouterr().out.strip().splitlines()
    assert "| 16 (" in out[-1] and not any("| 32 (" in line for line in out[-3:])
    rows = json.loads((tmp_path / "stage1_curve.json").read_text())["rows"]
    assert format_table(rows).count("| - | - | -") == 2  # each row lacks the other's temperature: dashes


def test_an_interrupted_or_outdated_stage_is_trained_again(tmp_path, monkeypatch):
    runs = _FakeRuns(monkeypatch)
    assert execute(_args(tmp_path)) == 0
    runs.take()
    stage0, stage1 = tmp_path / "w32" / "stage0_6", tmp_path / "w32" / "s1_6_from6"
    # An interrupted Stage 1: only a checkpoint (and the weights of a run before it) left, no model.json.
    (stage1 / "model.json").unlink()
    (stage1 / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "stage1_curve.json").unlink()
    assert execute(_args(tmp_path)) == 0
    assert runs.take() == ([("stage1", "s1_6_from6")], ["s1_6_from6"])
    # A Stage 0 interrupted and trained again: its student was distilled from the old weights, so it is trained again.
    (stage0 / "model.json").unlink()
    (tmp_path / "stage1_curve.json").unlink()
    assert execute(_args(tmp_path)) == 0
    assert runs.take() == ([("stage0", "stage0_6"), ("stage1", "s1_6_from6")], ["s1_6_from6"])
    # A stage folder trained with other settings (another width's run copied here) is not this point's stage.
    info = json.loads((stage0 / "model.json").read_text())
    info["train_config"]["model_overrides"] = {"n_embd": 64}
    (stage0 / "model.json").write_text(json.dumps(info))
    (tmp_path / "stage1_curve.json").unlink()
    assert execute(_args(tmp_path)) == 0
    assert runs.take()[0] == [("stage0", "stage0_6"), ("stage1", "s1_6_from6")]

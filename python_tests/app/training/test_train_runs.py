"""Trainer runs that must not lose or mix data (issue 12, items 9-14 and 16, and their siblings).

Each test drives the public entry points (``train``, ``main``, ``load_checkpoint``,
``load_model``) the way a user's interrupted, repeated or misconfigured run does.
"""

import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.train_helpers import VOCAB, micro_config, write_json_package
from kforcing_kernels.app.data import load_corpus
from kforcing_kernels.app.files import LOCK_NAME, atomic_write
from kforcing_kernels.app.train import main
from kforcing_kernels.app.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_model,
    read_metrics,
)
from kforcing_kernels.app.training.config import TrainConfig
from kforcing_kernels.app.training.loop import train
from kforcing_kernels.app.training.stage import _optimizer
from kforcing_kernels.model import KForcingLM, ModelConfig


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_json_package(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module", autouse=True)
def _cache(isolated_cache):
    yield


micro = functools.partial(micro_config, steps=4, warmup_steps=1)


def snapshot(folder: Path) -> dict:
    """Every file of ``folder`` but the run lock (an empty file a run attempt creates and keeps: checkpoint.RunLock)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def run_record(folder: Path) -> list[tuple]:
    """What a run computed, step by step (without the timings)."""
    keys = ("step", "loss", "loss_pos", "lr", "grad_norm", "val_loss", "val_loss_pos")
    return [tuple(m.get(k) for k in keys) for m in read_metrics(folder / "metrics.jsonl")]


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir):
    """An uninterrupted 4-step run: the reference every recovered run must equal."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(micro(out, corpus_dir))
    return out


# ---------------------------------------------------------------------- item 9: one run per folder


def test_rerun_into_a_finished_run_is_refused_and_leaves_it_untouched(tmp_path, corpus_dir, finished):
    out = tmp_path / "run"
    train(micro(out, corpus_dir))
    before = snapshot(out)
    with pytest.raises(ValueError, match="already holds a finished run.*--resume.*--overwrite"):
        train(micro(out, corpus_dir, lr=1e-3))
    assert snapshot(out) == before


def test_rerun_into_a_partial_run_without_checkpoints_is_refused(tmp_path, corpus_dir):
    # A run killed before its first checkpoint leaves its config and metrics behind.
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text(json.dumps({"note": "the first run"}))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    before = snapshot(out)
    with pytest.raises(ValueError, match="already holds a partial run"):
        train(micro(out, corpus_dir))
    assert snapshot(out) == before


def test_overwrite_replaces_the_old_run_and_equals_a_fresh_one(tmp_path, corpus_dir, finished):
    out = tmp_path / "run"
    train(micro(out, corpus_dir, steps=6, stop_at=3))  # a different, partial run
    (out / "notes.txt").write_text("mine")  # not files of the run: must survive, in checkpoints/ too
    (out / "checkpoints" / "my_notes.txt").write_text("mine too")
    train(micro(out, corpus_dir, overwrite=True))
    assert run_record(out) == run_record(finished)  # nothing of the replaced run is mixed in
    assert same_weights(out, finished)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "my_notes.txt",
        "step_00000004.json",
        "step_00000004.safetensors",
    ]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "checkpoints" / "my_notes.txt").read_text() == "mine too"
    with pytest.raises(ValueError, match="overwrite: .*pass one"):
        train(micro(out, corpus_dir, overwrite=True, resume=True))


# ---------------------------------------------------------------------- item 10: --resume needs a checkpoint


def test_resume_without_a_checkpoint_refuses_and_keeps_the_metrics(tmp_path, corpus_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text("{}")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 5.0}) + "\n")
    before = snapshot(out)
    with pytest.raises(ValueError, match="resume: no checkpoint to continue from.*stopped before its first checkpoint"):
        train(micro(out, corpus_dir, resume=True))
    assert snapshot(out) == before
    with pytest.raises(ValueError, match="resume: no checkpoint.*there is no run in"):
        train(micro(tmp_path / "empty", corpus_dir, resume=True))
    assert not (tmp_path / "empty").exists()  # the failed start left no folder behind


def test_resume_of_a_finished_run_with_other_settings_refuses(tmp_path, corpus_dir):
    """--resume on a finished run returns its summary only if the settings are the run's (else it would pass for this
    run)."""
    out = tmp_path / "run"
    summary = train(micro(out, corpus_dir))
    before = snapshot(out)
    assert train(micro(out, corpus_dir, resume=True)) == summary
    with pytest.raises(ValueError, match=r"steps: --resume needs the settings of the finished run .* it used 4, got 6"):
        train(micro(out, corpus_dir, resume=True, steps=6))
    assert snapshot(out) == before


def test_cli_resume_without_a_checkpoint_is_a_clear_error(tmp_path, corpus_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "stage0",
                "--out",
                str(tmp_path / "none"),
                "--data",
                str(corpus_dir),
                "--vocab-size",
                str(VOCAB),
                "--resume",
            ]
        )
    assert exc.value.code == 2
    assert "resume: no checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------- item 11: data too short, evaluation errors


@pytest.fixture(scope="module")
def short_val_file(tmp_path_factory):
    """One file: the validation split is its last 2%, here fewer tokens than one 96-token sequence."""
    path = tmp_path_factory.mktemp("one") / "text.py"
    path.write_text((Path(json.__file__).parent / "decoder.py").read_text()[:6000])
    corpus = load_corpus(str(path), vocab_size=VOCAB)
    assert corpus.val.numel() < 97 < corpus.train.numel()  # the premise of the test
    return path


def test_short_validation_split_is_refused_before_step_one(tmp_path, short_val_file):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="validation split of --data .* fewer than one sequence.*--seq-len"):
        train(micro(out, short_val_file, seq_len=96))
    # nothing trained, nothing written
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    train(micro(tmp_path / "fits", short_val_file, seq_len=16, steps=1))  # a sequence that fits trains


def test_a_start_that_fails_before_training_leaves_no_folder_behind(
    tmp_path, corpus_dir, short_val_file, finished, monkeypatch
):
    """Issue 38: an error after the run folder was made (locked) but before a step was trained leaves nothing, not a
    folder holding only the lock (or the config) that a rerun calls "a partial run" and refuses without --overwrite."""
    from kforcing_kernels.app.training import loop as trainer

    deep = tmp_path / "a" / "b" / "run"  # folders the start created on the way are removed too
    with pytest.raises(ValueError, match="data: the validation split"):  # check_splits, inside train()
        train(micro(deep, short_val_file, seq_len=96))
    assert not (tmp_path / "a").exists()
    bad_teacher = tmp_path / "stage2"
    with pytest.raises(ValueError, match="teacher: stage2 needs a PFLM teacher"):  # the model is built from the teacher
        train(micro(bad_teacher, corpus_dir, stage="stage2", teacher=str(finished)))
    assert not bad_teacher.exists()
    out = tmp_path / "run"

    def fail(*args, **kwargs):  # step 1 fails after train_config.json and tokenizer.json were written
        raise RuntimeError("boom")

    monkeypatch.setattr(trainer, "compute_loss", fail)
    with pytest.raises(RuntimeError, match="boom"):
        train(micro(out, corpus_dir))
    assert not out.exists()
    monkeypatch.undo()
    train(micro(out, corpus_dir))  # no --overwrite needed
    assert run_record(out) == run_record(finished)


def test_a_failed_start_leaves_a_folder_with_an_earlier_run_or_a_trained_step_untouched(
    tmp_path, corpus_dir, finished, monkeypatch
):
    from kforcing_kernels.app.training import loop as trainer

    partial = tmp_path / "partial"  # an earlier run with a checkpoint: a refused --resume removes nothing of it
    train(micro(partial, corpus_dir, stop_at=2))
    before = {p.name for p in partial.iterdir()}, snapshot(partial)
    with pytest.raises(ValueError, match="steps: --resume needs the settings"):
        train(micro(partial, corpus_dir, resume=True, steps=6))
    assert ({p.name for p in partial.iterdir()}, snapshot(partial)) == before
    mine = tmp_path / "mine"  # the user's folder: it stays with their file, the start's files go
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="teacher: stage2 needs a PFLM teacher"):
        train(micro(mine, corpus_dir, stage="stage2", teacher=str(finished)))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    real, calls = trainer.compute_loss, []

    def fail_at_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "compute_loss", fail_at_step_2)
    trained = tmp_path / "trained"  # step 1 was trained and logged: the partial run stays for the user to see
    with pytest.raises(RuntimeError, match="boom"):
        train(micro(trained, corpus_dir))
    assert {"train_config.json", "tokenizer.json", "metrics.jsonl"} <= {p.name for p in trained.iterdir()}
    assert run_record(trained) == run_record(finished)[:1]


def test_an_evaluation_error_loses_no_trained_steps(tmp_path, corpus_dir, finished, monkeypatch):
    import kforcing_kernels.app.training.loop as trainer

    def broken(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        mp.setattr(trainer, "evaluate_loss", broken)
        with pytest.raises(RuntimeError, match="evaluation failed"):
            train(micro(out, corpus_dir))
    assert latest_checkpoint(out).name == "step_00000004.json"  # all four steps are kept
    train(micro(out, corpus_dir, resume=True))  # runs only the final evaluation
    assert same_weights(out, finished)
    assert run_record(out) == run_record(finished)  # the same steps, and one final evaluation
    summary = json.loads((out / "model.json").read_text())["summary"]
    expected = json.loads((finished / "model.json").read_text())["summary"]
    assert [summary[k] for k in ("final_loss", "val_loss", "val_loss_pos")] == [
        expected[k] for k in ("final_loss", "val_loss", "val_loss_pos")
    ]


# ---------------------------------------------------------------------- item 12: torn metrics, full disks, leftovers


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path, corpus_dir, finished, capsys):
    out = tmp_path / "run"
    train(micro(out, corpus_dir, stop_at=2))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # the write a kill interrupted
    capsys.readouterr()
    train(micro(out, corpus_dir, resume=True))
    assert "dropped a torn last line" in capsys.readouterr().err
    assert run_record(out) == run_record(finished)
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())


def test_corrupt_metrics_line_in_the_middle_names_the_file(tmp_path, corpus_dir):
    out = tmp_path / "run"
    train(micro(out, corpus_dir, stop_at=2))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(["{not json"] + lines) + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl: line 1 is corrupt"):
        train(micro(out, corpus_dir, resume=True))


def _fail_replace(monkeypatch, pattern: str):
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).match(pattern):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("failing", ["step_00000004.json", "step_00000004.safetensors"])
def test_a_full_disk_leaves_no_orphans_and_resume_recovers(tmp_path, corpus_dir, finished, monkeypatch, failing):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        _fail_replace(mp, failing)
        with pytest.raises(CheckpointError, match=f"{failing}: cannot write .*free some space, then --resume"):
            train(micro(out, corpus_dir, ckpt_every=2))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_00000002.json", "step_00000002.safetensors"]  # the failed checkpoint left nothing behind
    assert not list(out.rglob("*.tmp"))
    train(micro(out, corpus_dir, ckpt_every=2, resume=True))
    assert same_weights(out, finished)


def test_resume_removes_leftover_temporaries_and_orphan_tensors(tmp_path, corpus_dir, capsys):
    out = tmp_path / "run"
    train(micro(out, corpus_dir, stop_at=2))
    # What a process killed inside a write leaves: temporaries, and tensors whose JSON never came.
    leftovers = [
        out / ".metrics.jsonl.0a1b2c3d.tmp",
        out / "checkpoints" / ".step_00000003.safetensors.deadbeef.tmp",
        out / "checkpoints" / "step_00000003.safetensors",
    ]
    for path in leftovers:
        path.write_bytes(b"partial")
    capsys.readouterr()
    train(micro(out, corpus_dir, resume=True, stop_at=3))
    assert "leftover" in capsys.readouterr().err
    assert not list(out.rglob("*.tmp"))
    assert load_file(str(out / "checkpoints" / "step_00000003.safetensors"))  # rewritten whole by the resumed run


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("old")

    def fail(p):
        Path(p).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="x.json: cannot write"):
        atomic_write(path, fail)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


# ---------------------------------------------------------------------- item 13: malformed checkpoint JSON


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(micro(out, corpus_dir, stop_at=2))
    return latest_checkpoint(out)


MALFORMED = {
    "unchanged (the control: loads)": lambda m: m,
    "a list": lambda m: [m],
    "step as text": lambda m: {**m, "step": "2"},
    "no param_groups": lambda m: {k: v for k, v in m.items() if k != "param_groups"},
    "tensors as a list": lambda m: {**m, "tensors": [m["tensors"]]},
    "tensors without sha256": lambda m: {
        **m,
        "tensors": {"file": m["tensors"]["file"], "bytes": m["tensors"]["bytes"]},
    },
    "tensors elsewhere": lambda m: {**m, "tensors": {**m["tensors"], "file": "../../x.safetensors"}},
    "param_groups wrong": lambda m: {**m, "param_groups": [{"lr": 1.0}]},
    "scaler as a number": lambda m: {**m, "scaler": 3},
    "model_config as text": lambda m: {**m, "model_config": "micro"},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_checkpoint_json_of_the_wrong_structure_names_the_file(tmp_path, checkpoint, case):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    json_path = folder / checkpoint.name
    (folder / checkpoint.with_suffix(".safetensors").name).write_bytes(
        checkpoint.with_suffix(".safetensors").read_bytes()
    )
    json_path.write_text(json.dumps(MALFORMED[case](json.loads(checkpoint.read_text()))))
    model = KForcingLM(ModelConfig.from_dict(json.loads(checkpoint.read_text())["model_config"]))
    model.noise_encoder.requires_grad_(False)  # as the stage-0 trainer: its optimizer has no noise-encoder parameters
    opt = _optimizer(model, TrainConfig(), fused_ok=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    if case.startswith("unchanged"):
        assert load_checkpoint(json_path, model, opt, scaler)["step"] == 2
        return
    with pytest.raises(CheckpointError, match=re.escape(str(json_path))):
        load_checkpoint(json_path, model, opt, scaler)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: {**m, "tensors": None},
        lambda m: {k: v for k, v in m.items() if k != "k"},
        lambda m: {**m, "model_config": {**m["model_config"], "n_embd": "wide"}},
        lambda m: {**m, "model_config": {**m["model_config"], "colour": 1}},
        lambda m: {**m, "model_config": {**m["model_config"], "n_embd": 2 * m["model_config"]["n_embd"]}},
    ],
)
def test_model_json_of_the_wrong_structure_names_the_file(tmp_path, finished, edit):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes((finished / name).read_bytes())
    (folder / "model.json").write_text(json.dumps(edit(json.loads((finished / "model.json").read_text()))))
    with pytest.raises(CheckpointError, match="model.json"):
        load_model(str(folder))


# ---------------------------------------------------------------------- item 14: the umask decides file modes


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_respect_the_umask(tmp_path, corpus_dir, umask, monkeypatch):
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))  # the tokenizer cache too
    old = os.umask(umask)
    try:
        train(micro(tmp_path / "run", corpus_dir, steps=2, ckpt_every=1))
        atomic_write(tmp_path / "single.txt", lambda p: Path(p).write_text("x"))
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 12
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


# ---------------------------------------------------------------------- item 16: data errors name --data


def _missing(d):
    return d / "missing"


def _no_text_files(d):
    return d


def _empty_file(d):
    (d / "empty.txt").write_text("")
    return d / "empty.txt"


def _blank_files(d):
    (d / "blank.md").write_text(" \n\n")
    return d


def _tiny_file(d):
    (d / "tiny.txt").write_text("hello world")
    return d / "tiny.txt"


@pytest.mark.parametrize(
    "make, message",
    [
        (_missing, "no such file or directory"),
        (_no_text_files, "no text files"),
        (_empty_file, "holds no text"),
        (_blank_files, "holds no text"),
        (_tiny_file, "too small to learn a 300-token vocabulary"),
    ],
)
def test_unusable_data_gives_a_clear_error_naming_data(tmp_path, capsys, make, message):
    data = tmp_path / "data"
    data.mkdir()
    (data / "binary.bin").write_bytes(b"\0\1")  # not a text file: ignored
    source = make(data)
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "stage0",
                "--out",
                str(tmp_path / "run"),
                "--data",
                str(source),
                "--vocab-size",
                str(VOCAB),
                "--steps",
                "1",
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--data" in err and message in err and "Traceback" not in err


def test_a_damaged_corpus_cache_is_rebuilt(tmp_path, corpus_dir, monkeypatch):
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    first = load_corpus(str(corpus_dir), vocab_size=VOCAB)
    (meta,) = (tmp_path / "cache").rglob("meta.json")
    meta.write_text('{"source": ')
    again = load_corpus(str(corpus_dir), vocab_size=VOCAB)
    assert torch.equal(first.train, again.train) and torch.equal(first.val, again.val)
    assert json.loads(meta.read_text())["vocab_size"] == VOCAB


def test_rerunning_the_cli_into_a_finished_run_is_refused(tmp_path, corpus_dir, finished, capsys):
    args = ["stage0", "--out", str(finished), "--data", str(corpus_dir), "--vocab-size", str(VOCAB), "--steps", "4"]
    before = snapshot(finished)
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert snapshot(finished) == before


def test_pipeline_resume_starts_stages_not_yet_begun_and_refuses_half_begun_ones(tmp_path, corpus_dir):
    from kforcing_kernels.app.training.pipeline import PipelineConfig, run_pipeline

    base = micro(tmp_path / "unused", corpus_dir, resume=True)
    pipe = PipelineConfig(out=str(tmp_path / "pipe"), k_final=1, steps_stage0=2, steps_stage1=2)
    (tmp_path / "pipe" / "stage1").mkdir(parents=True)  # an empty folder is no run
    summaries = run_pipeline(pipe, base)  # --resume with nothing begun: every stage starts
    assert sorted(summaries) == ["stage0", "stage1"] and (tmp_path / "pipe" / "stage1" / "model.json").exists()
    for name in ("model.json", "model.safetensors"):
        (tmp_path / "pipe" / "stage1" / name).unlink()
    shutil.rmtree(tmp_path / "pipe" / "stage1" / "checkpoints")  # killed before its first checkpoint
    with pytest.raises(ValueError, match="resume: no checkpoint.*stopped before its first checkpoint"):
        run_pipeline(pipe, base)


def test_corpus_cache_build_removes_stale_temporaries_only(tmp_path, corpus_dir, monkeypatch):
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    load_corpus(str(corpus_dir), vocab_size=VOCAB)
    (meta,) = (tmp_path / "cache").rglob("meta.json")
    stale, fresh = meta.parent / ".train.npy.0badf00d.tmp", meta.parent / ".val.npy.12345678.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    os.utime(stale, (1.0, 1.0))  # untouched for decades: a killed build's
    meta.unlink()  # the entry is incomplete: the next load rebuilds it
    load_corpus(str(corpus_dir), vocab_size=VOCAB)
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to a build running now


# ---------------------------------------------------------------------- issue #29 item 15: what replay hides


@pytest.mark.parametrize("accum", [2, 4])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, corpus_dir, accum):
    """grad_accum micro-batches average to the gradient of the whole batch (a sum would be accum times larger;
    Adam hides the scale in the weights, the dumped first-step gradients do not)."""
    runs = {}
    for a in (1, accum):
        dump = tmp_path / f"grads{a}.safetensors"
        summary = train(
            micro(tmp_path / f"accum{a}", corpus_dir, batch_size=4, grad_accum=a, steps=3, dump_grads=str(dump))
        )
        runs[a] = (
            load_file(str(dump)),
            read_metrics(tmp_path / f"accum{a}" / "metrics.jsonl"),
            summary,
            load_file(str(tmp_path / f"accum{a}" / "model.safetensors")),
        )
    (g1, m1, _, w1), (ga, ma, _, wa) = runs[1], runs[accum]
    assert g1.keys() == ga.keys() and g1
    for name in g1:
        torch.testing.assert_close(ga[name], g1[name], rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
    losses = lambda m: [r["loss"] for r in m if "loss" in r]  # noqa: E731
    assert len(losses(m1)) == len(losses(ma)) == 3
    torch.testing.assert_close(torch.tensor(losses(ma)), torch.tensor(losses(m1)), rtol=1e-4, atol=1e-6)
    for name in w1:
        torch.testing.assert_close(wa[name], w1[name], rtol=1e-3, atol=1e-5)


def test_resume_starts_from_the_newest_checkpoint_and_trains_only_the_rest(tmp_path, corpus_dir, monkeypatch, capsys):
    """Resuming from an older kept checkpoint replays the same steps to the same bits (deterministic), so the
    bitwise resume test cannot see it: assert which checkpoint it loads and how many steps it trains."""
    import dataclasses

    from kforcing_kernels.app.training import loop as trainer

    cfg = micro(tmp_path / "run", corpus_dir, steps=6, ckpt_every=2, keep_checkpoints=2, stop_at=5)
    train(cfg)
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*.json"))
    assert kept == ["step_00000004.json", "step_00000005.json"]
    assert latest_checkpoint(tmp_path / "run").name == "step_00000005.json"
    steps = []
    real = trainer.compute_loss

    def counting(*args, **kw):
        if torch.is_grad_enabled():
            steps.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(trainer, "compute_loss", counting)
    capsys.readouterr()
    train(dataclasses.replace(cfg, stop_at=None, resume=True))
    err = capsys.readouterr().err
    assert re.search(r"resumed from \S*step_00000005\.json at step 5", err), err[-2000:]
    assert len(steps) == 1  # step 6 only
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in m] == [1, 2, 3, 4, 5, 6]


def test_a_stage_writing_into_its_teachers_folder_is_refused_before_anything_is_removed(tmp_path, corpus_dir, finished):
    """--teacher X --out X (with --overwrite even more so) would replace the teacher: refused up front."""
    teacher = tmp_path / "teacher"
    shutil.copytree(finished, teacher)
    before = snapshot(teacher)
    for overwrite in (False, True):
        cfg = dataclasses.replace(micro(teacher, corpus_dir, overwrite=overwrite), stage="stage1", teacher=str(teacher))
        with pytest.raises(ValueError, match="^out: .* is the teacher's folder"):
            train(cfg)
        assert snapshot(teacher) == before


@pytest.mark.parametrize(
    "setting, value",
    [
        ("ckpt_every", 0),
        ("log_every", 0),
        ("grad_accum", 0),
        ("eval_batches", 0),
        ("steps", 0),
        ("steps", -3),
        ("batch_size", 0),
        ("keep_checkpoints", -1),
        ("keep_checkpoints", 0),
        ("seed", 1.5),
        ("device", "bogus"),
        ("model_overrides", {"n_layers": 2}),
        ("warmup_steps", -1),
        ("seq_len", True),
        # issue 40: real-valued settings (these trained and saved a NaN model, or ran with nonsense,
        # or a TypeError mid-run)
        ("lr", float("inf")),
        ("lr", "0.001"),
        ("lr", 0.0),
        ("grad_clip", float("nan")),
        ("grad_clip", 0),
        ("weight_decay", -3),
        ("min_lr_ratio", 5),
        ("tau_min", -1.0),
        ("tau_max", float("inf")),
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("lr", True),
    ],
)
def test_the_python_api_checks_settings_as_the_cli_does(tmp_path, corpus_dir, setting, value):
    """train(TrainConfig(...)) refuses what the CLI's argument types refuse, naming the setting, before
    touching --out (these once divided by zero mid-run, trained on empty batches or deleted checkpoints)."""
    cfg = dataclasses.replace(micro(tmp_path / "run", corpus_dir), **{setting: value})
    with pytest.raises(ValueError, match=f"^{setting}: "):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "setting, value",
    [
        ("lr", "inf"),
        ("lr", "0"),
        ("grad_clip", "nan"),
        ("grad_clip", "0"),
        ("weight_decay", "-3"),
        ("min_lr_ratio", "5"),
        ("tau_min", "-1"),
    ],
)
def test_the_cli_refuses_the_same_real_settings_with_the_same_words(tmp_path, corpus_dir, capsys, setting, value):
    """One check (train_config.FLOAT_SETTINGS) for both entry points: the CLI's refusal says what the API's says."""
    from kforcing_kernels.app.training.config import float_setting_error

    flag = "--" + setting.replace("_", "-")
    with pytest.raises(SystemExit) as exit_info:
        main(["stage0", "--out", str(tmp_path / "run"), "--data", str(corpus_dir), flag, value])
    assert exit_info.value.code == 2
    expected = float_setting_error(setting, float(value)).split(", got")[0]
    assert f"argument {flag}: {expected}" in capsys.readouterr().err
    cfg = dataclasses.replace(micro(tmp_path / "run", corpus_dir), **{setting: float(value)})
    with pytest.raises(ValueError, match=f"^{setting}: {re.escape(expected)}, got"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, corpus_dir, monkeypatch, capsys):
    """Step 3's loss is NaN: the run stops with an error naming the step before the optimizer uses it; the step-2
    checkpoint (equal to an uninterrupted run's) stays the newest, and no model or later metrics are written."""
    from kforcing_kernels.app.training import loop as trainer

    good = tmp_path / "good"
    train(micro(good, corpus_dir, ckpt_every=2, keep_checkpoints=5))
    calls = []
    real = trainer.compute_loss

    def nan_at_step_3(*args, **kwargs):
        loss, per_pos = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), per_pos) if len(calls) == 3 else (loss, per_pos)

    monkeypatch.setattr(trainer, "compute_loss", nan_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(
        trainer.NonFiniteLoss, match=r"^loss: step 3 gave a non-finite loss \(nan\).*step_00000002, holds the last good"
    ):
        train(micro(out, corpus_dir, ckpt_every=2, keep_checkpoints=5))
    assert latest_checkpoint(out).stem == "step_00000002"
    assert not (out / "model.json").exists()
    assert run_record(out) == run_record(good)[:2]  # steps 1 and 2 only
    saved = lambda run: load_file(str(run / "checkpoints" / "step_00000002.safetensors"))  # noqa: E731
    assert all(torch.equal(saved(out)[name], t) for name, t in saved(good).items())  # the good step-2 weights
    calls.clear()  # the CLI says the same, as an error (exit status 1), not a traceback
    monkeypatch.setattr(trainer, "compute_loss", nan_at_step_3)
    with pytest.raises(SystemExit, match="^kforcing-train: error: loss: step 3 gave a non-finite loss"):
        main(
            [
                "stage0",
                "--out",
                str(tmp_path / "cli"),
                "--data",
                str(corpus_dir),
                "--vocab-size",
                str(VOCAB),
                "--preset",
                "micro",
                "--seq-len",
                "16",
                "--steps",
                "4",
                "--batch-size",
                "4",
                "--warmup-steps",
                "1",
                "--ckpt-every",
                "2",
                "--eval-batches",
                "1",
                "--no-progress",
            ]
        )


def test_weight_decay_falls_on_matrices_only():
    """AdamW decays the Linear and Embedding weights and nothing else (norm gains, biases): the oracle is
    the module each parameter belongs to, not its shape."""
    from torch import nn

    cfg = TrainConfig(weight_decay=0.25)
    model = KForcingLM(ModelConfig.micro(vocab_size=40))
    should_decay, seen = set(), set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            seen.add(id(p))
            if isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
                should_decay.add(id(p))
    assert seen == {id(p) for p in model.parameters()} and should_decay and seen - should_decay
    decay = {
        id(p): group["weight_decay"]
        for group in _optimizer(model, cfg, fused_ok=False).param_groups
        for p in group["params"]
    }
    assert decay.keys() == seen  # every parameter in exactly one group
    assert {i for i, wd in decay.items() if wd == 0.25} == should_decay
    assert all(wd == 0.0 for i, wd in decay.items() if i not in should_decay)


@pytest.mark.parametrize("writer", ["atomic_write_file", "atomic_write"])
def test_atomic_writes_fsync_the_temporary_before_the_rename_and_the_folder_after(tmp_path, monkeypatch, writer):
    """Durability order (a crash at any point leaves the old file or the whole new one): fsync of the temporary's
    data, then os.replace(temporary, path), then fsync of the folder that holds the new name. Recorded by
    wrapping os.fsync / os.replace; each fsync names what its descriptor is open on (/proc/self/fd)."""
    from kforcing_kernels.app import files

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name what a descriptor is open on (Linux)")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "out.bin"
    if writer == "atomic_write_file":
        files.atomic_write_file(target, lambda f: f.write(b"new"))
    else:
        files.atomic_write(target, lambda name: Path(name).write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    replaced = [e for e in events if e[0] == "replace"]
    assert len(replaced) == 1 and replaced[0][2] == str(target)
    tmp, at = replaced[0][1], events.index(replaced[0])
    assert ("fsync", tmp) in events[:at], events  # the temporary's data reached the disk before it got the name
    assert ("fsync", str(tmp_path)) in events[at + 1 :], events  # and the rename itself after

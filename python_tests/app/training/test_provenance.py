"""Issue 29, "Trainer provenance and files": what ties a model to its text, tokenizer and teacher; one run per
folder at a time; one atomic writer that no symlink redirects; usage errors instead of tracebacks.

Each test drives the public entry points (``train``, ``run_pipeline``, the CLIs' ``main``) the way a user's
run meets changed data, a retrained teacher, a second run, a hostile folder or a bad option.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import REPO
from helpers.train_helpers import VOCAB, micro_config, write_json_package
from kforcing_kernels.app import files
from kforcing_kernels.app.data import load_corpus
from kforcing_kernels.app.evaluation.evaluate import load_judge
from kforcing_kernels.app.files import (
    LOCK_NAME,
    RunLock,
    append_jsonl,
    atomic_write,
    atomic_write_file,
    check_writable,
    write_json,
    write_text,
)
from kforcing_kernels.app.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_model,
    read_json,
    save_model,
    save_tensors,
)
from kforcing_kernels.app.training.config import ConfigError
from kforcing_kernels.app.training.loop import train
from kforcing_kernels.app.training.pipeline import PipelineConfig, run_pipeline


def write_package(folder: Path, package: str) -> Path:
    """A standard-library package's sources as a corpus (another text than the json package's)."""
    import importlib

    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(importlib.import_module(package).__file__).parent.glob("*.py")):
        (folder / path.name).write_text(path.read_text())
    return folder


@pytest.fixture(scope="module", autouse=True)
def _cache(isolated_cache):
    yield


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_json_package(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory):
    return write_package(tmp_path_factory.mktemp("other") / "corpus", "logging")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, corpus_dir, other_corpus):
    """Two AR teachers of the same size and vocabulary: one on the json package, one on the logging package."""
    root = tmp_path_factory.mktemp("teachers")
    train(micro_config(root / "json", corpus_dir, steps=2))
    train(micro_config(root / "logging", other_corpus, steps=2))
    return root


def corpus_folders(cache: Path) -> set:
    return {p.name for p in cache.glob("corpus-*")}


def perturbed_copy(src: Path, dst: Path) -> Path:
    """``src`` retrained in place, as far as anyone can tell: same files and settings, other weights."""
    shutil.copytree(src, dst)
    model, info, _ = load_model(dst)
    with torch.no_grad():
        model.wte.weight.add_(0.01)
    save_model(dst, model, {k: v for k, v in info.items() if k not in ("model_config", "tensors")})
    return dst


# ---------------------------------------------------------------------- item 5: a model's text and tokenizer


def test_provenance_is_recorded_in_models_and_checkpoints(teachers, corpus_dir, tmp_path):
    info = read_json(teachers / "json" / "model.json")
    assert len(info["data_sha256"]) == 64 and len(info["tokenizer_sha256"]) == 64
    assert info["data_sha256"] != read_json(teachers / "logging" / "model.json")["data_sha256"]
    train(
        micro_config(tmp_path / "s1", corpus_dir, stage="stage1", teacher=str(teachers / "json"), steps=2, ckpt_every=1)
    )
    s1 = read_json(tmp_path / "s1" / "model.json")
    assert s1["teacher_sha256"] == info["tensors"]["sha256"] and s1["tokenizer_sha256"] == info["tokenizer_sha256"]
    assert read_json(latest_checkpoint(tmp_path / "s1"))["info"]["teacher_sha256"] == info["tensors"]["sha256"]


def test_distilling_on_data_with_another_tokenizer_is_refused(teachers, other_corpus, tmp_path, capsys):
    from kforcing_kernels.app.train import main

    # Same vocabulary size, other ids: accepted before, and the student saved with the new tokenizer.
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "stage1",
                "--teacher",
                str(teachers / "json"),
                "--data",
                str(other_corpus),
                "--out",
                str(tmp_path / "s1"),
                "--vocab-size",
                str(VOCAB),
                "--seq-len",
                "16",
                "--batch-size",
                "4",
                "--steps",
                "2",
                "--no-progress",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--teacher" in err and "--data" in err and "tokenizer" in err
    assert not (tmp_path / "s1" / "model.json").exists() and not (tmp_path / "s1" / "tokenizer.json").exists()


def test_resume_after_the_data_changed_is_refused_before_a_new_tokenizer(tmp_path, corpus_dir):
    cache = Path(os.environ["KFORCING_CACHE"])
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    cfg = micro_config(tmp_path / "run", data, stop_at=2, ckpt_every=1)
    train(cfg)
    (data / "decoder.py").write_text((data / "decoder.py").read_text() + "\n# edited\n")
    before = corpus_folders(cache)
    with pytest.raises(ConfigError, match=r"data: --resume .*--data changed.*\(--data\)"):
        train(dataclasses.replace(cfg, resume=True, stop_at=None))
    assert corpus_folders(cache) == before  # no tokenizer trained mid-run on the new text
    (data / "decoder.py").write_text((corpus_dir / "decoder.py").read_text())
    train(dataclasses.replace(cfg, resume=True, stop_at=None))  # restored: the run continues and finishes
    (data / "decoder.py").write_text("changed again\n" * 50)
    with pytest.raises(ConfigError, match=r"data: --resume needs what the finished run .*\(--data\)"):
        train(dataclasses.replace(cfg, resume=True, stop_at=None))  # a finished run asked to resume: the same check


def test_resume_of_a_run_saved_before_provenance_warns_and_continues(tmp_path, corpus_dir, capsys):
    cfg = micro_config(tmp_path / "run", corpus_dir, stop_at=2, ckpt_every=1)
    train(cfg)
    ckpt = latest_checkpoint(tmp_path / "run")
    meta = json.loads(ckpt.read_text())
    for key in ("data_sha256", "tokenizer_sha256"):
        del meta["info"][key]
    ckpt.write_text(json.dumps(meta))
    capsys.readouterr()
    train(dataclasses.replace(cfg, resume=True, stop_at=None))
    assert "saved before data_sha256" in capsys.readouterr().err
    assert (tmp_path / "run" / "model.json").exists()


def test_a_foreign_tokenizer_json_in_a_stage_folder_is_refused(teachers, tmp_path):
    folder = shutil.copytree(teachers / "json", tmp_path / "stage")
    shutil.copy(teachers / "logging" / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not the tokenizer this model was trained with"):
        load_model(folder)


def test_evaluate_refuses_a_judge_with_another_tokenizer(teachers, tmp_path, capsys):

    run = tmp_path / "run"
    shutil.copytree(teachers / "json", run / "stage0")
    _, _, tokenizer = load_model(run / "stage0")
    with pytest.raises(ValueError, match="judge: the tokenizer of"):
        load_judge(run, teachers / "logging", "cpu", tokenizer)


def test_evaluate_cli_refuses_a_judge_with_another_tokenizer(teachers, tmp_path, capsys):
    from kforcing_kernels.app.evaluation.evaluate import main

    run = tmp_path / "run"
    shutil.copytree(teachers / "json", run / "stage0")
    with pytest.raises(SystemExit) as exc:
        main([str(run), "--judge", str(teachers / "logging"), "--reps", "1", "--batch-sizes", "2"])
    assert exc.value.code == 2 and "judge: the tokenizer of" in capsys.readouterr().err


# ---------------------------------------------------------------------- item 6: a stage's teacher, by identity


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, corpus_dir):
    root = tmp_path_factory.mktemp("pipeline")
    base = micro_config(root / "unused", corpus_dir)
    pipe = PipelineConfig(out=str(root / "run"), k_final=2, steps_stage0=2, steps_stage1=2, steps_stage2=2)
    run_pipeline(pipe, base)
    return pipe, base


def test_pipeline_refuses_students_of_a_teacher_retrained_in_place(pipeline_run, tmp_path):
    pipe, base = pipeline_run
    run = shutil.copytree(pipe.out, tmp_path / "run")
    shutil.rmtree(run / "stage0")
    perturbed_copy(Path(pipe.out) / "stage0", run / "stage0")  # Stage 0 retrained: its settings still match
    with pytest.raises(
        ConfigError,
        match=r"teacher: .*stage1 holds a finished stage1, but the teacher's model file \(--teacher\) changed",
    ):
        run_pipeline(dataclasses.replace(pipe, out=str(run)), base)
    # Its own rerun (nothing changed) still reuses every stage.
    assert set(run_pipeline(pipe, base)) == {"stage0", "stage1", "stage2_k2"}


def test_pipeline_refuses_stages_trained_on_text_that_changed_since(pipeline_run, corpus_dir, tmp_path):
    pipe, base = pipeline_run
    data = shutil.copytree(corpus_dir, tmp_path / "data")
    (data / "scanner.py").write_text((data / "scanner.py").read_text() + "\n# edited\n")
    run = shutil.copytree(pipe.out, tmp_path / "run")
    for stage in ("stage0", "stage1", "stage2_k2"):  # the same path typed: only the text differs
        for name in ("model.json", "train_config.json"):
            cfg = read_json(run / stage / name)
            (cfg.get("train_config") or cfg)["data"] = str(data)
            if name == "model.json":
                cfg["data"] = str(data)
            (run / stage / name).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"data: .*stage0 holds a finished stage0, but the text of --data changed"):
        run_pipeline(dataclasses.replace(pipe, out=str(run)), dataclasses.replace(base, data=str(data)))


def test_resume_refuses_a_teacher_retrained_since(teachers, corpus_dir, tmp_path):
    teacher = shutil.copytree(teachers / "json", tmp_path / "teacher")
    cfg = micro_config(
        tmp_path / "s1", corpus_dir, stage="stage1", teacher=str(teacher), steps=3, stop_at=1, ckpt_every=1
    )
    train(cfg)
    shutil.rmtree(teacher)
    perturbed_copy(teachers / "json", teacher)
    with pytest.raises(
        ConfigError, match=r"teacher: --resume .*teacher's model file \(--teacher\) changed.*\(--teacher\)"
    ):
        train(dataclasses.replace(cfg, resume=True, stop_at=None))


def test_evaluate_refuses_a_student_of_another_teacher(pipeline_run, tmp_path):
    from kforcing_kernels.app.evaluation.evaluate import evaluate_pipeline

    pipe, _ = pipeline_run
    run = shutil.copytree(pipe.out, tmp_path / "run")
    shutil.rmtree(run / "stage0")
    perturbed_copy(Path(pipe.out) / "stage0", run / "stage0")
    with pytest.raises(ValueError, match="stage1 was distilled from another teacher"):
        evaluate_pipeline(
            run,
            batch_sizes=(2,),
            reps=1,
            nll_batches=1,
            nll_batch_size=2,
            new_tokens=2,
            prompt_len=2,
            taus=(),
            log=lambda s: None,
        )


# ---------------------------------------------------------------------- item 7: one run per folder at a time


def test_a_second_run_into_a_locked_folder_fails_at_once(tmp_path, corpus_dir, capsys):
    from kforcing_kernels.app.train import main

    out = tmp_path / "run"
    with RunLock(out):  # another run holds the folder
        with pytest.raises(CheckpointError, match=r"out: .* is in use by another run.*--out"):
            train(micro_config(out, corpus_dir))
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "stage0",
                    "--out",
                    str(out),
                    "--data",
                    str(corpus_dir),
                    "--vocab-size",
                    str(VOCAB),
                    "--preset",
                    "micro",
                    "--seq-len",
                    "16",
                    "--batch-size",
                    "4",
                    "--steps",
                    "2",
                    "--no-progress",
                ]
            )
        assert exc.value.code == 2 and "is in use by another run" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing of the second run was written
    train(micro_config(out, corpus_dir, steps=2))  # released: the folder is free again
    assert (out / "model.json").exists()


def test_the_lock_is_held_by_another_process_and_released_when_it_ends(tmp_path, corpus_dir):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from kforcing_kernels.app.files import RunLock
        RunLock({str(out)!r}).acquire()
        print("locked", flush=True)
        sys.stdin.read()
    """),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match="is in use by another run"):
            train(micro_config(out, corpus_dir, steps=2))
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    train(micro_config(out, corpus_dir, steps=2))


def test_the_lock_is_released_when_the_run_fails(tmp_path, corpus_dir, monkeypatch):
    import kforcing_kernels.app.training.loop as trainer

    out = tmp_path / "run"

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(trainer, "compute_loss", fail)
    with pytest.raises(RuntimeError, match="boom"):
        train(micro_config(out, corpus_dir, steps=2))
    RunLock(out).acquire().release()  # free


def test_a_second_pipeline_into_a_locked_folder_fails_at_once(tmp_path, corpus_dir):
    pipe = PipelineConfig(out=str(tmp_path / "run"), k_final=1, steps_stage0=2, steps_stage1=2)
    with RunLock(pipe.out):
        with pytest.raises(CheckpointError, match="is in use by another run"):
            run_pipeline(pipe, micro_config(tmp_path / "unused", corpus_dir))
    assert not (tmp_path / "run" / "stage0").exists()


def test_a_lock_file_removed_while_a_run_opens_it_is_not_the_one_locked(tmp_path, monkeypatch):
    """A failed start removes its lock file while it holds it (issue 38); a run that opened that file just before must
    lock the file now at the path, or two runs could hold locks on two files of the same name."""
    import fcntl

    out, real, removed = tmp_path / "run", fcntl.flock, []

    def removed_before_the_lock(fd, operation):
        if not removed:  # between this run's open and its flock, the failed start's cleanup unlinks the file
            removed.append((out / LOCK_NAME).unlink())
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", removed_before_the_lock)
    lock = RunLock(out).acquire()
    monkeypatch.undo()
    try:
        assert removed and (out / LOCK_NAME).exists()  # the file at the path is the one locked, not the removed one
        assert os.path.samestat(os.fstat(lock._fd), os.stat(out / LOCK_NAME))
        with pytest.raises(CheckpointError, match="is in use by another run"):
            RunLock(out).acquire()
    finally:
        lock.release()


def test_the_lock_file_is_not_a_symlink_target(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(CheckpointError, match="cannot lock"):
        RunLock(out).acquire()
    assert victim.read_text() == "mine"


# ---------------------------------------------------------------------- item 8: one atomic writer, no symlink followed


PLANTED = "f" * 16


@pytest.fixture
def planted_names(monkeypatch):
    """Every temporary's first name draw is ``PLANTED`` (then random): the predictable name a symlink waits at."""
    import secrets

    real, calls = secrets.token_hex, []

    def token_hex(n=None):
        calls.append(n)
        return PLANTED if len(calls) % 2 else real(n)

    monkeypatch.setattr(files.secrets, "token_hex", token_hex)
    return calls


def plant(folder: Path, name: str, victim: Path) -> Path:
    link = folder / f".{name}.{PLANTED}.tmp"
    link.symlink_to(victim)
    return link


def test_no_writer_follows_a_symlink_planted_at_its_temporary_name(tmp_path, planted_names):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    folder = tmp_path / "run"
    folder.mkdir()
    writers = {
        "a.txt": lambda p: write_text(p, "text"),
        "b.json": lambda p: write_json(p, {"x": 1}),
        "c.safetensors": lambda p: save_tensors(p, {"w": torch.ones(3)}),
        "d.bin": lambda p: atomic_write_file(p, lambda f: f.write(b"bytes")),
        "e.bin": lambda p: atomic_write(p, lambda name: Path(name).write_bytes(b"by name")),
    }
    for name, write in writers.items():
        link = plant(folder, name, victim)
        write(folder / name)
        assert victim.read_text() == "mine", name
        assert (folder / name).is_file() and not (folder / name).is_symlink(), name
        assert link.is_symlink()  # left alone: not ours
    check_writable(folder / "f.txt", "--out")  # the probe draws a name too
    assert victim.read_text() == "mine"
    assert not [p for p in folder.glob(".*.tmp") if not p.is_symlink()]


def test_a_temporary_swapped_for_a_symlink_mid_write_is_not_renamed_into_place(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    target = tmp_path / "out.bin"

    def swap(f):
        (tmp,) = tmp_path.glob(".out.bin.*.tmp")
        tmp.unlink()
        tmp.symlink_to(victim)
        f.write(b"data")

    with pytest.raises(CheckpointError, match="replaced while it was written"):
        atomic_write_file(target, swap)
    assert victim.read_text() == "mine" and not target.exists() and not list(tmp_path.glob(".*.tmp"))


def test_metrics_are_never_appended_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(CheckpointError, match="cannot append"):
        append_jsonl(tmp_path / "metrics.jsonl", {"step": 1})
    assert victim.read_text() == "mine"


def test_corpus_cache_writers_do_not_follow_planted_symlinks(tmp_path, corpus_dir, planted_names):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    cache = tmp_path / "cache"
    corpus = load_corpus(str(corpus_dir), vocab_size=VOCAB, cache_dir=str(cache))  # learn the entry's folder name
    (entry,) = cache.glob("corpus-*")
    shutil.rmtree(entry)
    entry.mkdir()
    for name in ("tokenizer.json", "train.npy", "val.npy", "meta.json"):
        plant(entry, name, victim)
    again = load_corpus(str(corpus_dir), vocab_size=VOCAB, cache_dir=str(cache))
    assert victim.read_text() == "mine" and torch.equal(again.train, corpus.train)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """A K-Forcing stage folder (k=2) with a byte-level tokenizer."""
    from kforcing_kernels.app.data import _train_tokenizer
    from kforcing_kernels.model import KForcingLM, ModelConfig

    folder = tmp_path_factory.mktemp("stage")
    tok = _train_tokenizer(["def f(x): return x"], 257)
    torch.manual_seed(0)
    save_model(folder, KForcingLM(ModelConfig.micro(vocab_size=tok.get_vocab_size())), {"kind": "pflm", "k": 2})
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_generate_out_is_not_redirected_by_a_symlink_at_the_old_predictable_name(stage, tmp_path, monkeypatch, capsys):
    import kforcing_kernels.app.generation.inference as inference

    victim = tmp_path / "victim"
    victim.write_text("mine")
    out = tmp_path / "gen.jsonl"
    real = inference.generate_kforcing

    def generate_then_plant(*args, **kwargs):  # someone who can write the folder, while the model runs
        (tmp_path / f".gen.jsonl.{os.getpid()}.tmp").symlink_to(victim)
        return real(*args, **kwargs)

    monkeypatch.setattr(inference, "generate_kforcing", generate_then_plant)
    inference.main([str(stage), "--prompt", "def", "--new-tokens", "2", "--out", str(out)])
    assert victim.read_text() == "mine"
    assert out.is_file() and not out.is_symlink() and json.loads(out.read_text().splitlines()[0])["prompt"] == "def"


# ---------------------------------------------------------------------- item 9: usage errors, not tracebacks


def usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def commands(stage, tmp_path, corpus_dir):
    from kforcing_kernels.app import demo
    from kforcing_kernels.app import train as train_cli
    from kforcing_kernels.app.evaluation import evaluate
    from kforcing_kernels.app.generation import inference

    common = [
        "--data",
        str(corpus_dir),
        "--vocab-size",
        str(VOCAB),
        "--preset",
        "micro",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
    ]
    return {
        "train": (train_cli.main, ["stage0", *common, "--steps", "2"]),
        "pipeline": (
            train_cli.main,
            ["pipeline", *common, "--k-final", "1", "--steps-stage0", "2", "--steps-stage1", "2"],
        ),
        "demo": (demo.main, ["--quick"]),
        "generate": (inference.main, [str(stage), "--prompt", "def", "--new-tokens", "2"]),
        "evaluate": (evaluate.main, [str(tmp_path / "no-run")]),
    }


@pytest.mark.parametrize("command", ["train", "pipeline", "demo"])
def test_out_naming_an_existing_file_is_a_usage_error(command, stage, tmp_path, corpus_dir, capsys):
    main, argv = commands(stage, tmp_path, corpus_dir)[command]
    file = tmp_path / "a-file"
    file.write_text("mine")
    for out in (file, file / "below"):
        err = usage_error(capsys, main, [*argv, "--out", str(out)])
        assert "--out" in err and "is a file" in err
    assert file.read_text() == "mine"


@pytest.mark.parametrize("command", ["train", "pipeline", "demo", "generate", "evaluate"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_cuda_is_a_usage_error(command, device, stage, tmp_path, corpus_dir, capsys, no_cuda):
    main, argv = commands(stage, tmp_path, corpus_dir)[command]
    if command in ("train", "pipeline", "demo"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    err = usage_error(capsys, main, [*argv, "--device", device])
    assert "argument --device" in err and "not available" in err
    assert not (tmp_path / "out").exists()


def test_device_cuda_index_beyond_the_devices_is_a_usage_error(stage, tmp_path, corpus_dir, capsys, monkeypatch):
    from kforcing_kernels.app.generation import inference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = usage_error(capsys, inference.main, [str(stage), "--prompt", "x", "--device", "cuda:3"])
    assert "argument --device" in err and "1 CUDA device" in err


def test_evaluate_json_that_cannot_be_written_fails_before_the_evaluation(teachers, tmp_path, capsys):
    from kforcing_kernels.app.evaluation.evaluate import main

    run = tmp_path / "run"
    shutil.copytree(teachers / "json", run / "stage0")
    err = usage_error(capsys, main, [str(run), "--json", str(tmp_path / "missing" / "summary.json")])
    assert "argument --json: cannot write" in err
    err = usage_error(capsys, main, [str(run), "--judge", str(tmp_path / "nowhere")])
    assert "argument --judge" in err


def test_the_train_command_exits_with_a_usage_error_in_a_real_process(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "kforcing_kernels.app.train", "stage0", "--out", str(file), "--steps", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and "--out" in result.stderr, result.stderr


def test_dump_grads_that_cannot_be_written_fails_before_training(tmp_path, corpus_dir, capsys):
    from kforcing_kernels.app.train import main

    err = usage_error(
        capsys,
        main,
        [
            "stage0",
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(corpus_dir),
            "--vocab-size",
            str(VOCAB),
            "--preset",
            "micro",
            "--seq-len",
            "16",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--dump-grads",
            str(tmp_path),
        ],
    )
    assert "--dump-grads" in err and "is a directory" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)
def test_a_locked_folder_stops_every_rank_of_a_torchrun_run(tmp_path, corpus_dir):
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "kforcing_kernels.app.train",
        "stage0",
        "--out",
        str(out),
        "--data",
        str(corpus_dir),
        "--vocab-size",
        str(VOCAB),
        "--preset",
        "micro",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--no-progress",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with RunLock(out):
        result = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert result.stderr.count("is in use by another run") >= 2, result.stderr[-3000:]  # both ranks say why, none hangs
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]

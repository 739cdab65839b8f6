"""Saved metadata read back with its types and allowed values checked (app/files.py's Field and check_fields, the
tables of app/records.py): a damaged or hand-edited entry of a stage's model.json, a checkpoint's JSON, a sharded
checkpoint's manifest, an HF stage's records, a corpus cache's meta.json or a run's train_config is refused with an
error naming the file and the entry, through every door a user opens (load_student, ``kforcing-generate FOLDER``,
``kforcing-train ... --teacher FOLDER``), never a TypeError or KeyError later, nor a silent fallback."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from kforcing_kernels.app.files import CheckpointError, Field, check_fields, read_json  # noqa: E402
from kforcing_kernels.app.records import MODEL_JSON_FIELDS, TRAIN_CONFIG_FIELDS  # noqa: E402
from kforcing_kernels.app.student import load_student  # noqa: E402
from kforcing_kernels.app.training.config import TrainConfig  # noqa: E402
from kforcing_kernels.model import KForcingLM, ModelConfig  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, seq_len=16, noise_features=16, tau_features=4)
SHA = "ab" * 32


def _stage(folder: Path, **info) -> Path:
    """A stage folder as a finished stage1 writes it (its model.json entries the trainer records), k=1."""
    from kforcing_kernels.app.training.checkpoint import save_model

    record = {
        "kind": "pflm",
        "k": 1,
        "teacher": str(folder.parent / "stage0"),
        "teacher_k": 0,
        "supervision": "forward",
        "data_sha256": SHA,
        "tokenizer_sha256": None,  # not checked against a tokenizer (this folder has none)
        "teacher_sha256": SHA,
        "cdf_order": "probability",
        "stage": "stage1",
        "data": "stdlib",
        "train_config": TrainConfig(stage="stage1").to_dict(),
        "summary": {"final_loss": 3.5, "val_loss": 3.6, "steps": 10},
        "model_kind": "native",
    }
    save_model(folder, KForcingLM(CONFIG), {**record, **info})
    return folder


def _edit(folder: Path, edit) -> Path:
    path = folder / "model.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    return folder


# (name, edit of model.json, the entry the error must name)
CORRUPT = {
    "model_kind a list": (lambda m: m.update(model_kind=["native"]), "model_kind"),
    "model_kind an object": (lambda m: m.update(model_kind={"name": "native"}), "model_kind"),
    "model_kind a number": (lambda m: m.update(model_kind=3), "model_kind"),
    "model_kind unknown": (lambda m: m.update(model_kind="plugin"), "model_kind"),
    "k as text": (lambda m: m.update(k="1"), "k"),
    "k negative": (lambda m: m.update(k=-1), "k"),
    "k a flag": (lambda m: m.update(k=True), "k"),
    "teacher_k as text": (lambda m: m.update(teacher_k="0"), "teacher_k"),
    "teacher a list": (lambda m: m.update(teacher=["stage0"]), "teacher"),
    "cdf_order unknown": (lambda m: m.update(cdf_order="sideways"), "cdf_order"),
    "teacher_sha256 a number": (lambda m: m.update(teacher_sha256=5), "teacher_sha256"),
    "data_sha256 not a hash": (lambda m: m.update(data_sha256="abc"), "data_sha256"),
    "tensors.sha256 a list": (lambda m: m["tensors"].update(sha256=[SHA]), "tensors.sha256"),
    "train_config a list": (lambda m: m.update(train_config=[1]), "train_config"),
    "train_config.seq_len as text": (lambda m: m["train_config"].update(seq_len="64"), "train_config.seq_len"),
    "train_config.teacher a list": (lambda m: m["train_config"].update(teacher=["x"]), "train_config.teacher"),
    "train_config.preset a list": (lambda m: m["train_config"].update(preset=["tiny"]), "train_config.preset"),
    "train_config.lr not finite": (lambda m: m["train_config"].update(lr=float("inf")), "train_config.lr"),
    "summary a list": (lambda m: m.update(summary=[]), "summary"),
    "data a number": (lambda m: m.update(data=7), "data"),
}


def _names(entry: str) -> str:
    return re.escape(f"'{entry}'")


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_load_student_names_the_file_and_the_entry(tmp_path, case):
    edit, entry = CORRUPT[case]
    folder = _edit(_stage(tmp_path / "stage1"), edit)
    with pytest.raises(ValueError, match=re.escape(str(folder / "model.json"))) as caught:
        load_student(folder)
    assert re.search(_names(entry), str(caught.value)), str(caught.value)
    if case.startswith("model_kind"):  # the kinds this process knows are listed
        assert "hf, native" in str(caught.value)


def test_the_unchanged_stage_loads(tmp_path):
    """The control: the same folder unedited loads, and every one of its entries is in the table."""
    folder = _stage(tmp_path / "stage1")
    model, info, _ = load_student(folder)
    assert info["k"] == 1 and model.k_train == 1
    assert set(info) <= set(MODEL_JSON_FIELDS)


@pytest.mark.parametrize(
    "case", ["model_kind a list", "model_kind unknown", "k as text", "tensors.sha256 a list", "cdf_order unknown"]
)
def test_kforcing_generate_names_the_file_and_the_entry(tmp_path, capsys, case):
    from kforcing_kernels.app.generation.inference import main

    edit, entry = CORRUPT[case]
    folder = _edit(_stage(tmp_path / "stage1"), edit)
    with pytest.raises(SystemExit) as exit_:
        main([str(folder), "--prompt", "x", "--new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert str(folder / "model.json") in err and re.search(_names(entry), err), err


@pytest.mark.parametrize(
    "case", ["model_kind an object", "model_kind unknown", "k negative", "teacher_sha256 a number", "summary a list"]
)
def test_kforcing_train_teacher_names_the_file_and_the_entry(tmp_path, capsys, case):
    from kforcing_kernels.app.train import main

    edit, entry = CORRUPT[case]
    folder = _edit(_stage(tmp_path / "stage1"), edit)
    with pytest.raises(SystemExit) as exit_:
        main(["stage2", "--teacher", str(folder), "--out", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert str(folder / "model.json") in err and re.search(_names(entry), err), err
    assert not (tmp_path / "out" / "model.json").exists()


# ---------------------------------------------------------------------- the other records


def _checkpoint_meta() -> dict:
    return {
        "format": 1,
        "step": 2,
        "train_config": TrainConfig().to_dict(),
        "model_config": CONFIG.to_dict(),
        "info": {"kind": "ar", "k": 0, "data_sha256": SHA, "tokenizer_sha256": SHA},
        "param_groups": [{"lr": 1e-3}],
        "scaler": None,
        "tensors": {"file": "step_00000002.safetensors", "bytes": 1, "sha256": SHA},
    }


@pytest.mark.parametrize(
    "edit, entry",
    [
        (lambda m: None, None),
        (lambda m: m.update(step=-2), "step"),
        (lambda m: m["info"].update(tokenizer_sha256=["x"]), "info.tokenizer_sha256"),
        (lambda m: m["info"].update(k="0"), "info.k"),
        (lambda m: m["train_config"].update(data=["stdlib"]), "train_config.data"),
        (lambda m: m.update(param_groups=[3]), "param_groups[0]"),
    ],
)
def test_checkpoint_json_entries_are_checked(tmp_path, edit, entry):
    from kforcing_kernels.app.training.checkpoint import read_checkpoint_meta

    meta = _checkpoint_meta()
    edit(meta)
    path = tmp_path / "step_00000002.json"
    path.write_text(json.dumps(meta))
    if entry is None:
        assert read_checkpoint_meta(path)["step"] == 2
        return
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*" + _names(entry)):
        read_checkpoint_meta(path)


@pytest.mark.parametrize(
    "edit, entry",
    [
        (lambda m: None, None),
        (lambda m: m.update(world_size=0), "world_size"),
        (lambda m: m.update(rng=[{"cpu": 5}]), "rng[0].cpu"),
        (lambda m: m.update(rng=["state"]), "rng[0]"),
        (lambda m: m["files"][".metadata"].update(bytes="9"), "files..metadata.bytes"),
        (lambda m: m["info"].update(teacher_k=[1]), "info.teacher_k"),
    ],
)
def test_sharded_manifest_entries_are_checked(tmp_path, edit, entry):
    from kforcing_kernels.app.training.sharded_checkpoint import MANIFEST, SHARDED_FORMAT, read_sharded_meta

    manifest = {
        **_checkpoint_meta(),
        "format": SHARDED_FORMAT,
        "world_size": 2,
        "rng": [{"cpu": "AAAA"}, {"cpu": "AAAA"}],
        "files": {".metadata": {"bytes": 9, "sha256": SHA}},
    }
    edit(manifest)
    folder = tmp_path / "step_00000002.dcp"
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    if entry is None:
        assert read_sharded_meta(folder)["world_size"] == 2
        return
    with pytest.raises(CheckpointError, match=re.escape(str(folder / MANIFEST)) + ".*" + _names(entry)):
        read_sharded_meta(folder)


@pytest.mark.parametrize(
    "edit, entry",
    [
        (lambda m: m.update(files={"config.json": {"bytes": "10", "sha256": SHA}}), "files.config.json.bytes"),
        (lambda m: m.update(files={"config.json": [10]}), "files.config.json"),
        (lambda m: m["noise_embedding"].update(settings=[32]), "noise_embedding.settings"),
        (lambda m: m.update(hf_format="1"), "hf_format"),
        (lambda m: m.update(k=None), "k"),
    ],
)
def test_hf_stage_records_are_checked(tmp_path, edit, entry):
    from kforcing_kernels.app.hf_recipe.files import is_hf_stage, read_hf_stage_info

    record = {
        "k": 1,
        "hf_format": 1,
        "model_config": {"model_type": "llama"},
        "noise_embedding": {"format": 2, "settings": {"hidden_size": 32}, "tensors": {}},
        "files": {"config.json": {"bytes": 10, "sha256": SHA}},
        "tensors": {"file": "*", "bytes": 0, "sha256": SHA},
        "model_kind": "hf",
    }
    assert read_hf_stage_info(_write(tmp_path / "good", record))["k"] == 1
    edit(record)
    folder = _write(tmp_path / "bad", record)
    with pytest.raises(CheckpointError, match=re.escape(str(folder / "model.json")) + ".*" + _names(entry)):
        read_hf_stage_info(folder)
    # A model.json that is a JSON string mentioning "hf_format" is no HF stage (it was a substring test).
    assert not is_hf_stage(_write(tmp_path / "text", "hf_format"))


def _write(folder: Path, record) -> Path:
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps(record))
    return folder


def test_a_corpus_cache_with_a_malformed_meta_json_is_rebuilt(tmp_path):
    from kforcing_kernels.app.data import load_corpus

    (tmp_path / "text").mkdir()
    for i in range(40):
        (tmp_path / "text" / f"{i:02d}.txt").write_text(f"document {i}: " + "some words and more words " * 20)
    cache = tmp_path / "cache"
    first = load_corpus(str(tmp_path / "text"), vocab_size=300, cache_dir=cache)
    (meta_path,) = cache.glob("corpus-*/meta.json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "documents": ["many", "few"]}))
    again = load_corpus(str(tmp_path / "text"), vocab_size=300, cache_dir=cache)
    assert again.n_documents == first.n_documents and all(isinstance(n, int) for n in again.n_documents)
    assert json.loads(meta_path.read_text())["documents"] == list(first.n_documents)


def test_a_finished_stage_with_a_malformed_train_config_is_not_reused_by_the_pipeline(tmp_path):
    from kforcing_kernels.app.training.pipeline import PipelineConfig, run_pipeline

    run = tmp_path / "run"
    _edit(_stage(run / "stage0", k=0, kind="ar"), lambda m: m["train_config"].update(out=["x"]))
    with pytest.raises(CheckpointError, match=re.escape(str(run / "stage0" / "model.json")) + ".*'train_config.out'"):
        run_pipeline(PipelineConfig(out=str(run), steps_stage0=1), TrainConfig(device="cpu"))


# ---------------------------------------------------------------------- the helper and the tables


def test_check_fields_words():
    path = Path("x.json")
    fields = {
        "n": Field(int, required=True),
        "r": Field(float),
        "c": Field(str, choices=("a", "b")),
        "o": Field(dict, fields={"s": Field(str, required=True)}),
        "e": Field(list, each=Field(int)),
    }
    assert check_fields(path, {"n": 1, "r": 2, "c": "a", "o": {"s": ""}, "e": [1]}, fields)  # an int is a float
    for record, words in [
        ({}, "no 'n' entry"),
        ({"n": True}, "'n' has type bool, expected int"),
        ({"n": 1, "c": "z"}, "'c' is 'z', expected one of ('a', 'b')"),
        ({"n": 1, "o": {}}, "no 'o.s' entry"),
        ({"n": 1, "e": [1, "2"]}, "'e[1]' has type str, expected int"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(f"x.json: malformed: {words}")):
            check_fields(path, record, fields)


def test_the_train_config_table_agrees_with_train_config(tmp_path):
    """Every entry a resume compares is in the table, each is a TrainConfig field, and TrainConfig's defaults (and
    a stage as the CLI records it) pass it: a run this version writes is always read back."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(TRAIN_CONFIG_FIELDS) <= names
    assert set(TrainConfig.RESUME_KEYS) | {"out"} <= set(TRAIN_CONFIG_FIELDS)
    path = tmp_path / "train_config.json"
    for cfg in (TrainConfig(), TrainConfig(stage="stage2", teacher="/t", k=4, preset=None, model_config="/c.json")):
        path.write_text(json.dumps(cfg.to_dict()))
        assert read_json(path, fields=TRAIN_CONFIG_FIELDS) == json.loads(path.read_text())

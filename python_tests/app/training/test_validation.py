"""Every rule of app/training/validation.py refuses by name: one case per rule, a config valid but for that one setting,
and the message starts with the setting (and names the option where the CLI spells it otherwise). The CLI leaves these
rules to the validation: its refusal is the validation's own message."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kforcing_kernels.app.files import CheckpointError
from kforcing_kernels.app.train import main
from kforcing_kernels.app.training.config import ConfigError, TrainConfig
from kforcing_kernels.app.training.validation import (
    CHOICES,
    NON_NEGATIVE_INTS,
    POSITIVE_INTS,
    check_batch_divides,
    validate_config,
)


@pytest.fixture
def base(tmp_path) -> TrainConfig:
    """A stage0 config every rule accepts (its out folder does not exist yet)."""
    return TrainConfig(out=str(tmp_path / "run"), device="cpu")


# The entries a stage's model.json must hold (app/records.py, MODEL_JSON_FIELDS): what the teacher rule reads.
TEACHER_RECORD = {"k": 0, "kind": "ar", "model_config": {}, "tensors": {"sha256": "0" * 64}}


@pytest.fixture
def trained_teacher(tmp_path) -> str:
    """A folder the teacher rule counts as a trained AR stage: its model.json, as its kind reads it."""
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps(TEACHER_RECORD))
    return str(folder)


def test_the_base_config_is_valid(base, tmp_path):
    validate_config(base)
    validate_config(base, world=1)
    assert not (tmp_path / "run").exists()  # validation touches no folder


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_a_setting_outside_its_choices_is_refused_by_name(base, name):
    with pytest.raises(ConfigError, match=rf"^{name}: expected one of \("):
        validate_config(dataclasses.replace(base, **{name: "no-such-value"}))


@pytest.mark.parametrize("name", POSITIVE_INTS)
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_positive_ints_are_refused_by_name(base, name, value):
    with pytest.raises(ConfigError, match=rf"^{name}: expected a positive int, got {value!r}"):
        validate_config(dataclasses.replace(base, **{name: value}))


@pytest.mark.parametrize("name", NON_NEGATIVE_INTS)
@pytest.mark.parametrize("value", [-1, 0.5, False])
def test_non_negative_ints_are_refused_by_name(base, name, value):
    with pytest.raises(ConfigError, match=rf"^{name}: expected an int >= 0, got {value!r}"):
        validate_config(dataclasses.replace(base, **{name: value}))


def test_seed_is_an_int(base):
    validate_config(dataclasses.replace(base, seed=-3))  # any int
    with pytest.raises(ConfigError, match=r"^seed: expected an int, got '1'"):
        validate_config(dataclasses.replace(base, seed="1"))


def test_a_real_setting_out_of_range_is_refused_by_name(base):
    # Every real setting and bad value is tried in python_tests/test_real_settings.py; here the rule's place.
    with pytest.raises(ConfigError, match=r"^lr: expected"):
        validate_config(dataclasses.replace(base, lr=float("nan")))


def test_tau_min_above_tau_max_names_both_options(base):
    validate_config(dataclasses.replace(base, tau_min=0.7, tau_max=0.7))  # one temperature
    with pytest.raises(ConfigError, match=r"^tau_min: expected <= tau_max \(--tau-min <= --tau-max\), got tau_min=0.9"):
        validate_config(dataclasses.replace(base, tau_min=0.9, tau_max=0.5))


@pytest.mark.parametrize("device", ["gpu0", "cuda:99"])
def test_a_device_this_machine_lacks_is_refused_by_name(base, device):
    with pytest.raises(ConfigError, match=r"^device: "):
        validate_config(dataclasses.replace(base, device=device))


# ---------------------------------------------------------------------- the teacher


def test_a_distilled_stage_needs_a_teacher(base):
    with pytest.raises(ConfigError, match=r"^teacher: stage1 needs --teacher \(the stage0 folder\) or --model"):
        validate_config(dataclasses.replace(base, stage="stage1"))
    with pytest.raises(ConfigError, match=r"^teacher: stage2 needs --teacher \(the previous stage's folder\)"):
        validate_config(dataclasses.replace(base, stage="stage2"))


def test_the_teacher_must_hold_a_trained_model(base, tmp_path, trained_teacher):
    validate_config(dataclasses.replace(base, stage="stage1", teacher=trained_teacher))
    with pytest.raises(ConfigError, match=r"^teacher: no trained model in .*model\.json"):
        validate_config(dataclasses.replace(base, stage="stage1", teacher=str(tmp_path / "empty")))


def test_a_teacher_model_json_its_kind_cannot_read_is_refused_naming_the_file(base, trained_teacher):
    record = {**TEACHER_RECORD, "tensors": {"sha256": "not a digest"}}
    (Path(trained_teacher) / "model.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"teacher/model\.json: malformed: 'tensors.sha256' is 'not a digest'"):
        validate_config(dataclasses.replace(base, stage="stage1", teacher=trained_teacher))


def test_the_teacher_folder_is_not_the_stages_own(base, trained_teacher):
    with pytest.raises(ConfigError, match=r"^out: .* is the teacher's folder \(--teacher\)"):
        validate_config(dataclasses.replace(base, stage="stage1", teacher=trained_teacher, out=trained_teacher))


# ---------------------------------------------------------------------- the model


def test_model_overrides_name_model_config_fields(base):
    validate_config(dataclasses.replace(base, model_overrides={"n_layer": 1}))
    with pytest.raises(ConfigError, match=r"^model_overrides: colour is not a model setting"):
        validate_config(dataclasses.replace(base, model_overrides={"colour": 1}))


def test_a_native_model_the_model_config_refuses_is_refused_before_any_step(base):
    with pytest.raises(ConfigError, match=r"^model_overrides: "):
        validate_config(dataclasses.replace(base, model_overrides={"n_head": 3, "n_embd": 64}))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model="M", model_config="C.json"), r"^model_config: --model .* and --model-config .* pass one"),
        (dict(stage="stage1", model_config="C.json", teacher="T"), r"^model_config: only stage0 builds"),
        (dict(model="M"), r"^model: --model is a pretrained AR teacher, .* got stage 'stage0'"),
        (dict(stage="stage1", model="M", teacher="T"), r"^teacher: --model is stage1's teacher; pass --model or"),
        (dict(model_config="C.json", model_overrides={"n_layer": 2}), r"^model_overrides: --model-config gives"),
    ],
)
def test_the_model_sources_rules_are_the_hf_kinds_and_name_the_option(base, change, message):
    # Refused by the kind that reads --model / --model-config (ModelKind.check_stage_options), before any file is read.
    with pytest.raises(ConfigError, match=message):
        validate_config(dataclasses.replace(base, **change))


def test_a_model_source_that_is_not_there_is_refused_naming_the_option(base, tmp_path):
    # The folder / file itself, as the kind reads it (ModelKind.check_options), for the API as for the CLI.
    missing = str(tmp_path / "no-model")
    with pytest.raises(CheckpointError, match=r"^model: cannot read .*config\.json.*--model"):
        validate_config(dataclasses.replace(base, stage="stage1", model=missing, teacher=missing))
    with pytest.raises(CheckpointError, match=r"^model_config: cannot read a transformers config .*--model-config"):
        validate_config(dataclasses.replace(base, model_config=str(tmp_path / "no-config.json")))


# ---------------------------------------------------------------------- what only stage1 chooses


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(decode="residual"), r"^decode: the decoding rule is chosen in stage1"),
        (dict(supervision="noise_inversion"), r"^supervision: noise_inversion distils the AR teacher \(stage1\)"),
        (dict(k=2), r"^k: only stage1 with noise_inversion sets the window"),
    ],
)
def test_stage1_settings_are_refused_at_other_stages(base, trained_teacher, change, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(dataclasses.replace(base, **change))
    stage1 = dataclasses.replace(base, stage="stage1", teacher=trained_teacher, **change)
    if "k" in change:
        with pytest.raises(ConfigError, match=message):  # forward distillation has k = 1
            validate_config(stage1)
        stage1 = dataclasses.replace(stage1, supervision="noise_inversion")
    validate_config(stage1)


# ---------------------------------------------------------------------- ranks


def test_fsdp_refuses_fp16(base):
    validate_config(dataclasses.replace(base, parallel="fsdp", precision="bf16"))
    with pytest.raises(ConfigError, match=r"^precision: --parallel fsdp trains in fp32 or bf16"):
        validate_config(dataclasses.replace(base, parallel="fsdp", precision="fp16"))


@pytest.mark.parametrize("context_parallel", [0, 3, 1.0])
def test_context_parallel_divides_the_world(base, context_parallel):
    with pytest.raises(ConfigError, match=r"^context_parallel: expected a divisor of the world size 4"):
        validate_config(dataclasses.replace(base, context_parallel=context_parallel), world=4)


def test_the_batch_divides_over_data_parallel_ranks_and_accumulation(base):
    validate_config(dataclasses.replace(base, batch_size=8, grad_accum=4))
    with pytest.raises(ConfigError, match=r"^batch_size: expected a multiple of .* = 1 x 4 .*got 6$"):
        validate_config(dataclasses.replace(base, batch_size=6, grad_accum=4))
    # The same rule for another setting (a pipeline's batch_size_distill), with its own ending.
    with pytest.raises(ConfigError, match=r"^batch_size_distill: .* = 2 x 1 \(world size 4 / context_parallel 2\)"):
        check_batch_divides("batch_size_distill", 3, 4, 2, 1, " (stage1 and every stage2)")
    check_batch_divides("batch_size_distill", 4, 4, 2, 1)


# ---------------------------------------------------------------------- the run


@pytest.mark.parametrize("stop_at", [0, 1001])
def test_stop_at_is_a_step_of_the_run(base, stop_at):
    validate_config(dataclasses.replace(base, stop_at=1000))
    with pytest.raises(ConfigError, match=r"^stop_at: expected a step in \[1, steps=1000\]"):
        validate_config(dataclasses.replace(base, stop_at=stop_at))


def test_out_must_be_a_folder(base, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^out: .*file' is a file; --out expects a folder"):
        validate_config(dataclasses.replace(base, out=str(tmp_path / "file")))
    with pytest.raises(ConfigError, match=r"^out: .*file' \(in .*\) is a file"):
        validate_config(dataclasses.replace(base, out=str(tmp_path / "file" / "run")))


def test_resume_and_overwrite_exclude_each_other(base):
    with pytest.raises(ConfigError, match=r"^overwrite: --overwrite starts the run again and --resume continues it"):
        validate_config(dataclasses.replace(base, resume=True, overwrite=True))


# ---------------------------------------------------------------------- the CLI leaves the rules to the validation


@pytest.mark.parametrize(
    "argv, change",
    [
        (["stage0", "--tau-min", "0.9", "--tau-max", "0.5"], dict(tau_min=0.9, tau_max=0.5)),
        (["stage1"], dict(stage="stage1")),
        (["stage0", "--batch-size", "6", "--grad-accum", "4"], dict(batch_size=6, grad_accum=4)),
        # A pipeline checks its first stage before it makes its folder (run_pipeline validates it up front).
        (["pipeline", "--tau-min", "0.9", "--tau-max", "0.5"], dict(tau_min=0.9, tau_max=0.5)),
        (["pipeline", "--batch-size", "6", "--grad-accum", "4"], dict(batch_size=6, grad_accum=4)),
    ],
)
def test_the_cli_refuses_with_the_validations_own_words(tmp_path, capsys, argv, change):
    out = str(tmp_path / "run")
    with pytest.raises(ConfigError) as expected:
        validate_config(TrainConfig(out=out, device="cpu", **change))
    with pytest.raises(SystemExit) as exit_info:
        main([argv[0], "--out", out, "--device", "cpu", *argv[1:]])
    assert exit_info.value.code == 2
    assert f"error: {expected.value}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()

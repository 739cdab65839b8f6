"""The application modules of 0.2 moved in 0.3: importing an old name fails with an error naming the new place
(kforcing_kernels/_moved.py), the CHANGELOG's table lists the same moves, and names that never shipped are not
aliased."""

import importlib
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tqdm")

from helpers import REPO  # noqa: E402
from kforcing_kernels import _moved  # noqa: E402

ROOT = str(REPO)

# The public names each application module defined in 0.2 (recorded from the 0.2.0 sources, commit 326f36c^).
API_0_2 = {
    "train": (
        "DistInfo build_parser config_from_args evaluate_loss learning_rate main setup_distributed train"
    ).split(),
    "train_config": (
        "ConfigError PRECISIONS RUN_FILES STAGES SUPERVISIONS TrainConfig changed_settings check_splits existing_run "
        "prepare_out validate_config"
    ).split(),
    "pipeline": "PerRound PipelineConfig per_round_type run_pipeline".split(),
    "objectives": (
        "Batch Objective compute_loss document_mask forward_distillation_targets make_batch "
        "noise_inversion_supervision self_forcing_targets step_generator window_tokens"
    ).split(),
    "data": (
        "Corpus DEFAULT_SOURCE DataError EOS FORMAT_VERSION default_cache_dir document_offsets file_documents "
        "is_validation load_corpus load_documents sample_windows stdlib_documents"
    ).split(),
    "checkpoint": (
        "CHECKPOINT_FORMAT CheckpointError append_jsonl atomic_write checkpoint_dir clean_run_folder latest_checkpoint "
        "load_checkpoint load_model load_tensors read_checkpoint_meta read_json read_metrics read_model_info "
        "recover_metrics save_checkpoint save_model save_tensors stderr_log write_json write_text"
    ).split(),
    "evaluate": (
        "DEMO_EVAL EvalSettings ar_validation_nll build_parser distinct_n evaluate_pipeline format_nll_table "
        "format_report format_table1 format_tau_table interleaved_timings judge_score load_judge main per_position_nll "
        "plot_summary"
    ).split(),
    "demo": "DEMO LONG PRESETS QUICK build_parser main".split(),
    "inference": (
        "CACHES KVCache Prompts Temperature build_parser generate_ar generate_kforcing main pad_prompts"
    ).split(),
    "serving": "PagedGenerator Request window_layout".split(),
    "paged_cache": "PagePoolFull PagedKVCache paged_backend paged_trunk".split(),
    "cli_common": (
        "DEFAULT_DEVICE DEFAULT_NEW_TOKENS DEFAULT_SEED DEFAULT_TEMPERATURE HelpFormatter RETIRED_FLAGS SHARED_OPTIONS "
        "add_batch_size add_batch_sizes add_command add_device add_new_tokens add_preset add_seed add_temperature "
        "add_threads all_parsers apply_threads checked fraction int_list make_parser non_negative_float "
        "non_negative_int positive_float positive_float_list positive_int resolve_device"
    ).split(),
}

# Module names that existed only inside 0.3's development (the app grouped by job): never released, never aliased.
UNRELEASED = (
    "app.trainer",
    "app.train_config",
    "app.objectives",
    "app.parallel",
    "app.checkpoint",
    "app.pipeline",
    "app.inference",
    "app.paged_cache",
    "app.serving",
    "app.evaluate",
    "app.report",
    "app.hf_student",
    "app.hf_files",
    "app.hf_trainer",
)


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_table_covers_every_0_2_module():
    assert set(_moved.MOVED_0_2) == set(API_0_2)


@pytest.mark.parametrize("old", sorted(_moved.MOVED_0_2))
def test_an_old_module_fails_naming_its_new_place(old):
    new, names = _moved.MOVED_0_2[old]
    sys.modules.pop(f"kforcing_kernels.{old}", None)
    moved = re.escape(f"kforcing_kernels.{old} moved to {new} in kforcing_kernels 0.3")
    with pytest.raises(ModuleNotFoundError, match=moved) as err:
        importlib.import_module(f"kforcing_kernels.{old}")
    assert err.value.name == f"kforcing_kernels.{old}"
    for name, where in names.items():  # every name that is not in the new module is spelled out
        assert f"{name} is {where}" in str(err.value) or f"{name} was {where}" in str(err.value)


@pytest.mark.parametrize("old", sorted(API_0_2))
def test_every_0_2_name_is_where_the_error_says(old):
    new, names = _moved.MOVED_0_2[old]
    module = importlib.import_module(new)
    for name in API_0_2[old]:
        where = names.get(name)
        if where is None:
            assert hasattr(module, name), f"{old}.{name}: not in {new} and not in the table"
        elif not where.startswith("removed"):
            assert _resolve(where) is not None, (old, name, where)
            assert not hasattr(module, name) or where.startswith(new + "."), f"{new}.{name} exists: not in the table"


def test_the_changelog_table_lists_the_same_moves():
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        text = f.read()
    table = text.split("### Moved in 0.3", 1)[1].split("\n### ", 1)[0]
    for old, (new, names) in _moved.MOVED_0_2.items():
        assert f"| `kforcing_kernels.{old}` | `{new}` |" in table, old
        for name in names:
            assert f"`{name}`" in table, (old, name)


@pytest.mark.parametrize("old", UNRELEASED)
def test_names_that_never_shipped_are_not_aliased(old):
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module(f"kforcing_kernels.{old}")
    assert "moved to" not in str(err.value)


def test_renamed_names_are_not_aliased_on_the_new_modules():
    # data.sample_windows was a 0.2 name of kforcing_kernels.data; kforcing_kernels.app.data never had it.
    for module, name in (
        ("kforcing_kernels.app.data", "sample_windows"),
        ("kforcing_kernels.app.training.objectives", "window_tokens"),
        ("kforcing_kernels.app.evaluation.evaluate", "format_table1"),
    ):
        assert not hasattr(importlib.import_module(module), name), (module, name)


def test_python_dash_m_of_an_old_name_says_where_it_went():
    proc = subprocess.run(
        [sys.executable, "-m", "kforcing_kernels.train", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "kforcing_kernels.train moved to kforcing_kernels.app.train" in proc.stderr

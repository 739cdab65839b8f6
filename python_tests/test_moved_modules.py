"""The application modules of 0.2 keep working under their old names for one release (kforcing_kernels/_moved.py)."""

import importlib
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("tqdm")

from kforcing_kernels import _moved  # noqa: E402


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED_MODULES.items()))
def test_old_name_is_the_new_module_with_a_warning(old, new):
    sys.modules.pop(f"kforcing_kernels.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"kforcing_kernels.{old} moved to {new}"):
        module = importlib.import_module(f"kforcing_kernels.{old}")
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # the alias does not rewrite the real module's spec


def test_names_of_the_former_single_module_trainer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from kforcing_kernels.train import TrainConfig, load_model, train
    from kforcing_kernels.app.training.checkpoint import load_model as real_load_model
    from kforcing_kernels.app.training.config import TrainConfig as RealConfig
    from kforcing_kernels.app.training.loop import train as real_train

    assert (TrainConfig, load_model, train) == (RealConfig, real_load_model, real_train)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        importlib.import_module("kforcing_kernels.app.train").not_a_name
    with pytest.raises(AttributeError, match="setup_distributed was removed .*setup_parallel"):
        importlib.import_module("kforcing_kernels.app.train").setup_distributed


def test_python_dash_m_of_an_old_name_runs_the_new_module():
    proc = subprocess.run([sys.executable, "-m", "kforcing_kernels.train", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: kforcing-train")
    assert "kforcing_kernels.train moved to kforcing_kernels.app.train" in proc.stderr


# The public names each application module defined in 0.2 (recorded from the 0.2.0 sources, commit 326f36c^):
# every one is still found through the old module name (issue 40, item 4), renamed ones with a warning.
API_0_2 = {
    "train": (
        "DistInfo build_parser config_from_args evaluate_loss learning_rate main setup_distributed train"
    ).split(),
    "train_config": (
        "ConfigError PRECISIONS RUN_FILES STAGES SUPERVISIONS TrainConfig changed_settings check_splits existing_run prepare_out validate_config"
    ).split(),
    "pipeline": "PerRound PipelineConfig per_round_type run_pipeline".split(),
    "objectives": (
        "Batch Objective compute_loss document_mask forward_distillation_targets make_batch noise_inversion_supervision self_forcing_targets step_generator window_tokens"
    ).split(),
    "data": (
        "Corpus DEFAULT_SOURCE DataError EOS FORMAT_VERSION default_cache_dir document_offsets file_documents is_validation load_corpus load_documents sample_windows stdlib_documents"
    ).split(),
    "checkpoint": (
        "CHECKPOINT_FORMAT CheckpointError append_jsonl atomic_write checkpoint_dir clean_run_folder latest_checkpoint load_checkpoint load_model load_tensors read_checkpoint_meta read_json read_metrics read_model_info recover_metrics save_checkpoint save_model save_tensors stderr_log write_json write_text"
    ).split(),
    "evaluate": (
        "DEMO_EVAL EvalSettings ar_validation_nll build_parser distinct_n evaluate_pipeline format_nll_table format_report format_table1 format_tau_table interleaved_timings judge_score load_judge main per_position_nll plot_summary"
    ).split(),
    "demo": "DEMO LONG PRESETS QUICK build_parser main".split(),
    "inference": (
        "CACHES KVCache Prompts Temperature build_parser generate_ar generate_kforcing main pad_prompts"
    ).split(),
    "serving": "PagedGenerator Request window_layout".split(),
    "paged_cache": "PagePoolFull PagedKVCache paged_backend paged_trunk".split(),
    "cli_common": (
        "DEFAULT_DEVICE DEFAULT_NEW_TOKENS DEFAULT_SEED DEFAULT_TEMPERATURE HelpFormatter RETIRED_FLAGS SHARED_OPTIONS add_batch_size add_batch_sizes add_command add_device add_new_tokens add_preset add_seed add_temperature add_threads all_parsers apply_threads checked fraction int_list make_parser non_negative_float non_negative_int positive_float positive_float_list positive_int resolve_device"
    ).split(),
}
# No equivalent: listed in the CHANGELOG's breaking changes (the error names what replaced them).
REMOVED_0_2 = {("paged_cache", "paged_trunk"), ("train", "DistInfo"), ("train", "setup_distributed")}


@pytest.mark.parametrize("old", sorted(API_0_2))
def test_every_0_2_name_is_found_through_its_old_module(old):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(f"kforcing_kernels.{old}")
    for name in API_0_2[old]:
        if (old, name) in REMOVED_0_2:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(module, name)
        key = (module.__name__, name)
        if key in _moved.RENAMED:
            home, new = _moved.RENAMED[key].split(":")
            assert value is getattr(importlib.import_module(home), new)
            assert any(issubclass(w.category, DeprecationWarning) and f"kforcing_kernels.{old}.{name} is {home}.{new}"
                       in str(w.message) for w in caught), (old, name)


def test_renamed_names_warn_and_removed_ones_say_what_replaced_them():
    from kforcing_kernels.app import data
    from kforcing_kernels.app.training import objectives
    from kforcing_kernels.app.evaluation import report

    with pytest.warns(DeprecationWarning, match="kforcing_kernels.data.sample_windows is kforcing_kernels.app.data.sample_crops"):
        assert data.sample_windows is data.sample_crops
    with pytest.warns(DeprecationWarning, match="removed in 0.4"):
        assert objectives.window_tokens is objectives.crop_tokens
    with pytest.warns(DeprecationWarning):
        from kforcing_kernels.app.evaluation.evaluate import format_table1
    assert format_table1 is report.format_table1
    with pytest.raises(AttributeError, match=r"paged_trunk was removed in kforcing_kernels 0.3: .*cache.views\(rows\)"):
        importlib.import_module("kforcing_kernels.app.generation.paged_cache").paged_trunk
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        importlib.import_module("kforcing_kernels.app.data").not_a_name

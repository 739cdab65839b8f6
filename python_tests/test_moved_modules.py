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
    from kforcing_kernels.app.checkpoint import load_model as real_load_model
    from kforcing_kernels.app.train_config import TrainConfig as RealConfig
    from kforcing_kernels.app.trainer import train as real_train

    assert (TrainConfig, load_model, train) == (RealConfig, real_load_model, real_train)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        importlib.import_module("kforcing_kernels.app.train").not_a_name


def test_python_dash_m_of_an_old_name_runs_the_new_module():
    proc = subprocess.run([sys.executable, "-m", "kforcing_kernels.train", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: kforcing-train")
    assert "kforcing_kernels.train moved to kforcing_kernels.app.train" in proc.stderr

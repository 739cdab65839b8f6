"""Every real-valued setting of every config is refused by name when it is not a finite number in its range (issue 46).

The class, not the case: each config's float fields are found from its annotations, so a float field added later
without an entry in its ``REAL_SETTINGS`` table fails here, and each bad value is tried the way a user meets it
(the constructor, ``train``/``validate_config``, ``run_pipeline``, ``evaluate_pipeline``, the CLIs, generation).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from kforcing_kernels.app.evaluation.evaluate import EvalSettings, evaluate_pipeline
from kforcing_kernels.app.training.config import ConfigError, TrainConfig
from kforcing_kernels.app.training.pipeline import PipelineConfig, run_pipeline
from kforcing_kernels.app.training.validation import validate_config
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.settings import POSITIVE, UNIT_OPEN_HIGH, Real, argparse_type, check_reals

CONFIGS = (ModelConfig, TrainConfig, PipelineConfig, EvalSettings)
NOT_FINITE = (math.nan, math.inf, -math.inf)


def _float_fields(cls) -> list[str]:
    """The fields annotated with a float (``float``, ``Optional[float]``, ``tuple[float, ...]``, the per-round union;
    a per-round step count is an int, checked with the other step counts)."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if "float" in str(f.type) or ("PerRound" in str(f.type) and not f.name.startswith("steps_"))
    ]


def _bad_values(spec: Real) -> list:
    bad = list(NOT_FINITE) + ["1.0", True]
    if spec.low is not None:
        bad.append(spec.low if spec.low_open else spec.low - 1)
    if spec.high is not None:
        bad.append(spec.high if spec.high_open else spec.high + 1)
    return bad


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_float_field_has_a_range(cls):
    fields = _float_fields(cls)
    assert fields, cls  # the annotation scan finds them
    assert sorted(cls.REAL_SETTINGS) == sorted(fields), f"{cls.__name__}: a float field without a range (REAL_SETTINGS)"
    assert all(isinstance(spec, Real) for spec in cls.REAL_SETTINGS.values())


def _cases(cls):
    return [(cls, name, value) for name, spec in cls.REAL_SETTINGS.items() for value in _bad_values(spec)]


@pytest.mark.parametrize("name, value", [(n, v) for _, n, v in _cases(ModelConfig)])
def test_model_config_refuses_by_name(name, value, tmp_path):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        ModelConfig.micro(**{name: value})
    # Through training (model overrides of a native stage0): before any folder is made or any step trained.
    cfg = TrainConfig(out=str(tmp_path / "run"), model_overrides={name: value}, device="cpu")
    with pytest.raises(ConfigError, match=f"model_overrides: {name}: expected"):
        validate_config(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, value", [(n, v) for _, n, v in _cases(TrainConfig)])
def test_train_config_refuses_by_name(name, value, tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), device="cpu", **{name: value})
    with pytest.raises(ConfigError, match=f"^{name}: expected"):
        validate_config(cfg)


@pytest.mark.parametrize("name, value", [(n, v) for _, n, v in _cases(PipelineConfig)])
def test_pipeline_config_refuses_by_name_before_any_stage(name, value, tmp_path):
    pipe = PipelineConfig(out=str(tmp_path / "run"), k_final=2, **{name: value})
    with pytest.raises(ConfigError, match=rf"^{name}( \(--[a-z0-9-]+\))?: expected"):  # lr_stage2 names its option too
        run_pipeline(pipe, TrainConfig(device="cpu"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, value", [(n, v) for _, n, v in _cases(EvalSettings)])
def test_eval_settings_refuse_by_name(name, value, tmp_path):
    wrap = (lambda v: (v,)) if name == "taus" else (lambda v: v)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        EvalSettings(**{name: wrap(value)})
    with pytest.raises(ValueError, match=f"^{name}: expected"):  # before it looks for the run
        evaluate_pipeline(tmp_path / "no_run", **{name: wrap(value)})


def test_an_empty_tau_sweep_is_still_allowed():
    assert EvalSettings(taus=()).taus == ()


@pytest.mark.parametrize("tau", [math.nan, math.inf, -1.0])
def test_generation_temperatures_are_refused_by_name(tau):
    """Decoding and serving: generate_* and the paged Request refuse a bad tau by name (check_temperature)."""
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.app.generation.serving import PagedGenerator, Request

    model = KForcingLM(ModelConfig.micro()).eval()
    model.k_train = 2
    with pytest.raises(ValueError, match="^temperature: expected"):
        generate_kforcing(model, [[1, 2]], 2, 3, temperature=tau)
    with pytest.raises(ValueError, match="^temperature: expected"):
        PagedGenerator(model, 2, num_pages=8).step([Request([1, 2], 3, temperature=tau)])
    model.k_train = 0
    with pytest.raises(ValueError, match="^temperature: expected"):
        generate_ar(model, [[1, 2]], 3, temperature=tau)


def test_the_cli_type_and_the_config_check_say_the_same():
    import argparse

    parse = argparse_type(UNIT_OPEN_HIGH)
    assert parse("0.5") == 0.5
    for text in ("nan", "inf", "1", "-0.1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected a number in \[0, 1\)"):
            parse(text)

    @dataclasses.dataclass
    class Settings:
        a: float = 1.0
        b: list = dataclasses.field(default_factory=lambda: [1.0, 2.0])

    check_reals(Settings(), {"a": POSITIVE, "b": POSITIVE})
    with pytest.raises(ValueError, match=r"^b: expected a positive number, got nan \(in \[1.0, nan\]\)"):
        check_reals(Settings(b=[1.0, math.nan]), {"a": POSITIVE, "b": POSITIVE})

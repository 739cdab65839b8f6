"""The vLLM integration's stage checks (no vLLM needed: runs in the main suite): what load_pflm refuses, read_stage
refuses, naming the file."""

import json

import pytest

pytest.importorskip("transformers")

from bench.inference.vllm_models import build_stage  # noqa: E402
from kforcing_kernels.app.hf_recipe import files as hf_files  # noqa: E402
from kforcing_kernels.integrations.vllm.stage import HF_STAGE_FORMAT, StageError, read_stage  # noqa: E402


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    return build_stage(tmp_path_factory.mktemp("stage") / "s", "llama", k=2, hidden=32)


def test_the_stage_format_is_the_recipes():
    assert HF_STAGE_FORMAT == hf_files.HF_FORMAT and hf_files.NOISE_FILE == "noise_embedding.safetensors"


def test_a_good_stage_reads(stage):
    assert read_stage(stage)["k"] == 2


def test_a_corrupt_weight_file_is_refused(stage, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(stage, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(StageError, match="model.safetensors: truncated or corrupt"):
        read_stage(bad)


def test_an_old_noise_format_and_a_native_stage_are_refused(stage, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(stage, old)
    info = json.loads((old / "model.json").read_text())
    info["noise_embedding"]["format"] = 1
    (old / "model.json").write_text(json.dumps(info))
    with pytest.raises(StageError, match="noise embedding is format 1"):
        read_stage(old)
    native = tmp_path / "native"
    native.mkdir()
    (native / "model.json").write_text(json.dumps({"k": 2, "model_config": {}}))
    with pytest.raises(StageError, match="native reference model is not served"):
        read_stage(native)

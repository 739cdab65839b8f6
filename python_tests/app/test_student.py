"""The seam between model kinds (kforcing_kernels/app/student.py): both models implement the Student protocol, the
registry finds the kind of a model and of a folder, and a kind registered from outside is used by every caller."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from kforcing_kernels.app import student as registry  # noqa: E402
from kforcing_kernels.app.student import ModelKind, Student  # noqa: E402
from kforcing_kernels.model import KForcingLM, ModelConfig  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, seq_len=16, noise_features=16, tau_features=4)


def _hf_student():
    transformers = pytest.importorskip("transformers")
    import kforcing_kernels.integrations.hf  # noqa: F401  (registers "kforcing")
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return HFStudent(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing"))


def test_the_native_model_is_a_student_of_the_native_kind():
    model = KForcingLM(CONFIG)
    assert isinstance(model, Student)
    assert registry.kind_of(model).name == "native"
    assert model.decoder_layers() == list(model.blocks)
    assert model.tied_keys() == (["head.weight"] if CONFIG.tie_embeddings else [])
    # A module that declares no kind is the default kind's, as before the registry (anything not HF was native).
    assert registry.kind_of(torch.nn.Linear(2, 2)).name == registry.DEFAULT_KIND


def test_the_hf_student_is_a_student_of_the_hf_kind():
    model = _hf_student()
    assert isinstance(model, Student)
    kind = registry.kind_of(model)
    assert kind.name == "hf" and not kind.sized_by_preset and kind.tokenizer_from_model
    assert model.decoder_layers() == list(model.hf.model.layers)
    with pytest.raises(ValueError, match="decode: residual decoding is not available for a Hugging Face student"):
        kind.with_decode(model, "residual")


def test_folders_are_told_apart_by_the_registry(tmp_path):
    from kforcing_kernels.app.training.checkpoint import save_model

    native = tmp_path / "native"
    save_model(native, KForcingLM(CONFIG), {"k": 0})
    source = tmp_path / "hf_source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    stage = tmp_path / "hf_stage"
    stage.mkdir()
    (stage / "model.json").write_text(json.dumps({"hf_format": 1}))
    assert registry.find_kind(native).name == "native"
    assert registry.find_kind(source).name == "hf"
    assert registry.find_kind(stage).name == "hf"
    assert registry.find_kind(tmp_path / "missing") is None and registry.find_kind(tmp_path) is None
    assert registry.kind_of_folder(tmp_path).name == registry.DEFAULT_KIND  # whose loader names what is missing
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "model.json").write_text(json.dumps({"model_kind": "hf"}))  # a kind's save records its name
    assert registry.recorded_kind(recorded) == "hf" and registry.find_kind(recorded).name == "hf"
    assert registry.recorded_kind(native) is None  # saved by checkpoint.save_model directly, not through the kind
    model, info, _ = registry.load_student(native)
    assert isinstance(model, KForcingLM) and info["k"] == 0 and model.k_train == 0
    assert registry.kind_of_folder(native).identity(native) == info["tensors"]["sha256"]


class _MarkerKind(ModelKind):
    """A kind from outside the package: folders holding ``marker.txt``, loaded as a fresh native model."""

    name = "marker"

    def holds(self, folder):
        return (Path(folder) / "marker.txt").is_file()

    def load(self, folder, device="cpu"):
        return KForcingLM(CONFIG), {"k": 0, "tensors": {"sha256": "marker"}}, None

    def identity(self, folder):
        return "marker"

    def build(self, cfg, generator):
        raise NotImplementedError

    def build_like(self, model):
        return KForcingLM(model.config)

    def save(self, folder, model, info, corpus):
        (Path(folder) / "marker.txt").write_text("saved")

    def corpus(self, teacher, data, vocab_size, verbose=False):
        raise NotImplementedError

    def generate_kforcing(self, model, tokens, lengths, noise, temperature, **kw):
        return torch.full((tokens.shape[0], kw["max_new_tokens"]), 7), None

    def generate_ar(self, model, tokens, lengths, noise, temperature, **kw):
        return torch.full((tokens.shape[0], kw["max_new_tokens"]), 5), None


def test_a_registered_kind_serves_every_caller(tmp_path, monkeypatch):
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.app.training.config import teacher_sha256

    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_LOADED", dict(registry._LOADED))
    registry.register_kind("marker", _MarkerKind())
    (tmp_path / "marker.txt").write_text("")
    assert registry.find_kind(tmp_path).name == "marker"
    assert teacher_sha256(str(tmp_path)) == "marker"  # the trainer's resume check asks the kind
    model = KForcingLM(CONFIG)
    model.kind = "marker"
    model.k_train = 2
    assert generate_kforcing(model, [[1, 2]], 2, 3, temperature=1.0).tolist() == [[7, 7, 7]]
    model.k_train = 0
    assert generate_ar(model, [[1, 2]], 3, temperature=1.0).tolist() == [[5, 5, 5]]
    with pytest.raises(ValueError, match="kind: expected one of"):
        registry.kind_named("nothing")
    with pytest.raises(ValueError, match="where: expected a ModelKind"):
        registry.register_kind("bad", 3)


def test_both_models_take_the_protocols_arguments():
    # The methods the trainer calls by keyword: each implementation starts with the protocol's parameters, in order
    # (an extra trailing one, such as HFStudent.single_forward's keep_cache, must have a default).
    import inspect

    pytest.importorskip("transformers")
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    for name in (
        "forward",
        "single_forward",
        "double_forward",
        "context_parallel_forward",
        "embed_noise",
        "reset_noise_encoder",
        "decoder_layers",
        "tied_keys",
    ):
        want = list(inspect.signature(getattr(Student, name)).parameters)
        for cls in (KForcingLM, HFStudent):
            params = inspect.signature(getattr(cls, name)).parameters
            assert list(params)[: len(want)] == want, (cls.__name__, name)
            assert all(p.default is not p.empty for p in list(params.values())[len(want) :]), (cls.__name__, name)

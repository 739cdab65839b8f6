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


def test_a_registered_kind_serves_every_caller(tmp_path):
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.app.training.provenance import teacher_sha256

    registry.register_kind("marker", _MarkerKind())
    try:
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
    finally:
        registry.unregister_kind("marker")
    assert "marker" not in registry.kind_names() and registry.find_kind(tmp_path) is None
    with pytest.raises(ValueError, match="kind: expected one of"):
        registry.unregister_kind("marker")


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


# ---------------------------------------------------------------------- the seam is asked, never probed

import ast  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "kforcing_kernels"
# The kinds' own modules (and the registry, whose kind_of reads a module's declared kind): the only places that may
# probe a model or a kind for an attribute.
KIND_MODULES = ("app/native.py", "app/student.py", "app/hf_recipe/")
# Names the generic code gives a model (or a wrapper of one) or a kind.
MODEL_NAMES = {"model", "student", "teacher", "pflm", "judge", "inner", "final", "copy", "head", "kind", "net"}
KIND_CALLS = {"kind_of", "kind_named", "kind_of_folder", "find_kind", "stage_kind", "kind_of_config", "unwrap"}


def _names_a_model_or_kind(node: ast.expr) -> bool:
    """Whether ``node`` (getattr's first argument) is a model or a kind: a model-like name (``model``,
    ``hf_model``), an attribute of one (``model.config``, ``stage.student``), or what the registry returns."""
    while True:
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in KIND_CALLS:
                return True
            node = func
        elif isinstance(node, ast.Attribute):
            if node.attr in MODEL_NAMES or node.attr.endswith("_model") or node.attr == "config":
                return True
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id in MODEL_NAMES or node.id.endswith("_model")
        else:
            return False


def duck_typed_sites(source: str) -> list[str]:
    """``getattr`` / ``hasattr`` calls on a model or a kind in ``source``: ``"line: text"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and _names_a_model_or_kind(node.args[0])
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_getattr_or_hasattr_on_a_model_or_kind_outside_the_kinds():
    """The generic code asks the kind (ModelKind's members) or the Student protocol, never probes the object: every
    capability it needs is a member, and a kind without it refuses by name."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(KIND_MODULES) or not rel.startswith(("app/", "sdpa.py", "tools/")):
            continue
        offenders += [f"{rel}:{site}" for site in duck_typed_sites(path.read_text())]
    assert offenders == [], "\n".join(offenders)


def test_the_duck_typing_finder_sees_planted_sites():
    planted = """
hasattr(model, "wte")
getattr(kind_of(model), "static_step", False)
getattr(model.config, "decode", "argmax")
getattr(stage.student, "k_train", None)
getattr(hf_model, "hf_tokenizer", None)
getattr(args, "model", None)
getattr(os, "O_NOFOLLOW", 0)
getattr(noise, "shape", ())
"""
    assert [site.split(": ")[1] for site in duck_typed_sites(planted)] == [
        "hasattr(model, 'wte')",
        "getattr(kind_of(model), 'static_step', False)",
        "getattr(model.config, 'decode', 'argmax')",
        "getattr(stage.student, 'k_train', None)",
        "getattr(hf_model, 'hf_tokenizer', None)",
    ]


def test_the_native_kind_answers_what_the_generic_code_asks():
    model = KForcingLM(CONFIG)
    kind = registry.kind_of(model)
    assert kind.generation_options(None, None, False) == {"cache": "paged", "page_size": 16, "compile_step": False}
    assert kind.generation_options("contiguous", 4, True)["cache"] == "contiguous"
    assert kind.config_dict(model) == CONFIG.to_dict() and kind.decode_rule(model) == CONFIG.decode
    assert registry.kind_of_config(CONFIG.to_dict()) is kind  # a native checkpoint's exporter is its kind
    assert registry.kind_of_config({"model_type": "llama"}).name == "hf"


def test_a_kind_without_a_capability_refuses_it_by_name():
    from kforcing_kernels.app.generation.inference import generate_kforcing
    from kforcing_kernels.app.generation.serving import PagedGenerator

    kind = _MarkerKind()
    assert kind.generation_options(None, None, False) == {"cache": None, "page_size": None, "compile_step": False}
    model = KForcingLM(CONFIG)
    for args, option in (
        (("paged", None, False), "cache"),
        ((None, 8, False), "page_size"),
        ((None, None, True), "compile_step"),
    ):
        with pytest.raises(registry.CapabilityError, match=f"^{option}: "):
            kind.generation_options(*args)
    for ask in (lambda: kind.config_dict(model), lambda: kind.eos_id(model, None), lambda: kind.check_serving(model)):
        with pytest.raises(registry.CapabilityError, match="^model: "):
            ask()
    with pytest.raises(registry.CapabilityError, match="^checkpoint: "):
        kind.export_sharded("ckpt", "out", {}, {})
    # Through the public entry points: a model of that kind.
    model.kind, model.k_train = "marker", 2
    registry.register_kind("marker", kind)
    try:
        with pytest.raises(ValueError, match="^cache: "):
            generate_kforcing(model, [[1, 2]], 2, 3, cache="contiguous")
        with pytest.raises(registry.CapabilityError, match="PagedGenerator"):
            PagedGenerator(model, 2, num_pages=4)
    finally:
        registry.unregister_kind("marker")

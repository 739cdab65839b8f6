"""The vLLM integration's stage checks (no vLLM needed: runs in the main suite): what load_pflm refuses, read_stage
refuses, naming the file."""

import json

import pytest

pytest.importorskip("transformers")

from bench.inference.vllm_models import build_stage  # noqa: E402
from helpers.vllm_engine import eos_marker_corpus  # noqa: E402
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
    with pytest.raises(StageError, match="a native stage folder .*python -m kforcing_kernels.app.vllm_export"):
        read_stage(native)


def test_an_hf_stage_saves_the_packages_rule_for_special_token_text(tmp_path):
    # The package encodes <|eos|> in text as ordinary tokens (load_tokenizer, Corpus.encode, load_pflm's tokenizer);
    # the tokenizer a stage folder saves must read text the same way for AutoTokenizer and vLLM (split_special_tokens
    # in its tokenizer_config.json), the caller's tokenizer left as it was.
    import transformers
    from transformers import AutoTokenizer

    from bench.inference.vllm_models import config
    from kforcing_kernels.app.data import EOS
    from kforcing_kernels.app.hf_recipe.student import HFStudent
    from kforcing_kernels.app.hf_recipe.trainer import save_pflm

    corpus = eos_marker_corpus(tmp_path)
    tok = hf_files.hf_tokenizer_of(corpus)
    hf = transformers.AutoModelForCausalLM.from_config(
        config("llama", vocab=corpus.tokenizer.get_vocab_size(), hidden=32, layers=1), attn_implementation="kforcing"
    )
    save_pflm(HFStudent(hf, k_train=2), tmp_path / "stage", tokenizer=tok)
    text = f"print('{EOS}')\nx = 1 {EOS} 2 {EOS}{EOS}"
    want = corpus.encode(text)
    assert corpus.eos_id not in want
    assert AutoTokenizer.from_pretrained(str(tmp_path / "stage")).encode(text) == want
    assert hf_files.load_hf_stage(tmp_path / "stage")[2].encode(text).ids == want
    assert corpus.eos_id in tok.encode(text)  # the caller's tokenizer (the control): not changed by the save


# ---------------------------------------------------------------------- the native model's export


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(a native stage folder written by save_model, k_train 2; its vLLM export)."""
    from bench.inference.vllm_models import build_native_stage
    from kforcing_kernels.app.vllm_export import export_for_vllm

    root = tmp_path_factory.mktemp("native")
    folder = build_native_stage(root / "stage", k=2, n_embd=32)
    export_for_vllm(folder, root / "export")
    return folder, root / "export"


def test_the_native_export_reads_and_says_what_it_holds(native):
    folder, exported = native
    info = read_stage(exported)
    assert (info["k"], info["decode"], info["native_export"]) == (2, "argmax", 1)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["KForcingNativeForCausalLM"] and config["hidden_act"] == "gelu"
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (32, 128, 2)
    assert set(info["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert info["source_sha256"] == json.loads((folder / "model.json").read_text())["tensors"]["sha256"]
    from kforcing_kernels.integrations.vllm import architecture_of

    assert architecture_of(exported) == "KForcingNativeForCausalLM"


def test_the_package_refuses_to_load_an_export_naming_its_source(native, tmp_path):
    # An export is vLLM's folder (its model.json is not the package's): every loader says what it is and which
    # folder to load instead, before any native or HF loader check.
    from kforcing_kernels.app.files import CheckpointError
    from kforcing_kernels.app.hf_recipe.trainer import load_pflm
    from kforcing_kernels.app.student import load_student
    from kforcing_kernels.app.vllm_export import export_for_vllm

    folder, exported = native
    want = f"{exported}: a vLLM export of '{folder}' .*; load the source stage folder"
    for load in (load_student, load_pflm):
        with pytest.raises(CheckpointError, match=want):
            load(exported)
    with pytest.raises(CheckpointError, match=want):  # nor exported again
        export_for_vllm(exported, tmp_path / "again")
    assert load_student(folder)[1]["k"] == 2  # the source loads


def test_the_exported_tensors_are_the_native_models(native):
    # Every native tensor is in the export, under vLLM's Llama names, bit for bit; the noise embedding loaded from
    # the export (the HF NoiseEmbedding the vLLM model calls) embeds (z, tau) exactly as the native model does.
    import torch
    from safetensors.torch import load_file

    from kforcing_kernels.app.student import load_student
    from kforcing_kernels.integrations.vllm.stage import load_noise_embedding

    folder, exported = native
    model = load_student(folder)[0]
    backbone = load_file(str(exported / "model.safetensors"))
    state = model.state_dict()
    assert torch.equal(backbone["model.layers.1.self_attn.qkv_proj.weight"], state["blocks.1.attn.qkv.weight"])
    assert torch.equal(backbone["model.layers.0.mlp.fc.weight"], state["blocks.0.mlp.fc.weight"])
    assert torch.equal(backbone["lm_head.weight"], state["head.weight"])
    native_backbone = [n for n in state if not n.startswith("noise_encoder.")]
    assert len(backbone) == len(native_backbone)
    assert sum(t.numel() for t in backbone.values()) == sum(state[n].numel() for n in native_backbone)
    noise = load_noise_embedding(exported, read_stage(exported))
    z = torch.rand(5, 3, generator=torch.Generator().manual_seed(0))
    tau = torch.tensor([0.5, 0.7, 1.0, 1.3, 2.0])
    with torch.no_grad():
        assert torch.equal(noise(z, tau), model.embed_noise(z, tau))


def test_the_tensor_mapping_refuses_a_tensor_it_does_not_know():
    import torch

    from kforcing_kernels.integrations.vllm.export import vllm_tensors

    with pytest.raises(ValueError, match="no tensor 'blocks.0.attn.q_norm.weight'"):
        vllm_tensors({"blocks.0.attn.q_norm.weight": torch.zeros(2)}, tie_embeddings=True)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "noise_embedding.safetensors"])
def test_a_corrupt_exported_file_is_refused_by_name(native, tmp_path, name):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(native[1], bad)
    with open(bad / name, "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\x00\x01" if f.read(2) != b"\x00\x01" else b"\x01\x00")
    with pytest.raises(StageError, match=f"{name}: .*corrupt"):
        read_stage(bad)


def test_an_ar_stage_exports_as_a_plain_autoregressive_model(native, tmp_path):
    # The AR baseline on the native backbone: the teacher (k = 0) exported without the noise encoder, served with no
    # speculative config; read_stage checks its files as any export's; a noise file planted beside it is refused
    # (vLLM would load it as the model's).
    import shutil

    from bench.inference.vllm_models import build_native_stage
    from kforcing_kernels.app.vllm_export import export_for_vllm
    from kforcing_kernels.integrations.vllm import engine_kwargs, serve_args
    from kforcing_kernels.integrations.vllm.stage import NOISE_FILE

    ar = build_native_stage(tmp_path / "ar", k=0, n_embd=32)
    export_for_vllm(ar, tmp_path / "ar_out")
    info = read_stage(tmp_path / "ar_out")
    assert info["k"] == 0 and "noise_embedding" not in info and not (tmp_path / "ar_out" / NOISE_FILE).exists()
    config = json.loads((tmp_path / "ar_out" / "config.json").read_text())
    assert config["architectures"] == ["KForcingNativeARForCausalLM"]
    kwargs = engine_kwargs(tmp_path / "ar_out", enforce_eager=True)
    assert "speculative_config" not in kwargs and kwargs["hf_overrides"]["architectures"] == config["architectures"]
    assert serve_args(tmp_path / "ar_out") == [
        str(tmp_path / "ar_out"),
        "--hf-overrides",
        json.dumps(kwargs["hf_overrides"]),
    ]
    with pytest.raises(ValueError, match="an AR stage .* expected k None or 1, got 2"):
        engine_kwargs(tmp_path / "ar_out", 2)
    # The K-Forced export of the same backbone over it: its noise file is removed when the AR export replaces it.
    export_for_vllm(native[0], tmp_path / "over")
    export_for_vllm(ar, tmp_path / "over")
    assert read_stage(tmp_path / "over")["k"] == 0
    planted = tmp_path / "planted"
    shutil.copytree(tmp_path / "ar_out", planted)
    shutil.copy(native[1] / NOISE_FILE, planted / NOISE_FILE)
    with pytest.raises(StageError, match="holds no noise embedding"):
        read_stage(planted)
    with open(planted / "model.safetensors", "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\x00\x01" if f.read(2) != b"\x00\x01" else b"\x01\x00")
    (planted / NOISE_FILE).unlink()
    with pytest.raises(StageError, match="model.safetensors: truncated or corrupt"):
        read_stage(planted)


def test_what_the_export_refuses(native, tmp_path, stage):
    import shutil

    from kforcing_kernels.app.vllm_export import ExportError, export_for_vllm, main

    with pytest.raises(ExportError, match="serves .* as it is"):
        export_for_vllm(stage, tmp_path / "hf")
    with pytest.raises(ExportError, match="is the stage folder itself"):
        export_for_vllm(native[0], native[0])
    lost = tmp_path / "lost"
    shutil.copytree(native[0], lost)
    (lost / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="tokenizer.json: missing"):
        export_for_vllm(lost, tmp_path / "lost_out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match="not empty and holds no earlier vLLM export"):
        export_for_vllm(native[0], tmp_path / "busy")
    with pytest.raises(SystemExit):
        main([str(native[0]), "--out", str(tmp_path / "short"), "--max-positions", "0"])
    main([str(native[0]), "--out", str(tmp_path / "cli")])
    main([str(native[0]), "--out", str(tmp_path / "cli")])  # over an earlier export: replaced, the same bytes
    assert read_stage(tmp_path / "cli")["files"] == read_stage(native[1])["files"]

"""Exporting a Hugging Face student's sharded checkpoint (``sharded_checkpoint`` CLI / ``export_model``) where the run
is not finished or its teacher moved: the tokenizer comes from where the trainer took it, or from --tokenizer, and
is refused unless it is the run's. (Finished FSDP runs at 1 and 4 ranks: test_train_mesh.py, bit for bit.)"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.train_helpers import micro_config, write_json_package  # noqa: E402
from kforcing_kernels.app.data import EOS  # noqa: E402
from kforcing_kernels.app.files import CheckpointError, literal_specials, tokenizer_sha256  # noqa: E402
from kforcing_kernels.app.hf_recipe.export import _hf_tokenizer  # noqa: E402
from kforcing_kernels.app.hf_recipe.files import load_hf_stage  # noqa: E402
from kforcing_kernels.app.training.checkpoint import latest_checkpoint  # noqa: E402
from kforcing_kernels.app.training.loop import train  # noqa: E402
from kforcing_kernels.app.training.sharded_checkpoint import export_model  # noqa: E402

LLAMA = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_an_interrupted_stage0_exports_with_the_packages_tokenizer(tmp_path, monkeypatch):
    """Stage 0 of a --model-config run under FSDP2, stopped after step 1: its export is a stage folder with the run's
    BPE (eos token set), and its weights are a one-process step's within rounding (an independent run, no DCP)."""
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    corpus = write_json_package(tmp_path / "corpus")
    (tmp_path / "llama.json").write_text(transformers.LlamaConfig(**LLAMA).to_json_string())
    base = micro_config(tmp_path / "unused", corpus, vocab_size=300, model_config=str(tmp_path / "llama.json"))
    train(dataclasses.replace(base, out=str(tmp_path / "fsdp"), parallel="fsdp", steps=2, stop_at=1, ckpt_every=1))
    train(dataclasses.replace(base, out=str(tmp_path / "one"), steps=1))  # the same first step in one process
    assert not (tmp_path / "fsdp" / "model.json").exists() and latest_checkpoint(tmp_path / "fsdp").suffix == ".dcp"

    export_model(latest_checkpoint(tmp_path / "fsdp"), tmp_path / "export")
    model, info, tokenizer = load_hf_stage(tmp_path / "export")
    reference, ref_info, _ = load_hf_stage(tmp_path / "one")
    assert info["k"] == 0 and info["step"] == 1 and info["tokenizer_sha256"] == ref_info["tokenizer_sha256"]
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export")).eos_token == EOS
    want = reference.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-4, atol=1e-6, msg=name)


def _hf_tokenizer_folder(folder, text: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["</s>", "<unk>"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    tok.save_pretrained(folder)
    return tokenizer_sha256(literal_specials(transformers.AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer))


def test_a_moved_teacher_is_named_and_tokenizer_takes_its_place(tmp_path):
    teacher_copy = tmp_path / "teacher_copy"
    sha = _hf_tokenizer_folder(teacher_copy, "def f(x):\n    return x\n")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004.dcp"
    manifest = {
        "info": {"k": 2, "teacher": str(tmp_path / "moved_away"), "tokenizer_sha256": sha},
        "train_config": {"teacher": "moved_away"},
    }
    with pytest.raises(CheckpointError, match=r"^tokenizer: the run's teacher .*moved_away.* is not here.*--tokenizer"):
        _hf_tokenizer(checkpoint, manifest, None)
    tok = _hf_tokenizer(checkpoint, manifest, teacher_copy)
    assert tok.eos_token == "</s>"  # the teacher's own, not the package's
    other = tmp_path / "other"
    _hf_tokenizer_folder(other, "completely different text with other merges")
    with pytest.raises(CheckpointError, match=r"^tokenizer: --tokenizer .* is not the tokenizer this run was trained"):
        _hf_tokenizer(checkpoint, manifest, other)

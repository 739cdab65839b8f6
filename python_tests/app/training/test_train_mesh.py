"""One device mesh for every parallelism (app/training/parallel.py): FSDP2 with context parallelism, a sharded teacher,
and Hugging Face students under FSDP2 with activation checkpointing, each against a single process.

One torchrun launch (4 ranks, gloo on CPU; nccl when CUDA has >= 4 GPUs) runs mesh_worker.py; the references
are single-process runs of the same settings (fsdp_settings.stage2_config: three self-forcing steps on packed
documents, fp32). A 4-rank step sums the same per-sequence gradients in another order, so gradients agree
within rtol 1e-4 and the first loss within rel 1e-5 (as in test_train_fsdp.py); activation checkpointing and
resuming a sharded checkpoint are bitwise.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers.fsdp_settings import stage2_config
from helpers.train_helpers import REPO, torchrun, write_json_package
from kforcing_kernels.app.student import load_student
from kforcing_kernels.app.training.checkpoint import latest_checkpoint, read_metrics
from kforcing_kernels.app.training.loop import train

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 4 else "cpu"
BACKEND_OK = dist.is_available() and (dist.is_nccl_available() if DEVICE == "cuda" else dist.is_gloo_available())
needs_dist = pytest.mark.skipif(
    not BACKEND_OK, reason=f"torch.distributed with {'nccl' if DEVICE == 'cuda' else 'gloo'} is not available"
)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)


def losses(run: Path) -> list:
    return [m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KFORCING_CACHE", str(root / "cache"))
        _make_runs(root)
    return root


def _make_runs(root: Path) -> None:
    write_json_package(root / "corpus", one_document_per_line=False)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    (root / "llama.json").write_text(config.to_json_string())
    native, hf = stage2_config(root, DEVICE), stage2_config(root, DEVICE, teacher=str(root / "h1"))
    teacher = dict(packed_docs=False, steps=2, ckpt_every=100, teacher=None)
    train(dataclasses.replace(native, stage="stage0", out=str(root / "s0"), **teacher))
    train(dataclasses.replace(native, stage="stage1", out=str(root / "s1"), **{**teacher, "teacher": str(root / "s0")}))
    train(
        dataclasses.replace(
            native, stage="stage0", out=str(root / "h0"), model_config=str(root / "llama.json"), **teacher
        )
    )
    train(dataclasses.replace(native, stage="stage1", out=str(root / "h1"), **{**teacher, "teacher": str(root / "h0")}))
    for base, name in ((native, "one"), (hf, "hf_one")):
        train(dataclasses.replace(base, out=str(root / name), dump_grads=str(root / f"{name}.safetensors")))
    train(
        dataclasses.replace(
            hf,
            out=str(root / "hf_one_ac"),
            activation_checkpointing=True,
            dump_grads=str(root / "hf_one_ac.safetensors"),
        )
    )
    if BACKEND_OK:  # one-rank FSDP2 (a one-rank group): a sharded HF checkpoint, stopped and resumed
        train(dataclasses.replace(hf, out=str(root / "hf_w1"), parallel="fsdp"))
        train(dataclasses.replace(hf, out=str(root / "hf_w1_parts"), parallel="fsdp", stop_at=2))
        train(dataclasses.replace(hf, out=str(root / "hf_w1_parts"), parallel="fsdp", resume=True))
        torchrun(4, REPO / "python_tests" / "workers" / "mesh_worker.py", root, DEVICE, timeout=420)


def _same_first_step(runs: Path, run: str, reference: str) -> None:
    want, got = load_file(str(runs / f"{reference}.safetensors")), load_file(str(runs / f"{run}.safetensors"))
    assert want.keys() == got.keys() and len(want) > 5
    assert any(float(g.abs().max()) > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], **GRAD_TOL, msg=name)
    assert losses(runs / run)[0] == pytest.approx(losses(runs / reference)[0], rel=1e-5)
    assert losses(runs / run) == pytest.approx(losses(runs / reference), rel=1e-3)


@needs_dist
@pytest.mark.parametrize(
    "run, reference",
    [
        ("fsdp_cp", "one"),
        ("teacher_fsdp", "one"),
        ("hf_fsdp_ac", "hf_one"),
        ("hf_fsdp_cp", "hf_one"),
        ("hf_ddp_cp", "hf_one"),
    ],
)
def test_four_ranks_match_one_process(runs, run, reference):
    _same_first_step(runs, run, reference)
    model, info, _ = load_student(runs / run)  # the final model of a sharded run: a whole, loadable stage folder
    assert info["k"] == 2 and model.kind == ("hf" if reference.startswith("hf") else "native")


def test_hf_activation_checkpointing_is_bitwise(runs):
    plain, ac = load_file(str(runs / "hf_one.safetensors")), load_file(str(runs / "hf_one_ac.safetensors"))
    assert plain.keys() == ac.keys() and any(name.startswith("hf.model.layers.") for name in plain)
    for name in plain:
        assert torch.equal(ac[name], plain[name]), name
    assert losses(runs / "hf_one_ac") == losses(runs / "hf_one")


@needs_dist
def test_hf_sharded_checkpoint_resumes_bitwise(runs):
    assert latest_checkpoint(runs / "hf_w1_parts").suffix == ".dcp"
    assert losses(runs / "hf_w1_parts") == losses(runs / "hf_w1") and len(losses(runs / "hf_w1")) == 3
    for file in ("model.safetensors", "noise_embedding.safetensors"):
        a, b = load_file(str(runs / "hf_w1" / file)), load_file(str(runs / "hf_w1_parts" / file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    one = load_file(str(runs / "hf_one" / "model.safetensors"))  # one-rank FSDP2 is the single process, within rounding
    for name, tensor in load_file(str(runs / "hf_w1" / "model.safetensors")).items():
        torch.testing.assert_close(tensor, one[name], rtol=1e-4, atol=1e-6, msg=name)


@needs_dist
@pytest.mark.parametrize("run", ["hf_w1", "hf_fsdp_ac"], ids=["1-rank", "4-rank"])
def test_hf_sharded_checkpoint_exports_as_the_stage_folder(runs, run, tmp_path, capsys):
    """The export of an HF student's sharded checkpoint (written by 1 or 4 ranks, gathered in one process) is its stage
    folder: the final checkpoint's export loads with load_hf_stage and from_pretrained and equals the run's own final
    stage bit for bit (weights, noise embedding, tokenizer); another tokenizer is refused naming --tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from kforcing_kernels.app.files import tokenizer_sha256
    from kforcing_kernels.app.hf_recipe.files import load_hf_stage
    from kforcing_kernels.app.training.sharded_checkpoint import main as export_main

    assert latest_checkpoint(runs / run).name == "step_00000003.dcp"  # the final step: the run's own model
    export_main([str(runs / run), "--out", str(tmp_path / "export")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "export" / "model.json")
    exported, info, tokenizer = load_hf_stage(tmp_path / "export")
    final, final_info, final_tokenizer = load_hf_stage(runs / run)
    assert info["k"] == final_info["k"] == 2 and info["step"] == 3 and exported.k_train == 2
    want = final.state_dict()
    assert exported.state_dict().keys() == want.keys()
    assert all(torch.equal(tensor, want[name]) for name, tensor in exported.state_dict().items())
    assert tokenizer_sha256(tokenizer) == tokenizer_sha256(final_tokenizer)
    backbone = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert torch.equal(backbone.get_input_embeddings().weight, final.wte.weight)

    other = Tokenizer(models.BPE(unk_token="<unk>"))  # a tokenizer the run was not trained with
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.train_from_iterator(
        ["something else entirely"] * 20, trainers.BpeTrainer(vocab_size=40, special_tokens=["<unk>"])
    )
    other.save(str(tmp_path / "other.json"))
    with pytest.raises(SystemExit):
        export_main([str(runs / run), "--out", str(tmp_path / "export2"), "--tokenizer", str(tmp_path / "other.json")])
    assert "tokenizer: --tokenizer" in capsys.readouterr().err and not (tmp_path / "export2" / "model.json").exists()


def test_parallelize_compiles_each_decoder_layer_after_checkpointing(monkeypatch):
    """--compile: torch.compile per decoder layer, around the checkpointed forward; the same loss and gradients.
    (Inductor on CPU takes minutes to build; dynamo's "eager" backend traces the same graph-broken layers.)"""
    from kforcing_kernels.app.training.parallel import ParallelDims, decoder_layers, parallelize
    from kforcing_kernels.model import KForcingLM, ModelConfig

    compiled = []
    original = torch.nn.Module.compile

    def compile_eagerly(module, **kwargs):
        compiled.append(module)
        return original(module, backend="eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eagerly)
    dims = ParallelDims(1, 1, False, 0, torch.device("cpu"))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(**options):
        torch.manual_seed(0)
        model = KForcingLM(ModelConfig.micro(n_layer=3))
        assert parallelize(model, dims, **options) is model  # one process, nothing sharded: the model itself
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return model, loss, [p.grad for p in model.parameters()]

    plain, loss, grads = step()
    model, loss_c, grads_c = step(compile=True, activation_checkpointing=True)
    assert compiled == decoder_layers(model) and len(compiled) == 3
    assert all(layer._compiled_call_impl is not None for layer in model.blocks)
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=0)
    for a, b in zip(grads, grads_c):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_hf_decoder_layers_are_the_models_own_layer_class():
    from kforcing_kernels.app.hf_recipe.student import HFStudent
    from kforcing_kernels.app.training.parallel import decoder_layers

    for config in (
        transformers.LlamaConfig(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        transformers.GPT2Config(vocab_size=48, n_embd=32, n_layer=3, n_head=4),
    ):
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing")
        layers = decoder_layers(HFStudent(hf))
        want = list(hf.model.layers) if hasattr(hf, "model") else list(hf.transformer.h)
        assert layers == want

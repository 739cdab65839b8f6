"""FSDP2 (``--parallel fsdp``), activation checkpointing and sharded (DCP) checkpoints, against independent runs.

One torchrun launch (2 ranks; gloo on CPU, nccl when CUDA has >= 2 GPUs) does every two-rank run
(python_tests/workers/fsdp_worker.py); the references are single-process runs of the same settings:

* FSDP2 on 2 ranks == one process (DDP code path, no sharding): gradients of the first step within
  rtol 1e-4 / atol 1e-7 (fp32, only the order of the reduction over the batch differs: the two half-batch
  means are summed by the reduce-scatter), first loss within rel 1e-5, later losses within rel 1e-3
  (Adam's first updates, ~lr * sign(g), amplify rounding in tiny gradient entries).
* Activation checkpointing == without, bitwise (losses, gradients), in one process and under FSDP2.
* DCP: stop at step 2 and resume on 2 ranks == the uninterrupted run, bitwise (metrics and final weights);
  resume on another world size (2 -> 1, 1 -> 2) == the uninterrupted run within the tolerances above
  (only step 3's reduction order differs).
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers.fsdp_settings import stage2_config
from helpers.train_helpers import REPO, torchrun, write_json_package
from kforcing_kernels.app.train import build_parser, config_from_args
from kforcing_kernels.app.training import sharded_checkpoint
from kforcing_kernels.app.training.checkpoint import (
    CheckpointError,
    clean_run_folder,
    latest_checkpoint,
    load_model,
    read_metrics,
)
from kforcing_kernels.app.training.config import ConfigError
from kforcing_kernels.app.training.loop import train
from kforcing_kernels.app.training.sharded_checkpoint import MANIFEST, export_model
from kforcing_kernels.app.training.sharded_checkpoint import main as export_main

DEVICE = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
BACKEND_OK = dist.is_available() and (dist.is_nccl_available() if DEVICE == "cuda" else dist.is_gloo_available())
needs_dist = pytest.mark.skipif(
    not BACKEND_OK, reason=f"torch.distributed with {'nccl' if DEVICE == 'cuda' else 'gloo'} is not available"
)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)


def losses(run: Path) -> list:
    return [m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m]


def weights(run: Path) -> dict:
    return load_file(str(run / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Teacher, single-process references, one-rank FSDP runs, then the torchrun launch; the folder holding them."""
    root = tmp_path_factory.mktemp("fsdp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KFORCING_CACHE", str(root / "cache"))
        _make_runs(root)
    return root


def _make_runs(root: Path) -> None:
    write_json_package(root / "corpus", one_document_per_line=False)
    base = stage2_config(root, DEVICE)
    teacher = dict(packed_docs=False, steps=2, ckpt_every=100, teacher=None)
    train(dataclasses.replace(base, stage="stage0", out=str(root / "s0"), **teacher))
    train(dataclasses.replace(base, stage="stage1", out=str(root / "s1"), **{**teacher, "teacher": str(root / "s0")}))
    train(dataclasses.replace(base, out=str(root / "one"), dump_grads=str(root / "one.safetensors")))
    train(
        dataclasses.replace(
            base, out=str(root / "one_ac"), activation_checkpointing=True, dump_grads=str(root / "one_ac.safetensors")
        )
    )
    if BACKEND_OK:
        train(dataclasses.replace(base, out=str(root / "w1"), parallel="fsdp", stop_at=2))  # one rank, for 1 -> 2
        torchrun(2, REPO / "python_tests" / "workers" / "fsdp_worker.py", root, DEVICE, timeout=240)
        train(dataclasses.replace(base, out=str(root / "f2_stop_for_1"), parallel="fsdp", resume=True))  # 2 -> 1


def test_activation_checkpointing_is_bitwise_in_one_process(runs):
    one, ac = load_file(str(runs / "one.safetensors")), load_file(str(runs / "one_ac.safetensors"))
    assert one.keys() == ac.keys() and len(one) > 5
    for name in one:
        assert torch.equal(ac[name], one[name]), name
    assert losses(runs / "one_ac") == losses(runs / "one")
    assert all(torch.equal(a, b) for a, b in zip(weights(runs / "one_ac").values(), weights(runs / "one").values()))


@needs_dist
@pytest.mark.parametrize("run", ["f2", "f2_cp"], ids=["dp2xcp1", "dp1xcp2"])
def test_fsdp_two_ranks_match_one_process(runs, run):
    """Both degenerate meshes of two ranks: FSDP2 over dp (2 x 1), and over cp when dp is 1 (1 x 2; every mesh test
    elsewhere is 2 x 2, where the flattened dims hide a shard over the wrong one)."""
    one, two = load_file(str(runs / "one.safetensors")), load_file(str(runs / f"{run}.safetensors"))
    assert one.keys() == two.keys() and len(one) > 5
    assert any(float(g.abs().max()) > 0 for g in one.values())
    for name in one:
        torch.testing.assert_close(two[name], one[name], **GRAD_TOL, msg=name)
    assert len(losses(runs / run)) == 3
    assert losses(runs / run)[0] == pytest.approx(losses(runs / "one")[0], rel=1e-5)
    assert losses(runs / run) == pytest.approx(losses(runs / "one"), rel=1e-3)
    model, info, tokenizer = load_model(runs / run)  # the final model of an FSDP run: a plain model file
    assert info["k"] == 2 and tokenizer is not None
    for name, tensor in weights(runs / "one").items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-3, atol=1e-5, msg=name)


@needs_dist
def test_fsdp_gradient_accumulation_matches_one_process(runs):
    one, accum = load_file(str(runs / "one.safetensors")), load_file(str(runs / "f2_accum.safetensors"))
    assert one.keys() == accum.keys()
    for name in one:
        torch.testing.assert_close(accum[name], one[name], **GRAD_TOL, msg=name)


@needs_dist
def test_activation_checkpointing_is_bitwise_under_fsdp(runs):
    plain, ac = load_file(str(runs / "f2.safetensors")), load_file(str(runs / "f2_ac.safetensors"))
    for name in plain:
        assert torch.equal(ac[name], plain[name]), name
    assert losses(runs / "f2_ac") == losses(runs / "f2")
    assert all(torch.equal(a, b) for a, b in zip(weights(runs / "f2_ac").values(), weights(runs / "f2").values()))


@needs_dist
def test_sharded_resume_on_two_ranks_is_bitwise(runs):
    ckpt = latest_checkpoint(runs / "f2_stop")
    assert ckpt.name == "step_00000003.dcp" and (ckpt / MANIFEST).is_file()
    assert json.loads((ckpt / MANIFEST).read_text())["world_size"] == 2
    assert len(list(ckpt.glob("*.distcp"))) == 2  # each rank wrote its own shards
    assert losses(runs / "f2_stop") == losses(runs / "f2")
    resumed, straight = weights(runs / "f2_stop"), weights(runs / "f2")
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


@needs_dist
@pytest.mark.parametrize("run", ["f2_stop_for_1", "w1"], ids=["2->1", "1->2"])
def test_sharded_resume_on_another_world_size(runs, run):
    assert losses(runs / run)[:2] == pytest.approx(losses(runs / "f2")[:2], rel=1e-5)
    assert losses(runs / run) == pytest.approx(losses(runs / "f2"), rel=1e-3)
    resumed, straight = weights(runs / run), weights(runs / "f2")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-3, atol=1e-5, msg=name)
    saved_world = json.loads((runs / run / "checkpoints" / "step_00000002.dcp" / MANIFEST).read_text())["world_size"]
    assert saved_world == (2 if run == "f2_stop_for_1" else 1)


@needs_dist
def test_export_loads_with_load_model_and_equals_the_run(runs, tmp_path):
    ckpt = runs / "f2" / "checkpoints" / "step_00000003.dcp"
    export_main([str(runs / "f2"), "--out", str(tmp_path / "cli")])  # a run folder: its newest checkpoint
    export_model(ckpt, tmp_path / "fn")
    for folder in ("cli", "fn"):
        model, info, tokenizer = load_model(tmp_path / folder)
        assert info["k"] == 2 and tokenizer is not None and info["step"] == 3
        for name, tensor in weights(runs / "f2").items():
            assert torch.equal(model.state_dict()[name], tensor), name


@needs_dist
def test_torn_corrupt_or_foreign_sharded_checkpoints_are_refused(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "f2_stop", run, ignore=shutil.ignore_patterns("model.*"))
    ckpt = latest_checkpoint(run)
    torn = run / "checkpoints" / f".step_00000004.dcp.{'ab' * 8}.tmp"  # a write that never got renamed into place
    shutil.copytree(ckpt, torn)
    assert latest_checkpoint(run) == ckpt  # never mistaken for a checkpoint
    assert torn in clean_run_folder(run) and not torn.exists()
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: SHA-256"):
        export_model(ckpt, tmp_path / "out")
    cfg = stage2_config(runs, DEVICE, parallel="fsdp", out=str(run), resume=True, steps=4)
    with pytest.raises(ConfigError, match=r"steps: --resume needs the settings"):
        train(cfg)
    with pytest.raises(ConfigError, match=r"parallel: --resume needs the settings.*'fsdp', got 'ddp'"):
        train(dataclasses.replace(cfg, steps=3, parallel="ddp"))
    with pytest.raises(CheckpointError, match="corrupt: SHA-256"):
        train(dataclasses.replace(cfg, steps=3))


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(["stage0", "--out", "x", "--parallel", "fsdp", "--activation-checkpointing"])
    cfg = config_from_args(args)
    assert cfg.parallel == "fsdp" and cfg.activation_checkpointing
    assert config_from_args(build_parser().parse_args(["stage0", "--out", "x"])).parallel == "ddp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage0", "--out", "x", "--parallel", "zero3"])


def test_activation_checkpointing_recomputes_each_block_and_keeps_less():
    """The wrapper is active: every block's forward runs again in backward, and fewer bytes are saved for it."""
    from kforcing_kernels.app.training.parallel import checkpoint_blocks
    from kforcing_kernels.model import KForcingLM, ModelConfig

    def step(ac: bool):
        torch.manual_seed(0)
        model = KForcingLM(ModelConfig.micro(n_layer=3))
        calls, saved = [0], [0]
        for block in model.blocks:
            block.attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        if ac:
            checkpoint_blocks(model)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        pack = lambda t: (saved.__setitem__(0, saved[0] + t.numel() * t.element_size()), t)[1]  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return calls[0], saved[0], [p.grad for p in model.parameters()]

    (calls, saved, grads), (calls_ac, saved_ac, grads_ac) = step(False), step(True)
    assert calls == 3 and calls_ac == 6
    assert saved_ac < saved / 2
    assert sum(g is not None for g in grads) > 10
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, grads_ac))


def test_one_process_sharded_checkpoint_respects_umask_and_refuses_another_model(tmp_path, monkeypatch):
    from helpers.train_helpers import micro_config
    from kforcing_kernels.app.training.parallel import parallelize, setup_parallel
    from kforcing_kernels.app.training.sharded_checkpoint import load_sharded_checkpoint
    from kforcing_kernels.model import KForcingLM, ModelConfig

    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    corpus = write_json_package(tmp_path / "corpus")
    old = os.umask(0o027)
    try:
        train(micro_config(tmp_path / "run", corpus, steps=1, parallel="fsdp"))
    finally:
        os.umask(old)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step_00000001.dcp"
    for path in [ckpt, *ckpt.iterdir()]:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o027 == 0, (path.name, oct(mode))  # the umask took bits away, nothing was forced open
        assert mode & 0o600 == 0o600, (path.name, oct(mode))
    with pytest.raises(ConfigError, match="precision: --parallel fsdp"):
        train(micro_config(tmp_path / "fp16", corpus, steps=1, parallel="fsdp", precision="fp16"))
    dims = setup_parallel("cpu", parallel="fsdp")  # a one-rank process group
    try:
        other = KForcingLM(ModelConfig.micro(vocab_size=300, n_layer=3))
        parallelize(other, dims)
        optimizer = torch.optim.AdamW(other.parameters())
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        with pytest.raises(CheckpointError, match=r"saved for another model \(config differs in n_layer\)"):
            load_sharded_checkpoint(ckpt, other, optimizer, scaler)

        def full_disk(path, obj):
            raise CheckpointError(f"{path}: cannot write (No space left on device)")

        monkeypatch.setattr(sharded_checkpoint, "write_json", full_disk)  # the manifest, written last, fails
        with pytest.raises(CheckpointError, match="step_00000007.dcp: cannot write .*No space left"):
            sharded_checkpoint.save_sharded_checkpoint(tmp_path / "run", 7, other, optimizer, scaler, {}, {}, keep=2)
        # nothing else
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001.dcp"]
    finally:
        dims.close()


def test_export_refuses_a_file_or_the_run_folder_as_out_before_reading_anything(tmp_path, capsys):
    """--out naming a file is a usage error naming --out; --out the run folder itself (whose model.safetensors and
    model.json are the run's final model) is refused instead of silently replacing them. Python API alike."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000003.dcp"
    ckpt.mkdir(parents=True)
    (run / "model.json").write_text("{}")  # the run's own final model: must stay as it is
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    cases = [
        ([str(run), "--out", str(a_file)], "argument --out: .* is a file; --out expects a folder"),
        ([str(ckpt), "--out", str(a_file)], "argument --out: .* is a file; --out expects a folder"),
        ([str(run), "--out", str(run)], "argument --out: .* is the run folder of .*choose another --out"),
        ([str(ckpt), "--out", str(run)], "argument --out: .* is the run folder of .*choose another --out"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            export_main(argv)
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv
    for out in (a_file, run):
        with pytest.raises(ConfigError, match="^out: "):
            export_model(ckpt, out)
    assert (run / "model.json").read_text() == "{}" and a_file.read_bytes() == b"x"

"""Issue 38 section 3, the HF ``Trainer`` route: ``app.hf_trainer`` (the loss and targets of Stage 1 and Stage 2,
``KForcingTrainer``) and ``save_pflm`` / ``load_pflm`` (the noise embedding saved and loaded
with the backbone).

Oracles: Stage 1's targets are the inverse-CDF samples of an ``sdpa`` twin's logits (``AutoModelForCausalLM`` as
transformers runs it); the saved folder loads with plain ``from_pretrained`` without missing or unexpected keys; the
loaded PFLM's tensors and its ``generate_kforcing`` output equal the trained model's.
"""

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.train_helpers import write_json_package  # noqa: E402
from kforcing_kernels.app.data import EOS, load_corpus  # noqa: E402
from kforcing_kernels.app.generation.inference import generate_kforcing  # noqa: E402
from kforcing_kernels.app.hf_recipe.student import HFStudent  # noqa: E402
from kforcing_kernels.app.hf_recipe.trainer import (  # noqa: E402
    KForcingTrainer,
    kforcing_loss,
    kforcing_targets,
    load_pflm,
    save_pflm,
)
from kforcing_kernels.ops.sampling import inverse_cdf_sample  # noqa: E402

VOCAB, N, ROWS = 300, 8, 8


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Qwen2 folder with a fast tokenizer, as a user's pretrained model."""
    root = tmp_path_factory.mktemp("trainer_route")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        # A pad token inside the vocabulary: Trainer aligns the model config's pad_token_id with the tokenizer's.
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=load_corpus(str(write_json_package(root / "corpus")), vocab_size=VOCAB).tokenizer,
            eos_token=EOS,
            pad_token=EOS,
        )
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen2")
    tokenizer.save_pretrained(root / "qwen2")
    return root


def load(folder, implementation="kforcing"):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=implementation, dtype=torch.float32
    )


def rows(k, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (N,), generator=gen),
            "noise": torch.rand(N, k, generator=gen),
            "tau": 1.0,
        }
        for _ in range(ROWS)
    ]


def trainer(student, teacher, stage, data, out, tokenizer, steps=3, **settings):
    args = transformers.TrainingArguments(
        **{
            "output_dir": str(out),
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "learning_rate": 3e-3,
            "lr_scheduler_type": "constant",
            "report_to": "none",
            "save_strategy": "no",
            "logging_steps": 1,
            "use_cpu": True,
            "remove_unused_columns": False,
            "disable_tqdm": True,
            "seed": 0,
            "dataloader_num_workers": 0,
            **settings,
        }
    )
    return KForcingTrainer(
        model=student, teacher=teacher, stage=stage, args=args, train_dataset=data, processing_class=tokenizer
    )


def test_stage1_targets_and_loss_are_the_teachers_inverse_cdf_samples(source):
    teacher = HFStudent(load(source / "qwen2"), k_train=0)
    torch.manual_seed(1)
    student = HFStudent(load(source / "qwen2"))
    data = rows(1, seed=2)
    ids, noise = torch.stack([r["input_ids"] for r in data]), torch.stack([r["noise"] for r in data])
    tau = torch.full((ROWS,), 0.7)
    with torch.no_grad():
        oracle = inverse_cdf_sample(
            load(source / "qwen2", "sdpa")(ids).logits, noise[..., 0], tau[:, None].expand(ROWS, N)
        )
    targets = kforcing_targets("stage1", teacher, ids, noise, tau)
    assert targets.shape == (ROWS, N, 1) and torch.equal(targets[..., 0], oracle)
    loss = kforcing_loss("stage1", student, teacher, ids, noise, tau)
    by_hand = F.cross_entropy(student(ids, noise, tau).flatten(0, 2), oracle.flatten())
    torch.testing.assert_close(loss, by_hand)


def test_stage1_then_stage2_with_trainer_save_and_load(source, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(source / "qwen2")
    teacher = HFStudent(load(source / "qwen2"), k_train=0)
    torch.manual_seed(1)
    student = HFStudent(load(source / "qwen2"))
    run = trainer(student, teacher, "stage1", rows(1, seed=3), tmp_path / "t1", tokenizer, steps=4)
    run.train()
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    run.save_model(str(tmp_path / "stage1"))

    # One call back: backbone and noise embedding, bit for bit; plain from_pretrained loads the backbone cleanly.
    pflm = load_pflm(tmp_path / "stage1")
    assert pflm.k_train == 1
    trained, loaded = student.state_dict(), pflm.state_dict()
    assert trained.keys() == loaded.keys() and any(key.startswith("noise_encoder.") for key in trained)
    assert all(torch.equal(trained[key].cpu(), loaded[key]) for key in trained)
    backbone, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stage1", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    # Stage 2 (k = 2) from the loaded PFLM(1), its targets two rounds of the teacher.
    teacher2 = load_pflm(tmp_path / "stage1")
    student2 = load_pflm(tmp_path / "stage1").train()
    data = rows(2, seed=4)
    ids, noise = torch.stack([r["input_ids"] for r in data]), torch.stack([r["noise"] for r in data])
    targets = kforcing_targets("stage2", teacher2, ids, noise, 1.0)
    with torch.no_grad():
        round_one = teacher2(ids, noise[..., :1], torch.ones(ROWS)).argmax(-1)
    assert targets.shape == (ROWS, N, 2) and torch.equal(targets[..., :1], round_one)
    run2 = trainer(student2, teacher2, "stage2", data, tmp_path / "t2", tokenizer, steps=2)
    run2.train()
    run2.save_model(str(tmp_path / "stage2_k2"))
    final = load_pflm(tmp_path / "stage2_k2")
    assert final.k_train == 2

    # generate_kforcing accepts the loaded wrapper, and it decodes as the trained one.
    prompts = ids[:2, :4]
    noise_gen = torch.rand(2, 3, 2, generator=torch.Generator().manual_seed(5))
    got = generate_kforcing(final, prompts, 2, 6, noise=noise_gen)
    want = generate_kforcing(student2.eval(), prompts, 2, 6, noise=noise_gen)
    assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))


def test_the_route_refuses_what_it_cannot_train(source, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(source / "qwen2")
    plain = load(source / "qwen2")
    with pytest.raises(ValueError, match="model: expected an HFStudent"):
        trainer(plain, HFStudent(load(source / "qwen2"), k_train=0), "stage1", rows(1, 0), tmp_path, tokenizer)
    with pytest.raises(ValueError, match="stage: expected one of"):
        trainer(
            HFStudent(load(source / "qwen2")),
            HFStudent(load(source / "qwen2")),
            "stage3",
            rows(1, 0),
            tmp_path,
            tokenizer,
        )
    with pytest.raises(ValueError, match="teacher: stage2 needs a PFLM teacher"):
        trainer(
            HFStudent(load(source / "qwen2")),
            HFStudent(load(source / "qwen2"), k_train=0),
            "stage2",
            rows(2, 0),
            tmp_path,
            tokenizer,
        )
    with pytest.raises(ValueError, match="tokenizer: a stage folder holds its tokenizer"):
        save_pflm(HFStudent(load(source / "qwen2"), k_train=1), tmp_path / "x")
    # Issue 46: a trainer without a tokenizer would train and then fail at its first checkpoint (nothing to resume):
    # refused when it is made, before any step or any folder.
    with pytest.raises(ValueError, match="processing_class: expected the model's tokenizer"):
        trainer(
            HFStudent(load(source / "qwen2")),
            HFStudent(load(source / "qwen2"), k_train=0),
            "stage1",
            rows(1, 0),
            tmp_path / "no_tokenizer",
            None,
            save_strategy="steps",
            save_steps=1,
        )
    assert not (tmp_path / "no_tokenizer").exists()
    with_tokenizer = HFStudent(load(source / "qwen2"))
    with_tokenizer.hf_tokenizer = tokenizer  # a model that carries its tokenizer (load_pflm's) needs none passed
    trainer(
        with_tokenizer, HFStudent(load(source / "qwen2"), k_train=0), "stage1", rows(1, 0), tmp_path / "carried", None
    )


def test_resume_from_checkpoint_continues_the_run_bit_for_bit(source, tmp_path):
    """Issue 38: Trainer's checkpoints hold the noise embedding with the backbone, and ``resume_from_checkpoint``
    restores both: the resumed run's losses and final weights equal the uninterrupted run's (CPU, fp32)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(source / "qwen2")
    teacher, data = HFStudent(load(source / "qwen2"), k_train=0), rows(1, seed=6)
    # A warmup and decay schedule and a mid-epoch checkpoint (8 rows, 4 per step): the schedule, optimizer and data
    # order must all be restored too.
    schedule = dict(save_strategy="steps", save_steps=3, lr_scheduler_type="cosine", warmup_steps=2)

    def student(seed):
        torch.manual_seed(seed)
        return HFStudent(load(source / "qwen2"))

    whole = student(1)
    initial = {name: t.clone() for name, t in whole.noise_encoder.state_dict().items()}
    run = trainer(whole, teacher, "stage1", data, tmp_path / "whole", tokenizer, steps=5, **schedule)
    run.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "noise_embedding.safetensors").exists() and load_pflm(checkpoint).k_train == 1
    # Another initial noise embedding: only a checkpoint that restores it can give the same run.
    resumed = student(2)
    resumed.reset_noise_encoder(torch.Generator().manual_seed(2))
    assert any(not torch.equal(t, initial[name]) for name, t in resumed.noise_encoder.state_dict().items())
    again = trainer(resumed, teacher, "stage1", data, tmp_path / "resumed", tokenizer, steps=5, **schedule)
    again.train(resume_from_checkpoint=str(checkpoint))
    losses = lambda t: [(e["step"], e["loss"]) for e in t.state.log_history if "loss" in e]  # noqa: E731
    assert len(losses(run)) == 5 and losses(again) == losses(run)
    trained, continued = whole.state_dict(), resumed.state_dict()
    assert trained.keys() == continued.keys() and all(torch.equal(trained[k], continued[k]) for k in trained)

    # A checkpoint of another stage (another window) is refused, naming the argument.
    stage2 = trainer(
        HFStudent(load(source / "qwen2")),
        HFStudent(load(source / "qwen2"), k_train=1),
        "stage2",
        rows(2, 0),
        tmp_path / "stage2",
        tokenizer,
    )
    with pytest.raises(
        ValueError,
        match=r"resume_from_checkpoint: .*checkpoint-3 holds a PFLM trained for k=1, this trainer trains k=2",
    ):
        stage2.train(resume_from_checkpoint=str(checkpoint))
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .*model.json: not found"):
        stage2.train(resume_from_checkpoint=str(tmp_path))

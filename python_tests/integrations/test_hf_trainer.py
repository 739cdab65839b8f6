"""HF ``Trainer`` (with accelerate) trains a model with attn_implementation="kforcing" and a custom K-Forcing loss.

The loss is SingleForward's: the layout rides along as ``kforcing_layout``, the noise embedding is a
submodule of the model (so the Trainer's optimizer updates it too). One Trainer step equals a
hand-written AdamW step of an ``sdpa`` twin given the layout's dense mask; a few steps lower the loss.
CPU, no saving, no logging integrations.
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402

N, K, SAMPLES, LR = 6, 2, 4, 1e-2


def dataset():
    gen = torch.Generator().manual_seed(11)
    return [
        {
            "input_ids": torch.randint(0, H.VOCAB, (N,), generator=gen),
            "noise": torch.rand(N, K, generator=gen),
            "targets": torch.randint(0, H.VOCAB, (N, K), generator=gen),
        }
        for _ in range(SAMPLES)
    ]


def single_forward_loss(model, inputs, dense: bool = False):
    """Mean cross entropy of window t slot i against targets[t, i]; ``dense``: the layout as an SDPA mask instead."""
    ids, noise, targets = inputs["input_ids"], inputs["noise"], inputs["targets"]
    batch = kf_hf.single_forward_inputs(model, ids, noise, model.noise_embedding, torch.ones(ids.shape[0]))
    if dense:
        layout = batch.pop("kforcing_layout")
        batch["attention_mask"] = layout.dense_mask()[None, None].expand(ids.shape[0], 1, -1, -1)
    logits = model(**batch, use_cache=False).logits[:, N:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class KForcingTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = single_forward_loss(model, inputs)
        return (loss, None) if return_outputs else loss


def models():
    ours, sdpa = H.twin_models(H.llama(), "kforcing", "sdpa")
    torch.manual_seed(1)
    ours.noise_embedding = kf_hf.NoiseEmbedding(H.HIDDEN)
    sdpa.noise_embedding = kf_hf.NoiseEmbedding(H.HIDDEN)
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def trainer(model, tmp_path, steps, optim="adamw_torch"):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=SAMPLES,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim=optim,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return KForcingTrainer(model=model, args=args, train_dataset=dataset())


def test_one_trainer_step_equals_a_hand_written_sdpa_step(tmp_path):
    ours, sdpa = models()
    # SGD: Adam's first step is lr * sign(grad) where |grad| >> eps, which turns fp32 rounding of a near-zero
    # gradient into a full-size difference; SGD keeps the comparison at fp32 tolerance.
    trainer(ours, tmp_path, steps=1, optim="sgd").train()
    # The same step by hand: one batch of every sample (the mean loss does not depend on their order).
    inputs = {key: torch.stack([s[key] for s in dataset()]) for key in ("input_ids", "noise", "targets")}
    optimizer = torch.optim.SGD(sdpa.parameters(), lr=LR)
    sdpa.train()
    single_forward_loss(sdpa, inputs, dense=True).backward()
    optimizer.step()
    trained, by_hand = dict(ours.named_parameters()), dict(sdpa.named_parameters())
    assert trained.keys() == by_hand.keys() and any(name.startswith("noise_embedding") for name in trained)
    before = models()[1].state_dict()
    for name, p in trained.items():
        torch.testing.assert_close(p.detach(), by_hand[name].detach(), atol=1e-6, rtol=1e-5, msg=name)
    assert all(
        not torch.equal(trained[name].detach(), before[name]) for name in trained if name.endswith("proj.weight")
    )


def test_trainer_lowers_the_loss(tmp_path):
    ours, _ = models()
    run = trainer(ours, tmp_path, steps=6)
    run.train()
    losses = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

"""K-Forcing with Hugging Face ``Trainer``: the loss and targets of each stage, and a Trainer that saves the PFLM.

What the CLI route (``kforcing-train pipeline --model``) does for a user who trains with their own ``Trainer``::

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
    from kforcing_kernels.app.hf_student import HFStudent
    from kforcing_kernels.app.hf_trainer import KForcingTrainer

    load = lambda: AutoModelForCausalLM.from_pretrained(path, attn_implementation="kforcing", dtype=torch.float32)
    teacher = HFStudent(load(), k_train=0)            # Stage 1: the AR model, frozen
    student = HFStudent(load())                        # its copy + a fresh noise embedding
    rows = [{"input_ids": ids [N], "noise": uniform [N, 1], "tau": temperature}, ...]   # Stage 2 at k: noise [N, k]
    KForcingTrainer(model=student, teacher=teacher, stage="stage1", args=TrainingArguments(..., remove_unused_columns=False),
                    train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(path)).train()
    trainer.save_model("stage1")                       # a stage folder, noise embedding included
    pflm = HFStudent.from_pretrained("stage1")         # back: generate_kforcing(pflm, prompts, k, n) accepts it

* :func:`kforcing_loss` is the CLI's loss (``objectives.compute_loss``): Stage 1 (``stage="stage1"``, paper Algorithm 2)
  distils the AR teacher's inverse-CDF sample at each noise ``u`` (noise ``[B, N, 1]``); Stage 2 (``stage="stage2"``,
  Algorithm 3) trains PFLM(2k) from a PFLM(k) teacher's two rounds (SingleForward on ``noise[..., :k]``, then
  DoubleForward on ``noise[..., k:]``; noise ``[B, N, 2k]``). :func:`kforcing_targets` gives those targets alone.
* :class:`KForcingTrainer` computes that loss and saves the model with :meth:`HFStudent.save_pretrained` (a plain
  ``Trainer`` saves only a state dict, and a noise embedding attached to an HF model as a submodule is dropped by
  ``from_pretrained`` as unexpected keys). ``resume_from_checkpoint`` is not supported (the CLI's ``--resume`` is).
"""

from __future__ import annotations

from typing import Optional

import torch
import transformers

from .hf_student import HFStudent
from .objectives import Batch, Objective, compute_loss, student_inputs

STAGES = ("stage1", "stage2")


def _objective(stage: str, student, teacher) -> Objective:
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES} (stage 0 is plain next-token training), got {stage!r}")
    for name, model in (("model", student), ("teacher", teacher)):
        if model is not None and not isinstance(model, HFStudent):
            raise ValueError(f"{name}: expected an HFStudent (HFStudent(AutoModelForCausalLM.from_pretrained(..., "
                             f"attn_implementation='kforcing'))), got {type(model).__name__}")
    if teacher is None:
        raise ValueError(f"teacher: {stage} distils a teacher (Stage 1: the AR model; Stage 2: the PFLM(k)), got None")
    return Objective.of(stage)


def _batch(input_ids: torch.Tensor, noise: torch.Tensor, tau, separator: Optional[int]) -> Batch:
    tau = torch.as_tensor(tau, dtype=torch.float32, device=input_ids.device)
    tau = tau.expand(input_ids.shape[0]) if tau.dim() == 0 else tau
    if tau.shape != input_ids.shape[:1]:
        raise ValueError(f"tau: expected a scalar or one temperature per sequence [{input_ids.shape[0]}], got {tuple(tau.shape)}")
    return Batch(input_ids, noise, tau, separator=separator)


def kforcing_targets(stage: str, teacher: HFStudent, input_ids: torch.Tensor, noise: torch.Tensor, tau,
                     separator: Optional[int] = None) -> torch.Tensor:
    """The teacher's targets ``[B, N, k]`` for context ``input_ids [B, N]`` and ``noise [B, N, k]`` (see the module docstring).

    ``tau``: a scalar or ``[B]`` (> 0); ``separator``: the EOS id of packed documents (attention stays in each), or None.
    """
    objective = _objective(stage, None, teacher)
    return student_inputs(objective, _batch(input_ids, noise, tau, separator), teacher, None)[2]


def kforcing_loss(stage: str, student: HFStudent, teacher: HFStudent, input_ids: torch.Tensor, noise: torch.Tensor, tau,
                  separator: Optional[int] = None) -> torch.Tensor:
    """Mean cross-entropy of the student's SingleForward (``[B, N, k, V]``) against :func:`kforcing_targets`; with
    ``separator``, over the predictions whose target lies inside their document (the CLI's ``--packed-docs``)."""
    objective = _objective(stage, student, teacher)
    return compute_loss(objective, student, _batch(input_ids, noise, tau, separator), teacher)[0]


class KForcingTrainer(transformers.Trainer):
    """``transformers.Trainer`` for one K-Forcing stage: ``model`` an :class:`HFStudent` (the student), ``teacher`` the
    frozen teacher, ``stage`` "stage1" or "stage2"; rows ``{"input_ids" [N], "noise" [N, k], "tau"}`` (``tau`` optional:
    1.0). Saves stage folders (:meth:`HFStudent.save_pretrained`, ``processing_class`` as the tokenizer)."""

    def __init__(self, *args, teacher: HFStudent, stage: str, separator: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        _objective(stage, self.model, teacher)
        if stage == "stage2" and not (isinstance(teacher.k_train, int) and teacher.k_train >= 1):
            raise ValueError(f"teacher: stage2 needs a PFLM teacher with its k_train set (HFStudent.from_pretrained of a stage "
                             f"folder), got k_train={teacher.k_train!r}")
        self.teacher, self.stage, self.separator = teacher.requires_grad_(False).eval(), stage, separator
        self.model.k_train = 1 if stage == "stage1" else 2 * teacher.k_train

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        if next(self.teacher.parameters()).device != ids.device:
            self.teacher.to(ids.device)
        loss = kforcing_loss(self.stage, model, self.teacher, ids, inputs["noise"], inputs.get("tau", 1.0), self.separator)
        return (loss, None) if return_outputs else loss

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, tokenizer=self.processing_class)
        torch.save(self.args, f"{output_dir}/training_args.bin")

"""K-Forcing with Hugging Face ``Trainer``: the loss and targets of each stage, and a Trainer that saves the PFLM.

What the CLI route (``kforcing-train pipeline --model``) does for a user who trains with their own ``Trainer``::

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
    from kforcing_kernels.app.hf_recipe.student import HFStudent
    from kforcing_kernels.app.hf_recipe.trainer import KForcingTrainer, load_pflm

    load = lambda: AutoModelForCausalLM.from_pretrained(path, attn_implementation="kforcing", dtype=torch.float32)
    teacher = HFStudent(load(), k_train=0)            # Stage 1: the AR model, frozen
    student = HFStudent(load())                        # its copy + a fresh noise embedding
    rows = [{"input_ids": ids [N], "noise": uniform [N, 1], "tau": temperature}, ...]   # Stage 2 at k: noise [N, k]
    KForcingTrainer(model=student, teacher=teacher, stage="stage1", args=TrainingArguments(...,
    remove_unused_columns=False),
                    train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(path)).train()
    trainer.save_model("stage1")                       # a stage folder, noise embedding included
    pflm = load_pflm("stage1")                         # back: generate_kforcing(pflm, prompts, k, n) accepts it

* :func:`kforcing_loss` is the CLI's loss (``objectives.compute_loss``): Stage 1 (``stage="stage1"``, paper Algorithm 2)
  distils the AR teacher's inverse-CDF sample at each noise ``u`` (noise ``[B, N, 1]``); Stage 2 (``stage="stage2"``,
  Algorithm 3) trains PFLM(2k) from a PFLM(k) teacher's two rounds (SingleForward on ``noise[..., :k]``, then
  DoubleForward on ``noise[..., k:]``; noise ``[B, N, 2k]``). :func:`kforcing_targets` gives those targets alone.
* :class:`KForcingTrainer` computes that loss and saves the model with :func:`save_pflm` (a plain
  ``Trainer`` saves only a state dict, and a noise embedding attached to an HF model as a submodule is dropped by
  ``from_pretrained`` as unexpected keys). Its checkpoints (``checkpoint-N``) are such stage folders beside
  Trainer's optimizer, scheduler, RNG and trainer state, so ``train(resume_from_checkpoint=...)`` restores backbone
  and noise embedding (every file's SHA-256 checked) and continues the run as ``Trainer`` continues any;
  ``load_best_model_at_end`` loads the same way.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import transformers

from ..training.objectives import Batch, Objective, compute_loss, student_inputs
from .files import load_hf_stage, save_hf_stage
from .student import HFStudent

STAGES = ("stage1", "stage2")


def _objective(stage: str, student, teacher) -> Objective:
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES} (stage 0 is plain next-token training), got {stage!r}")
    for name, model in (("model", student), ("teacher", teacher)):
        if model is not None and not isinstance(model, HFStudent):
            raise ValueError(
                f"{name}: expected an HFStudent (HFStudent(AutoModelForCausalLM.from_pretrained(..., "
                f"attn_implementation='kforcing'))), got {type(model).__name__}"
            )
    if teacher is None:
        raise ValueError(f"teacher: {stage} distils a teacher (Stage 1: the AR model; Stage 2: the PFLM(k)), got None")
    return Objective.of(stage)


def _batch(input_ids: torch.Tensor, noise: torch.Tensor, tau, separator: Optional[int]) -> Batch:
    tau = torch.as_tensor(tau, dtype=torch.float32, device=input_ids.device)
    tau = tau.expand(input_ids.shape[0]) if tau.dim() == 0 else tau
    if tau.shape != input_ids.shape[:1]:
        raise ValueError(
            f"tau: expected a scalar or one temperature per sequence [{input_ids.shape[0]}], got {tuple(tau.shape)}"
        )
    return Batch(input_ids, noise, tau, separator=separator)


def kforcing_targets(
    stage: str, teacher: HFStudent, input_ids: torch.Tensor, noise: torch.Tensor, tau, separator: Optional[int] = None
) -> torch.Tensor:
    """The teacher's targets ``[B, N, k]`` for context ``input_ids [B, N]`` and ``noise [B, N, k]`` (see the module
    docstring).

    ``tau``: a scalar or ``[B]`` (> 0); ``separator``: the EOS id of packed documents (attention stays in each), or
    None."""
    objective = _objective(stage, None, teacher)
    return student_inputs(objective, _batch(input_ids, noise, tau, separator), teacher, None)[2]


def kforcing_loss(
    stage: str,
    student: HFStudent,
    teacher: HFStudent,
    input_ids: torch.Tensor,
    noise: torch.Tensor,
    tau,
    separator: Optional[int] = None,
) -> torch.Tensor:
    """Mean cross-entropy of the student's SingleForward (``[B, N, k, V]``) against :func:`kforcing_targets`; with
    ``separator``, over the predictions whose target lies inside their document (the CLI's ``--packed-docs``)."""
    objective = _objective(stage, student, teacher)
    return compute_loss(objective, student, _batch(input_ids, noise, tau, separator), teacher)[0]


# ---------------------------------------------------------------------- stage folders: one call each way
# (Functions here rather than HFStudent methods: hf_files builds HFStudents, so hf_student cannot import it.)


def save_pflm(student: HFStudent, folder, tokenizer=None, k: Optional[int] = None) -> None:
    """Write ``student`` as a stage folder: the backbone as ``save_pretrained`` writes it
    (``AutoModelForCausalLM.from_pretrained`` loads it), the tokenizer, ``noise_embedding.safetensors`` and
    ``model.json`` (k, files' SHA-256s), as the CLI's stages. :func:`load_pflm` loads it back.

    ``tokenizer``: an HF fast tokenizer (default: the one the model was loaded with, ``hf_tokenizer``); ``k``: the
    window the model was trained for (default ``student.k_train``).
    """
    if not isinstance(student, HFStudent):
        raise ValueError(f"student: expected an HFStudent, got {type(student).__name__}")
    tokenizer = tokenizer if tokenizer is not None else getattr(student, "hf_tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "tokenizer: a stage folder holds its tokenizer (generation and the CLI read it); pass the model's tokenizer"
        )
    k = student.k_train if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"k: expected the window the model was trained for (an int >= 1; k_train is {student.k_train!r}), got {k!r}"
        )
    save_hf_stage(folder, student, {"kind": "pflm", "k": k}, tokenizer)


def load_pflm(folder, device="cpu") -> HFStudent:
    """A stage folder of :func:`save_pflm` (or of ``kforcing-train``) as the PFLM: backbone + noise embedding, every
    file's size and SHA-256 checked; in eval mode, ``k_train`` and ``hf_tokenizer`` set. ``generate_kforcing`` accepts
    it."""
    return load_hf_stage(folder, device)[0]


class KForcingTrainer(transformers.Trainer):
    """``transformers.Trainer`` for one K-Forcing stage: ``model`` an :class:`HFStudent` (the student), ``teacher`` the
    frozen teacher, ``stage`` "stage1" or "stage2"; rows ``{"input_ids" [N], "noise" [N, k], "tau"}`` (``tau`` optional:
    1.0). Saves stage folders (:func:`save_pflm`, ``processing_class`` as the tokenizer)."""

    def __init__(self, *args, teacher: HFStudent, stage: str, separator: Optional[int] = None, **kwargs):
        # Every save (each checkpoint-N, save_model) writes a stage folder, which holds its tokenizer: without one the
        # run would train and then fail at its first checkpoint, leaving nothing to resume. Refused before Trainer
        # makes anything (its output folder included).
        bound = inspect.signature(transformers.Trainer.__init__).bind_partial(self, *args, **kwargs).arguments
        if bound.get("processing_class") is None and getattr(bound.get("model"), "hf_tokenizer", None) is None:
            raise ValueError(
                "processing_class: expected the model's tokenizer (KForcingTrainer(..., processing_class="
                "AutoTokenizer.from_pretrained(path))): every checkpoint and save_model writes a stage "
                "folder, which holds its tokenizer; got None, and the model carries none (hf_tokenizer)"
            )
        super().__init__(*args, **kwargs)
        _objective(stage, self.model, teacher)
        teacher_k = teacher.k_train if isinstance(teacher.k_train, int) else 0
        if stage == "stage2" and teacher_k < 1:
            raise ValueError(
                f"teacher: stage2 needs a PFLM teacher with its k_train set (load_pflm of a stage "
                f"folder), got k_train={teacher.k_train!r}"
            )
        self.teacher, self.stage, self.separator = teacher.requires_grad_(False).eval(), stage, separator
        self.model.k_train = 1 if stage == "stage1" else 2 * teacher_k

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        if next(self.teacher.parameters()).device != ids.device:
            self.teacher.to(ids.device)
        loss = kforcing_loss(
            self.stage, model, self.teacher, ids, inputs["noise"], inputs.get("tau", 1.0), self.separator
        )
        return (loss, None) if return_outputs else loss

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Trainer would load model.safetensors (the backbone's keys, not the wrapper's) with strict=False: nothing.
        _load_stage_into(
            self.accelerator.unwrap_model(model if model is not None else self.model),
            resume_from_checkpoint,
            "resume_from_checkpoint",
        )

    def _load_best_model(self):
        _load_stage_into(
            self.accelerator.unwrap_model(self.model), self.state.best_model_checkpoint, "load_best_model_at_end"
        )

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pflm(self.accelerator.unwrap_model(self.model), output_dir, tokenizer=self.processing_class)
        torch.save(self.args, f"{output_dir}/training_args.bin")


def _load_stage_into(student: HFStudent, folder, option: str) -> None:
    """Copy a stage folder's backbone and noise embedding (checked by :func:`load_pflm`) into ``student``, in place."""
    try:
        saved, info, _ = load_hf_stage(folder)
    except ValueError as exc:  # CheckpointError: the folder is missing, damaged or not a stage folder
        raise ValueError(f"{option}: {exc}") from None
    if info["k"] != student.k_train:
        raise ValueError(
            f"{option}: {folder} holds a PFLM trained for k={info['k']}, this trainer trains k={student.k_train}"
        )
    try:
        student.load_state_dict(saved.state_dict())
    except RuntimeError as exc:
        raise ValueError(f"{option}: {folder} is not a checkpoint of this model ({exc})") from None

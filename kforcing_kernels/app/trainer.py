"""The K-Forcing training loop: one stage (Stage 0 AR teacher, Stage 1 forward distillation, Stage 2
self-forcing) from a :class:`TrainConfig`; :func:`train` returns the run's summary.

The command line is :mod:`kforcing_kernels.app.train`; the objectives are in
:mod:`kforcing_kernels.app.objectives`, the files of a run (checkpoints, models, metrics, the
atomic writer) in :mod:`kforcing_kernels.app.checkpoint`, the settings in
:mod:`kforcing_kernels.app.train_config`.

Reproducibility: the batch, noise and temperatures of step s are drawn from a
generator seeded by (seed, s), the global batch is cut into equal per-rank shards,
and checkpoints hold the model and optimizer state exactly, so ``--resume`` repeats
the uninterrupted run bit for bit and a data-parallel run averages the same
gradients as a single process. With ``--parallel fsdp`` the student is sharded by FSDP2
(:mod:`kforcing_kernels.app.parallel`) and checkpoints are sharded
(:mod:`kforcing_kernels.app.sharded_checkpoint`); writing a checkpoint, evaluating and gathering the
final model are then collectives that every rank joins.

An output folder holds one run: a second run into it is refused unless it continues
the first (``--resume``) or replaces it (``--overwrite``), and a run holds an exclusive lock
on its folder (``.kforcing.lock``, rank 0) while it runs, so a second run started into it
at the same time fails at once. The checkpoint of the last step is written before the
final evaluation, so no error after training loses steps.

Provenance: every checkpoint and model.json records ``data_sha256`` (the text of --data),
``tokenizer_sha256`` and, for a distilled stage, ``teacher_sha256`` (the SHA-256 of the
teacher's model file). A student trains only with its teacher's tokenizer; ``--resume``
refuses when the text, the tokenizer or the teacher changed. A run saved before these were
recorded resumes with a warning (its settings, vocabulary size and teacher path are still checked).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import env
from ..model import PRESETS, KForcingLM
from .checkpoint import CheckpointError, latest_checkpoint, read_json, read_metrics, recover_metrics, save_tensors, stderr_log
from .checkpointer import Checkpointer, read_meta
from .files import RunLock, append_jsonl, check_writable, write_json, write_text
from .data import Corpus, data_sha256, tokenizer_sha256
from .hf_files import build_from_config, corpus_for, hf_tokenizer_of, load_any_model
from .parallel import ParallelDims, broadcast_value, full_gradients, gradient_sync, local_value, parallelize, place_teacher, setup_parallel
from .objectives import (
    STAGE1_CDF_ORDER,
    Objective,
    compute_loss,
    make_batch,
    step_generator,
)
from .context_parallel import context_parallel_loss
from .train_config import (
    PROVENANCE,
    ConfigError,
    TrainConfig,
    changed_provenance,
    changed_settings,
    check_device,
    check_splits,
    prepare_out,
    teacher_sha256,
    validate_config,
)

# ---------------------------------------------------------------------- schedule, model, optimizer


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine down to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _amp_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    if precision == "auto":
        if device.type != "cuda":
            return None  # CPU: fp32 (bf16 autocast is slower than fp32 on most CPUs)
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _check_teacher_tokenizer(cfg: TrainConfig, teacher_tokenizer, corpus: Corpus, log) -> None:
    """The student learns the teacher's token ids: the tokenizer of --data must be the teacher's."""
    if teacher_tokenizer is None:
        log(f"warning: {cfg.teacher} has no tokenizer.json; only its vocabulary size can be checked against --data")
        return
    if tokenizer_sha256(teacher_tokenizer) != corpus.tokenizer_sha256:
        raise ConfigError(f"teacher: the tokenizer of --teacher {cfg.teacher} is not the one --data {cfg.data!r} "
                          f"(--vocab-size {cfg.vocab_size}) gives: the same ids would mean other text; distil on the "
                          "teacher's --data and --vocab-size, or train a teacher on this --data")


def _build(cfg: TrainConfig, dims: ParallelDims, corpus: Corpus, log):
    """(student, teacher or None, student k, provenance info)."""
    init = torch.Generator().manual_seed(cfg.seed)
    if cfg.stage == "stage0" and cfg.model_config:  # a Hugging Face model from a config, trained as an AR model
        student = build_from_config(cfg.model_config, cfg.seed)
        student.noise_encoder.requires_grad_(False)
        return student, None, 0, {"kind": "ar", "k": 0, **_text_provenance(corpus)}
    if cfg.stage == "stage0":
        model_cfg = PRESETS[cfg.preset](**{"seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, **cfg.model_overrides})
        student = KForcingLM(model_cfg)
        student.reset_parameters(init)
        student.noise_encoder.requires_grad_(False)  # the AR model never sees noise tokens
        return student, None, 0, {"kind": "ar", "k": 0, **_text_provenance(corpus)}
    teacher, tinfo, teacher_tokenizer = load_any_model(cfg.teacher, dims.device)
    teacher.requires_grad_(False)
    _check_teacher_tokenizer(cfg, teacher_tokenizer, corpus, log)
    if cfg.stage == "stage1":
        if tinfo["k"] != 0:
            raise ConfigError(f"teacher: stage1 distils an AR teacher (stage0), got a PFLM with k={tinfo['k']} from {cfg.teacher}")
        student = copy.deepcopy(teacher).cpu()
        student.reset_noise_encoder(init)  # the backbone is the teacher's; the noise encoder is new
        k = cfg.k
    else:
        if tinfo["k"] == 0:
            raise ConfigError(f"teacher: stage2 needs a PFLM teacher (stage1 or stage2), got the AR model in {cfg.teacher}")
        student = copy.deepcopy(teacher).cpu()
        k = 2 * tinfo["k"]
    student.requires_grad_(True)
    info = {"kind": "pflm", "k": k, "teacher": str(Path(cfg.teacher).resolve()), "teacher_k": tinfo["k"], "supervision": cfg.supervision,
            **_text_provenance(corpus), "teacher_sha256": tinfo["tensors"]["sha256"]}
    if cfg.stage == "stage1":  # which inverse-CDF construction the student learned (app/noise_diagnosis.py reads it)
        info["cdf_order"] = STAGE1_CDF_ORDER
    return student, teacher, k, info


def _optimizer(model: KForcingLM, cfg: TrainConfig, fused_ok: bool) -> torch.optim.AdamW:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True if fused_ok else None)


def _require_resume_settings(saved: dict, cfg: TrainConfig, run: str) -> None:
    """--resume continues ``run`` (its saved train_config ``saved``) only with the settings it was trained with."""
    for key, used, wanted in changed_settings(saved, cfg):
        flag = f" (--{key.replace('_', '-')})" if key in TrainConfig.RESUME_DEFAULTS else ""
        raise ConfigError(f"{key}: --resume needs the settings of {run}; it used {used!r}, got {wanted!r}{flag}")


def _text_provenance(corpus: Corpus) -> dict:
    return {"data_sha256": corpus.data_sha256, "tokenizer_sha256": corpus.tokenizer_sha256}


def _require_same_provenance(saved: dict, now: dict, run: str, log) -> None:
    """--resume continues ``run`` (``saved``: its recorded info) only on the same text and teacher."""
    changed, unknown = changed_provenance(saved, now)
    for key, what in changed:
        raise ConfigError(f"{key.split('_')[0]}: --resume needs what {run} was trained on; {what}. Restore it, or start "
                          f"again with --overwrite (or another --out) ({PROVENANCE[key]})")
    if unknown:
        log(f"warning: {run} was saved before {', '.join(unknown)} were recorded; cannot check that "
            f"{' and '.join(sorted({PROVENANCE[k] for k in unknown}))} did not change since")


def _resume_state(out: Path, cfg: TrainConfig, log) -> tuple[Path, dict]:
    """The newest checkpoint, after checking settings, data and teacher (before the corpus is built)."""
    ckpt = latest_checkpoint(out)
    meta = read_meta(ckpt)
    _require_resume_settings(meta["train_config"], cfg, f"the run in {out}")
    _require_same_provenance(meta["info"], {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
                             f"the run in {out}", log)
    return ckpt, meta


# ---------------------------------------------------------------------- the training loop


def _lock_out(out: Path, dims: ParallelDims) -> Optional[RunLock]:
    """Rank 0 locks the run folder; every rank fails with the same message when another run holds it."""
    lock, error = None, None
    if dims.main:
        try:
            lock = RunLock(out).acquire()
        except CheckpointError as exc:
            error = exc
    if dims.world > 1:
        box = [None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = CheckpointError(box[0])
    if error is not None:
        raise error
    return lock


class NonFiniteLoss(RuntimeError):
    """A training step's loss was NaN or infinite: the run stopped before that step changed the model."""


def _non_finite_message(loss: float, step: int, out: Path) -> str:
    ckpt = latest_checkpoint(out)
    kept = (f"its newest checkpoint, {ckpt.stem}, holds the last good state" if ckpt is not None
            else "no checkpoint was written yet")
    return (f"loss: step {step} gave a non-finite loss ({loss}); the run stopped before the optimizer step, so nothing "
            f"from it was saved ({out}: {kept}). Lower --lr, keep --grad-clip small or train in --precision fp32")


def train(cfg: TrainConfig) -> dict:
    """Run one stage; returns a summary (final loss, validation loss, timings).

    The run folder is locked (:class:`~kforcing_kernels.app.checkpoint.RunLock`, held by rank 0) from the
    first look at it to the return: a second run into the same ``out`` fails at once.
    """
    check_device(cfg.device)  # before anything is set up on it
    if cfg.model and not cfg.teacher:
        cfg = dataclasses.replace(cfg, teacher=cfg.model)  # --model is stage1's teacher
    validate_config(cfg, env.distributed_ranks()[0])
    # One process group and one dp x cp device mesh for the stage; FSDP2 in one process gets a one-rank group.
    dims = setup_parallel(cfg.device, cfg.context_parallel,
                          cfg.parallel, group=cfg.parallel == "fsdp" or (cfg.teacher_parallel == "fsdp" and cfg.stage != "stage0"))
    out = Path(cfg.out)
    try:
        lock = _lock_out(out, dims)
        try:
            return _train(cfg, dims, out)
        finally:
            if lock is not None:
                lock.release()
    finally:
        dims.close()


@dataclass
class _Stage:
    """What one stage trains and with what, built once by :func:`_set_up` (every rank holds its own)."""

    cfg: TrainConfig
    dims: ParallelDims
    out: Path
    log: object
    corpus: Corpus
    objective: Objective
    k: int
    student: torch.nn.Module  # the model the optimizer updates (sharded under FSDP2)
    model: torch.nn.Module  # what a step calls: the student, or DDP around it
    teacher: Optional[torch.nn.Module]
    model_info: dict
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    checkpointer: Checkpointer
    autocast: object
    start: int

    @property
    def everyone_evaluates(self) -> bool:
        """Evaluation is a collective when the student or the teacher is sharded; else rank 0 runs it alone."""
        return self.dims.shard or (self.teacher is not None and self.cfg.teacher_parallel == "fsdp")

    def evaluate(self) -> tuple[float, list[float]]:
        return evaluate_loss(self.student, self.teacher, self.objective, self.k, self.cfg, self.corpus, self.dims.device,
                             self.autocast)


def _train(cfg: TrainConfig, dims: ParallelDims, out: Path) -> dict:
    log = stderr_log(f"[{cfg.stage}]") if dims.main else (lambda message: None)
    if cfg.resume and (out / "model.json").exists() and (cfg.stop_at is None or cfg.stop_at == cfg.steps):
        finished = read_json(out / "model.json")
        _require_resume_settings(finished.get("train_config", {}), cfg, f"the finished run in {out}")
        _require_same_provenance(finished, {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
                                 f"the finished run in {out}", log)
        log(f"{out} is complete (model.json exists); nothing to resume")
        return finished.get("summary", {})
    stage = _set_up(cfg, dims, out, log)
    t_start = time.perf_counter()
    last_loss = _run_steps(stage)
    return _finish(stage, last_loss, t_start)


def _set_up(cfg: TrainConfig, dims: ParallelDims, out: Path, log) -> _Stage:
    """The run folder, data, models (parallelized), optimizer and checkpointer of a stage; restores a checkpoint."""
    prepare_out(cfg, dims.main, log)
    if cfg.dump_grads and dims.main:
        check_writable(cfg.dump_grads, "--dump-grads")  # now, not after the first step
    # --resume: settings, data and teacher are checked before the corpus is built (changed data would train a new tokenizer).
    ckpt, ckpt_meta = _resume_state(out, cfg, log) if cfg.resume else (None, None)

    # Data: rank 0 builds the tokenizer cache first so the ranks never race on it.
    if dims.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size, verbose=True)
    dims.barrier()
    if not dims.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size)

    objective = Objective.of(cfg.stage, cfg.supervision)
    if ckpt_meta is not None:  # the same text could still be tokenized otherwise (another tokenizers version)
        _require_same_provenance(ckpt_meta["info"], {"tokenizer_sha256": corpus.tokenizer_sha256}, f"the run in {out}", log)
    student, teacher, k, model_info = _build(cfg, dims, corpus, log)
    _check_vocab(cfg, student, corpus)
    check_splits(cfg, corpus, objective, k)
    student.to(dims.device).train()
    amp = _amp_dtype(cfg.precision, dims.device)
    if teacher is not None:
        place_teacher(teacher, dims, cfg.teacher_parallel, amp)
    model = parallelize(student, dims, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile, amp=amp)
    optimizer = _optimizer(student, cfg, fused_ok=dims.device.type == "cuda")
    scaler = torch.amp.GradScaler(dims.device.type, enabled=amp == torch.float16)
    checkpointer = Checkpointer(out, dims, cfg.keep_checkpoints)
    start = 0
    if cfg.resume:
        start = checkpointer.load(ckpt, student, optimizer, scaler)
        log(f"resumed from {ckpt} at step {start}")
    if dims.main:
        out.mkdir(parents=True, exist_ok=True)
        recover_metrics(out / "metrics.jsonl", start, log)
        write_json(out / "train_config.json", cfg.to_dict())
        write_text(out / "tokenizer.json", corpus.tokenizer.to_str(pretty=True))
    autocast = (lambda: torch.autocast(dims.device.type, dtype=amp)) if amp is not None else nullcontext
    return _Stage(cfg, dims, out, log, corpus, objective, k, student, model, teacher, model_info, optimizer, scaler,
                  checkpointer, autocast, start)


def _check_vocab(cfg: TrainConfig, student, corpus: Corpus) -> None:
    hf, vocab = getattr(student, "is_hf", False), student.config.vocab_size
    if hf and cfg.stage != "stage0":  # the teacher's own tokenizer: its ids on --data must have embeddings
        top = max(int(corpus.train.max()), int(corpus.val.max()))
        if top >= vocab:
            raise ConfigError(f"vocab_size: the tokenizer of {cfg.teacher} gives id {top} on --data, outside the model's {vocab} embeddings")
    elif vocab != corpus.vocab_size:
        what = f"--model-config {cfg.model_config!r}" if cfg.model_config else "the model"
        raise ConfigError(f"vocab_size: {what} has {student.config.vocab_size} tokens but the tokenizer of {cfg.data!r} (--vocab-size "
                          f"{cfg.vocab_size}) has {corpus.vocab_size}; make them equal")


def _step_loss(stage: _Stage, part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(backward loss, reported loss, per-position loss) of one micro-batch on this rank."""
    cp = stage.dims.context_parallel
    if cp is None:
        loss, per_pos = compute_loss(stage.objective, stage.model, part, stage.teacher, k=stage.k)
        return loss, loss, per_pos
    # This rank's share of its CP group's sequences (app/context_parallel.py).
    return context_parallel_loss(stage.objective, stage.model, part, stage.teacher, cp, k=stage.k)


def _run_steps(stage: _Stage) -> float:
    """The optimizer steps from ``stage.start`` to ``--stop-at`` (or the end); returns the last step's loss."""
    cfg, dims, out = stage.cfg, stage.dims, stage.out
    stop = cfg.stop_at or cfg.steps
    separator = stage.corpus.eos_id if cfg.packed_docs else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    live = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    bar = tqdm(total=cfg.steps, initial=stage.start, desc=f"[{cfg.stage}]", disable=not (dims.main and live), file=sys.stderr,
               dynamic_ncols=True, mininterval=0.2)
    every = max(1, (stop - stage.start) // 10)  # without a live bar: about ten plain progress lines
    t_start, last_loss = time.perf_counter(), float("nan")
    for step in range(stage.start, stop):
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step)
        for group in stage.optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(stage.objective, stage.corpus.train, cfg.batch_size, cfg.seq_len, stage.k, (cfg.tau_min, cfg.tau_max),
                           step_generator(cfg.seed, step), separator).shard(dims.dp_rank, dims.dp)
        loss_sum, pos_sum = 0.0, 0.0
        for micro in range(cfg.grad_accum):
            part = batch.shard(micro, cfg.grad_accum).to(dims.device)
            sync = micro == cfg.grad_accum - 1 or dims.world == 1
            with gradient_sync(stage.model, sync), stage.autocast():
                loss, reported, per_pos = _step_loss(stage, part)
            stage.scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum, pos_sum = loss_sum + reported.detach(), pos_sum + per_pos
        if cfg.dump_grads and step == stage.start and (dims.main or dims.shard):
            grads = full_gradients(stage.student)  # under FSDP a collective: every rank gathers
            if dims.main:
                save_tensors(Path(cfg.dump_grads), grads)
        done = step + 1
        stats = torch.cat([(loss_sum / cfg.grad_accum)[None], pos_sum / cfg.grad_accum]).float()
        if dims.world > 1:
            dist.all_reduce(stats)  # every rank sees the same mean, so all of them stop together below
            stats /= dims.world
        if not math.isfinite(float(stats[0])):  # before the optimizer step: the checkpoints keep the last good weights
            raise NonFiniteLoss(_non_finite_message(float(stats[0]), done, out))
        last_loss = float(stats[0])
        stage.scaler.unscale_(stage.optimizer)
        grad_norm = local_value(torch.nn.utils.clip_grad_norm_(stage.student.parameters(), cfg.grad_clip))
        stage.scaler.step(stage.optimizer)
        stage.scaler.update()
        stage.optimizer.zero_grad(set_to_none=True)

        tok_s = tokens_per_step / (time.perf_counter() - t0)
        if dims.main:
            bar.set_postfix_str(f"loss {last_loss:.4f} {tok_s:,.0f} tok/s", refresh=False)
            bar.update(1)
            if not live and (done % every == 0 or done == stop):
                stage.log(f"step {done}/{cfg.steps} loss {last_loss:.4f} {tok_s:,.0f} tok/s ({time.perf_counter() - t_start:.0f}s)")
            if done % cfg.log_every == 0 or done == stop:
                append_jsonl(out / "metrics.jsonl", {
                    "step": done, "loss": last_loss, "loss_pos": stats[1:].tolist(), "lr": lr,
                    "grad_norm": float(grad_norm), "tokens_per_s": tok_s, "elapsed_s": time.perf_counter() - t_start,
                })
        # The checkpoint comes before the evaluation: an evaluation error never costs trained steps.
        if done % cfg.ckpt_every == 0 or done == stop:
            stage.checkpointer.save(done, stage.student, stage.optimizer, stage.scaler, cfg.to_dict(), stage.model_info)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps and (dims.main or stage.everyone_evaluates):
            val = stage.evaluate()
            if dims.main:
                append_jsonl(out / "metrics.jsonl", {"step": done, "val_loss": val[0], "val_loss_pos": val[1]})
    bar.close()
    return last_loss


def _finish(stage: _Stage, last_loss: float, t_start: float) -> dict:
    """The final evaluation (once) and the stage's model folder, when the last step is done."""
    cfg, dims, out = stage.cfg, stage.dims, stage.out
    summary = {"final_loss": last_loss, "steps": cfg.steps, "seconds": time.perf_counter() - t_start}
    if (cfg.stop_at or cfg.steps) != cfg.steps:
        dims.barrier()
        return summary
    vals = None
    if dims.main or stage.everyone_evaluates:
        # The final evaluation, once: a resume after it failed (the last checkpoint is in place) runs only this.
        vals = [m for m in read_metrics(out / "metrics.jsonl") if "val_loss" in m] if dims.main else None
        again = not vals or vals[-1]["step"] != cfg.steps
        if broadcast_value(again) if stage.everyone_evaluates else again:  # a collective: rank 0 decides for all
            val = stage.evaluate()
            if dims.main:
                vals.append({"step": cfg.steps, "val_loss": val[0], "val_loss_pos": val[1]})
                append_jsonl(out / "metrics.jsonl", vals[-1])
    record = None
    if dims.main:
        if math.isnan(last_loss):  # resumed at the last step: the loss of the last logged step
            losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
            summary["final_loss"] = losses[-1] if losses else last_loss
        summary.update(val_loss=vals[-1]["val_loss"], val_loss_pos=vals[-1]["val_loss_pos"])
        record = {**stage.model_info, "stage": cfg.stage, "data": cfg.data, "train_config": cfg.to_dict(), "summary": summary}
    hf_tokenizer = hf_tokenizer_of(stage.corpus) if getattr(stage.student, "is_hf", False) and dims.main else None
    stage.checkpointer.export(stage.student, record, hf_tokenizer)  # a collective under FSDP2: rank 0 writes
    dims.barrier()
    return summary


@torch.no_grad()
def evaluate_loss(student, teacher, objective: Objective, k: int, cfg: TrainConfig, corpus: Corpus, device, autocast
                  ) -> tuple[float, list[float]]:
    """Training objective on fixed validation batches (same batches every time)."""
    was_training = student.training
    student.eval()
    total, per_pos = 0.0, 0.0
    for i in range(cfg.eval_batches):
        batch = make_batch(objective, corpus.val, cfg.batch_size, cfg.seq_len, k, (cfg.tau_min, cfg.tau_max),
                           step_generator(cfg.seed, i, salt=1), corpus.eos_id if cfg.packed_docs else None).to(device)
        with autocast():
            loss, pos = compute_loss(objective, student, batch, teacher, k=k)
        total, per_pos = total + float(loss), per_pos + pos.float()
    student.train(was_training)
    return total / cfg.eval_batches, (per_pos / cfg.eval_batches).tolist()

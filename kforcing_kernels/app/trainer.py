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
from .checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, load_model, read_checkpoint_meta, read_json,
                         read_metrics, recover_metrics, save_checkpoint, save_model, save_tensors, stderr_log)
from .files import RunLock, append_jsonl, check_writable, write_json, write_text
from .data import Corpus, data_sha256, tokenizer_sha256
from .hf_files import build_from_config, corpus_for, hf_tokenizer_of, load_any_model, save_hf_stage
from .parallel import (broadcast_value, data_parallel, ensure_process_group, full_copy, full_gradients, gradient_sync, local_value, prepare_student,
                       release_process_group)
from .sharded_checkpoint import is_sharded, load_sharded_checkpoint, read_sharded_meta, save_sharded_checkpoint
from .objectives import (
    STAGE1_CDF_ORDER,
    Objective,
    compute_loss,
    make_batch,
    step_generator,
)
from .context_parallel import context_parallel_loss
from .context_parallel import setup as setup_context_parallel
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

# ---------------------------------------------------------------------- distributed


@dataclass
class DistInfo:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> DistInfo:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; gloo on CPU, nccl on CUDA. Single process otherwise."""
    world, rank, local = env.distributed_ranks()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank, world, dev)


def _barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()


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


def _build(cfg: TrainConfig, info: DistInfo, corpus: Corpus, log):
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
    teacher, tinfo, teacher_tokenizer = load_any_model(cfg.teacher, info.device)
    teacher.requires_grad_(False)
    _check_teacher_tokenizer(cfg, teacher_tokenizer, corpus, log)
    if cfg.stage == "stage1":
        if tinfo["k"] != 0:
            raise ConfigError(f"teacher: stage1 distils an AR teacher (stage0), got a PFLM with k={tinfo['k']} from {cfg.teacher}")
        student = copy.deepcopy(teacher).cpu()
        student.reset_noise_encoder(init)  # the backbone is the teacher's; the noise encoder is new
        if cfg.decode != "argmax":  # how the PFLM decodes, saved in its model config (model/decoding.py)
            if getattr(student, "is_hf", False):
                raise ConfigError(f"decode: {cfg.decode} decoding is for native models; a Hugging Face student decodes by argmax")
            student.config = dataclasses.replace(student.config, decode=cfg.decode)
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
    meta = (read_sharded_meta if is_sharded(ckpt) else read_checkpoint_meta)(ckpt)
    _require_resume_settings(meta["train_config"], cfg, f"the run in {out}")
    _require_same_provenance(meta["info"], {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
                             f"the run in {out}", log)
    return ckpt, meta


# ---------------------------------------------------------------------- the training loop


def _lock_out(out: Path, info: DistInfo) -> Optional[RunLock]:
    """Rank 0 locks the run folder; every rank fails with the same message when another run holds it."""
    lock, error = None, None
    if info.main:
        try:
            lock = RunLock(out).acquire()
        except CheckpointError as exc:
            error = exc
    if info.world > 1:
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
    info = setup_distributed(cfg.device)
    if cfg.model and not cfg.teacher:
        cfg = dataclasses.replace(cfg, teacher=cfg.model)  # --model is stage1's teacher
    validate_config(cfg, info.world)
    own_group = ensure_process_group(cfg.parallel, info.device)  # FSDP2 in one process: a one-rank group
    out = Path(cfg.out)
    try:
        lock = _lock_out(out, info)
        try:
            return _train(cfg, info, out)
        finally:
            if lock is not None:
                lock.release()
    finally:
        release_process_group(own_group)


def _train(cfg: TrainConfig, info: DistInfo, out: Path) -> dict:
    log = stderr_log(f"[{cfg.stage}]") if info.main else (lambda message: None)
    if cfg.resume and (out / "model.json").exists() and (cfg.stop_at is None or cfg.stop_at == cfg.steps):
        finished = read_json(out / "model.json")
        _require_resume_settings(finished.get("train_config", {}), cfg, f"the finished run in {out}")
        _require_same_provenance(finished, {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
                                 f"the finished run in {out}", log)
        log(f"{out} is complete (model.json exists); nothing to resume")
        return finished.get("summary", {})
    prepare_out(cfg, info.main, log)
    if cfg.dump_grads and info.main:
        check_writable(cfg.dump_grads, "--dump-grads")  # now, not after the first step
    # --resume: settings, data and teacher are checked before the corpus is built (changed data would train a new tokenizer).
    ckpt, ckpt_meta = _resume_state(out, cfg, log) if cfg.resume else (None, None)

    # Data: rank 0 builds the tokenizer cache first so the ranks never race on it.
    if info.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size, verbose=True)
    _barrier(info)
    if not info.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size)

    objective = Objective.of(cfg.stage, cfg.supervision)
    par = setup_context_parallel(cfg.context_parallel, info.rank, info.world)  # CP groups; data parallel between them
    if ckpt_meta is not None:  # the same text could still be tokenized otherwise (another tokenizers version)
        _require_same_provenance(ckpt_meta["info"], {"tokenizer_sha256": corpus.tokenizer_sha256}, f"the run in {out}", log)
    student, teacher, k, model_info = _build(cfg, info, corpus, log)
    hf, vocab = getattr(student, "is_hf", False), student.config.vocab_size
    if hf and cfg.stage != "stage0":  # the teacher's own tokenizer: its ids on --data must have embeddings
        top = max(int(corpus.train.max()), int(corpus.val.max()))
        if top >= vocab:
            raise ConfigError(f"vocab_size: the tokenizer of {cfg.teacher} gives id {top} on --data, outside the model's {vocab} embeddings")
    elif vocab != corpus.vocab_size:
        what = f"--model-config {cfg.model_config!r}" if cfg.model_config else "the model"
        raise ConfigError(f"vocab_size: {what} has {student.config.vocab_size} tokens but the tokenizer of {cfg.data!r} (--vocab-size "
                          f"{cfg.vocab_size}) has {corpus.vocab_size}; make them equal")
    check_splits(cfg, corpus, objective, k)
    student.to(info.device).train()
    amp = _amp_dtype(cfg.precision, info.device)
    fsdp = cfg.parallel == "fsdp"
    prepare_student(student, cfg.parallel, cfg.activation_checkpointing, info.device, amp)  # FSDP2 shards here
    optimizer = _optimizer(student, cfg, fused_ok=info.device.type == "cuda")
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    start = 0
    if cfg.resume:
        if is_sharded(ckpt) != fsdp:  # the settings check names --parallel first; this is the same refusal
            raise ConfigError(f"parallel: {ckpt} is {'a sharded' if is_sharded(ckpt) else 'a whole-model'} checkpoint; "
                              f"resume it with --parallel {'fsdp' if is_sharded(ckpt) else 'ddp'}")
        start = (load_sharded_checkpoint if fsdp else load_checkpoint)(ckpt, student, optimizer, scaler)["step"]
        log(f"resumed from {ckpt} at step {start}")
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
        recover_metrics(out / "metrics.jsonl", start, log)
        write_json(out / "train_config.json", cfg.to_dict())
        write_text(out / "tokenizer.json", corpus.tokenizer.to_str(pretty=True))
    model = data_parallel(student, cfg.parallel, info.world, info.device)

    autocast = (lambda: torch.autocast(info.device.type, dtype=amp)) if amp is not None else nullcontext
    evaluate = lambda: evaluate_loss(student, teacher, objective, k, cfg, corpus, info.device, autocast)  # noqa: E731
    stop = cfg.stop_at or cfg.steps
    separator = corpus.eos_id if cfg.packed_docs else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    live = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    bar = tqdm(total=cfg.steps, initial=start, desc=f"[{cfg.stage}]", disable=not (info.main and live), file=sys.stderr,
               dynamic_ncols=True, mininterval=0.2)
    every = max(1, (stop - start) // 10)  # without a live bar: about ten plain progress lines
    t_start, last_loss = time.perf_counter(), float("nan")
    for step in range(start, stop):
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(objective, corpus.train, cfg.batch_size, cfg.seq_len, k, (cfg.tau_min, cfg.tau_max),
                           step_generator(cfg.seed, step), separator).shard(par.dp_rank, par.dp_world)
        loss_sum, pos_sum = 0.0, 0.0
        for micro in range(cfg.grad_accum):
            part = batch.shard(micro, cfg.grad_accum).to(info.device)
            sync = micro == cfg.grad_accum - 1 or info.world == 1
            with gradient_sync(model, sync), autocast():
                if par.cp is None:
                    loss, per_pos = compute_loss(objective, model, part, teacher, k=k)
                    reported = loss
                else:  # loss: this rank's share of its group's sequences (app/context_parallel.py)
                    loss, reported, per_pos = context_parallel_loss(objective, model, part, teacher, par.cp, k=k)
            scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum, pos_sum = loss_sum + reported.detach(), pos_sum + per_pos
        if cfg.dump_grads and step == start and (info.main or fsdp):
            grads = full_gradients(student)  # under FSDP a collective: every rank gathers
            if info.main:
                save_tensors(Path(cfg.dump_grads), grads)
        done = step + 1
        stats = torch.cat([(loss_sum / cfg.grad_accum)[None], pos_sum / cfg.grad_accum]).float()
        if info.world > 1:
            dist.all_reduce(stats)  # every rank sees the same mean, so all of them stop together below
            stats /= info.world
        if not math.isfinite(float(stats[0])):  # before the optimizer step: the checkpoints keep the last good weights
            raise NonFiniteLoss(_non_finite_message(float(stats[0]), done, out))
        last_loss = float(stats[0])
        scaler.unscale_(optimizer)
        grad_norm = local_value(torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        tok_s = tokens_per_step / (time.perf_counter() - t0)
        if info.main:
            bar.set_postfix_str(f"loss {last_loss:.4f} {tok_s:,.0f} tok/s", refresh=False)
            bar.update(1)
            if not live and (done % every == 0 or done == stop):
                log(f"step {done}/{cfg.steps} loss {last_loss:.4f} {tok_s:,.0f} tok/s ({time.perf_counter() - t_start:.0f}s)")
            if done % cfg.log_every == 0 or done == stop:
                append_jsonl(out / "metrics.jsonl", {
                    "step": done, "loss": last_loss, "loss_pos": stats[1:].tolist(), "lr": lr,
                    "grad_norm": float(grad_norm), "tokens_per_s": tok_s, "elapsed_s": time.perf_counter() - t_start,
                })
        # The checkpoint comes before the evaluation: an evaluation error never costs trained steps.
        # Under FSDP both are collectives (every rank takes part); otherwise rank 0 alone does them.
        if (done % cfg.ckpt_every == 0 or done == stop) and fsdp:
            save_sharded_checkpoint(out, done, student, optimizer, scaler, cfg.to_dict(), model_info, cfg.keep_checkpoints)
        elif (done % cfg.ckpt_every == 0 or done == stop) and info.main:
            save_checkpoint(out, done, student, optimizer, scaler, cfg.to_dict(), model_info, cfg.keep_checkpoints)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps and (info.main or fsdp):
            val = evaluate()
            if info.main:
                append_jsonl(out / "metrics.jsonl", {"step": done, "val_loss": val[0], "val_loss_pos": val[1]})
    bar.close()

    summary = {"final_loss": last_loss, "steps": cfg.steps, "seconds": time.perf_counter() - t_start}
    if stop == cfg.steps and (info.main or fsdp):
        # The final evaluation, once: a resume after it failed (the last checkpoint is in place) runs only this.
        vals = [m for m in read_metrics(out / "metrics.jsonl") if "val_loss" in m] if info.main else None
        again = not vals or vals[-1]["step"] != cfg.steps
        if broadcast_value(again) if fsdp else again:  # under FSDP rank 0 decides for all
            val = evaluate()
            if info.main:
                vals.append({"step": cfg.steps, "val_loss": val[0], "val_loss_pos": val[1]})
                append_jsonl(out / "metrics.jsonl", vals[-1])
        final = full_copy(student, info.main)  # under FSDP a collective: rank 0 gets the full weights
    if stop == cfg.steps and info.main:
        if math.isnan(last_loss):  # resumed at the last step: the loss of the last logged step
            losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
            summary["final_loss"] = losses[-1] if losses else last_loss
        summary.update(val_loss=vals[-1]["val_loss"], val_loss_pos=vals[-1]["val_loss_pos"])
        record = {**model_info, "stage": cfg.stage, "data": cfg.data, "train_config": cfg.to_dict(), "summary": summary}
        save_hf_stage(out, final, record, hf_tokenizer_of(corpus)) if hf else save_model(out, final, record)
    _barrier(info)
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

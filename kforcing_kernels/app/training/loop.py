"""The K-Forcing training loop: one stage (Stage 0 AR teacher, Stage 1 forward distillation, Stage 2
self-forcing) from a :class:`TrainConfig`; :func:`train` returns the run's summary.

:func:`train` is three steps: the world (:func:`~kforcing_kernels.app.training.parallel.setup_parallel`: one dp x cp
device mesh), the stage's set-up (:func:`~kforcing_kernels.app.training.stage.set_up`: data, models parallelized,
optimizer, checkpointer, resume), then the steps and the finish here. The command line is
:mod:`kforcing_kernels.app.train`; the objectives are in :mod:`kforcing_kernels.app.training.objectives`, the
checkpoint formats behind :class:`~kforcing_kernels.app.training.checkpointer.Checkpointer`, the settings in
:mod:`kforcing_kernels.app.training.config` (checked by :mod:`~kforcing_kernels.app.training.validation`).

Reproducibility: the batch, noise and temperatures of step s are drawn from a
generator seeded by (seed, s), the global batch is cut into equal per-rank shards,
and checkpoints hold the model and optimizer state exactly, so ``--resume`` repeats
the uninterrupted run bit for bit and a data-parallel run averages the same
gradients as a single process. With ``--parallel fsdp`` the student is sharded by FSDP2
(:mod:`kforcing_kernels.app.training.parallel`) and checkpoints are sharded
(:mod:`kforcing_kernels.app.training.sharded_checkpoint`); writing a checkpoint, evaluating and gathering the
final model are then collectives that every rank joins (evaluation too with ``--teacher-parallel fsdp``).

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

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from ... import env
from ..data import Corpus, data_sha256
from ..files import append_jsonl, save_tensors
from ..records import read_model_json
from .checkpoint import latest_checkpoint, read_metrics, stderr_log
from .config import TrainConfig
from .context_parallel import context_parallel_loss
from .objectives import Objective, compute_loss, make_batch, step_generator
from .parallel import ParallelDims, broadcast_value, full_gradients, gradient_sync, local_value, setup_parallel
from .provenance import effective_config, require_resume_settings, require_same_provenance, teacher_sha256
from .run_folder import discard_failed_start, folder_before_start
from .stage import Stage, lock_out, set_up
from .validation import validate_config

# Without a live bar (stderr not a terminal, or --no-progress): a plain progress line at least this often.
PROGRESS_SECONDS = 30.0


class ProgressLines:
    """When to print a plain progress line without a live bar: after the first step (it shows the step time), about
    ten times over the run (every ``(stop - start) // 10`` steps), whenever ``seconds`` passed since the last line
    (a slow stage otherwise stays silent for minutes), and at the last step. ``seconds``: default
    :data:`PROGRESS_SECONDS`; ``clock``: seconds, monotonic."""

    def __init__(self, start: int, stop: int, seconds: Optional[float] = None, clock=time.monotonic):
        self.start, self.stop, self.clock = start, stop, clock
        self.seconds = PROGRESS_SECONDS if seconds is None else seconds
        self.every = max(1, (stop - start) // 10)
        self.last = clock()

    def due(self, done: int) -> bool:
        """Whether step ``done`` (1-based, as printed) gets a line; call once per step, in order."""
        now = self.clock()
        if done == self.start + 1 or done % self.every == 0 or done == self.stop or now - self.last >= self.seconds:
            self.last = now
            return True
        return False


# ---------------------------------------------------------------------- schedule, model, optimizer


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine down to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------- the training loop


class NonFiniteLoss(RuntimeError):
    """A training step's loss was NaN or infinite: the run stopped before that step changed the model."""


def _non_finite_message(loss: float, step: int, out: Path) -> str:
    ckpt = latest_checkpoint(out)
    kept = (
        f"its newest checkpoint, {ckpt.stem}, holds the last good state"
        if ckpt is not None
        else "no checkpoint was written yet"
    )
    return (
        f"loss: step {step} gave a non-finite loss ({loss}); the run stopped before the optimizer step, so nothing "
        f"from it was saved ({out}: {kept}). Lower --lr, keep --grad-clip small or train in --precision fp32"
    )


def train(cfg: TrainConfig) -> dict:
    """Run one stage; returns a summary (final loss, validation loss, timings).

    The run folder is locked (:class:`~kforcing_kernels.app.training.checkpoint.RunLock`, held by rank 0) from the
    first look at it to the return: a second run into the same ``out`` fails at once.
    """
    if cfg.model and not cfg.teacher:
        cfg = dataclasses.replace(cfg, teacher=cfg.model)  # --model is stage1's teacher
    validate_config(cfg, env.distributed_ranks()[0])  # before anything is set up or touched
    cfg = effective_config(cfg)  # what the run records and compares: no preset for an HF model, stage2's own k
    # One process group and one dp x cp device mesh for the stage; FSDP2 in one process gets a one-rank group.
    dims = setup_parallel(
        cfg.device,
        cfg.context_parallel,
        cfg.parallel,
        group=cfg.parallel == "fsdp" or (cfg.teacher_parallel == "fsdp" and cfg.stage != "stage0"),
    )
    out = Path(cfg.out)
    try:
        before = folder_before_start(out) if dims.main else None
        lock = lock_out(out, dims)
        try:
            return _train(cfg, dims, out)
        except BaseException:
            if lock is not None and before is not None:  # a start that trained nothing leaves nothing behind
                discard_failed_start(out, before, cfg.overwrite)
            raise
        finally:
            if lock is not None:
                lock.release()
    finally:
        dims.close()


def _train(cfg: TrainConfig, dims: ParallelDims, out: Path) -> dict:
    log = stderr_log(f"[{cfg.stage}]") if dims.main else (lambda message: None)
    if cfg.resume and (out / "model.json").exists() and (cfg.stop_at is None or cfg.stop_at == cfg.steps):
        finished = read_model_json(out)
        require_resume_settings(finished.get("train_config", {}), cfg, f"the finished run in {out}")
        require_same_provenance(
            finished,
            {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
            f"the finished run in {out}",
            log,
        )
        log(f"{out} is complete (model.json exists); nothing to resume")
        return finished.get("summary", {})
    stage = set_up(cfg, dims, out, log)
    log(threads_line(dims))
    if dims.world > 1 or dims.shard:
        log(layout_line(stage))
    t_start = time.perf_counter()
    last_loss = _run_steps(stage)
    return _finish(stage, last_loss, t_start)


def threads_line(dims: ParallelDims) -> str:
    """The start line that says what the run computes on: the device and, on CPU, the threads torch uses (--threads,
    else torch's default: every core, which on a busy machine can make a step many times slower than --threads 1)."""
    if dims.device.type != "cpu":
        return f"device {dims.device}"
    ranks = f" per rank ({dims.world} ranks)" if dims.world > 1 else ""
    n = torch.get_num_threads()
    threads = f"{n} thread{'s' if n != 1 else ''}{ranks}"
    return f"device cpu, {threads} (--threads N sets it; on a busy machine try --threads 1)"


def layout_line(stage: Stage) -> str:
    """The start line of a run over ranks (torchrun): the ``dp x cp`` layout, how the student is spread (DDP or
    FSDP2), the precision it computes in, and where the frozen teacher lives."""
    dims, cfg = stage.dims, stage.cfg
    student = f"FSDP2 (sharded over {dims.world} ranks)" if dims.shard else "DDP (a full copy per rank)"
    amp = getattr(stage.autocast(), "fast_dtype", None)  # torch.autocast, or nullcontext: fp32
    precision = f"{str(amp).removeprefix('torch.')} autocast" if amp is not None else "fp32"
    if stage.teacher is None:
        teacher = "no teacher"
    elif cfg.teacher_parallel == "fsdp":
        teacher = f"teacher FSDP2-sharded over {dims.world} ranks"
    else:
        teacher = "teacher replicated on every rank"
    return (
        f"parallel layout: {dims.world} ranks = dp {dims.dp} x cp {dims.cp}, student {student}, precision "
        f"{precision} (--precision {cfg.precision}), {teacher}"
    )


def _evaluate(stage: Stage) -> tuple[float, list[float]]:
    return evaluate_loss(
        stage.student,
        stage.teacher,
        stage.objective,
        stage.k,
        stage.cfg,
        stage.corpus,
        stage.dims.device,
        stage.autocast,
    )


def _step_loss(stage: Stage, part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(backward loss, reported loss, per-position loss) of one micro-batch on this rank."""
    cp = stage.dims.context_parallel
    if cp is None:
        loss, per_pos = compute_loss(stage.objective, stage.model, part, stage.teacher, k=stage.k)
        return loss, loss, per_pos
    # This rank's share of its CP group's sequences (app/training/context_parallel.py).
    return context_parallel_loss(stage.objective, stage.model, part, stage.teacher, cp, k=stage.k)


def _run_steps(stage: Stage) -> float:
    """The optimizer steps from ``stage.start`` to ``--stop-at`` (or the end); returns the last step's loss."""
    cfg, dims, out = stage.cfg, stage.dims, stage.out
    stop = cfg.stop_at or cfg.steps
    separator = stage.corpus.eos_id if cfg.packed_docs else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    live = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    bar = tqdm(
        total=cfg.steps,
        initial=stage.start,
        desc=f"[{cfg.stage}]",
        disable=not (dims.main and live),
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.2,
    )
    lines = ProgressLines(stage.start, stop)  # without a live bar: plain progress lines, about ten and every 30 s
    t_start, last_loss = time.perf_counter(), float("nan")
    for step in range(stage.start, stop):
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step)
        for group in stage.optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(
            stage.objective,
            stage.corpus.train,
            cfg.batch_size,
            cfg.seq_len,
            stage.k,
            (cfg.tau_min, cfg.tau_max),
            step_generator(cfg.seed, step),
            separator,
        ).shard(dims.dp_rank, dims.dp)
        loss_sum: Optional[torch.Tensor] = None
        pos_sum: Optional[torch.Tensor] = None
        for micro in range(cfg.grad_accum):
            part = batch.shard(micro, cfg.grad_accum).to(dims.device)
            sync = micro == cfg.grad_accum - 1 or dims.world == 1
            with gradient_sync(stage.model, sync), stage.autocast():
                loss, reported, per_pos = _step_loss(stage, part)
            stage.scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum = reported.detach() if loss_sum is None else loss_sum + reported.detach()
            pos_sum = per_pos if pos_sum is None else pos_sum + per_pos
        assert loss_sum is not None and pos_sum is not None  # grad_accum >= 1 (validate_config)
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
            if not live and lines.due(done):
                stage.log(
                    f"step {done}/{cfg.steps} loss {last_loss:.4f} {tok_s:,.0f} tok/s "
                    f"({time.perf_counter() - t_start:.0f}s)"
                )
            if done % cfg.log_every == 0 or done == stop:
                append_jsonl(
                    out / "metrics.jsonl",
                    {
                        "step": done,
                        "loss": last_loss,
                        "loss_pos": stats[1:].tolist(),
                        "lr": lr,
                        "grad_norm": float(grad_norm),
                        "tokens_per_s": tok_s,
                        "elapsed_s": time.perf_counter() - t_start,
                    },
                )
        # The checkpoint comes before the evaluation: an evaluation error never costs trained steps.
        if done % cfg.ckpt_every == 0 or done == stop:
            stage.checkpointer.save(done, stage.student, stage.optimizer, stage.scaler, cfg.to_dict(), stage.model_info)
        if (
            cfg.eval_every
            and done % cfg.eval_every == 0
            and done != cfg.steps
            and (dims.main or stage.everyone_evaluates)
        ):
            val = _evaluate(stage)
            if dims.main:
                append_jsonl(out / "metrics.jsonl", {"step": done, "val_loss": val[0], "val_loss_pos": val[1]})
    bar.close()
    return last_loss


def _finish(stage: Stage, last_loss: float, t_start: float) -> dict:
    """The final evaluation (once) and the stage's model folder, when the last step is done."""
    cfg, dims, out = stage.cfg, stage.dims, stage.out
    summary = {"final_loss": last_loss, "steps": cfg.steps, "seconds": time.perf_counter() - t_start}
    if (cfg.stop_at or cfg.steps) != cfg.steps:
        dims.barrier()
        return summary
    vals: list[dict] = []  # rank 0's
    if dims.main or stage.everyone_evaluates:
        # The final evaluation, once: a resume after it failed (the last checkpoint is in place) runs only this.
        vals = [m for m in read_metrics(out / "metrics.jsonl") if "val_loss" in m] if dims.main else []
        again = not vals or vals[-1]["step"] != cfg.steps
        if broadcast_value(again) if stage.everyone_evaluates else again:  # a collective: rank 0 decides for all
            val = _evaluate(stage)
            if dims.main:
                vals.append({"step": cfg.steps, "val_loss": val[0], "val_loss_pos": val[1]})
                append_jsonl(out / "metrics.jsonl", vals[-1])
    record: Optional[dict] = None  # rank 0's
    if dims.main:
        if math.isnan(last_loss):  # resumed at the last step: the loss of the last logged step
            losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
            summary["final_loss"] = losses[-1] if losses else last_loss
        summary.update(val_loss=vals[-1]["val_loss"], val_loss_pos=vals[-1]["val_loss_pos"])
        record = {
            **stage.model_info,
            "stage": cfg.stage,
            "data": cfg.data,
            "train_config": cfg.to_dict(),
            "summary": summary,
        }
    stage.checkpointer.export(stage.student, record, stage.corpus)  # a collective under FSDP2: rank 0 writes
    dims.barrier()
    return summary


@torch.no_grad()
def evaluate_loss(
    student, teacher, objective: Objective, k: int, cfg: TrainConfig, corpus: Corpus, device, autocast
) -> tuple[float, list[float]]:
    """Training objective on fixed validation batches (same batches every time)."""
    was_training = student.training
    student.eval()
    total = 0.0
    per_pos: Optional[torch.Tensor] = None
    for i in range(cfg.eval_batches):
        batch = make_batch(
            objective,
            corpus.val,
            cfg.batch_size,
            cfg.seq_len,
            k,
            (cfg.tau_min, cfg.tau_max),
            step_generator(cfg.seed, i, salt=1),
            corpus.eos_id if cfg.packed_docs else None,
        ).to(device)
        with autocast():
            loss, pos = compute_loss(objective, student, batch, teacher, k=k)
        total, per_pos = total + float(loss), (pos.float() if per_pos is None else per_pos + pos.float())
    student.train(was_training)
    if per_pos is None:
        raise ValueError(f"eval_batches: expected a positive int, got {cfg.eval_batches!r}")
    return total / cfg.eval_batches, (per_pos / cfg.eval_batches).tolist()

"""The set-up of one training stage: the models (the student built or inherited, the teacher loaded, both placed
on the ranks by :mod:`~kforcing_kernels.app.training.parallel`), the optimizer, the checkpointer, the run folder's lock,
and the checks a ``--resume`` must pass (settings, text, tokenizer, teacher; :mod:`.provenance`'s) before anything is
built.

:func:`set_up` returns a :class:`Stage`; :mod:`~kforcing_kernels.app.training.loop` runs its steps.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from ..data import Corpus, data_sha256
from ..files import CheckpointError, RunLock, check_writable, tokenizer_sha256, write_json, write_text
from ..student import Student, corpus_for, kind_of, load_student, stage_kind
from .checkpoint import latest_checkpoint, recover_metrics
from .checkpointer import Checkpointer, read_meta
from .config import ConfigError, TrainConfig
from .objectives import Objective
from .parallel import ParallelDims, parallelize, place_teacher
from .provenance import require_resume_settings, require_same_provenance, teacher_sha256
from .run_folder import prepare_out
from .targets import STAGE1_CDF_ORDER
from .validation import check_splits


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
        raise ConfigError(
            f"teacher: the tokenizer of --teacher {cfg.teacher} is not the one --data {cfg.data!r} "
            f"(--vocab-size {cfg.vocab_size}) gives: the same ids would mean other text; distil on the "
            "teacher's --data and --vocab-size, or train a teacher on this --data"
        )


def _build(cfg: TrainConfig, dims: ParallelDims, corpus: Corpus, log) -> tuple[Student, Optional[Student], int, dict]:
    """(student, teacher or None, student k, provenance info)."""
    init = torch.Generator().manual_seed(cfg.seed)
    if cfg.stage == "stage0":  # the kind's own model (a preset, or --model-config), trained as an AR model
        student = stage_kind(cfg).build(cfg, init)
        student.noise_encoder.requires_grad_(False)  # the AR model never sees noise tokens
        return student, None, 0, {"kind": "ar", "k": 0, **_text_provenance(corpus)}
    assert cfg.teacher is not None  # validate_config asks every distilled stage for --teacher
    teacher, tinfo, teacher_tokenizer = load_student(cfg.teacher, dims.device)
    teacher.requires_grad_(False)
    _check_teacher_tokenizer(cfg, teacher_tokenizer, corpus, log)
    if cfg.stage == "stage1":
        if tinfo["k"] != 0:
            raise ConfigError(
                f"teacher: stage1 distils an AR teacher (stage0), got a PFLM with k={tinfo['k']} from {cfg.teacher}"
            )
        student = copy.deepcopy(teacher).cpu()
        student.reset_noise_encoder(init)  # the backbone is the teacher's; the noise encoder is new
        if cfg.decode != "argmax":  # how the PFLM decodes, saved in its model config (model/decoding.py)
            try:
                kind_of(student).with_decode(student, cfg.decode)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        k = cfg.k
    else:
        if tinfo["k"] == 0:
            raise ConfigError(
                f"teacher: stage2 needs a PFLM teacher (stage1 or stage2), got the AR model in {cfg.teacher}"
            )
        student = copy.deepcopy(teacher).cpu()
        k = 2 * tinfo["k"]
    student.requires_grad_(True)
    info = {
        "kind": "pflm",
        "k": k,
        "teacher": str(Path(cfg.teacher).resolve()),
        "teacher_k": tinfo["k"],
        "supervision": cfg.supervision,
        **_text_provenance(corpus),
        "teacher_sha256": tinfo["tensors"]["sha256"],
    }
    # which inverse-CDF construction the student learned (app/evaluation/noise_diagnosis.py reads it)
    if cfg.stage == "stage1":
        info["cdf_order"] = STAGE1_CDF_ORDER
    return student, teacher, k, info


def _optimizer(model: Student, cfg: TrainConfig, fused_ok: bool) -> torch.optim.AdamW:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True if fused_ok else None)


def _text_provenance(corpus: Corpus) -> dict:
    return {"data_sha256": corpus.data_sha256, "tokenizer_sha256": corpus.tokenizer_sha256}


def _resume_state(out: Path, cfg: TrainConfig, log) -> tuple[Path, dict]:
    """The newest checkpoint, after checking settings, data and teacher (before the corpus is built)."""
    ckpt = latest_checkpoint(out)
    if ckpt is None:  # prepare_out (run_folder.py) found one; gone since
        raise ConfigError(f"resume: no checkpoint in {out} to resume from")
    meta = read_meta(ckpt)
    require_resume_settings(meta["train_config"], cfg, f"the run in {out}")
    require_same_provenance(
        meta["info"],
        {"data_sha256": data_sha256(cfg.data), "teacher_sha256": teacher_sha256(cfg.teacher)},
        f"the run in {out}",
        log,
    )
    return ckpt, meta


def lock_out(out: Path, dims: ParallelDims) -> Optional[RunLock]:
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


@dataclass
class Stage:
    """What one stage trains and with what, built once by :func:`set_up` (every rank holds its own)."""

    cfg: TrainConfig
    dims: ParallelDims
    out: Path
    log: Callable[[str], None]
    corpus: Corpus
    objective: Objective
    k: int
    student: Student  # the model the optimizer updates (sharded under FSDP2)
    model: torch.nn.Module  # what a step calls: the student, or DDP around it
    teacher: Optional[Student]
    model_info: dict
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    checkpointer: Checkpointer
    autocast: Callable[[], ContextManager[Any]]
    start: int

    @property
    def everyone_evaluates(self) -> bool:
        """Evaluation is a collective when the student or the teacher is sharded; else rank 0 runs it alone."""
        return self.dims.shard or (self.teacher is not None and self.cfg.teacher_parallel == "fsdp")


def set_up(cfg: TrainConfig, dims: ParallelDims, out: Path, log) -> Stage:
    """The run folder, data, models (parallelized), optimizer and checkpointer of a stage; restores a checkpoint."""
    prepare_out(cfg, dims.main, log)
    if cfg.dump_grads and dims.main:
        check_writable(cfg.dump_grads, "--dump-grads")  # now, not after the first step
    # --resume: settings, data and teacher are checked before the corpus is built (changed data would train a new
    # tokenizer).
    ckpt: Optional[Path] = None
    ckpt_meta: Optional[dict] = None
    if cfg.resume:
        ckpt, ckpt_meta = _resume_state(out, cfg, log)

    # Data: rank 0 builds the tokenizer cache first so the ranks never race on it.
    if dims.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size, verbose=True)
    dims.barrier()
    if not dims.main:
        corpus = corpus_for(cfg.teacher, cfg.data, cfg.vocab_size)

    objective = Objective.of(cfg.stage, cfg.supervision)
    if ckpt_meta is not None:  # the same text could still be tokenized otherwise (another tokenizers version)
        require_same_provenance(
            ckpt_meta["info"], {"tokenizer_sha256": corpus.tokenizer_sha256}, f"the run in {out}", log
        )
    student, teacher, k, model_info = _build(cfg, dims, corpus, log)
    _check_vocab(cfg, student, corpus)
    check_splits(cfg, corpus, objective, k)
    student.to(dims.device).train()
    amp = _amp_dtype(cfg.precision, dims.device)
    if teacher is not None:
        place_teacher(teacher, dims, cfg.teacher_parallel, amp)
    model = parallelize(
        student, dims, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile, amp=amp
    )
    optimizer = _optimizer(student, cfg, fused_ok=dims.device.type == "cuda")
    scaler = torch.amp.GradScaler(dims.device.type, enabled=amp == torch.float16)
    checkpointer = Checkpointer(out, dims, cfg.keep_checkpoints)
    start = 0
    if ckpt is not None:  # --resume
        start = checkpointer.load(ckpt, student, optimizer, scaler)
        log(f"resumed from {ckpt} at step {start}")
    if dims.main:
        out.mkdir(parents=True, exist_ok=True)
        recover_metrics(out / "metrics.jsonl", start, log)
        write_json(out / "train_config.json", cfg.to_dict())
        write_text(out / "tokenizer.json", corpus.tokenizer.to_str(pretty=True))
    autocast = (lambda: torch.autocast(dims.device.type, dtype=amp)) if amp is not None else nullcontext
    return Stage(
        cfg,
        dims,
        out,
        log,
        corpus,
        objective,
        k,
        student,
        model,
        teacher,
        model_info,
        optimizer,
        scaler,
        checkpointer,
        autocast,
        start,
    )


def _check_vocab(cfg: TrainConfig, student, corpus: Corpus) -> None:
    vocab = student.config.vocab_size
    # A teacher's own tokenizer (its kind's text): its ids on --data need embeddings, whatever their number.
    if kind_of(student).tokenizer_from_model and cfg.stage != "stage0":
        top = max(int(corpus.train.max()), int(corpus.val.max()))
        if top >= vocab:
            raise ConfigError(
                f"vocab_size: the tokenizer of {cfg.teacher} gives id {top} on --data, outside the "
                f"model's {vocab} embeddings"
            )
    elif vocab != corpus.vocab_size:
        what = f"--model-config {cfg.model_config!r}" if cfg.model_config else "the model"
        raise ConfigError(
            f"vocab_size: {what} has {student.config.vocab_size} tokens but the tokenizer of "
            f"{cfg.data!r} (--vocab-size "
            f"{cfg.vocab_size}) has {corpus.vocab_size}; make them equal"
        )

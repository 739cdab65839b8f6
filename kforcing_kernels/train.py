"""K-Forcing trainer: Stage 0 (AR teacher) -> Stage 1 (AR -> PFLM(1)) -> Stage 2 (PFLM(k) -> PFLM(2k)), repeated.

    python -m kforcing_kernels.train stage0 --out runs/x/stage0 --steps 1500
    python -m kforcing_kernels.train stage1 --teacher runs/x/stage0 --out runs/x/stage1
    python -m kforcing_kernels.train stage2 --teacher runs/x/stage1 --out runs/x/stage2_k2
    python -m kforcing_kernels.train pipeline --out runs/x          # 0 -> 1 -> 2 (k=2) -> 2 (k=4)
    torchrun --nproc_per_node 2 -m kforcing_kernels.train ...      # data parallel, same flags

Paper references: Algorithm 2 (Stage 1: the AR teacher's temperature-scaled
inverse-CDF sample at uniform z is the target), Algorithm 3 (Stage 2: the PFLM(k)
teacher's SingleForward with z[:k], then its DoubleForward with z[k:] conditioned
on its own first k tokens; the student sees all 2k noises in one SingleForward).

Reproducibility: the batch, noise and temperatures of step s are drawn from a
generator seeded by (seed, s), the global batch is cut into equal per-rank shards,
and checkpoints hold the model and optimizer state exactly, so ``--resume`` repeats
the uninterrupted run bit for bit and a data-parallel run averages the same
gradients as a single process. Checkpoints are safetensors + JSON, written to a
temporary file and renamed; a checkpoint exists only once its JSON is in place,
and the JSON holds the SHA-256 of the tensors it belongs to.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .data import DEFAULT_SOURCE, Corpus, load_corpus, sample_windows
from .model import PRESETS, KForcingLM, ModelConfig
from .ops.sampling import inverse_cdf_sample, noise_inversion

STAGES = ("stage0", "stage1", "stage2")
SUPERVISIONS = ("forward", "noise_inversion")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHECKPOINT_FORMAT = 1


@dataclass
class TrainConfig:
    """One training stage. ``batch_size`` is global (sequences per optimizer step, all ranks together)."""

    stage: str = "stage0"
    out: str = "runs/train"
    teacher: Optional[str] = None  # stage folder of the teacher (stage1, stage2)
    data: str = DEFAULT_SOURCE
    vocab_size: int = 2048
    preset: str = "tiny"  # stage0 only: the model size (later stages inherit the teacher's)
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = 128
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    tau_min: float = 0.5
    tau_max: float = 1.0
    # stage1 only: "forward" (Algorithm 2, k=1) or "noise_inversion" (the PTP baseline of the
    # paper's ablation: real next-k tokens, z inverted from the AR teacher's CDF bins, any k).
    supervision: str = "forward"
    k: int = 1
    seed: int = 0
    precision: str = "auto"
    device: str = "auto"
    log_every: int = 10
    ckpt_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    resume: bool = False
    stop_at: Optional[int] = None  # leave (with a checkpoint) once this step is done; --resume continues
    progress: Optional[bool] = None  # None: a live bar when stderr is a terminal
    dump_grads: Optional[str] = None  # debugging: write the first step's averaged gradients here

    # Fields that change what a step computes; a resumed run must agree on them.
    RESUME_KEYS = ("stage", "teacher", "data", "vocab_size", "preset", "model_overrides", "seq_len", "steps", "batch_size",
                   "grad_accum", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
                   "tau_min", "tau_max", "supervision", "k", "seed", "precision")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


class CheckpointError(ValueError):
    """A checkpoint or model file is missing, truncated, corrupt or does not match the run."""


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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
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


# ---------------------------------------------------------------------- files: atomic writes, checkpoints, models


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path``: readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(path: Path, obj: dict) -> None:
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(obj, indent=1)))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda p: save_file(tensors, p))
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt JSON ({exc}); delete it to fall back to an earlier checkpoint") from None


def _load_tensors(json_path: Path, record: dict) -> dict[str, torch.Tensor]:
    """Load the tensors a JSON record points at, after checking size and SHA-256."""
    path = json_path.parent / record["file"]
    if not path.exists():
        raise CheckpointError(f"{path}: missing (referenced by {json_path.name})")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise CheckpointError(f"{path}: truncated or corrupt: {size} bytes, expected {record['bytes']} (from {json_path.name})")
    if _sha256(path) != record["sha256"]:
        raise CheckpointError(f"{path}: corrupt: SHA-256 does not match {json_path.name}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def _model_tensors(model: KForcingLM) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("head.weight")  # the same tensor as wte.weight
    return sd


def _load_model_tensors(model: KForcingLM, tensors: dict[str, torch.Tensor], where: Path) -> None:
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not (k == "head.weight" and model.config.tie_embeddings)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{where}: tensors do not match the model (missing {missing}, unexpected {result.unexpected_keys})")


def save_model(folder: Path, model: KForcingLM, info: dict) -> None:
    """Final weights of a stage: ``model.safetensors`` + ``model.json`` (config, k, provenance, checksum)."""
    record = _save_tensors(folder / "model.safetensors", _model_tensors(model))
    _write_json(folder / "model.json", {**info, "model_config": model.config.to_dict(), "tensors": record})


def load_model(folder: str, device: str | torch.device = "cpu"):
    """``(model in eval mode, info dict, tokenizer or None)`` from a stage folder written by :func:`save_model`."""
    from tokenizers import Tokenizer

    folder_path = Path(folder)
    info = _read_json(folder_path / "model.json")
    model = KForcingLM(ModelConfig.from_dict(info["model_config"]))
    _load_model_tensors(model, _load_tensors(folder_path / "model.json", info["tensors"]), folder_path)
    model.k_train = info["k"]  # the window it was trained with (0: AR); generate_kforcing checks k against it
    tok_path = folder_path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
    return model.to(device).eval(), info, tokenizer


def _checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def latest_checkpoint(out: Path) -> Optional[Path]:
    """The JSON of the newest complete checkpoint (a checkpoint exists once its JSON does)."""
    found = sorted(_checkpoint_dir(out).glob("step_*.json"))
    return found[-1] if found else None


def save_checkpoint(out: Path, step: int, model: KForcingLM, optimizer, scaler, cfg: TrainConfig, info: dict, keep: int) -> Path:
    ckpt = _checkpoint_dir(out)
    stem = f"step_{step:08d}"
    opt = optimizer.state_dict()
    tensors = {f"model/{k}": v for k, v in _model_tensors(model).items()}
    for pid, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim/{pid}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    record = _save_tensors(ckpt / f"{stem}.safetensors", tensors)
    meta = {
        "format": CHECKPOINT_FORMAT, "step": step, "train_config": cfg.to_dict(), "model_config": model.config.to_dict(),
        "info": info, "param_groups": opt["param_groups"], "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "tensors": record,
    }
    _write_json(ckpt / f"{stem}.json", meta)  # last: the checkpoint now exists
    for old in sorted(ckpt.glob("step_*.json"))[:-keep]:
        old.with_suffix(".safetensors").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return ckpt / f"{stem}.json"


def load_checkpoint(json_path: Path, model: KForcingLM, optimizer, scaler) -> dict:
    """Restore model, optimizer and scaler state in place; returns the checkpoint's JSON."""
    meta = _read_json(json_path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{json_path}: unknown checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    tensors = _load_tensors(json_path, meta["tensors"])
    _load_model_tensors(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}, json_path)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, pid, name = key.split("/", 2)
            state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    if meta["scaler"] is not None:
        scaler.load_state_dict(meta["scaler"])
    return meta


# ---------------------------------------------------------------------- objectives (paper Algorithms 2 and 3)


def forward_distillation_targets(teacher_logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Stage-1 targets: inverse-CDF of ``softmax(logits / tau)`` at z (Algorithm 2, lines 5-6).

    teacher_logits ``[B, N, V]``, z ``[B, N]`` uniform, tau ``[B]`` -> token ids ``[B, N]``.
    """
    return inverse_cdf_sample(teacher_logits, z, tau[:, None].expand(z.shape))


@torch.no_grad()
def self_forcing_targets(teacher: KForcingLM, context: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Stage-2 targets: two teacher rounds (Algorithm 3, lines 4-9).

    context ``[B, N]``, z ``[B, N, 2k]``, tau ``[B]`` -> ``[B, N, 2k]``: round one decodes
    ``z[..., :k]`` with SingleForward; round two decodes ``z[..., k:]`` with DoubleForward,
    conditioned on round one's tokens and reusing its context K/V.
    """
    k = z.shape[-1] // 2
    logits1, context_kv = teacher.single_forward(context, z[..., :k], tau)
    first = logits1.argmax(-1)  # [B, N, k]
    second = teacher.double_forward(context_kv, first, z[..., k:], tau).argmax(-1)  # [B, N, k]
    return torch.cat([first, second], -1)


def noise_inversion_supervision(
    teacher: KForcingLM, tokens: torch.Tensor, k: int, tau: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PTP baseline (paper Section 3.2.1): real tokens as targets, their noise recovered from the AR teacher.

    tokens ``[B, N + k]`` of real text -> (context ``[B, N]``, z ``[B, N, k]``, targets ``[B, N, k]``):
    slot j of window t targets ``tokens[t + 1 + j]`` with z uniform in its CDF bin under
    ``softmax(logits / tau)`` of the teacher given the real text up to ``t + j``.
    """
    n = tokens.shape[1] - k
    logits = teacher(tokens[:, :-1])  # [B, N + k - 1, V]: position p predicts tokens[p + 1]
    reads = torch.arange(n, device=tokens.device)[:, None] + torch.arange(k, device=tokens.device)  # [N, k]
    targets = tokens[:, 1:][:, reads]  # [B, N, k]
    z = noise_inversion(logits[:, reads], targets, tau[:, None, None].expand(targets.shape), generator)
    return tokens[:, :n], z, targets


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, N + 1] (stage 0), [B, N + k] (noise inversion) or context [B, N]
    noise: Optional[torch.Tensor] = None  # [B, N, k]
    tau: Optional[torch.Tensor] = None  # [B]
    seed: Optional[int] = None  # noise inversion: seeds the in-bin uniforms of this shard

    def shard(self, index: int, count: int) -> "Batch":
        size = self.tokens.shape[0] // count
        part = slice(index * size, (index + 1) * size)
        seed = None if self.seed is None else (self.seed * 1009 + index + 1) % 2**62
        return Batch(*(None if t is None else t[part] for t in (self.tokens, self.noise, self.tau)), seed)

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (self.tokens, self.noise, self.tau)), self.seed)


def make_batch(cfg: TrainConfig, k: int, stream: torch.Tensor, generator: torch.Generator) -> Batch:
    """The global batch for one step: windows of the token stream, and for k >= 1 noise and temperatures."""
    if k == 0:
        return Batch(sample_windows(stream, cfg.batch_size, cfg.seq_len + 1, generator))
    if cfg.supervision == "noise_inversion":
        tokens = sample_windows(stream, cfg.batch_size, cfg.seq_len + k, generator)
        tau = cfg.tau_min + (cfg.tau_max - cfg.tau_min) * torch.rand(cfg.batch_size, generator=generator)
        return Batch(tokens, None, tau, int(torch.randint(0, 2**40, (), generator=generator)))
    tokens = sample_windows(stream, cfg.batch_size, cfg.seq_len, generator)
    noise = torch.rand(cfg.batch_size, cfg.seq_len, k, generator=generator)
    tau = cfg.tau_min + (cfg.tau_max - cfg.tau_min) * torch.rand(cfg.batch_size, generator=generator)
    return Batch(tokens, noise, tau)


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 8 + salt)


def compute_loss(model, teacher: Optional[KForcingLM], teacher_k: int, k: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-position mean loss ``[k]``) of one (micro-)batch of a student PFLM(k) (k=0: AR).

    ``teacher_k`` 0 means an AR teacher (Stage 1), else a PFLM(teacher_k) teacher (Stage 2).
    """
    if teacher is None:  # Stage 0: next-token prediction on the data
        logits = model(batch.tokens[:, :-1])  # [B, N, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tokens[:, 1:].flatten())
        return loss, loss.detach()[None]
    context, noise = batch.tokens, batch.noise
    with torch.no_grad():
        if batch.seed is not None:  # Stage 1, noise-inversion baseline
            generator = torch.Generator(device=context.device).manual_seed(batch.seed)
            context, noise, targets = noise_inversion_supervision(teacher, batch.tokens, k, batch.tau, generator)
        elif teacher_k == 0:  # Stage 1, forward distillation
            targets = forward_distillation_targets(teacher(context), noise[..., 0], batch.tau)[..., None]  # [B, N, 1]
        else:  # Stage 2, self-forcing
            targets = self_forcing_targets(teacher, context, noise, batch.tau)  # [B, N, 2k]
    logits = model(context, noise, batch.tau)  # [B, N, k, V]
    per_token = F.cross_entropy(logits.flatten(0, 2).float(), targets.flatten(), reduction="none").view(targets.shape)
    return per_token.mean(), per_token.detach().mean((0, 1))


# ---------------------------------------------------------------------- schedule, logging


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine down to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """A one-line progress bar on a terminal; plain lines (about ten per run) otherwise."""

    def __init__(self, total: int, start: int, label: str, live: Optional[bool]):
        self.total, self.start, self.label = total, start, label
        self.live = sys.stderr.isatty() if live is None else live
        self.every = max(1, (total - start) // 10)
        self.t0, self.last_draw = time.perf_counter(), 0.0

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        now = time.perf_counter()
        done = step == self.total
        if self.live and (now - self.last_draw > 0.2 or done):
            filled = int(30 * step / self.total)
            eta = (now - self.t0) / max(step - self.start, 1) * (self.total - step)
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r[{self.label}] [{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s eta {eta:.0f}s",
                  end="\n" if done else "", file=sys.stderr, flush=True)
            self.last_draw = now
        elif not self.live and (step % self.every == 0 or done):
            print(f"[{self.label}] step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s ({now - self.t0:.0f}s)", file=sys.stderr, flush=True)


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop metric lines of steps the crashed run did past its last checkpoint."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write(path, lambda p: Path(p).write_text("".join(line + "\n" for line in keep)))


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------- the training loop


def _amp_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    if precision == "auto":
        if device.type != "cuda":
            return None  # CPU: fp32 (bf16 autocast is slower than fp32 on most CPUs)
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _build(cfg: TrainConfig, info: DistInfo):
    """(student, teacher or None, teacher_k, student k, provenance info)."""
    init = torch.Generator().manual_seed(cfg.seed)
    if cfg.stage == "stage0":
        model_cfg = PRESETS[cfg.preset](**{"seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, **cfg.model_overrides})
        student = KForcingLM(model_cfg)
        student.reset_parameters(init)
        student.noise_encoder.requires_grad_(False)  # the AR model never sees noise tokens
        return student, None, 0, 0, {"kind": "ar", "k": 0}
    teacher, tinfo, _ = load_model(cfg.teacher, info.device)
    teacher.requires_grad_(False)
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
    info = {"kind": "pflm", "k": k, "teacher": str(cfg.teacher), "teacher_k": tinfo["k"], "supervision": cfg.supervision}
    return student, teacher, tinfo["k"], k, info


def _optimizer(model: KForcingLM, cfg: TrainConfig, fused_ok: bool) -> torch.optim.AdamW:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True if fused_ok else None)


def validate_config(cfg: TrainConfig, world: int = 1) -> None:
    """Clear errors for settings that cannot work, naming the setting."""
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage: expected one of {STAGES}, got {cfg.stage!r}")
    if cfg.stage != "stage0" and not cfg.teacher:
        raise ConfigError(f"teacher: {cfg.stage} needs --teacher (the previous stage's folder)")
    if cfg.stage != "stage0" and not (Path(cfg.teacher) / "model.json").exists():
        raise ConfigError(f"teacher: no trained model in {cfg.teacher!r} (expected {Path(cfg.teacher) / 'model.json'})")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"preset: expected one of {sorted(PRESETS)}, got {cfg.preset!r}")
    if cfg.supervision not in SUPERVISIONS:
        raise ConfigError(f"supervision: expected one of {SUPERVISIONS}, got {cfg.supervision!r}")
    if cfg.supervision == "noise_inversion" and cfg.stage != "stage1":
        raise ConfigError(f"supervision: noise_inversion distils the AR teacher (stage1), got stage {cfg.stage!r}")
    if cfg.k != 1 and not (cfg.stage == "stage1" and cfg.supervision == "noise_inversion"):
        raise ConfigError(f"k: only stage1 with noise_inversion sets the window (forward distillation has k=1, stage2 doubles its teacher's), got {cfg.k}")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision: expected one of {PRECISIONS}, got {cfg.precision!r}")
    if not 0 < cfg.tau_min <= cfg.tau_max:
        raise ConfigError(f"tau_min: expected 0 < tau_min <= tau_max={cfg.tau_max}, got {cfg.tau_min}")
    shards = world * cfg.grad_accum
    if cfg.batch_size % shards:
        raise ConfigError(f"batch_size: expected a multiple of world size x grad_accum = {world} x {cfg.grad_accum}, got {cfg.batch_size}")
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ConfigError(f"stop_at: expected a step in [1, steps={cfg.steps}], got {cfg.stop_at}")


def _resume_state(out: Path, cfg: TrainConfig) -> Optional[Path]:
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return None
    saved = _read_json(ckpt)["train_config"]
    for key in TrainConfig.RESUME_KEYS:
        if saved.get(key) != getattr(cfg, key):
            raise ConfigError(f"{key}: --resume needs the settings of the run in {out}; it used {saved.get(key)!r}, got {getattr(cfg, key)!r}")
    return ckpt


def train(cfg: TrainConfig) -> dict:
    """Run one stage; returns a summary (final loss, validation loss, timings, output folder)."""
    info = setup_distributed(cfg.device)
    validate_config(cfg, info.world)
    out = Path(cfg.out)
    final_json = out / "model.json"
    if cfg.resume and final_json.exists() and (cfg.stop_at is None or cfg.stop_at == cfg.steps):
        if info.main:
            print(f"[{cfg.stage}] {out} is complete (model.json exists); nothing to resume", file=sys.stderr)
        return json.loads(final_json.read_text()).get("summary", {})
    if not cfg.resume and latest_checkpoint(out) is not None:
        raise ConfigError(f"out: {out} already holds checkpoints; pass --resume to continue, or choose another --out")

    # Data: rank 0 builds the tokenizer cache first so the ranks never race on it.
    if info.main:
        corpus = load_corpus(cfg.data, vocab_size=cfg.vocab_size, verbose=True)
    _barrier(info)
    if not info.main:
        corpus = load_corpus(cfg.data, vocab_size=cfg.vocab_size)

    student, teacher, teacher_k, k, model_info = _build(cfg, info)
    if student.config.vocab_size != corpus.vocab_size:
        raise ConfigError(f"vocab_size: the model has {student.config.vocab_size} tokens but the tokenizer of {cfg.data!r} has {corpus.vocab_size}")
    student.to(info.device).train()
    optimizer = _optimizer(student, cfg, fused_ok=info.device.type == "cuda")
    amp = _amp_dtype(cfg.precision, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    start = 0
    if cfg.resume:
        ckpt = _resume_state(out, cfg)
        if ckpt is not None:
            meta = load_checkpoint(ckpt, student, optimizer, scaler)
            start = meta["step"]
            if info.main:
                print(f"[{cfg.stage}] resumed from {ckpt} at step {start}", file=sys.stderr)
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(out / "metrics.jsonl", start)
        _write_json(out / "train_config.json", cfg.to_dict())
        atomic_write(out / "tokenizer.json", lambda p: corpus.tokenizer.save(p))
    model = student
    if info.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            student, device_ids=[info.device.index] if info.device.type == "cuda" else None, broadcast_buffers=False
        )

    autocast = (lambda: torch.autocast(info.device.type, dtype=amp)) if amp is not None else nullcontext
    stop = cfg.stop_at or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.seq_len
    progress = Progress(cfg.steps, start, cfg.stage, cfg.progress) if info.main else None
    t_start, last_loss = time.perf_counter(), float("nan")
    for step in range(start, stop):
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(cfg, k, corpus.train, step_generator(cfg.seed, step)).shard(info.rank, info.world)
        loss_sum, pos_sum = 0.0, 0.0
        for micro in range(cfg.grad_accum):
            part = batch.shard(micro, cfg.grad_accum).to(info.device)
            sync = micro == cfg.grad_accum - 1 or info.world == 1
            with (nullcontext() if sync else model.no_sync()), autocast():
                loss, per_pos = compute_loss(model, teacher, teacher_k, k, part)
            scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum, pos_sum = loss_sum + loss.detach(), pos_sum + per_pos
        if cfg.dump_grads and step == start and info.main:
            _save_tensors(Path(cfg.dump_grads), {n: p.grad for n, p in student.named_parameters() if p.grad is not None})
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        stats = torch.cat([(loss_sum / cfg.grad_accum)[None], pos_sum / cfg.grad_accum]).float()
        if info.world > 1:
            dist.all_reduce(stats)
            stats /= info.world
        last_loss = float(stats[0])
        tok_s = tokens_per_step / (time.perf_counter() - t0)
        if info.main:
            progress.update(done, last_loss, tok_s)
            if done % cfg.log_every == 0 or done == stop:
                _append_jsonl(out / "metrics.jsonl", {
                    "step": done, "loss": last_loss, "loss_pos": stats[1:].tolist(), "lr": lr,
                    "grad_norm": float(grad_norm), "tokens_per_s": tok_s, "elapsed_s": time.perf_counter() - t_start,
                })
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            val = evaluate_loss(student, teacher, teacher_k, k, cfg, corpus, info.device, autocast) if info.main else None
            if info.main:
                _append_jsonl(out / "metrics.jsonl", {"step": done, "val_loss": val[0], "val_loss_pos": val[1]})
        if info.main and (done % cfg.ckpt_every == 0 or done == stop):
            save_checkpoint(out, done, student, optimizer, scaler, cfg, model_info, cfg.keep_checkpoints)

    summary = {"final_loss": last_loss, "steps": cfg.steps, "seconds": time.perf_counter() - t_start}
    if stop == cfg.steps and info.main:
        metrics = read_metrics(out / "metrics.jsonl")
        vals = [m for m in metrics if "val_loss" in m]
        summary.update(val_loss=vals[-1]["val_loss"] if vals else None, val_loss_pos=vals[-1]["val_loss_pos"] if vals else None)
        save_model(out, student, {**model_info, "stage": cfg.stage, "data": cfg.data, "train_config": cfg.to_dict(), "summary": summary})
    _barrier(info)
    return summary


@torch.no_grad()
def evaluate_loss(student, teacher, teacher_k, k, cfg: TrainConfig, corpus: Corpus, device, autocast) -> tuple[float, list[float]]:
    """Training objective on fixed validation batches (same batches every time)."""
    was_training = student.training
    student.eval()
    total, per_pos = 0.0, 0.0
    for i in range(cfg.eval_batches):
        batch = make_batch(cfg, k, corpus.val, step_generator(cfg.seed, i, salt=1)).to(device)
        with autocast():
            loss, pos = compute_loss(student, teacher, teacher_k, k, batch)
        total, per_pos = total + float(loss), per_pos + pos.float()
    student.train(was_training)
    return total / cfg.eval_batches, (per_pos / cfg.eval_batches).tolist()


# ---------------------------------------------------------------------- pipeline


@dataclass
class PipelineConfig:
    """All stages from one config: 0 -> 1 -> 2 (k=2) -> ... -> 2 (k=k_final)."""

    out: str = "runs/pipeline"
    k_final: int = 4
    steps_stage0: int = 1000
    steps_stage1: int = 300
    steps_stage2: int = 300  # each self-forcing round
    lr_stage0: float = 1e-3
    lr_distill: float = 5e-4
    batch_size_distill: Optional[int] = None  # default: the stage-0 batch size

    def stage_folders(self) -> list[tuple[str, Path]]:
        out = Path(self.out)
        rounds = [("stage0", out / "stage0"), ("stage1", out / "stage1")]
        k = 2
        while k <= self.k_final:
            rounds.append(("stage2", out / f"stage2_k{k}"))
            k *= 2
        return rounds


def run_pipeline(pipe: PipelineConfig, base: TrainConfig) -> dict:
    """Train every stage in turn; a finished stage (model.json present) is skipped, so the pipeline resumes."""
    if pipe.k_final < 1 or pipe.k_final & (pipe.k_final - 1):
        raise ConfigError(f"k_final: expected a power of two >= 1 (windows double: 1 -> 2 -> 4 ...), got {pipe.k_final}")
    summaries, teacher = {}, None
    for stage, folder in pipe.stage_folders():
        distill = stage != "stage0"
        cfg = dataclasses.replace(
            base, stage=stage, out=str(folder), teacher=str(teacher) if teacher else None,
            steps={"stage0": pipe.steps_stage0, "stage1": pipe.steps_stage1, "stage2": pipe.steps_stage2}[stage],
            lr=pipe.lr_distill if distill else pipe.lr_stage0,
            batch_size=(pipe.batch_size_distill or base.batch_size) if distill else base.batch_size,
        )
        if (folder / "model.json").exists():
            print(f"[pipeline] {folder} is done; skipping", file=sys.stderr)
            summaries[folder.name] = _read_json(folder / "model.json").get("summary", {})
        else:
            summaries[folder.name] = train(cfg)
        teacher = folder
    return summaries


# ---------------------------------------------------------------------- CLI


def _checked(cast, accept, expected: str):
    """An argparse ``type`` that casts and checks, naming what it expected."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
_fraction = _checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _add_common(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    p.add_argument("--out", required=True, help="output folder (checkpoints, metrics.jsonl, model.safetensors)")
    p.add_argument("--data", default=defaults.data, help="'stdlib' (default: the interpreter's standard library), a text file or a directory")
    p.add_argument("--vocab-size", type=_positive_int, default=defaults.vocab_size)
    p.add_argument("--seq-len", type=_positive_int, default=defaults.seq_len, help="context length N")
    p.add_argument("--batch-size", type=_positive_int, default=defaults.batch_size, help="global sequences per step")
    p.add_argument("--grad-accum", type=_positive_int, default=defaults.grad_accum)
    p.add_argument("--min-lr-ratio", type=_fraction, default=defaults.min_lr_ratio)
    p.add_argument("--warmup-steps", type=_non_negative_int, default=defaults.warmup_steps)
    p.add_argument("--weight-decay", type=_fraction, default=defaults.weight_decay)
    p.add_argument("--grad-clip", type=_positive_float, default=defaults.grad_clip)
    p.add_argument("--tau-min", type=_positive_float, default=defaults.tau_min)
    p.add_argument("--tau-max", type=_positive_float, default=defaults.tau_max)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--precision", choices=PRECISIONS, default=defaults.precision, help="auto: bf16/fp16 autocast on CUDA, fp32 on CPU")
    p.add_argument("--device", default=defaults.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--log-every", type=_positive_int, default=defaults.log_every)
    p.add_argument("--ckpt-every", type=_positive_int, default=defaults.ckpt_every)
    p.add_argument("--keep-checkpoints", type=_positive_int, default=defaults.keep_checkpoints)
    p.add_argument("--eval-every", type=_non_negative_int, default=defaults.eval_every, help="0: only at the end")
    p.add_argument("--eval-batches", type=_positive_int, default=defaults.eval_batches)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out (bit for bit)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.add_argument("--preset", choices=sorted(PRESETS), default=defaults.preset, help="model size for stage0")
    p.add_argument("--n-layer", type=_positive_int)
    p.add_argument("--n-head", type=_positive_int)
    p.add_argument("--n-embd", type=_positive_int)


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m kforcing_kernels.train", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("stage0", "AR teacher on the corpus"), ("stage1", "AR -> PFLM(k=1) forward distillation"),
                            ("stage2", "PFLM(k) -> PFLM(2k) self-forcing distillation")):
        p = sub.add_parser(name, help=help_text)
        _add_common(p, d)
        p.add_argument("--steps", type=_positive_int, default=d.steps)
        p.add_argument("--lr", type=_positive_float, default=d.lr if name == "stage0" else PipelineConfig.lr_distill)
        if name != "stage0":
            p.add_argument("--teacher", required=True, help="the previous stage's output folder")
        if name == "stage1":
            p.add_argument("--supervision", choices=("forward", "noise-inversion"), default="forward",
                           help="forward: Algorithm 2 (k=1); noise-inversion: the PTP baseline on real text (any --k)")
            p.add_argument("--k", type=_positive_int, default=1, help="student window (noise-inversion only)")
        p.add_argument("--stop-at", type=_positive_int, help="stop (with a checkpoint) after this step; --resume continues")
        p.add_argument("--dump-grads", help="debugging: write the first step's averaged gradients (safetensors) here")
    pp = sub.add_parser("pipeline", help="all stages: 0 -> 1 -> 2 (k=2) -> ... -> 2 (k=--k-final)")
    _add_common(pp, d)
    pd = PipelineConfig()
    pp.add_argument("--k-final", type=_positive_int, default=pd.k_final)
    pp.add_argument("--steps-stage0", type=_positive_int, default=pd.steps_stage0)
    pp.add_argument("--steps-stage1", type=_positive_int, default=pd.steps_stage1)
    pp.add_argument("--steps-stage2", type=_positive_int, default=pd.steps_stage2, help="steps of each self-forcing round")
    pp.add_argument("--lr-stage0", type=_positive_float, default=pd.lr_stage0)
    pp.add_argument("--lr-distill", type=_positive_float, default=pd.lr_distill)
    pp.add_argument("--batch-size-distill", type=_positive_int, default=None)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["model_overrides"] = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if getattr(args, k, None) is not None}
    if args.command in STAGES:
        values["stage"] = args.command
    if "supervision" in values:
        values["supervision"] = values["supervision"].replace("-", "_")
    return TrainConfig(**values)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.tau_min > args.tau_max:
        parser.error(f"argument --tau-min: expected <= --tau-max ({args.tau_max}), got {args.tau_min}")
    try:
        if args.command == "pipeline":
            pipe = PipelineConfig(
                out=args.out, k_final=args.k_final, steps_stage0=args.steps_stage0, steps_stage1=args.steps_stage1,
                steps_stage2=args.steps_stage2, lr_stage0=args.lr_stage0, lr_distill=args.lr_distill,
                batch_size_distill=args.batch_size_distill,
            )
            result = run_pipeline(pipe, cfg)
        else:
            result = train(cfg)
    except (ConfigError, CheckpointError) as exc:
        parser.error(str(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The K-Forcing training objectives: targets, batches, and the loss of each objective.

    AR                  Stage 0: next-token cross-entropy on real text.
    FORWARD             Stage 1, paper Algorithm 2: the AR teacher's temperature-scaled
                        inverse-CDF sample at uniform z is the target of the PFLM(1) student.
    NOISE_INVERSION     Stage 1, the PTP baseline (paper Section 3.2.1): real next-k tokens are
                        the targets, their noise recovered from the AR teacher's CDF bins.
    SELF_FORCING        Stage 2, paper Algorithm 3: the PFLM(k) teacher's SingleForward with
                        z[:k], then its DoubleForward with z[k:] conditioned on its own first k
                        tokens; the PFLM(2k) student sees all 2k noises in one SingleForward.

:func:`compute_loss` is told the objective; it never guesses it from which inputs are present.

Packed documents (``Batch.separator`` set, the trainer's ``--packed-docs``): a window of the
token stream holds pieces of several documents, each ending with the separator (EOS). Every
model call, teacher and student, gets the crop's ``cu_seqlens``
(:func:`~kforcing_kernels.layouts.positions.document_offsets`),
so attention never crosses a document and RoPE positions restart at 0 in each. A prediction
whose target lies past the end of its document is left out of the loss: in AR, the separator
position (it would predict the next document's first token); in a K-Forcing window t, slot j
(target position ``t + 1 + j``) once a separator lies in ``tokens[t .. t + j]``. A document
that runs past the window's right edge has no known end, so its slots all count. The loss is
the mean over the predictions that count (per micro-batch: with gradient accumulation or
data parallelism the step averages those means, which weights a shard by 1, not by its count).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ...layouts.positions import document_offsets
from ..data import sample_crops
from .linear_ce import linear_cross_entropy
from .targets import (
    STAGE1_CDF_ORDER,
    decode_chunks,
    forward_distillation_targets,
    forward_targets,
    noise_inversion_supervision,
    output_head,
    self_forcing_targets,
    teacher_head,
)


class Objective(str, enum.Enum):
    AR = "ar"
    FORWARD = "stage1_forward"
    NOISE_INVERSION = "stage1_noise_inversion"
    SELF_FORCING = "stage2_self_forcing"

    @classmethod
    def of(cls, stage: str, supervision: str = "forward") -> "Objective":
        """The objective a trainer stage optimises (``supervision`` matters for stage1 only)."""
        if stage == "stage0":
            return cls.AR
        if stage == "stage1":
            return cls.NOISE_INVERSION if supervision == "noise_inversion" else cls.FORWARD
        if stage == "stage2":
            return cls.SELF_FORCING
        raise ValueError(f"stage: expected 'stage0', 'stage1' or 'stage2', got {stage!r}")

    @property
    def distills(self) -> bool:
        return self is not Objective.AR


# ---------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One (micro-)batch. What it holds depends on the objective:

    AR: tokens ``[B, N + 1]``. FORWARD: context tokens ``[B, N]``, noise ``[B, N, 1]``, tau ``[B]``.
    NOISE_INVERSION: real tokens ``[B, N + k]``, tau ``[B]``, seed (of the in-bin uniforms).
    SELF_FORCING: context ``[B, N]``, noise ``[B, N, 2k]``, tau ``[B]``.
    ``separator``: None, or the token id that ends each document of a packed window (EOS);
    the documents of every row are read off ``tokens`` (see the module docstring).
    """

    tokens: torch.Tensor
    noise: Optional[torch.Tensor] = None
    tau: Optional[torch.Tensor] = None
    seed: Optional[int] = None
    separator: Optional[int] = None

    def shard(self, index: int, count: int) -> "Batch":
        size = self.tokens.shape[0] // count
        part = slice(index * size, (index + 1) * size)
        seed = None if self.seed is None else (self.seed * 1009 + index + 1) % 2**62
        noise, tau = (None if t is None else t[part] for t in (self.noise, self.tau))
        return Batch(self.tokens[part], noise, tau, seed, self.separator)

    def to(self, device) -> "Batch":
        noise, tau = (None if t is None else t.to(device) for t in (self.noise, self.tau))
        return Batch(self.tokens.to(device), noise, tau, self.seed, self.separator)

    def cu_seqlens(self, tokens: torch.Tensor):
        """The documents of ``tokens`` (a prefix of every row of this batch): one ``[D_b + 1]`` per row, or None
        unpacked."""
        return None if self.separator is None else document_offsets(tokens, self.separator)


def crop_tokens(objective: Objective, seq_len: int, k: int) -> int:
    """Tokens of the stream one sequence of the batch reads (the length of its crop)."""
    return {Objective.AR: seq_len + 1, Objective.NOISE_INVERSION: seq_len + k}.get(objective, seq_len)


def make_batch(
    objective: Objective,
    stream: torch.Tensor,
    batch_size: int,
    seq_len: int,
    k: int,
    tau_range: tuple[float, float],
    generator: torch.Generator,
    separator: Optional[int] = None,
) -> Batch:
    """The global batch of one step: windows of the token stream ``[T]``, and for distillation noise and temperatures.

    ``k`` is the student's window (1 for FORWARD, twice the teacher's for SELF_FORCING).
    ``separator`` (the corpus's EOS id) packs documents: the windows keep the stream's
    document boundaries and every model call of :func:`compute_loss` respects them. The
    random draws do not depend on it, so packed and unpacked batches hold the same tokens.
    """
    objective = Objective(objective)
    if separator is not None and (isinstance(separator, bool) or not isinstance(separator, int)):
        raise ValueError(f"separator: expected None or a token id (int), got {separator!r}")
    tokens = sample_crops(stream, batch_size, crop_tokens(objective, seq_len, k), generator)
    if objective is Objective.AR:
        return Batch(tokens, separator=separator)
    lo, hi = tau_range
    if objective is Objective.NOISE_INVERSION:
        tau = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
        return Batch(tokens, None, tau, int(torch.randint(0, 2**40, (), generator=generator)), separator)
    noise = torch.rand(batch_size, seq_len, k, generator=generator)
    tau = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
    return Batch(tokens, noise, tau, separator=separator)


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """The generator of step ``step`` (salt 1: validation batch ``step``), independent of any earlier draw."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 8 + salt)


# ---------------------------------------------------------------------- the loss


def document_mask(tokens: torch.Tensor, separator: int, n: int, k: int) -> torch.Tensor:
    """bool ``[B, n, k]``: True where slot j of window t (target position ``t + 1 + j``) stays in its document.

    tokens ``[B, L]`` (``L >= n``): slot j of window t counts unless a separator lies in
    ``tokens[t .. t + j]`` (read up to the row's end: past it, the document's end is unknown).
    """
    seps = torch.nn.functional.pad((tokens == separator).to(torch.int64).cumsum(1), (1, 0))  # [B, L + 1]: in tokens[:i]
    t = torch.arange(n, device=tokens.device)[:, None]
    last = (t + torch.arange(k, device=tokens.device) + 1).clamp(max=tokens.shape[1])  # [n, k]
    return (seps[:, last] - seps[:, t]) == 0


def _masked_mean(per_token: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over kept predictions, per-slot mean ``[k]`` detached) of ``per_token [B, N, k]``."""
    kept = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    counts = keep.sum((0, 1))
    loss = kept.sum() / counts.sum().clamp(min=1)
    return loss, (kept.detach().sum((0, 1)) / counts.clamp(min=1))


def require_inputs(objective: Objective, batch: Batch, teacher, k: Optional[int]) -> None:
    """ValueError naming the argument unless ``batch``, ``teacher`` and ``k`` are what ``objective`` needs."""
    if objective.distills and teacher is None:
        raise ValueError(f"teacher: objective {objective.value} distils a teacher, got None")
    if not objective.distills and teacher is not None:
        raise ValueError(f"teacher: objective {objective.value} trains on the data alone, got a teacher")
    if objective.distills and batch.tau is None:
        raise ValueError(f"batch.tau: objective {objective.value} needs per-sequence temperatures [B], got None")
    noise = batch.noise
    if objective in (Objective.FORWARD, Objective.SELF_FORCING) and noise is None:
        raise ValueError(f"batch.noise: objective {objective.value} needs noise [B, N, k], got None")
    if objective is Objective.FORWARD and noise is not None and noise.shape[-1] != 1:
        raise ValueError(
            f"batch.noise: forward distillation trains PFLM(1), expected [B, N, 1], got {tuple(noise.shape)}"
        )
    if objective is Objective.SELF_FORCING and noise is not None and noise.shape[-1] % 2:
        raise ValueError(f"batch.noise: self-forcing needs 2k noises per window, got {noise.shape[-1]}")
    if objective is Objective.NOISE_INVERSION:
        if batch.seed is None:
            raise ValueError("batch.seed: noise inversion draws in-bin uniforms from batch.seed, got None")
        if not isinstance(k, int) or not 1 <= k < batch.tokens.shape[1]:
            raise ValueError(f"k: noise inversion needs the student window 1 <= k < tokens.shape[1], got {k!r}")


_T = TypeVar("_T")


def _given(value: Optional[_T], name: str) -> _T:
    """``value``, which :func:`require_inputs` checked is there for the objective."""
    if value is None:
        raise ValueError(f"{name}: expected a value for this objective, got None")
    return value


@torch.no_grad()
def student_inputs(
    objective: Objective,
    batch: Batch,
    teacher,
    k: Optional[int],
    *,
    chunked: bool = True,
    chunk_rows: Optional[int] = None,
):
    """``(context [B, N], noise [B, N, k], targets [B, N, k], cu_seqlens or None)`` of a distillation objective:
    what the student's SingleForward reads and the teacher's targets for it. ``chunked``: the teacher's logits are
    made and decoded chunk by chunk of ``chunk_rows`` rows (the same targets; see :func:`self_forcing_targets`)."""
    context, tau = batch.tokens, _given(batch.tau, "batch.tau")
    packed = batch.separator is not None
    if objective is Objective.NOISE_INVERSION:
        window = _given(k, "k")
        cu = batch.cu_seqlens(context[:, : batch.tokens.shape[1] - window])
        generator = torch.Generator(device=context.device).manual_seed(_given(batch.seed, "batch.seed"))
        context, noise, targets = noise_inversion_supervision(
            teacher,
            batch.tokens,
            window,
            tau,
            generator,
            cu_seqlens=batch.cu_seqlens(batch.tokens[:, :-1]),
            chunked=chunked,
            chunk_rows=chunk_rows,
        )
        return context, noise, targets, cu
    cu = batch.cu_seqlens(context)
    noise = _given(batch.noise, "batch.noise")
    if objective is Objective.FORWARD:
        head = teacher_head(teacher) if chunked else None
        kwargs = {"cu_seqlens": cu} if packed else {}
        if head is None:
            teacher_logits = teacher(context, **kwargs)
            targets = forward_distillation_targets(teacher_logits, noise[..., 0], tau)[..., None]  # [B, N, 1]
        else:
            hidden = teacher(context, return_hidden=True, **kwargs)  # [B, N, C]
            taus = tau[:, None].expand(context.shape)
            targets = decode_chunks(
                head,
                hidden,
                lambda logits, z, t: forward_targets(logits, z, t, STAGE1_CDF_ORDER),
                noise[..., 0],
                taus,
                chunk_rows=chunk_rows,
            )[..., None]  # [B, N, 1]
    else:
        targets = self_forcing_targets(
            teacher, context, noise, tau, cu_seqlens=cu, chunked=chunked, chunk_rows=chunk_rows
        )  # [B, N, 2k]
    return context, noise, targets, cu


def _chunked_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    keep: Optional[torch.Tensor],
    chunk_rows: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-prediction CE ``targets.shape`` fp32 detached) of ``hidden [*S, C]`` through ``head``, chunked.

    The loss is the mean over the predictions (``keep`` None), or over those ``keep`` holds (bool ``targets.shape``),
    exactly as :func:`_masked_mean` weights them: each kept row by ``1 / count``."""
    rows = targets.numel()
    if keep is None:
        weights = torch.full((rows,), 1.0 / max(rows, 1), dtype=torch.float32, device=targets.device)
    else:
        weights = keep.flatten().to(torch.float32) / keep.sum().clamp(min=1).to(torch.float32)
    loss, per_row = linear_cross_entropy(
        hidden.reshape(rows, -1), head.weight, head.bias, targets.flatten(), weights, chunk_rows
    )
    return loss, per_row.view(targets.shape)


def compute_loss(
    objective: Objective | str,
    model,
    batch: Batch,
    teacher=None,
    *,
    k: Optional[int] = None,
    chunked: bool = True,
    chunk_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-position mean loss ``[k]``, detached) of ``model`` on one (micro-)batch.

    ``objective`` selects what is computed (see :class:`Objective`); ``teacher`` is the
    AR model (FORWARD, NOISE_INVERSION) or the PFLM(k/2) model (SELF_FORCING), None for AR;
    ``k`` is the student window, needed by NOISE_INVERSION only (the batch fixes it otherwise).
    The loss is the mean cross-entropy of the student's logits against the targets over all
    ``B * N * k`` predictions (AR: ``B * N``); with packed documents (``batch.separator``) over
    those whose target lies inside their document (see the module docstring).

    ``chunked`` (default): when the model offers :func:`output_head`, the forward returns its hidden states and
    the head and cross-entropy run over chunks of ``chunk_rows`` rows (None: ~64 MiB of fp32 logits each,
    ``app/training/linear_ce.py``), never holding every row's ``[rows, V]`` logits; the loss and gradients equal
    the unchunked path's (``chunked=False``, or a model without ``output_head``) within fp32 rounding.
    """
    objective = Objective(objective)
    require_inputs(objective, batch, teacher, k)
    packed = batch.separator is not None
    head = output_head(model) if chunked else None
    if objective is Objective.AR:
        inputs = batch.tokens[:, :-1]
        kwargs = {"cu_seqlens": batch.cu_seqlens(inputs)} if packed else {}
        if head is not None:
            keep = (
                document_mask(inputs, _given(batch.separator, "batch.separator"), inputs.shape[1], 1)[..., 0]
                if packed
                else None
            )
            hidden = model(inputs, return_hidden=True, **kwargs)  # [B, N, C]
            loss, _ = _chunked_loss(hidden, head, batch.tokens[:, 1:], keep, chunk_rows)
            return loss, loss.detach()[None]
        logits = model(inputs, **kwargs)  # [B, N, V]
        if not packed:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tokens[:, 1:].flatten())
            return loss, loss.detach()[None]
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), batch.tokens[:, 1:].flatten(), reduction="none")
        loss, _ = _masked_mean(
            per_token.view(*inputs.shape, 1),
            document_mask(inputs, _given(batch.separator, "batch.separator"), inputs.shape[1], 1),
        )
        return loss, loss.detach()[None]
    context, noise, targets, cu = student_inputs(objective, batch, teacher, k, chunked=chunked, chunk_rows=chunk_rows)
    if head is not None:
        # Noise inversion reads the real tokens past the context (all within the window); the others only the context.
        keep = (
            document_mask(batch.tokens, _given(batch.separator, "batch.separator"), *targets.shape[1:])
            if packed
            else None
        )
        kwargs = {"cu_seqlens": cu} if packed else {}
        hidden = model(context, noise, batch.tau, return_hidden=True, **kwargs)  # [B, N, k, C]
        loss, per_token = _chunked_loss(hidden, head, targets, keep, chunk_rows)
        if keep is None:
            return loss, per_token.mean((0, 1))
        return loss, _masked_mean(per_token, keep)[1]
    logits = model(context, noise, batch.tau, **({"cu_seqlens": cu} if packed else {}))  # [B, N, k, V]
    per_token = F.cross_entropy(logits.flatten(0, 2).float(), targets.flatten(), reduction="none").view(targets.shape)
    if not packed:
        return per_token.mean(), per_token.detach().mean((0, 1))
    # Noise inversion reads the real tokens past the context (all within the window); the others only the context.
    keep = document_mask(batch.tokens, _given(batch.separator, "batch.separator"), *targets.shape[1:])
    return _masked_mean(per_token, keep)

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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .data import sample_windows
from .ops.sampling import inverse_cdf_sample, noise_inversion


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


# ---------------------------------------------------------------------- targets (paper Algorithms 2 and 3)


def forward_distillation_targets(teacher_logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Stage-1 targets: inverse-CDF of ``softmax(logits / tau)`` at z (Algorithm 2, lines 5-6).

    teacher_logits ``[B, N, V]``, z ``[B, N]`` uniform, tau ``[B]`` -> token ids ``[B, N]``.
    """
    return inverse_cdf_sample(teacher_logits, z, tau[:, None].expand(z.shape))


@torch.no_grad()
def self_forcing_targets(teacher, context: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
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
    teacher, tokens: torch.Tensor, k: int, tau: torch.Tensor, generator: torch.Generator
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


# ---------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One (micro-)batch. What it holds depends on the objective:

    AR: tokens ``[B, N + 1]``. FORWARD: context tokens ``[B, N]``, noise ``[B, N, 1]``, tau ``[B]``.
    NOISE_INVERSION: real tokens ``[B, N + k]``, tau ``[B]``, seed (of the in-bin uniforms).
    SELF_FORCING: context ``[B, N]``, noise ``[B, N, 2k]``, tau ``[B]``.
    """

    tokens: torch.Tensor
    noise: Optional[torch.Tensor] = None
    tau: Optional[torch.Tensor] = None
    seed: Optional[int] = None

    def shard(self, index: int, count: int) -> "Batch":
        size = self.tokens.shape[0] // count
        part = slice(index * size, (index + 1) * size)
        seed = None if self.seed is None else (self.seed * 1009 + index + 1) % 2**62
        return Batch(*(None if t is None else t[part] for t in (self.tokens, self.noise, self.tau)), seed)

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (self.tokens, self.noise, self.tau)), self.seed)


def window_tokens(objective: Objective, seq_len: int, k: int) -> int:
    """Tokens of the stream one sequence of the batch reads."""
    return {Objective.AR: seq_len + 1, Objective.NOISE_INVERSION: seq_len + k}.get(objective, seq_len)


def make_batch(objective: Objective, stream: torch.Tensor, batch_size: int, seq_len: int, k: int,
               tau_range: tuple[float, float], generator: torch.Generator) -> Batch:
    """The global batch of one step: windows of the token stream ``[T]``, and for distillation noise and temperatures.

    ``k`` is the student's window (1 for FORWARD, twice the teacher's for SELF_FORCING).
    """
    objective = Objective(objective)
    tokens = sample_windows(stream, batch_size, window_tokens(objective, seq_len, k), generator)
    if objective is Objective.AR:
        return Batch(tokens)
    lo, hi = tau_range
    if objective is Objective.NOISE_INVERSION:
        tau = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
        return Batch(tokens, None, tau, int(torch.randint(0, 2**40, (), generator=generator)))
    noise = torch.rand(batch_size, seq_len, k, generator=generator)
    tau = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
    return Batch(tokens, noise, tau)


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """The generator of step ``step`` (salt 1: validation batch ``step``), independent of any earlier draw."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 8 + salt)


# ---------------------------------------------------------------------- the loss


def _require(objective: Objective, batch: Batch, teacher, k: Optional[int]) -> None:
    if objective.distills and teacher is None:
        raise ValueError(f"teacher: objective {objective.value} distils a teacher, got None")
    if not objective.distills and teacher is not None:
        raise ValueError(f"teacher: objective {objective.value} trains on the data alone, got a teacher")
    if objective.distills and batch.tau is None:
        raise ValueError(f"batch.tau: objective {objective.value} needs per-sequence temperatures [B], got None")
    if objective in (Objective.FORWARD, Objective.SELF_FORCING) and batch.noise is None:
        raise ValueError(f"batch.noise: objective {objective.value} needs noise [B, N, k], got None")
    if objective is Objective.FORWARD and batch.noise.shape[-1] != 1:
        raise ValueError(f"batch.noise: forward distillation trains PFLM(1), expected [B, N, 1], got {tuple(batch.noise.shape)}")
    if objective is Objective.SELF_FORCING and batch.noise.shape[-1] % 2:
        raise ValueError(f"batch.noise: self-forcing needs 2k noises per window, got {batch.noise.shape[-1]}")
    if objective is Objective.NOISE_INVERSION:
        if batch.seed is None:
            raise ValueError("batch.seed: noise inversion draws in-bin uniforms from batch.seed, got None")
        if not isinstance(k, int) or not 1 <= k < batch.tokens.shape[1]:
            raise ValueError(f"k: noise inversion needs the student window 1 <= k < tokens.shape[1], got {k!r}")


def compute_loss(objective: Objective | str, model, batch: Batch, teacher=None, *, k: Optional[int] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-position mean loss ``[k]``, detached) of ``model`` on one (micro-)batch.

    ``objective`` selects what is computed (see :class:`Objective`); ``teacher`` is the
    AR model (FORWARD, NOISE_INVERSION) or the PFLM(k/2) model (SELF_FORCING), None for AR;
    ``k`` is the student window, needed by NOISE_INVERSION only (the batch fixes it otherwise).
    The loss is the mean cross-entropy of the student's logits against the targets over all
    ``B * N * k`` predictions (AR: ``B * N``).
    """
    objective = Objective(objective)
    _require(objective, batch, teacher, k)
    if objective is Objective.AR:
        logits = model(batch.tokens[:, :-1])  # [B, N, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tokens[:, 1:].flatten())
        return loss, loss.detach()[None]
    context, noise = batch.tokens, batch.noise
    with torch.no_grad():
        if objective is Objective.NOISE_INVERSION:
            generator = torch.Generator(device=context.device).manual_seed(batch.seed)
            context, noise, targets = noise_inversion_supervision(teacher, batch.tokens, k, batch.tau, generator)
        elif objective is Objective.FORWARD:
            targets = forward_distillation_targets(teacher(context), noise[..., 0], batch.tau)[..., None]  # [B, N, 1]
        else:
            targets = self_forcing_targets(teacher, context, noise, batch.tau)  # [B, N, 2k]
    logits = model(context, noise, batch.tau)  # [B, N, k, V]
    per_token = F.cross_entropy(logits.flatten(0, 2).float(), targets.flatten(), reduction="none").view(targets.shape)
    return per_token.mean(), per_token.detach().mean((0, 1))

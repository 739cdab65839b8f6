"""The teachers' targets of the K-Forcing objectives (paper Algorithms 2 and 3) and the noise inversion baseline.

    forward_distillation_targets   Stage 1: the AR teacher's inverse-CDF sample at uniform z.
    self_forcing_targets           Stage 2: the PFLM(k) teacher's two rounds (SingleForward, then DoubleForward).
    noise_inversion_supervision    Stage 1, the PTP baseline: real tokens, their noise from the teacher's CDF bins.

A teacher that offers its head (:func:`teacher_head`) has its targets decoded from its hidden states chunk by chunk
(:func:`decode_chunks`), never every row's ``[V]`` logits at once. :mod:`~kforcing_kernels.app.training.objectives`
builds the batches and losses on these (and keeps the three 0.2 names of ``kforcing_kernels.objectives``
importable: ``forward_distillation_targets``, ``noise_inversion_supervision``, ``self_forcing_targets``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...model.decoding import decode_rule, decode_slots
from ...ops.sampling import inverse_cdf_sample, noise_inversion
from ..student import Student, unwrap
from .linear_ce import chunk_rows_for

# The vocabulary order of the Stage-1 CDF. Any order gives exact teacher samples at uniform z (the
# paper's construction fixes one per context); what differs is the z -> token map the student must
# learn. "vocab": token-id order (the sampler's own). "probability": descending teacher probability,
# ties by id (z in [0, p_1) is the mode). Measured on the default demo's teacher (BENCHMARKS.md,
# "Stage 1: mode collapse, diagnosed"), the vocab order is the easier one: after the same 200 steps the
# student's tokens change with redrawn noise at 0.63 (probability order: 0.41) against the teacher's
# 0.82, probably because in id order part of the map is context-independent (BPE ids run from bytes to rarer
# merges), while in probability order every rank -> token step depends on the context.
CDF_ORDERS = ("probability", "vocab")
STAGE1_CDF_ORDER = "vocab"


def forward_distillation_targets(
    teacher_logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor, order: str = STAGE1_CDF_ORDER
) -> torch.Tensor:
    """Stage-1 targets: inverse-CDF of ``softmax(logits / tau)`` at z (Algorithm 2, lines 5-6).

    teacher_logits ``[B, N, V]``, z ``[B, N]`` uniform, tau ``[B]`` -> token ids ``[B, N]``.
    ``order``: the vocabulary order the CDF accumulates in (:data:`CDF_ORDERS`; see there why
    Stage 1 keeps the token-id order).
    """
    return forward_targets(teacher_logits, z, tau[:, None].expand(z.shape), order)


def forward_targets(teacher_logits: torch.Tensor, z: torch.Tensor, taus: torch.Tensor, order: str) -> torch.Tensor:
    """:func:`forward_distillation_targets` with one temperature per row (``taus`` of z's shape): row by row."""
    if order == "vocab":
        return inverse_cdf_sample(teacher_logits, z, taus)
    if order != "probability":
        raise ValueError(f"order: expected one of {CDF_ORDERS}, got {order!r}")
    # [B, N, V] ids, most probable first
    by_probability = torch.sort(teacher_logits, dim=-1, descending=True, stable=True).indices
    rank = inverse_cdf_sample(teacher_logits.gather(-1, by_probability), z, taus)  # [B, N]
    return by_probability.gather(-1, rank[..., None])[..., 0]


def teacher_head(teacher) -> Optional[nn.Linear]:
    """The teacher's output head when its targets can be decoded chunk by chunk from its hidden states, else None.

    None for a model without ``output_head`` and for a sharded one (FSDP2 ``--teacher-parallel fsdp`` reshards the
    root after every pass: its head is a shard outside the forward), which then decodes from its logits."""
    head = output_head(teacher)
    if head is None or type(head.weight).__name__ == "DTensor":
        return None
    return head


# The fewest rows a teacher chunk's head product gets. BLAS runs a product of very few rows with other kernels
# (matrix-vector ones) whose sums round differently: on this repository's CPU (MKL, 1 and 2 threads) products of
# 1-11 rows differed in the last bit from the same rows inside a larger product, from 12 rows on none did (widths
# 16-768, vocabularies 96-50258). A shorter tail joins the chunk before it.
MIN_TEACHER_CHUNK = 16


def chunk_bounds(rows: int, step: int, smallest: int = MIN_TEACHER_CHUNK) -> list[tuple[int, int]]:
    """``[(start, end)]`` covering ``range(rows)`` in chunks of ``max(step, smallest)`` rows; a tail shorter than
    ``smallest`` joins the chunk before it (so no chunk but a lone one is shorter than ``smallest``)."""
    step = max(step, smallest)
    bounds = [(start, min(rows, start + step)) for start in range(0, rows, step)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < smallest:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


def decode_chunks(
    head: nn.Linear, hidden: torch.Tensor, decode, *per_row: torch.Tensor, chunk_rows: Optional[int] = None
) -> torch.Tensor:
    """Tokens int64 ``hidden.shape[:-1]`` of ``decode(head(rows) [c, V], *per_row[rows] [c])`` over chunks of rows.

    hidden ``[*S, C]``; every ``per_row`` tensor has shape ``S``. ``decode`` must be row-wise (argmax, the inverse-CDF
    sampler): then the tokens are those of ``decode(head(hidden), *per_row)`` (the same logits row by row), while
    only one chunk's ``[c, V]`` logits exists at a time (``chunk_rows``; None: ~64 MiB of fp32 logits; at least
    :data:`MIN_TEACHER_CHUNK`, see there why)."""
    shape, width = hidden.shape[:-1], hidden.shape[-1]
    rows = shape.numel()
    flat_hidden = hidden.reshape(rows, width)
    flat = [t.reshape(rows) for t in per_row]
    step = chunk_rows or chunk_rows_for(head.weight.shape[0])
    out = torch.empty(rows, dtype=torch.int64, device=hidden.device)
    for start, end in chunk_bounds(rows, step):
        out[start:end] = decode(head(flat_hidden[start:end]), *(t[start:end] for t in flat))
    return out.view(shape)


@torch.no_grad()
def self_forcing_targets(
    teacher,
    context: torch.Tensor,
    z: torch.Tensor,
    tau: torch.Tensor,
    cu_seqlens=None,
    *,
    chunked: bool = True,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Stage-2 targets: two teacher rounds (Algorithm 3, lines 4-9).

    context ``[B, N]``, z ``[B, N, 2k]``, tau ``[B]`` -> ``[B, N, 2k]``: round one decodes
    ``z[..., :k]`` with SingleForward; round two decodes ``z[..., k:]`` with DoubleForward,
    conditioned on round one's tokens and reusing its context K/V. Both rounds decode by the
    teacher's own rule, as it generates (``config.decode``: argmax as in Algorithm 3, or residual).
    ``cu_seqlens``: the packed documents of ``context`` (both rounds get them), or None.
    ``chunked`` (when :func:`teacher_head` offers the head): each round returns hidden states and its slots are
    decoded over chunks of ``chunk_rows`` rows (:func:`decode_chunks`), never every slot's ``[V]`` at once;
    the same tokens as the unchunked path (``chunked=False``), bit for bit, when the head's product is.
    """
    k = z.shape[-1] // 2
    rule = decode_rule(teacher)  # the paper's argmax, or the residual rule the teacher decodes with (model/decoding.py)
    head = teacher_head(teacher) if chunked else None
    if head is None:
        logits1, context_kv = teacher.single_forward(context, z[..., :k], tau, cu_seqlens=cu_seqlens)
        first = decode_slots(logits1, z[..., :k], rule)  # [B, N, k]
        del logits1
        logits2 = teacher.double_forward(context_kv, first, z[..., k:], tau, cu_seqlens=cu_seqlens)
        return torch.cat([first, decode_slots(logits2, z[..., k:], rule)], -1)  # [B, N, 2k]

    def decode(logits, noise):
        return decode_slots(logits, noise, rule)

    hidden1, context_kv = teacher.single_forward(context, z[..., :k], tau, cu_seqlens=cu_seqlens, return_hidden=True)
    first = decode_chunks(head, hidden1, decode, z[..., :k], chunk_rows=chunk_rows)  # [B, N, k]
    del hidden1
    hidden2 = teacher.double_forward(context_kv, first, z[..., k:], tau, cu_seqlens=cu_seqlens, return_hidden=True)
    second = decode_chunks(head, hidden2, decode, z[..., k:], chunk_rows=chunk_rows)
    return torch.cat([first, second], -1)  # [B, N, 2k]


def noise_inversion_supervision(
    teacher,
    tokens: torch.Tensor,
    k: int,
    tau: torch.Tensor,
    generator: torch.Generator,
    cu_seqlens=None,
    *,
    chunked: bool = True,
    chunk_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PTP baseline (paper Section 3.2.1): real tokens as targets, their noise recovered from the AR teacher.

    tokens ``[B, N + k]`` of real text -> (context ``[B, N]``, z ``[B, N, k]``, targets ``[B, N, k]``):
    slot j of window t targets ``tokens[t + 1 + j]`` with z uniform in its CDF bin under
    ``softmax(logits / tau)`` of the teacher given the real text up to ``t + j``.
    ``cu_seqlens``: the packed documents of the teacher's input ``tokens[:, :-1]``, or None.
    ``chunked``: the CDF bins over chunks of ``chunk_rows`` (window, slot) rows from the teacher's hidden states
    (as :func:`self_forcing_targets`), the in-bin uniforms drawn once for all rows: the same z as unchunked.
    """
    n = tokens.shape[1] - k
    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    reads = torch.arange(n, device=tokens.device)[:, None] + torch.arange(k, device=tokens.device)  # [N, k]
    targets = tokens[:, 1:][:, reads]  # [B, N, k]
    taus = tau[:, None, None].expand(targets.shape)
    head = teacher_head(teacher) if chunked else None
    if head is None:
        logits = teacher(tokens[:, :-1], **packed)  # [B, N + k - 1, V]: position p predicts tokens[p + 1]
        z = noise_inversion(logits[:, reads], targets, taus, generator)
        return tokens[:, :n], z, targets
    hidden = teacher(tokens[:, :-1], return_hidden=True, **packed)  # [B, N + k - 1, C]
    # the in-bin uniforms, drawn as noise_inversion draws them
    u = torch.rand(targets.shape, generator=generator, device=generator.device).to(tokens.device)
    z = torch.empty(targets.shape, dtype=torch.float32, device=tokens.device)
    rows, step = targets.numel(), chunk_rows or chunk_rows_for(head.weight.shape[0])
    flat_hidden = hidden[:, reads].reshape(rows, hidden.shape[-1])
    flat_z = z.view(rows)
    for start, end in chunk_bounds(rows, step):
        part = slice(start, end)
        flat_z[part] = noise_inversion(
            head(flat_hidden[part]), targets.reshape(rows)[part], taus.reshape(rows)[part], u=u.reshape(rows)[part]
        )
    return tokens[:, :n], z, targets


def output_head(model) -> Optional[nn.Linear]:
    """The output head of ``model`` (through DDP and ``torch.compile`` wrappers) when its forward can return the final
    hidden states (``return_hidden=True``; ``KForcingLM``, ``HFStudent``), else None (the loss then takes logits)."""
    inner = unwrap(model)
    return inner.output_head() if isinstance(inner, Student) else None

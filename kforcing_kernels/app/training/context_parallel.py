"""The trainer's context parallelism (``--context-parallel N``): N ranks share each sequence.

The world (``torchrun --nproc_per_node W``) is a ``W / N`` x N device mesh (``app/parallel.ParallelDims``):
its ``cp`` dim makes the CP groups of N consecutive ranks, and the batch is sharded over the ``dp`` rows; the ranks of a
group get the same sequences and split each one's query rows (``kforcing_kernels.parallel``: balanced by attended
pairs, K/V all-gathered per attention layer, dK/dV reduce-scattered). Each rank runs the student on
its rows only, so activation memory per rank is about 1/N of the sequence's (see BENCHMARKS.md).

Loss: the group's sum over its predictions divided by the group's count (the same mean a single
process takes over the whole sequence); each rank back-propagates its own share of that sum. DDP
(over the whole world) averages gradients over all W ranks, so each rank's share is scaled by N:
the step's gradient is then the mean over groups of each group's summed gradient, as without CP.

The teacher (frozen, no autograd, one layer's activations alive at a time) runs the full sequence on
every rank of the group: its targets are the same on every rank and only the student is split.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...parallel import ContextParallel
from .objectives import Batch, Objective, document_mask, require_inputs, student_inputs


def context_parallel_loss(
    objective: Objective | str, model, batch: Batch, teacher, cp: ContextParallel, *, k: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(backward loss, group loss, per-position group loss [k])`` of this rank's rows.

    The group loss (detached) equals :func:`~kforcing_kernels.app.training.objectives.compute_loss` on the whole
    sequences; the backward loss is this rank's share of it times ``cp.world`` (see the module docstring).
    ``model`` is the student (or its DDP wrapper): it is called with ``context_parallel=cp``.
    """
    objective = Objective(objective)
    require_inputs(objective, batch, teacher, k)
    sep = batch.separator
    if objective is Objective.AR:
        inputs = batch.tokens[:, :-1]
        logits, rows = model(inputs, cu_seqlens=batch.cu_seqlens(inputs), context_parallel=cp)  # [B, R, V]
        rows = rows.to(inputs.device)
        targets = batch.tokens[:, 1:][:, rows]
        keep = None if sep is None else document_mask(inputs, sep, inputs.shape[1], 1)[:, rows, 0]
        slots, slot = 1, torch.zeros_like(rows)
    else:
        context, noise, full_targets, cu = student_inputs(objective, batch, teacher, k)
        logits, rows = model(context, noise, batch.tau, cu_seqlens=cu if sep is not None else None, context_parallel=cp)
        rows = rows.to(context.device)
        slots = full_targets.shape[-1]
        targets = full_targets.flatten(1)[:, rows]  # window token t * k + j
        keep = None if sep is None else document_mask(batch.tokens, sep, context.shape[1], slots).flatten(1)[:, rows]
        slot = rows % slots
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    if keep is None:
        keep = torch.ones_like(targets, dtype=torch.bool)
    kept = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    stats = torch.zeros(2, slots, dtype=torch.float64, device=per_token.device)
    stats[0].index_add_(0, slot, kept.detach().sum(0).double())
    stats[1].index_add_(0, slot, keep.sum(0).double())
    cp.all_reduce(stats)  # the group's sums and counts per slot
    count = stats[1].sum().clamp(min=1)
    share = kept.sum() / count.to(kept.dtype)
    per_pos = (stats[0] / stats[1].clamp(min=1)).float()
    return share * cp.world, (stats[0].sum() / count).float(), per_pos

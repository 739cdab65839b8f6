"""The K-Forcing inputs of one context-parallel rank: which rows of the AR forward or the SingleForward it runs, their
embeddings and positions. Both model kinds build them here (``KForcingLM.context_parallel_forward`` in model/gpt.py and
``HFStudent.context_parallel_forward`` in app/hf_recipe/student.py), so the rows, their order and the positions they
take are one definition; each model then runs its own trunk on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..layouts import WindowLayout
from ..layouts.positions import as_cu_seqlens, context_positions, single_positions
from ..types import Temperature
from .context_parallel import ContextParallel, RankRows


@dataclass(frozen=True)
class RankInputs:
    """What one rank runs: ``embeds [B, R, C]`` at ``positions`` (``[R]`` or ``[B, R]``), attending through
    ``shard`` (the layout's rows of this rank). Of the R outputs the caller keeps the last ``kept`` (AR: all; the
    SingleForward: its window rows, its context rows only feed the other ranks' attention), which are ``rows``
    (int64 ``[kept]``, CPU: AR context positions t, SingleForward window tokens ``t * k + j``)."""

    embeds: torch.Tensor
    positions: torch.Tensor
    shard: RankRows
    rows: torch.Tensor
    kept: int


def context_parallel_inputs(
    cp: ContextParallel,
    tokens: torch.Tensor,
    noise: Optional[torch.Tensor],
    tau: Temperature,
    cu_seqlens,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    embed_noise: Callable[[torch.Tensor, Temperature], torch.Tensor],
) -> RankInputs:
    """This rank's rows of the AR forward (``noise`` None) or of the SingleForward (``noise [B, N, k]``) of ``tokens
    [B, N]`` (checked by the model), embedded by the model's ``embed_tokens`` (ids ``[B, r]`` -> ``[B, r, C]``) and
    ``embed_noise`` (uniforms ``[B, r]``, tau -> ``[B, r, C]``). Every rank of ``cp``'s group passes the same inputs."""
    if not isinstance(cp, ContextParallel):
        raise ValueError(
            f"context_parallel: expected a kforcing_kernels.parallel.ContextParallel, got {type(cp).__name__}"
        )
    b, n = tokens.shape
    cu = as_cu_seqlens(cu_seqlens, n, b)
    if noise is None:
        shard = cp.shard(WindowLayout.causal(n, cu_seqlens=cu))
        rows = shard.query_rows.to(tokens.device)
        positions = context_positions(n, cu, tokens.device)[..., rows]
        return RankInputs(embed_tokens(tokens[:, rows]), positions, shard, shard.query_rows, rows.numel())
    if noise.dim() != 3 or noise.shape[:2] != (b, n):
        raise ValueError(f"noise: expected shape [{b}, {n}, k] (tokens' [B, N] + k), got {tuple(noise.shape)}")
    k = noise.shape[2]
    shard = cp.shard(WindowLayout.kforcing_single(n, k, cu_seqlens=cu))
    rows = shard.query_rows.to(tokens.device)
    context_rows, window_rows = rows[rows < n], rows[rows >= n] - n  # rows ascend: [its context | its windows]
    embeds = torch.cat(
        [embed_tokens(tokens[:, context_rows]), embed_noise(noise.reshape(b, n * k)[:, window_rows], tau)], 1
    )
    positions = single_positions(n, k, tokens.device, cu)[..., rows]
    return RankInputs(embeds, positions, shard, window_rows.cpu(), window_rows.numel())

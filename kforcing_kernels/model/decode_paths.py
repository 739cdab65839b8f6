"""The static decode step's direct path: a layer's paged cached context and the blocks' math without modules.

:class:`PagedPast` is one layer's cached context read in place from a paged K/V pool, the alternative to a
contiguous ``past`` for :meth:`~kforcing_kernels.model.gpt.Attention.forward`. :class:`DirectBlock` and
:func:`direct_block` run a decoder block's math on flattened rows without ``nn.Module`` calls, the path
:meth:`~kforcing_kernels.model.gpt.KForcingLM.trunk` takes for a static decode step
(``app/generation/static_step.py``). Import them from here (``PagedPast`` is also public as
``kforcing_kernels.model.PagedPast``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..ops.paged_attention import paged_attention
from ..ops.paged_attention.op import paged_attention_unchecked


@dataclass(frozen=True)
class PagedPast:
    """One layer's cached context, read in place from a paged K/V pool (the vLLM / FlashInfer layout).

    The alternative to a contiguous ``past`` (K, V ``[B, H, P, D]``) for
    :meth:`~kforcing_kernels.model.gpt.Attention.forward`:
    request b's context token t sits in page ``block_table[b, t // page_size]`` at slot ``t % page_size``
    of ``k_pages`` / ``v_pages`` ``[num_pages, page_size, H, D]``. The query tokens form one decode
    window per request that sees the request's ``context_lens[b]`` cached tokens and, causally, itself
    (:func:`~kforcing_kernels.ops.paged_attention.paged_attention`), so no layout is passed with it.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_pages]
    context_lens: torch.Tensor  # int64 [B]
    backend: Optional[str] = None
    check_table: bool = True  # scan the table (a host sync): a cache that built it may skip it after one layer
    # False: a static decode step (app/generation/static_step.py) built and checked the table and lengths once;
    # the call then has no value check and no host sync (paged_attention_unchecked; backend must be resolved).
    checked: bool = True
    # A block's DirectBlock: KForcingLM.trunk runs the blocks' math without nn.Module calls (direct_block), the
    # same bits with half the host work of a decode step; only for models without module hooks (no FSDP).
    direct: Optional["DirectBlock"] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The window's queries/keys/values ``[B, H, W, D]`` -> attention output ``[B, H, W, D]``."""
        if not self.checked:
            if self.backend is None:
                raise ValueError("PagedPast.backend: an unchecked call (checked=False) needs a resolved backend name")
            return paged_attention_unchecked(
                q,
                k,
                v,
                self.k_pages,
                self.v_pages,
                self.block_table,
                self.context_lens,
                1.0 / math.sqrt(q.shape[-1]),
                self.backend,
            )
        return paged_attention(
            q,
            k,
            v,
            self.k_pages,
            self.v_pages,
            self.block_table,
            self.context_lens,
            backend=self.backend,
            check_table=self.check_table,
        )


class DirectBlock(NamedTuple):
    """A block's parameters as the direct decode path reads them (linear weights transposed: ``x @ W.t()``)."""

    norm1: torch.Tensor
    eps1: float
    qkv_t: torch.Tensor
    proj_t: torch.Tensor
    norm2: torch.Tensor
    eps2: float
    fc_t: torch.Tensor
    mlp_proj_t: torch.Tensor
    n_head: int
    head_dim: int


def direct_block(x: torch.Tensor, b: int, n: int, cos2: torch.Tensor, sin2: torch.Tensor, past: PagedPast):
    """:meth:`~kforcing_kernels.model.gpt.Block.forward` over a paged past, the math called directly: rows
    ``x [B * n, C]`` -> (rows, (K, V)).

    The same operations on the same values as the module path, so the same bits (a test checks it): the linears
    are the ``mm`` that ``F.linear`` runs on the flattened rows, RoPE rotates q and k together as
    ``x * cos2 + rotate_half(x) * sin2`` (``cos2 = [cos, cos]``, ``rotate_half(x) = [-x2, x1]``: the same products,
    added in the other order or subtracted as a negation, exactly). No ``nn.Module`` call, so no hook fires:
    what a static decode step runs (app/generation/static_step.py) when the model has none.
    """
    w = past.direct
    if w is None:
        raise ValueError("direct_block: past.direct is None (the block's DirectBlock, from Block.direct_weights)")
    c = x.shape[-1]
    qkv = torch.mm(F.rms_norm(x, (c,), w.norm1, w.eps1), w.qkv_t)
    qkv = qkv.view(b, n, 3, w.n_head, w.head_dim).permute(2, 0, 3, 1, 4)
    qk = qkv[:2]
    x1, x2 = qk.chunk(2, dim=-1)
    qk = qk * cos2 + torch.cat([-x2, x1], dim=-1) * sin2
    k, v = qk[1], qkv[2]
    y = past.attend(qk[0], k, v)  # [B, H, n, D]
    x = x + torch.mm(y.transpose(1, 2).reshape(b * n, c), w.proj_t)
    x = x + torch.mm(F.gelu(torch.mm(F.rms_norm(x, (c,), w.norm2, w.eps2), w.fc_t)), w.mlp_proj_t)
    return x, (k, v)

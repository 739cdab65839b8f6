"""Jacobi Forcing's interleaved storage <-> the package's stream order, so a user keeps their collator.

Jacobi Forcing's batched trainer stores each sample as ``[prompt | noisy_0 | clean_0 | noisy_1 | clean_1
| ...]`` (prompt length P_b, N_b blocks of T_b tokens), padded to the batch's longest sample.
``WindowLayout.jacobi(P, num_blocks=N, block_size=T)`` (per-sample values) stores the same tokens as
``[prompt_b | clean stream_b | padding || noisy stream_b | padding]``: context ``C = max(P_b + N_b T_b)``,
one window of ``max(N_b T_b)`` slots. :func:`stream_order` gives, for every position of that order,
where the token sits in the interleaved storage; :func:`to_streams` / :func:`from_streams` move ids,
positions or hidden states (``[B, L]`` or ``[B, L, ...]``) between the two.

    order = stream_order(P, N, T)                     # int64 [B, C + max(N T)], -1 at padding
    ids_s = to_streams(ids, order)                    # interleaved [B, L] -> stream order
    pos_s = to_streams(position_ids, order)
    hidden = from_streams(out_s, order, ids.shape[1])  # model output back to the interleaved layout
"""

from __future__ import annotations

import torch

from .documents import as_int, as_int_tensor


def _ints(name: str, value) -> torch.Tensor:
    """int64 ``[n]``: one int (a Python or numpy int, a 0-dim tensor) as ``[1]``, or a sequence as it is."""
    # a scalar, as the other constructors take it
    if getattr(value, "ndim", None) == 0 or not hasattr(value, "__len__"):
        return torch.tensor([as_int(name, value)], dtype=torch.int64)
    return as_int_tensor(name, value, dims=(1,))


def _per_sample(name: str, value, b: int) -> torch.Tensor:
    t = _ints(name, value)
    if t.numel() == 1 and b > 1:
        t = t.expand(b).clone()
    if t.numel() != b:
        raise ValueError(f"{name}: expected one value per sample ({b}) or one for all, got {t.numel()}")
    return t


def stream_order(prompt_lens, num_blocks, block_sizes) -> torch.Tensor:
    """int64 ``[B, C + T_max]``: the interleaved index of each stream-order position (-1: padding).

    Args (each an int for all samples or ``[B]``): prompt lengths P_b >= 1, block counts N_b >= 1,
    block sizes T_b >= 1. Stream order per sample: ``[prompt | clean_0 .. clean_{N-1} | pad]``
    (C = max(P_b + N_b T_b)) then ``[noisy_0 .. noisy_{N-1} | pad]`` (max(N_b T_b) slots).
    """
    sizes = [
        _ints(n, v).numel()
        for n, v in (("prompt_lens", prompt_lens), ("num_blocks", num_blocks), ("block_sizes", block_sizes))
    ]
    b = max(sizes)
    p = _per_sample("prompt_lens", prompt_lens, b)
    n = _per_sample("num_blocks", num_blocks, b)
    t = _per_sample("block_sizes", block_sizes, b)
    for name, v in (("prompt_lens", p), ("num_blocks", n), ("block_sizes", t)):
        if bool((v < 1).any()):
            raise ValueError(f"{name}: expected positive ints, got {v.tolist()}")
    noisy = n * t
    c, w = int((p + noisy).max()), int(noisy.max())
    order = torch.full((b, c + w), -1, dtype=torch.int64)
    for i in range(b):
        pi, ni, ti = int(p[i]), int(n[i]), int(t[i])
        # offset of noisy_j's token r after the prompt
        blk = torch.arange(ni)[:, None] * (2 * ti) + torch.arange(ti)[None]
        order[i, :pi] = torch.arange(pi)
        order[i, pi : pi + ni * ti] = (pi + ti + blk).flatten()  # clean_j follows noisy_j
        order[i, c : c + ni * ti] = (pi + blk).flatten()
    return order


def to_streams(x: torch.Tensor, order: torch.Tensor, fill=0) -> torch.Tensor:
    """Interleaved ``x [B, L, ...]`` -> stream order ``[B, C + T_max, ...]`` (``fill`` at padding)."""
    if x.dim() < 2 or x.shape[0] != order.shape[0]:
        raise ValueError(f"x: expected [B={order.shape[0]}, L, ...], got {tuple(x.shape)}")
    if int(order.max()) >= x.shape[1]:
        raise ValueError(f"x: expected at least {int(order.max()) + 1} interleaved positions, got {x.shape[1]}")
    idx = order.clamp(min=0).to(x.device)
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:])
    out = torch.gather(x, 1, idx)
    pad = (order < 0).to(x.device).view(*order.shape, *([1] * (x.dim() - 2)))
    return torch.where(pad, torch.as_tensor(fill, dtype=x.dtype, device=x.device), out)


def from_streams(y: torch.Tensor, order: torch.Tensor, length: int, fill=0) -> torch.Tensor:
    """Stream order ``y [B, C + T_max, ...]`` -> interleaved ``[B, length, ...]`` (``fill`` where no token maps).

    ``length`` (an int, numpy int or 0-dim tensor) must hold every interleaved position ``order`` maps to
    (at least ``order.max() + 1``; the collator's padded length is usual).
    """
    if y.dim() < 2 or tuple(y.shape[:2]) != tuple(order.shape):
        raise ValueError(f"y: expected [B, C + T_max] = {tuple(order.shape)} leading dims, got {tuple(y.shape)}")
    length = as_int("length", length)
    need = int(order.max()) + 1 if order.numel() else 0
    if length < need:
        raise ValueError(f"length: expected at least {need} (the interleaved positions order maps to), got {length}")
    out = torch.full((y.shape[0], length, *y.shape[2:]), fill, dtype=y.dtype, device=y.device)
    for i in range(y.shape[0]):
        keep = order[i] >= 0
        out[i, order[i][keep].to(y.device)] = y[i, keep.to(y.device)]
    return out

"""Packed documents and blocks: the per-position facts the layout constructors need (and their int checks).

FlashAttention's convention: ``cu_seqlens`` is an int sequence ``[num_docs + 1]``
that starts at 0, ends at the packed length and never decreases (an empty
document is allowed). It is shared by the batch, or given once per batch element
(a 2-D tensor, or a list of 1-D sequences that may differ in length).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Union

import torch

IntsLike = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]]]  # [n] or per batch element [B, n]


def as_int(name: str, value) -> int:
    """``value`` as a Python int (numpy integers accepted); bools and floats refused."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None


def as_int_tensor(name: str, value: IntsLike, dims: tuple[int, ...] = (1, 2)) -> torch.Tensor:
    """An owned int64 CPU copy of ``value`` (never an alias of the caller's buffer)."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: expected a sequence of ints, got {type(value).__name__} ({exc})") from None
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        if t.numel() == 0 and t.dtype.is_floating_point:  # [] parses as float32: an empty int list
            t = t.to(torch.int64)
        else:
            raise ValueError(f"{name}: expected integers, got dtype {t.dtype}")
    if t.dim() not in dims:
        shapes = " or ".join({1: "[n]", 2: "[B, n]"}[d] for d in dims)
        raise ValueError(f"{name}: expected shape {shapes}, got {tuple(t.shape)}")
    # clone(): a layout owns its numbers; refilling the caller's buffer must not change it.
    return t.detach().to(device="cpu", dtype=torch.int64).clone().contiguous()


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1."""
    v = as_int(name, value)
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return v


def check_spans(
    prefix: str,
    lo: torch.Tensor,
    hi: torch.Tensor,
    n_ctx: int,
    what: str,
    *,
    lo_name: Optional[str] = None,
    hi_name: Optional[str] = None,
) -> None:
    """``0 <= lo <= hi <= n_ctx`` for every ``what`` (the errors name ``{prefix}_lo``/``_hi`` or the given names)."""
    lo_name, hi_name = lo_name or f"{prefix}_lo", hi_name or f"{prefix}_hi"
    if lo.numel() and int(lo.min()) < 0:
        raise ValueError(f"{lo_name}: expected values >= 0, got min {int(lo.min())}")
    if hi.numel() and int(hi.max()) > n_ctx:
        raise ValueError(f"{hi_name}: expected values <= n_ctx={n_ctx}, got max {int(hi.max())}")
    if bool((lo > hi).any()):
        bad = int(torch.nonzero(lo > hi)[0, -1])
        raise ValueError(
            f"{lo_name}: expected {lo_name} <= {hi_name} for every {what}, {what} {bad} has {lo_name} > {hi_name}"
        )


def _one(name: str, cu: IntsLike, n: int) -> torch.Tensor:
    t = as_int_tensor(name, cu, dims=(1,))
    if t.numel() < 2:
        raise ValueError(f"{name}: expected at least [0, n] (2 entries), got {t.tolist()}")
    if int(t[0]) != 0:
        raise ValueError(f"{name}: expected to start at 0, got {int(t[0])}")
    if int(t[-1]) != n:
        raise ValueError(f"{name}: expected to end at the packed length {n}, got {int(t[-1])}")
    if bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {t.tolist()}")
    return t


class PerBatch(list):
    """One validated ``cu`` per batch element (``parse_cu_seqlens`` of a 2-D tensor or a list of rows), even when
    there is one: a per-batch ``[1, D+1]`` describes a batch of one, never a row shared by any batch."""


def parse_cu_seqlens(cu_seqlens, n: int, name: str = "cu_seqlens") -> Optional[list[torch.Tensor]]:
    """Validated offsets: None, ``[cu]`` (a 1-D sequence, shared by the batch) or a :class:`PerBatch` list
    with one ``cu`` per batch element (a 2-D tensor or a list of sequences, even of one row)."""
    if cu_seqlens is None:
        return None
    per_batch = (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 2) or (
        isinstance(cu_seqlens, (list, tuple))
        and len(cu_seqlens) > 0
        and all(isinstance(x, (list, tuple, torch.Tensor)) for x in cu_seqlens)
    )
    if not per_batch:
        return [_one(name, cu_seqlens, n)]
    if len(cu_seqlens) == 0:
        raise ValueError(f"{name}: expected at least one batch element, got none")
    return PerBatch(_one(f"{name}[{b}]", cu, n) for b, cu in enumerate(cu_seqlens))


def document_bounds(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(start [n], end [n])``: the document of each position, as its half-open span."""
    pos = torch.arange(n)
    doc = torch.searchsorted(cu, pos, right=True) - 1
    return cu[doc], cu[doc + 1]


def check_block_aligned(name: str, docs: Optional[list[torch.Tensor]], block: int, end: int) -> None:
    """Blocks never straddle documents: every document boundary must be a multiple of ``block``, but for
    the sequence end ``end`` (the last block is shorter there, as without documents)."""
    if docs is None:
        return
    for cu in docs:
        bad = cu[(cu % block != 0) & (cu != end)]
        if bad.numel():
            raise ValueError(f"{name}: expected document boundaries at multiples of block={block}, got {int(bad[0])}")


def stack_rows(rows: list[torch.Tensor], per_batch: bool) -> torch.Tensor:
    """The rows built from ``parse_cu_seqlens``' list: ``[B, n]`` when it was per batch (``[1, n]`` for one
    row: the layout then refuses any other batch size), else the one shared row ``[n]``."""
    if per_batch:
        return torch.stack(rows)
    if len(rows) != 1:
        raise ValueError(f"cu_seqlens: expected one shared row, got {len(rows)}")
    return rows[0]

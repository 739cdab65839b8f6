"""Positions and document bounds of packed sequences: the one place the model, the Hugging Face
integration and the trainer take them from (the layouts take the same ``cu_seqlens``).

Documents follow FlashAttention's ``cu_seqlens`` (:mod:`.documents` validates them). Positions
(RoPE / ``position_ids``) restart at 0 in each document. In the K-Forcing storage orders, slot i
of the window after context token t sits at ``pos(t) + 1 + i``: where the token it predicts will
sit once it is appended to the context.

    context_positions   [N]: t, per document
    single_positions    [N + N*k]: SingleForward ``[ctx | noise]`` (eq. 18)
    double_positions    [2*N*k]: DoubleForward queries ``[Future-1 | Future-2]`` (eq. 19)
    sbd_positions       [2L]: SBD ``[clean | masked copy]``
    document_offsets    ``cu_seqlens`` of rows of a token stream joined with a separator (EOS)
    as_cu_seqlens       user offsets as int64 CPU data (shared or per batch element)
"""

from __future__ import annotations

from typing import Optional

import torch


def context_positions(n: int, cu_seqlens: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """int64 [N] (or [B, N] for per-batch ``cu_seqlens``): context positions, restarting at 0 per document."""
    t = torch.arange(n, device=device)
    if cu_seqlens is None:
        return t
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        cu = cu_seqlens.to(device)
        return t - cu[torch.searchsorted(cu, t, right=True) - 1]
    rows = [torch.as_tensor(row, device=device) for row in cu_seqlens]
    return torch.stack([t - row[torch.searchsorted(row, t, right=True) - 1] for row in rows])


def single_positions(n: int, k: int, device=None, cu_seqlens=None) -> torch.Tensor:
    """int64 [N + N*k] (or [B, ...]): positions of ``[ctx | noise]``; noise slot i of window t at pos(t) + 1 + i."""
    t = context_positions(n, cu_seqlens, device)
    noise = (t[..., None] + 1 + torch.arange(k, device=device)).flatten(-2)
    return torch.cat([t, noise], -1)


def double_positions(n: int, k: int, device=None, cu_seqlens=None) -> torch.Tensor:
    """int64 [2*N*k] (or [B, ...]): positions of ``[Future-1 | Future-2]``, stream-major; slot i of the 2k-window of t
    at pos(t) + 1 + i."""
    t = context_positions(n, cu_seqlens, device)[..., None]
    i = torch.arange(k, device=device)
    return torch.cat([(t + 1 + i).flatten(-2), (t + 1 + k + i).flatten(-2)], -1)


def as_cu_seqlens(cu_seqlens, n: int, batch: Optional[int] = None):
    """``cu_seqlens`` as int64 CPU data: a tensor [D+1], or one tensor per batch element (None passes).

    The layout constructors validate the offsets (start 0, end ``n``, non-decreasing). ``batch``: the
    batch size the offsets are for; per-batch offsets (a 2-D tensor or a list of rows, even of one row)
    must have exactly that many rows (only a 1-D ``[D+1]`` is shared by the batch).
    """
    if cu_seqlens is None:
        return None
    if (
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dim() == 1
        or (
            isinstance(cu_seqlens, (list, tuple))
            and all(not isinstance(x, (list, tuple, torch.Tensor)) for x in cu_seqlens)
        )
    ):
        return torch.as_tensor(cu_seqlens).detach().cpu().to(torch.int64)
    rows = [torch.as_tensor(row).detach().cpu().to(torch.int64) for row in cu_seqlens]
    if batch is not None and len(rows) != batch:
        raise ValueError(
            f"cu_seqlens: expected one row per batch element ({batch} rows) or a shared 1-D [D+1], got {len(rows)} rows"
        )
    return rows


def sbd_positions(n: int, device=None) -> torch.Tensor:
    """int64 [2L] for SBD storage ``[clean (L) | masked copy (L)]``: token j of either copy at j."""
    return torch.arange(n, device=device).repeat(2)


def document_offsets(tokens: torch.Tensor, separator: int) -> list[torch.Tensor]:
    """Where the documents of each window begin: one int64 ``[D_b + 1]`` per row of ``tokens [B, L]``.

    A corpus that joins documents as ``doc_1 EOS doc_2 EOS ...`` (the app's ``load_corpus``) makes a
    document end with (and include) its separator; the next one starts right after it.
    Row b's offsets are FlashAttention's ``cu_seqlens``: ``[0, i_1 + 1, i_2 + 1, ..., L]`` for
    the separators at ``i_1 < i_2 < ...`` (one at ``L - 1`` closes the last document at ``L``).
    The first and last documents of a row are usually cut by the row's edges (a crop of a stream).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected token ids [B, L], got shape {tuple(tokens.shape)}")
    length = tokens.shape[1]
    inner = (tokens[:, :-1] == separator).cpu()  # a separator at L - 1 ends the row anyway
    rows = []
    for row in inner:
        cuts = torch.nonzero(row).flatten() + 1
        rows.append(torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.full((1,), length, dtype=torch.int64)]))
    return rows

"""The output head and the cross-entropy over row chunks: never every row's ``[rows, V]`` logits at once.

The student's loss is ``sum_r w_r * CE(hidden[r] @ W.T + b, target[r])``: the row weights ``w_r`` hold the
mean and the packed-document mask (``objectives.compute_loss``), and are known before the loss runs. So
:class:`LinearCrossEntropy` computes, chunk by chunk of rows, the logits (fp32), each row's cross-entropy,
and at once the gradients of the weighted sum with respect to ``hidden`` and to ``W`` (and ``b``), as
Liger-Kernel's fused linear cross-entropy does; the backward only scales them by the incoming gradient.
At most one chunk's ``[chunk, V]`` logits (and, under autocast, their low-precision copy) is alive, and the
backward recomputes nothing, so the step does the same matrix products as the unchunked path.

Precision mirrors the unchunked path ``F.cross_entropy(F.linear(hidden, W, b).float(), target)``: the logits
are computed in the dtype ``F.linear`` would use (the autocast dtype under ``torch.autocast``, else the
weight's), then converted to fp32 for the softmax; the gradient of the logits is formed in fp32 and
converted back to that dtype for the two products, as autograd's would be. The row weights enter the
products divided by their largest value (1 for a mean) and that factor is applied after, so an fp16
product never sees a gradient scaled down by 1/rows.

Without grad mode (evaluation) or when neither ``hidden`` nor ``W`` needs a gradient, only the losses
are computed. ``ignore_index`` rows (target -100) have loss 0 and no gradient, as in ``F.cross_entropy``.
Label smoothing is not offered: the objectives do not use it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Bytes of one chunk's fp32 logits. 64 MiB: ~330 rows at the GPT-2 vocabulary (a matrix product of
# 330 x 768 x 50258 still runs at full speed on CPU and GPU), a small fraction of [rows, V] at any
# training shape worth chunking.
DEFAULT_CHUNK_BYTES = 64 * 2**20


def chunk_rows_for(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here (autocast's, if on for this device and floating)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype.is_floating_point:
        return torch.get_autocast_dtype(device)
    return torch.result_type(hidden, weight)


class LinearCrossEntropy(torch.autograd.Function):
    """``(loss, per-row CE [R] fp32)`` of ``hidden [R, C]``, ``weight [V, C]``, ``bias [V] | None``,
    ``targets int [R]``, ``row_weights fp32 [R]``: ``loss = sum_r row_weights[r] * CE_r``.

    Gradients are computed in the forward, chunk by chunk (see the module docstring); the per-row CE is
    not differentiable (the trainer logs it). ``chunk_rows`` rows per chunk; ``compute_dtype`` as
    :func:`_compute_dtype` chose it outside (autocast is off inside a custom function's backward)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, row_weights, chunk_rows: int, compute_dtype: torch.dtype, grad_mode: bool
    ):
        rows, vocab = hidden.shape[0], weight.shape[0]
        # grad_mode: torch.is_grad_enabled() at the call (it is always off in here). needs_input_grad follows
        # requires_grad alone, so under no_grad / inference_mode it would still ask for every gradient.
        needs = [grad_mode and need for need in ctx.needs_input_grad[:3]]
        want_grad = any(needs)
        per_row = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        valid = targets != IGNORE_INDEX
        safe_targets = torch.where(valid, targets, torch.zeros((), dtype=targets.dtype, device=targets.device))
        w_cd = weight.to(compute_dtype)
        b_cd = None if bias is None else bias.to(compute_dtype)
        top = row_weights.abs().max() if rows else row_weights.new_ones(())
        top = torch.where(top > 0, top, torch.ones_like(top))
        scale = (row_weights / top).to(torch.float32)  # the products see weights <= 1 (see the module docstring)
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = (
            torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None and needs[2] else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_rows):
                end = min(rows, start + chunk_rows)
                h = hidden[start:end].to(compute_dtype)
                logits = F.linear(h, w_cd, b_cd).float()  # [c, V]: one chunk of the [rows, V] never held
                tgt = safe_targets[start:end, None]
                lse = torch.logsumexp(logits, -1)
                ce = lse - logits.gather(1, tgt)[:, 0]
                per_row[start:end] = torch.where(valid[start:end], ce, ce.new_zeros(()))
                if not want_grad:
                    continue
                # d CE / d logits = softmax - onehot, times the row's weight: formed in place in the logits' buffer.
                grad = logits.sub_(lse[:, None]).exp_()
                grad.scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=grad.dtype))
                grad.mul_((scale[start:end] * valid[start:end])[:, None])
                g = grad.to(compute_dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (g @ w_cd).to(hidden.dtype)
                if grad_weight is not None:
                    if g.dtype == torch.float32 and h.dtype == torch.float32:
                        grad_weight.addmm_(g.t(), h)  # in place: no [V, C] temporary per chunk
                    else:
                        grad_weight += (g.t() @ h).float()
                if grad_bias is not None:
                    grad_bias += g.float().sum(0)
                del logits, grad, g
        loss = (per_row * row_weights.to(torch.float32)).sum()
        if want_grad:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, top)
        ctx.spent = False
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(per_row)
        return loss, per_row

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_row):
        if ctx.spent:
            raise RuntimeError(
                "LinearCrossEntropy: backward through the same loss twice (retain_graph) is not "
                "supported: its saved gradients are scaled in place"
            )
        ctx.spent = True
        grad_hidden, grad_weight, grad_bias, top = ctx.saved_tensors
        factor = (grad_loss * top).to(torch.float32)
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        # In place: the saved gradients become the returned ones (no second weight-sized buffer at the peak).
        out_h = None if grad_hidden is None else grad_hidden.mul_(factor.to(grad_hidden.dtype)).to(h_dtype)
        out_w = None if grad_weight is None else grad_weight.mul_(factor).to(w_dtype)
        out_b = None if grad_bias is None else grad_bias.mul_(factor).to(b_dtype)
        return out_h, out_w, out_b, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_r row_weights[r] * CE_r, CE [R] fp32 detached)``, ``CE_r = CE(hidden[r] @ weight.T + bias, targets[r])``.

    Args:
        hidden: ``[R, C]`` (the model's final hidden states, flattened over batch and positions).
        weight: ``[V, C]`` the output head (tied to the input embedding or not); ``bias``: ``[V]`` or None.
        targets: int ``[R]`` in ``[0, V)``, or ``IGNORE_INDEX`` (-100: loss 0, no gradient).
        row_weights: ``[R]`` the weight of each row's loss in the returned sum (``1 / R`` for a mean;
            0 for a masked row); a constant (no gradient flows into it).
        chunk_rows: rows per chunk (None: :func:`chunk_rows_for` the vocabulary).

    Equal to the unchunked ``(F.cross_entropy(F.linear(hidden, weight, bias).float(), targets,
    reduction="none") * row_weights).sum()`` and its gradients within fp32 rounding, without holding ``[R, V]``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden, weight: expected [R, C] and [V, C], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias: expected None or shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"targets: expected int64/int32 [{hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}"
        )
    if row_weights.shape != hidden.shape[:1]:
        raise ValueError(f"row_weights: expected shape [{hidden.shape[0]}], got {tuple(row_weights.shape)}")
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(weight.shape[0])
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive int, got {chunk_rows!r}")
    loss, per_row = LinearCrossEntropy.apply(
        hidden,
        weight,
        bias,
        targets.long(),
        row_weights.detach(),
        chunk_rows,
        _compute_dtype(hidden, weight),
        torch.is_grad_enabled(),  # False under no_grad and inference_mode: only the losses are computed
    )
    return loss, per_row

"""How a PFLM turns its slot logits and noise into tokens (issue 39).

A push-forward LM maps (context, z) to a token through a deterministic rule applied to the slot's
logits, which cross-entropy trains towards the posterior ``p(target | context, what the network
resolves of z)``:

* ``"argmax"`` (the paper's greedy decoding): exact once the student resolves z to the width of
  every CDF interval, so that its posterior is one-hot. Under-trained, the posterior is broad and
  its argmax is the mode of the interval neighbourhood: the teacher's likely tokens, mode collapse
  (BENCHMARKS.md, "Stage 1: mode collapse, diagnosed").
* ``"residual"``: the inverse CDF of the slot's own softmax at the noise's unresolved digits,
  ``r(z) = frac(RESIDUAL_SCALE * z)``. Still a deterministic map of (context, z), one forward pass,
  k tokens per pass; the same as argmax when the posterior is one-hot (a converged student), and an
  exact teacher sample when the posterior is calibrated and constant over z-cells of width
  ``1 / RESIDUAL_SCALE`` (the student's resolution is far coarser), because ``r(z)`` is then uniform
  and independent of the cell. The digits the network cannot resolve pick within its posterior
  instead of being thrown away by the argmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.sampling import inverse_cdf_sample
from ..ops.sampling.op import inverse_cdf_sample_unchecked

DECODE_RULES = ("argmax", "residual")
# r(z) keeps the digits of z below 1/1024. float32 uniforms (multiples of 2^-24) leave 14 bits for r.
RESIDUAL_SCALE = 1024


def residual_noise(z: torch.Tensor) -> torch.Tensor:
    """``frac(RESIDUAL_SCALE * z)`` of uniforms z in [0, 1), in z's dtype: uniform again, and about independent
    of any function of z that varies on scales much wider than ``1 / RESIDUAL_SCALE``."""
    r = torch.frac(z.to(torch.float64) * RESIDUAL_SCALE)
    return r.clamp(max=1.0 - 2.0**-24).to(z.dtype if z.dtype.is_floating_point else torch.float32)


def decode_slots(
    logits: torch.Tensor, noise: torch.Tensor, rule: str = "argmax", *, sampler: Optional[str] = None
) -> torch.Tensor:
    """Tokens int64 ``[...]`` of slot logits ``[..., V]`` driven by their noise ``[...]`` under ``rule``
    (:data:`DECODE_RULES`).

    ``sampler``: a resolved sampler backend name for a static decode step (noise already checked, on the
    logits' device): the residual rule then samples without argument checks or host syncs; the same bits.
    """
    if rule == "argmax":
        return logits.argmax(-1)
    if rule != "residual":
        raise ValueError(f"rule: expected one of {DECODE_RULES}, got {rule!r}")
    if noise.shape != logits.shape[:-1]:
        raise ValueError(
            f"noise: expected shape {tuple(logits.shape[:-1])} (the logits' [..., V] less V), got {tuple(noise.shape)}"
        )
    if sampler is not None:
        one = torch.ones((), dtype=torch.float64, device=logits.device)
        return inverse_cdf_sample_unchecked(logits.float(), residual_noise(noise), one, sampler)
    return inverse_cdf_sample(logits.float(), residual_noise(noise.to(logits.device)), 1.0)


def decode_rule(model) -> str:
    """The decoding rule a model was trained for (its config's ``decode``; models without one decode by argmax)."""
    return getattr(getattr(model, "config", None), "decode", "argmax")

"""Reference backend of the sampler: softmax + cumsum + searchsorted in torch, float64.

It materialises the ``[..., V]`` CDF (what the fused samplers avoid) and is the oracle they are
checked against; it runs anywhere, and is the default where neither fused sampler is available.
Arguments arrive validated by ``op.py`` (z in [0, 1), ids in range, tau > 0 as a tensor).
"""

from __future__ import annotations

from typing import Optional

import torch


def available() -> Optional[str]:
    return None


def check_rows(logits: torch.Tensor, tau: torch.Tensor) -> None:
    """Refuses rows without a distribution, as the cpp kernels do: max(logits / tau) must be finite.

    That one reduction catches a row of all -inf (max -inf), any +inf or a finite logit
    that overflows when divided by tau (max +inf) and any NaN (max propagates NaN);
    dividing the max by tau > 0 equals the max of the divided row.
    """
    if not logits.numel():
        return
    top = logits.amax(-1).to(torch.float64) / tau.to(torch.float64)
    bad = ~torch.isfinite(top.reshape(-1))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"logits: expected every row to define a distribution, row {row} has no finite maximum or a non-finite "
            "sum (all -inf, +inf or NaN)"
        )


def _cdf(logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """float64 [..., V] cumulative sum of softmax(logits / tau)."""
    scaled = logits.to(torch.float64) / (tau[..., None] if tau.dim() else tau).to(torch.float64)
    return torch.softmax(scaled, -1).cumsum(-1)


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: ``min{v : F(v) > z}``, clamped to ``V - 1``.

    z is compared with ``z * F(V-1)`` rather than with 1 - so that a total that rounds
    below 1 cannot send z just below 1 to an impossible (-inf) last token.
    """
    check_rows(logits, tau)
    cdf = _cdf(logits, tau)
    target = z.to(cdf.dtype)[..., None] * cdf[..., -1:]
    ids = torch.searchsorted(cdf, target.contiguous(), right=True)[..., 0]
    return ids.clamp_(max=logits.shape[-1] - 1)


def noise_inversion(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float32 z ``[...]`` at fraction u of each token's CDF bin ``[F(t-1), F(t))``."""
    check_rows(logits, tau)
    cdf = _cdf(logits, tau)
    t = tokens.long()[..., None]
    upper = cdf.gather(-1, t)[..., 0]
    lower = torch.where(t[..., 0] > 0, cdf.gather(-1, (t - 1).clamp(min=0))[..., 0], torch.zeros_like(upper))
    total = cdf[..., -1]
    z = ((lower + u.to(torch.float64) * (upper - lower)) / total).to(torch.float32)
    below_one = torch.tensor(1.0, device=z.device).nextafter(torch.tensor(0.0, device=z.device))
    z = torch.minimum(z, below_one)
    # Nudge by float32 ulps until z * total lands in [lower, upper), as the sampler compares.
    for _ in range(4):
        z = torch.where((z.double() * total >= upper) & (z > 0), z.nextafter(torch.zeros_like(z)), z)
    for _ in range(4):
        z = torch.where(z.double() * total < lower, z.nextafter(torch.ones_like(z)), z)
    # Never 1.0 (outside the sampler's [0, 1)): a bin at the top narrower than the last float32 ulp
    # below 1 holds no float32 z; it gets the largest one, which samples the token before it.
    return torch.minimum(z, below_one)

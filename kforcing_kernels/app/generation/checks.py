"""Argument checks shared by the two generation paths (the contiguous cache in ``inference.py`` and the
paged one in ``serving.py``), so both accept and refuse the same inputs with the same messages."""

from __future__ import annotations

from numbers import Real
from typing import Optional

import torch

from ...types import Temperature
from ..student import Student


def check_temperature(temperature: Temperature, batch: int = 1, *, allow_zero: bool) -> None:
    """tau: a real number or a [B] tensor, finite, > 0 (>= 0 for AR, where a scalar 0 is greedy)."""
    what = (
        "a finite number >= 0 (0 = greedy)"
        if allow_zero
        else "a finite number > 0 (K-Forcing decodes by argmax; tau only conditions the noise)"
    )
    if isinstance(temperature, torch.Tensor):
        if temperature.dtype == torch.bool or temperature.is_complex():
            raise ValueError(f"temperature: expected a real tensor, got dtype {temperature.dtype}")
        if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != batch):
            raise ValueError(
                f"temperature: expected a scalar or shape [{batch}] (one per prompt), got {tuple(temperature.shape)}"
            )
        values = temperature.detach().double().cpu().flatten()
    elif isinstance(temperature, Real) and not isinstance(temperature, bool):
        values = torch.tensor([float(temperature)], dtype=torch.float64)
    else:
        raise ValueError(f"temperature: expected {what}, got {temperature!r}")
    ok = torch.isfinite(values) & (values > 0)
    if allow_zero and not isinstance(temperature, torch.Tensor):
        ok |= values == 0
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0, 0])
        bad = values[row].item()
        if allow_zero and isinstance(temperature, torch.Tensor):
            # Greedy is a decision for the whole batch (is_greedy): a number 0, never a 0 inside a tensor.
            at = f" (row {row})" if temperature.dim() else ""
            raise ValueError(
                f"temperature: expected a tensor of finite numbers > 0 (0 = greedy only as a number, temperature=0, "
                f"for the whole batch; a greedy row: the paged server's Request(temperature=0)), got {bad}{at}"
            )
        raise ValueError(f"temperature: expected {what}, got {bad}")


def is_greedy(temperature: Temperature) -> bool:
    """A scalar temperature of 0 (Python or numpy number, not a tensor): AR decoding by argmax."""
    return isinstance(temperature, Real) and not isinstance(temperature, bool) and float(temperature) == 0


def check_generator(generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
    """The generator the noise is drawn from: a ``torch.Generator`` or None (torch's default one)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return generator


def check_noise(noise: torch.Tensor, name: str = "noise") -> None:
    """Uniform noise: a floating tensor with every value in [0, 1) (NaN refused), as the sampler requires."""
    if not isinstance(noise, torch.Tensor) or not noise.dtype.is_floating_point:
        raise ValueError(
            f"{name}: expected a floating tensor of uniforms in [0, 1), "
            f"got {getattr(noise, 'dtype', type(noise).__name__)}"
        )
    outside = ~((noise >= 0) & (noise < 1))
    if bool(outside.any()):
        raise ValueError(f"{name}: expected values in [0, 1), got {noise[outside].flatten()[0].item()}")


def check_k(model: Student, k, k_train: Optional[int] = None) -> None:
    """k tokens per forward pass: a positive int, at most the window the model was trained with."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: expected a positive int (tokens per forward pass), got {k!r}")
    k_train = model.k_train if k_train is None else k_train
    if k_train is None:
        return
    if k_train == 0:
        raise ValueError("k: this model was trained as an AR model (k_train=0); use generate_ar")
    if k > k_train:
        raise ValueError(f"k: expected 1 <= k <= k_train={k_train} (the window the model was trained with), got {k}")


def check_ar(model: Student) -> None:
    """AR decoding needs an AR model: a K-Forcing model (``k_train >= 1``) predicts from noise windows, and its
    next-token logits without noise are not what it was trained to give. A model whose ``k_train`` is unknown (None)
    is not checked."""
    k_train = model.k_train
    if k_train:
        raise ValueError(
            f"model: this model was trained with K-Forcing (k_train={k_train}); AR decoding would read it "
            f"without its noise window: use generate_kforcing (1 <= k <= {k_train}), or an AR (stage0) "
            "model"
        )

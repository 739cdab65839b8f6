"""Inverse-CDF sampling and noise inversion (K-Forcing's push-forward noise).

op.py              the public functions, validation, the backend registry
reference.py       softmax + cumsum + searchsorted in float64: the oracle and the fallback
cpp.py             the fused C++ sampler (kforcing_kernels._C)
triton.py          the fused Triton sampler (triton_kernels.py)
"""

from .op import (
    REGISTRY,
    inverse_cdf_sample,
    inverse_cdf_sample_reference,
    noise_inversion,
    noise_inversion_reference,
    sampler_backend,
)

__all__ = [
    "inverse_cdf_sample",
    "inverse_cdf_sample_reference",
    "noise_inversion",
    "noise_inversion_reference",
    "sampler_backend",
    "REGISTRY",
]

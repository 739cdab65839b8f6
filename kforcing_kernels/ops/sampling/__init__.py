"""Inverse-CDF sampling and noise inversion (K-Forcing's push-forward noise).

    op.py              the public functions, validation, backend choice, references
    triton_kernels.py  the Triton GPU sampler
"""

from .op import (
    inverse_cdf_sample,
    inverse_cdf_sample_reference,
    noise_inversion,
    noise_inversion_reference,
    sampler_backend,
)

__all__ = ["inverse_cdf_sample", "inverse_cdf_sample_reference", "noise_inversion", "noise_inversion_reference", "sampler_backend"]

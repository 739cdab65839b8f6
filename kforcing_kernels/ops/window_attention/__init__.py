"""Prefix-window attention: ``window_attention(q, k, v, layout)``.

    op.py             the public function, validation, torch.library custom ops
    backends.py       the backend protocol and registry (explicit names, no fakes)
    reference.py      dense mask + SDPA, the oracle
    composite/        a few standard attention calls merged by log-sum-exp (pieces, fused CUDA calls, and
                      query_rows.py: the same on a QueryRowsLayout, per-interval calls over groups of its rows)
    lse_attention.py  attention with its log-sum-exp and the matching backward (composite, reference, masked_keys)
    cpp.py            the C++ CPU kernels (csrc/)
    flex.py           torch's FlexAttention over the layout's analytic BlockMask (CPU: forward only)
    dispatch.py       the measured CUDA dispatch table (dispatch_table.json): backend=None's choice by GPU measurement
    triton/           the Triton GPU kernels: tile plan, configs, launchers, @triton.jit source
What the ops share (registry, argument checks, acc_dtype, the Triton availability rules) is ``ops/common/``.
"""

from .backends import BACKENDS, backend_limits, backends_available, default_backend, get_backend
from .checks import SUPPORTED_DTYPES
from .op import window_attention

__all__ = [
    "window_attention",
    "BACKENDS",
    "backends_available",
    "backend_limits",
    "default_backend",
    "get_backend",
    "SUPPORTED_DTYPES",
]

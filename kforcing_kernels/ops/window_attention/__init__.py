"""Prefix-window attention: ``window_attention(q, k, v, layout)``.

    op.py             the public function, validation, torch.library custom ops
    backends.py       the backend protocol and registry (explicit names, no fakes)
    reference.py      dense mask + SDPA, the oracle
    composite.py      a few standard attention calls merged by log-sum-exp
    lse_attention.py  attention with its log-sum-exp and the matching backward
    cpp.py            the C++ CPU kernels (csrc/)
    triton.py         the Triton GPU kernels: triton_kernels.py, run over tile_plan.py
"""

from .backends import BACKENDS, backends_available, default_backend, get_backend
from .op import SUPPORTED_DTYPES, window_attention

__all__ = ["window_attention", "BACKENDS", "backends_available", "default_backend", "get_backend", "SUPPORTED_DTYPES"]

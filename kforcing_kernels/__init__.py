"""kforcing_kernels: prefix-window attention for parallel-decoding LLM training.

from kforcing_kernels import WindowLayout, window_attention
layout = WindowLayout.kforcing_single(n_ctx=N, k=4)
out = window_attention(q, k, v, layout)      # q, k, v: [B, H, L, D]
layout.dense_mask()                          # bool [Lq, Lk], the oracle
"""

from . import _moved
from .layouts import WindowLayout
from .ops.sampling import inverse_cdf_sample, noise_inversion
from .ops.window_attention import BACKENDS, backends_available, default_backend, window_attention

_moved.install()  # an import of a 0.2 application module (kforcing_kernels.train, ...) fails naming its 0.3 place

__version__ = "0.3.0"  # the one version source: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "WindowLayout",
    "window_attention",
    "inverse_cdf_sample",
    "noise_inversion",
    "backends_available",
    "default_backend",
    "BACKENDS",
    "__version__",
]

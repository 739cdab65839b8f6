"""C++ backend: the compiled CPU kernels of ``kforcing_kernels._C`` (csrc/).

Per (batch, head, query tile) the kernel walks the layout's tile plan: each
context K/V chunk is loaded once and applied to every window packed in the tile,
with an online softmax in fp32 (fp64 for fp64 inputs) and register-blocked
AVX-512 / AVX2 / portable micro-kernels chosen at run time. bf16 and fp16 inputs
are computed in fp32. CPU tensors only; absent (with the reason) when the
extension is not built.

Row subsets (``QueryRowsLayout``, context parallelism, EAGLE-3 steps) run the same kernels over
tiles of the selected rows (``layouts/intervals.py``, ``subset_query_tiles``). A row's output and
dQ have the same bits in the full layout and in any subset holding it: a row's key chunks start at
fixed key positions, whichever rows share its tile (csrc/kf_isa_impl.h, ``for_each_chunk``).

Non-finite values: a NaN/inf in K or V at a key a row does not see never reaches
that row, forward or backward (the kernels keep masked keys out of their products,
csrc/kf_isa_impl.h); no scan of K/V happens in Python.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ... import _extension
from ...layouts import QueryRowsLayout, WindowLayout


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Every dtype the op accepts and any head dim."""
    return True


def available() -> Optional[str]:
    return _extension.reason()


def _layout_args(layout: Union[WindowLayout, QueryRowsLayout]):
    # The row intervals say what each row sees, the query tiles which rows go together
    # (both derived once per layout, in layouts/intervals.py); the geometry gives the sizes.
    # A row subset brings its own rows' intervals and tiles and its parent's geometry.
    return (
        layout.row_intervals_int32,
        *layout.cpu_query_tiles,
        layout.n_ctx,
        layout.num_windows,
        layout.window_size,
        layout.last_window_size,
        layout.n_streams,
        layout.queries == "all",
    )


def _n_rows(layout) -> int:
    """The kernels' row count: -1 (every row of the layout) or a subset's rows."""
    return layout.n_queries if isinstance(layout, QueryRowsLayout) else -1


def forward(q, k, v, layout: Union[WindowLayout, QueryRowsLayout], scale: float):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] (CPU) -> (out [B, H, Lq, D], lse [B, H, Lq] natural log, fp32; fp64 for
    fp64).

    ``layout`` may be a row subset (``QueryRowsLayout``): the same kernels over its rows' tiles."""
    if layout.n_queries == 0:  # a subset of no rows: nothing for the kernels to tile
        return q.new_zeros(q.shape), q.new_zeros(
            q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32
        )
    return _extension.require().attention_forward(q, k, v, *_layout_args(layout), float(scale), _n_rows(layout))


def backward(dout, q, k, v, out, lse, layout: Union[WindowLayout, QueryRowsLayout], scale: float):
    """Gradients (dq, dk, dv) given the forward's ``out`` and ``lse``."""
    if layout.n_queries == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _extension.require().attention_backward(
        dout, q, k, v, out, lse, *_layout_args(layout), float(scale), _n_rows(layout)
    )


def preferred() -> bool:
    """Whether ``cpp`` should be the default CPU backend here.

    Its AVX2 and AVX-512 builds beat ``composite`` by 1.6-3x (bench/attention/cpu_kernels.py);
    the portable 128-bit build is slower than ``composite`` on x86, so there the
    default stays ``composite`` (``backend="cpp"`` still works).
    """
    return available() is None and isa() in ("avx2", "avx512")


def isa() -> str:
    """Instruction set the kernels run with here (``generic``, ``avx2`` or ``avx512``)."""
    return _extension.require().isa()


__all__ = ["available", "preferred", "forward", "backward", "isa"]

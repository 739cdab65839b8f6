"""The Triton kernels' shared ``@triton.jit`` helpers and argument conventions (kernel source only).

What a row sees is never re-derived in a kernel: ``RowIv`` is the layout's row intervals and
``WindowKeys`` its slot-to-key table (``layout.row_intervals_int32`` / ``window_token_keys``,
uploaded by ``plan_device.device_plan``). The argument roles below let ``tools/aot_report.py`` type
every kernel argument without running the launcher.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Argument roles (the AOT report builds kernel signatures from these).
IO_POINTERS = ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")  # in the inputs' dtype
FP32_POINTERS = ("Lse", "Delta")  # other pointers are int32 plan tensors
# The int32 plan tables (plan_device.device_int32 uploads them 16-byte aligned), and Counters (int32, the caller's).
PLAN_POINTERS = (
    "QueryTiles",
    "Bounds",
    "Order",
    "KeyTiles",
    "StepPtr",
    "StepEntries",
    "StepOrder",
    "RowIv",
    "WindowKeys",
    "RowSlot0",
)
FLOAT_ARGS = ("qk_scale", "sm_scale")
# Strides of q/k/v/dout are multiples of the head dim (>= 32), so Triton may assume 16-divisibility.
ALIGNED_STRIDES = ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn")


def jit_kernel(fn):
    """``triton.jit`` specialising only pointers and the aligned strides: layout sizes (which
    may be 1 or multiples of 16) would otherwise fork new variants at run time that the AOT
    report never compiled."""
    shape_args = [
        name
        for name in inspect.signature(fn).parameters
        if name[0].islower() and name not in ALIGNED_STRIDES and name not in FLOAT_ARGS
    ]
    return triton.jit(do_not_specialize=shape_args)(fn)


def interpreting() -> bool:
    """True when the kernels were built for Triton's interpreter (decided when triton was first imported)."""
    return not isinstance(_row_interval, triton.runtime.JITFunction)


# ====================================================================== what a row sees
#
# The kernels never re-derive the mask. RowIv is the layout's row intervals (int32
# [B', Lq, n_iv, 2], WindowLayout.row_intervals()): row r sees keys [lo, hi) of each of
# its n_iv intervals (0: context part, 1..S: its own window's streams). WindowKeys
# (int32 [M * w], -1 past a short last window) is the key of each window slot, so the
# slot steps read both storage orders in place without a storage formula.


@triton.jit
def _row_interval(RowIv, iv_base, rows, ok, interval, n_iv):
    """Interval ``interval`` of query ``rows``: ``(lo, hi)``, ``[0, 0)`` outside ``ok``."""
    ptr = RowIv + iv_base + rows.to(tl.int64) * (n_iv * 2) + interval * 2
    return tl.load(ptr, mask=ok, other=0), tl.load(ptr + 1, mask=ok, other=0)


@triton.jit
def _sees(RowIv, iv_base, rows, ok, key, n_iv):
    """Whether each of ``rows`` sees its ``key`` through its own-window intervals 1..n_iv-1."""
    seen = key != key  # all False
    for j in range(1, n_iv):
        lo, hi = _row_interval(RowIv, iv_base, rows, ok, j, n_iv)
        seen = seen | ((lo <= key) & (key < hi))
    return seen & ok


@triton.jit
def _slot_block(block, windows_per_block, num_windows, window_size, WindowKeys, BLOCK_T: tl.constexpr):
    """Tokens of slot block ``block`` (whole windows, window-major): (ok, index of the window's
    slot 0 in WindowKeys, own key)."""
    t = tl.arange(0, BLOCK_T)
    m = block * windows_per_block + t // window_size
    in_block = (t < windows_per_block * window_size) & (m < num_windows)
    slot0 = m * window_size
    key = tl.load(WindowKeys + slot0 + t % window_size, mask=in_block, other=-1)
    return key >= 0, slot0, key


@triton.jit
def _finish(m_i, l_i):
    """(1 / l, LSE in log2 units) of an online softmax; a row that saw no key gets (0, -inf)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    return tl.where(seen, 1.0 / l_safe, 0.0), tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _lse2_for_grad(lse):
    """LSE (natural log) -> log2 units for p = 2^(s - lse2); -inf (no key seen) -> +inf so p = 0."""
    lse2 = lse * 1.4426950408889634
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)

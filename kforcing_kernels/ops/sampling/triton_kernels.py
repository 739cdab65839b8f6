"""Triton inverse-CDF sampler and noise inversion for CUDA tensors.

The algorithm of the C++ sampler (csrc/kf_isa_impl.h), in float64:

1. ``_block_stats``, one program per (row, block of BLOCK logits): the block's max
   ``m_b`` of ``x / tau`` and ``s_b = sum exp(x / tau - m_b)``: one pass over the
   logits, spread over the whole GPU.
2. ``_sample`` / ``_invert``, one program per row: from the block stats, the row max
   M, the block totals ``c_b = s_b e^(m_b - M)`` and their running sum, hence the
   block that holds ``z * Z``; only that block is read again, and a cumulative sum
   inside it finds the token (or the token's bin for the inversion).

The [..., V] cumulative sum is never stored: the extra memory is 16 bytes per
block. Runs compiled on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``
(set before this module is imported). Rows without a distribution (all -inf,
+inf or NaN) and z outside [0, 1) are refused by the public functions in
``op.py`` before these kernels run, exactly as on the other backends.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import env

BLOCK = 1024


def interpreting() -> bool:
    return env.triton_interpret()


def available() -> Optional[str]:
    """None when the kernels can run here, else why not."""
    if torch.cuda.is_available() or interpreting():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 is not set"


@triton.jit
def _block_stats(x_ptr, tau_ptr, stats_ptr, V, NB, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float64)
    t = x / tl.load(tau_ptr + row)
    m = tl.max(t, 0)
    s = tl.sum(tl.where(t > float("-inf"), tl.exp(t - m), 0.0), 0)
    base = (row.to(tl.int64) * NB + b) * 2
    tl.store(stats_ptr + base, m)
    tl.store(stats_ptr + base + 1, s)


@triton.jit
def _row_totals(stats_ptr, row, NB, NB_P2: tl.constexpr):
    """Block maxima, e^(m_b - M), the running sum of block totals after each block, and Z."""
    idx = tl.arange(0, NB_P2)
    valid = idx < NB
    base = row.to(tl.int64) * NB * 2
    mb = tl.load(stats_ptr + base + idx * 2, mask=valid, other=float("-inf"))
    sb = tl.load(stats_ptr + base + idx * 2 + 1, mask=valid, other=0.0)
    M = tl.max(mb, 0)
    rel = tl.where(mb > float("-inf"), tl.exp(mb - M), 0.0)
    after = tl.cumsum(sb * rel, 0)
    Z = tl.sum(tl.where(idx == NB - 1, after, 0.0), 0)
    return idx, mb, rel, after, Z


@triton.jit
def _pick(values, idx, i):
    return tl.sum(tl.where(idx == i, values, tl.zeros_like(values)), 0)


@triton.jit
def _block_prefix(x_ptr, row, V, b, tau, mb, BLOCK: tl.constexpr):
    """e^(x_u / tau - m_b) over block b, and its inclusive running sum."""
    ar = tl.arange(0, BLOCK)
    offs = b * BLOCK + ar
    valid = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=valid, other=float("-inf")).to(tl.float64)
    e = tl.where(valid & (x > float("-inf")), tl.exp(x / tau - mb), 0.0)
    return ar, e, tl.cumsum(e, 0)


@triton.jit
def _sample(x_ptr, z_ptr, tau_ptr, stats_ptr, out_ptr, V, NB, BLOCK: tl.constexpr, NB_P2: tl.constexpr):
    row = tl.program_id(0)
    tau = tl.load(tau_ptr + row)
    idx, mb, rel, after, Z = _row_totals(stats_ptr, row, NB, NB_P2)
    target = tl.load(z_ptr + row) * Z
    b = tl.min(tl.where((after > target) & (idx < NB), idx, NB_P2), 0)
    found = b < NB
    b = tl.minimum(b, NB - 1)
    before = tl.where(b > 0, _pick(after, idx, b - 1), 0.0)
    ar, e, prefix = _block_prefix(x_ptr, row, V, b, tau, _pick(mb, idx, b), BLOCK)
    i = tl.min(tl.where(before + prefix * _pick(rel, idx, b) > target, ar, BLOCK), 0)
    last_positive = tl.max(tl.where(e > 0, ar, 0), 0)
    i = tl.where(i < BLOCK, i, last_positive)  # rounding inside the block: its last bin absorbs it
    token = tl.where(found & (Z == Z) & (Z > 0), b.to(tl.int64) * BLOCK + i, V - 1)
    tl.store(out_ptr + row, token)


@triton.jit
def _invert(x_ptr, tok_ptr, u_ptr, tau_ptr, stats_ptr, out_ptr, V, NB, BLOCK: tl.constexpr, NB_P2: tl.constexpr):
    row = tl.program_id(0)
    tau = tl.load(tau_ptr + row)
    idx, mb, rel, after, Z = _row_totals(stats_ptr, row, NB, NB_P2)
    t = tl.load(tok_ptr + row)
    b = (t // BLOCK).to(tl.int32)
    it = (t % BLOCK).to(tl.int32)
    block_start = tl.where(b > 0, _pick(after, idx, b - 1), 0.0)
    block_end = _pick(after, idx, b)
    r = _pick(rel, idx, b)
    ar, e, prefix = _block_prefix(x_ptr, row, V, b, tau, _pick(mb, idx, b), BLOCK)
    lower = block_start + tl.where(it > 0, _pick(prefix, ar, it - 1), 0.0) * r
    last_positive = tl.max(tl.where(e > 0, ar, 0), 0)
    upper = tl.where(it == last_positive, block_end, tl.minimum(block_start + _pick(prefix, ar, it) * r, block_end))
    u = tl.load(u_ptr + row).to(tl.float64)
    z = ((lower + u * (upper - lower)) / Z).to(tl.float32)
    z = tl.minimum(z, 0.99999994)
    # Nudge by float32 ulps until z * Z lands in [lower, upper), as the sampler sees it.
    for _ in tl.static_range(4):
        high = (z.to(tl.float64) * Z >= upper) & (z > 0)
        z = tl.where(high, (z.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), z)
    for _ in tl.static_range(4):
        low = z.to(tl.float64) * Z < lower
        z = tl.where(low, (z.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), z)
    # Never 1.0: a top bin narrower than the last float32 ulp below 1 gets the largest z below 1.
    z = tl.minimum(z, 0.99999994)
    tl.store(out_ptr + row, z)


def _prepare(logits: torch.Tensor, tau: torch.Tensor):
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    if x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = x.float()
    x = x.contiguous()
    rows = x.shape[0]
    tau_rows = tau.to(device=x.device, dtype=torch.float64).expand(logits.shape[:-1]).reshape(rows).contiguous()
    nb = triton.cdiv(V, BLOCK)
    stats = torch.empty(rows, nb, 2, dtype=torch.float64, device=x.device)
    if rows:
        _block_stats[(rows, nb)](x, tau_rows, stats, V, nb, BLOCK=BLOCK)
    return x, tau_rows, stats, rows, V, nb


def inverse_cdf_sample(logits: torch.Tensor, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """logits [..., V], z [...], tau 0-dim or [...] (> 0) -> int64 [...]: min{v : F(v) > z}, clamped to V - 1."""
    x, tau_rows, stats, rows, V, nb = _prepare(logits, tau)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        zr = z.to(torch.float64).reshape(rows).contiguous()
        _sample[(rows,)](x, zr, tau_rows, stats, out, V, nb, BLOCK=BLOCK, NB_P2=triton.next_power_of_2(nb))
    return out.view(z.shape)


def noise_inversion(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float32 z [...] at fraction u [...] of each token's CDF bin (see ``sampling.noise_inversion``)."""
    x, tau_rows, stats, rows, V, nb = _prepare(logits, tau)
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        tk = tokens.to(torch.int64).reshape(rows).contiguous()
        ur = u.to(torch.float64).reshape(rows).contiguous()
        _invert[(rows,)](x, tk, ur, tau_rows, stats, out, V, nb, BLOCK=BLOCK, NB_P2=triton.next_power_of_2(nb))
    return out.view(tokens.shape)

"""Fused kernels for the composite backend's pieces on CUDA (each returns the log-sum-exp).

The composite backend (``__init__.py``, ``pieces.py``) cuts a prefix-window mask into standard
attention calls (context triangle, slot-major staircase, intra-window blocks, masked prefix
chunks) and merges them by LSE; the paper's own observation is that each piece is natively
a FlashAttention call. Here every such call, on a CUDA tensor, goes to the first kernel below that takes it:

* ``flash_attn``: flash-attn's varlen API (``_flash_attn_varlen_forward/_backward``, the
  package installed; fp16/bf16, D % 8 == 0, D <= 256, no mask). The batch is packed as
  equal-length sequences; GQA is native;
* ``sdpa_flash``: ``aten._scaled_dot_product_flash_attention`` and its backward (same
  limits; K/V heads repeated to the query heads, their gradients summed back);
* ``sdpa_efficient``: ``aten._scaled_dot_product_efficient_attention`` and its backward,
  which also take a mask as an additive bias (fp32 too);
* else the portable path of :mod:`lse_attention` (fp32 matmuls), as before.

Causal pieces always have Lq == Lk (top-left and bottom-right alignment agree). A kernel
that raises for some (dtype, head dim, masked) is switched off for that signature for the
rest of the process, with the reason kept (``status()``), and the call falls through to
the next one: a missing or refusing kernel costs speed, never a wrong result. Backward
takes the *merged* ``out``/``lse`` like lse_attention's (any kernel can do any piece's
backward). Tests inject CPU stand-ins for the ops through ``use_ops``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Callable, Optional

import torch

from ...common.dtypes import acc_dtype
from .. import lse_attention

KERNELS = ("flash_attn", "sdpa_flash", "sdpa_efficient")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_lock = threading.Lock()
_disabled: dict[tuple, str] = {}  # (kernel, dtype, head dim, masked) -> why it was switched off
_devices = ("cuda",)
_ops: dict[str, object] = {}  # injected stand-ins (tests); else the real ops, resolved lazily


_flash_attn_module: list = []  # [module or None] once the import was tried
_fa_lse_checked: set = set()  # dtypes whose flash_attn forward returned the [H, total] LSE layout


def _op(name: str):
    """The op ``name`` (an injected stand-in first), or None if this install lacks it."""
    if name in _ops:
        return _ops[name]
    if name == "flash_attn":
        if not _flash_attn_module:
            try:
                _flash_attn_module.append(importlib.import_module("flash_attn.flash_attn_interface"))
            except Exception:  # noqa: BLE001 - not installed, or built for another torch/CUDA
                _flash_attn_module.append(None)
        return _flash_attn_module[0]
    return getattr(torch.ops.aten, name, None)


@contextlib.contextmanager
def use_ops(ops: dict, devices=("cuda",)):
    """Replace ops (``flash_attn`` module-like, or aten op names) and the devices routed here; for tests."""
    global _devices
    saved_ops, saved_devices = dict(_ops), _devices
    saved_disabled, saved_checked, saved_aux = dict(_disabled), set(_fa_lse_checked), dict(_aux)
    _ops.update(ops)
    _devices = tuple(devices)
    _disabled.clear()
    _fa_lse_checked.clear()
    _aux.clear()
    try:
        yield
    finally:
        _ops.clear()
        _ops.update(saved_ops)
        _devices = saved_devices
        _disabled.clear()
        _disabled.update(saved_disabled)
        _fa_lse_checked.clear()
        _fa_lse_checked.update(saved_checked)
        _aux.clear()
        _aux.update(saved_aux)


def status() -> dict:
    """``{kernel: None if present, else why not}`` plus ``disabled``: the signatures switched off and why."""
    present = {
        "flash_attn": None if _op("flash_attn") is not None else "flash_attn is not importable",
        "sdpa_flash": None if _op("_scaled_dot_product_flash_attention") is not None else "aten op missing",
        "sdpa_efficient": None if _op("_scaled_dot_product_efficient_attention") is not None else "aten op missing",
    }
    return {**present, "disabled": {"/".join(map(str, k)): v for k, v in _disabled.items()}}


def _candidates(q: torch.Tensor, k: torch.Tensor, causal: bool, masked: bool, kind: str = "forward") -> list[str]:
    if q.device.type not in _devices or (causal and q.shape[2] != k.shape[2]):
        return []
    if masked and kind == "backward":
        # sdpa_efficient's backward with a -inf bias gave NaN and run-to-run different dq/dk on an H100
        # (torch 2.11, the blank slot of a short last window: a row with no visible key); the portable
        # path takes masked pieces' backward. Forward with a bias is exact (rows without keys fixed by
        # _empty_rows) and stays fused.
        return []
    d = q.shape[-1]
    out = []
    if q.dtype in _LOW_PRECISION and d % 8 == 0 and d <= 256 and not masked:
        out += ["flash_attn", "sdpa_flash"]
    if q.dtype in _LOW_PRECISION + (torch.float32,) and d % 8 == 0 and d <= 256:
        out.append("sdpa_efficient")
    sig = (str(q.dtype), d, masked)
    return [name for name in out if (name, *sig) not in _disabled and _op(_OP_NAME[name]) is not None]


def _run(kind: str, q, k, causal, masked, calls: dict[str, Callable]):
    for name in _candidates(q, k, causal, masked, kind):
        try:
            return calls[name]()
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            with _lock:
                _disabled[(name, str(q.dtype), q.shape[-1], masked)] = f"{kind}: {type(exc).__name__}: {exc}"[:300]
    return None


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _bias(allowed: torch.Tensor, q: torch.Tensor, lk: int) -> torch.Tensor:
    """Additive bias [B, H, Lq, Lk] in q.dtype, its rows padded to 16 elements (the kernel's alignment)."""
    b, h, lq = q.shape[0], q.shape[1], q.shape[2]
    padded = torch.zeros(allowed.shape[0], 1, lq, -(-lk // 16) * 16, dtype=q.dtype, device=q.device)
    padded[..., :lk].masked_fill_(~allowed.to(q.device), float("-inf"))
    return padded[..., :lk].expand(b, h, lq, lk)


# ---------------------------------------------------------------------- flash-attn varlen


def _pack(x: torch.Tensor) -> torch.Tensor:
    # [B, H, L, D] -> [B*L, H, D]: the batch as B equal-length sequences.
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)


def _unpack(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.view(b, -1, *x.shape[1:]).transpose(1, 2)


def _cu_seqlens(b: int, n: int, device) -> torch.Tensor:
    return torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)


def _fa_forward(q, k, v, causal, scale):
    fa = _op("flash_attn")
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    res = fa._flash_attn_varlen_forward(
        _pack(q),
        _pack(k),
        _pack(v),
        _cu_seqlens(b, lq, q.device),
        _cu_seqlens(b, lk, q.device),
        lq,
        lk,
        0.0,
        scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    )
    out, lse = res[0], res[1]
    if tuple(lse.shape) != (h, b * lq):  # older releases pad the LSE per sequence: not this layout
        raise ValueError(f"flash_attn: expected an LSE [{h}, {b * lq}], got {tuple(lse.shape)}")
    _fa_lse_checked.add(q.dtype)
    return _unpack(out, b), lse.view(h, b, lq).transpose(0, 1).to(torch.float32)


def _fa_backward(dout, q, k, v, out, lse, causal, scale):
    if q.dtype not in _fa_lse_checked:  # the backward reads our LSE in the layout a forward confirmed
        raise ValueError("flash_attn: no forward confirmed its LSE layout for this dtype yet")
    fa = _op("flash_attn")
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    qp, kp, vp = _pack(q), _pack(k), _pack(v)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    fa._flash_attn_varlen_backward(
        _pack(dout),
        qp,
        kp,
        vp,
        _pack(out),
        lse.to(torch.float32).transpose(0, 1).reshape(h, b * lq).contiguous(),
        dq,
        dk,
        dv,
        _cu_seqlens(b, lq, q.device),
        _cu_seqlens(b, lk, q.device),
        lq,
        lk,
        0.0,
        scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=True,
        rng_state=None,
    )
    return _unpack(dq, b), _unpack(dk, b), _unpack(dv, b)


# ---------------------------------------------------------------------- torch SDPA kernels

# The forward's bookkeeping outputs (cum_seq_q/k, rng state; dropout is 0, so data-independent), kept
# per (op, device) from a real forward and handed back to the backward exactly as the op produced them.
_aux: dict[tuple, tuple] = {}


def _aux_of(name: str, q: torch.Tensor) -> tuple:
    key = (name, str(q.device))
    if key not in _aux:  # backward before any forward on this device: one tiny forward
        x = torch.zeros(1, 1, 16, q.shape[-1], dtype=q.dtype, device=q.device)
        (_sdpa_flash_forward if name == "sdpa_flash" else _sdpa_eff_forward)(x, x, x, None, False, 1.0)
    return _aux[key]


def _sdpa_flash_forward(q, k, v, allowed, causal, scale):
    h = q.shape[1]
    res = _op("_scaled_dot_product_flash_attention")(
        q, _repeat_kv(k, h), _repeat_kv(v, h), 0.0, causal, False, scale=scale
    )
    out, lse, cum_q, cum_k, _, _, rng, unused = res[:8]
    _aux.setdefault(("sdpa_flash", str(q.device)), (cum_q, cum_k, rng, unused))
    return out, lse[..., : q.shape[2]].to(torch.float32)


def _sdpa_flash_backward(dout, q, k, v, out, lse, allowed, causal, scale):
    h, hkv = q.shape[1], k.shape[1]
    cum_q, cum_k, rng, unused = _aux_of("sdpa_flash", q)
    dq, dk, dv = _op("_scaled_dot_product_flash_attention_backward")(
        dout,
        q,
        _repeat_kv(k, h),
        _repeat_kv(v, h),
        out,
        lse.to(torch.float32).contiguous(),
        cum_q,
        cum_k,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        rng,
        unused,
        scale=scale,
    )[:3]
    return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


def _sdpa_eff_forward(q, k, v, allowed, causal, scale):
    h = q.shape[1]
    bias = None if allowed is None else _bias(allowed, q, k.shape[2])
    out, lse, seed, offset = _op("_scaled_dot_product_efficient_attention")(
        q, _repeat_kv(k, h), _repeat_kv(v, h), bias, True, 0.0, causal, scale=scale
    )[:4]
    _aux.setdefault(("sdpa_efficient", str(q.device)), (seed, offset))
    return out, lse[..., : q.shape[2]].to(torch.float32)  # the kernel pads the LSE rows to a multiple of 32


def _sdpa_eff_backward(dout, q, k, v, out, lse, allowed, causal, scale):
    b, h, lq = q.shape[:3]
    hkv = k.shape[1]
    seed, offset = _aux_of("sdpa_efficient", q)
    lse_padded = lse.new_zeros(b, h, -(-lq // 32) * 32, dtype=torch.float32)
    lse_padded[..., :lq] = lse
    bias = None if allowed is None else _bias(allowed, q, k.shape[2])
    dq, dk, dv = _op("_scaled_dot_product_efficient_attention_backward")(
        dout,
        q,
        _repeat_kv(k, h),
        _repeat_kv(v, h),
        bias,
        out,
        lse_padded,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )[:3]
    return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


_OP_NAME = {
    "flash_attn": "flash_attn",
    "sdpa_flash": "_scaled_dot_product_flash_attention",
    "sdpa_efficient": "_scaled_dot_product_efficient_attention",
}


# ---------------------------------------------------------------------- entry points (lse_attention's API)


def _empty_rows(out, lse, allowed):
    # Rows that see no key: out 0, lse -inf (what the portable path gives), whatever the kernel wrote.
    if allowed is None:
        return out, lse
    empty = ~allowed.to(out.device).any(-1)
    if bool(empty.any()):
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def attend(q, k, v, *, causal: bool, scale: float, allowed: Optional[torch.Tensor] = None):
    """As :func:`lse_attention.attend`: ``(out [B, H, Lq, D] q.dtype, lse [B, H, Lq] acc_dtype)``."""
    masked = allowed is not None
    got = _run(
        "forward",
        q,
        k,
        causal,
        masked,
        {
            "flash_attn": lambda: _fa_forward(q, k, v, causal, scale),
            "sdpa_flash": lambda: _sdpa_flash_forward(q, k, v, allowed, causal, scale),
            "sdpa_efficient": lambda: _sdpa_eff_forward(q, k, v, allowed, causal, scale),
        },
    )
    if got is None:
        return lse_attention.attend(q, k, v, causal=causal, scale=scale, allowed=allowed)
    out, lse = _empty_rows(got[0].to(q.dtype), got[1].to(acc_dtype(q.dtype)), allowed)
    return out, lse


def attend_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, allowed: Optional[torch.Tensor] = None):
    """As :func:`lse_attention.attend_backward`: one piece's ``(dq, dk, dv)`` from the merged out/lse (the
    portable path's in the accumulation dtype: the composite sums pieces and rounds once)."""
    masked = allowed is not None
    dc, qc, kc, vc, oc = (t.contiguous() for t in (dout, q, k, v, out))
    got = _run(
        "backward",
        q,
        k,
        causal,
        masked,
        {
            "flash_attn": lambda: _fa_backward(dc, qc, kc, vc, oc, lse, causal, scale),
            "sdpa_flash": lambda: _sdpa_flash_backward(dc, qc, kc, vc, oc, lse, allowed, causal, scale),
            "sdpa_efficient": lambda: _sdpa_eff_backward(dc, qc, kc, vc, oc, lse, allowed, causal, scale),
        },
    )
    if got is None:  # the portable path; fp32 gradients for 16-bit inputs (the composite sums pieces)
        return lse_attention.attend_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, allowed=allowed, acc_grads=True
        )
    return tuple(g.to(t.dtype) for g, t in zip(got, (q, k, v)))

"""The argument checks of ``window_attention`` (op.py) and of the entry points that share them (context
parallelism): ValueError naming the argument."""

from __future__ import annotations

from ...layouts import QueryRowsLayout, WindowLayout
from ..common.validation import ATTENTION_DTYPES, check_scale, check_tensor
from .backends import REGISTRY

SUPPORTED_DTYPES = ATTENTION_DTYPES


def validate(q, k, v, layout, scale, backend) -> None:
    """The checks of a ``window_attention`` call: ``layout`` a WindowLayout or QueryRowsLayout, q ``[B, H, Lq, D]``
    and k, v ``[B, Hkv, Lk, D]`` as :func:`check_qkv` asks with ``Lq == layout.n_queries`` and
    ``Lk == layout.n_keys``, the layout's batch (:func:`check_layout_batch`), ``scale`` and ``backend`` (a known
    name or None). ValueError naming the argument."""
    if not isinstance(layout, (WindowLayout, QueryRowsLayout)):
        raise ValueError(f"layout: expected a WindowLayout or QueryRowsLayout, got {type(layout).__name__}")
    check_qkv(q, k, v)
    if q.shape[2] != layout.n_queries:
        raise ValueError(f"q: expected length {layout.n_queries} (layout.n_queries), got {q.shape[2]}")
    if k.shape[2] != layout.n_keys:
        raise ValueError(f"k: expected length {layout.n_keys} (layout.n_keys), got {k.shape[2]}")
    check_layout_batch(layout, q.shape[0])
    check_scale(scale)
    REGISTRY.check_name(backend)


def check_qkv(q, k, v) -> None:
    """What every entry point of the op asks of q ``[B, H, Lq, D]`` and k, v ``[B, Hkv, Lk, D]`` whatever their
    lengths mean (``window_attention``: the layout's; context parallelism: a rank's rows and keys): tensors of rank 4,
    a supported dtype and one device, k and v alike, one batch and head dim, ``H % Hkv == 0`` (GQA). ValueError
    naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, rank=4, dtypes=SUPPORTED_DTYPES, shape=" [B, H, L, D]")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected dtype {q.dtype} (q's), got k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k, v: expected device {q.device} (q's), got k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"k: expected batch {b} (q's), got {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"k: expected head dim {d} (q's), got {k.shape[3]}")
    if d == 0:
        raise ValueError(f"q: expected head dim >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] == 0 and h != 0:
        raise ValueError(f"k: expected at least one kv head for {h} query heads, got shape {tuple(k.shape)}")
    if k.shape[1] and h % k.shape[1] != 0:
        raise ValueError(f"q: expected a head count that is a multiple of k's {k.shape[1]} (GQA), got {h}")


def check_layout_batch(layout, batch: int) -> None:
    """A layout with per-batch ranges (``layout.batch_size`` set) fits only a batch of that size."""
    if layout.batch_size is not None and layout.batch_size != batch:
        raise ValueError(
            f"layout: expected per-batch ranges for batch {batch}, got {layout.batch_size} (per-batch "
            "cu_seqlens, ranges or live_slots give one row per batch element; 1-D ones are shared)"
        )

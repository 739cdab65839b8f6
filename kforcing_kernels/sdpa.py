"""Drop-in entry points with ``torch.nn.functional.scaled_dot_product_attention``'s calling convention.

Three ways in, from explicit to automatic:

* ``scaled_dot_product_attention(q, k, v, layout=layout)``: SDPA's signature plus a
  ``layout=``; the layout is the mask and the call runs :func:`window_attention`.
* ``scaled_dot_product_attention(q, k, v, attn_mask=dense, layout="auto")``: the
  boolean mask is compared with the dense masks of the known layouts (K-Forcing
  Single/DoubleForward, SBD, PTP, Jacobi, causal); an exact match routes to
  :func:`window_attention`, anything else runs SDPA with the mask unchanged.
* ``with route_dense_masks(): legacy_code()``: existing code that calls
  ``F.scaled_dot_product_attention`` with a dense boolean mask is intercepted (a
  ``TorchFunctionMode``, so it also catches ``from torch.nn.functional import
  scaled_dot_product_attention``) and routed the same way.

Detection is a verification, never a guess: structural probes only *propose*
candidate layouts (from the mask's shape, its row counts and a few rows), and a
candidate is accepted only if its ``dense_mask()`` equals the given mask in every
element (after broadcasting over batch and heads). A mask that differs in one
element falls back to SDPA. Each distinct mask tensor is verified once: the
verdict is remembered per tensor object together with a copy of the content it
was given for, and reused only while the mask still equals that copy (one
``torch.equal``, far cheaper than matching), so a mask shared by all layers of a
model costs one match. The content is compared rather than trusting the version
counter, which in-place edits through ``.data``, numpy views or other aliases
do not bump.
Detection reads mask values, so it runs in eager mode only; under torch.compile
these entry points call SDPA unless an explicit ``layout`` is given.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .layouts import WindowLayout
from .ops.window_attention import SUPPORTED_DTYPES, window_attention

__all__ = ["scaled_dot_product_attention", "match_layout", "route_dense_masks"]

# Per-router memory of verified masks; one entry per distinct mask tensor seen recently. Each entry
# keeps a copy of the verified content (one byte per element), bounded in total.
_MATCH_CACHE_SIZE = 16
_MATCH_CACHE_MAX_ELEMENTS = 1 << 26


def scaled_dot_product_attention(
    query: torch.Tensor,  # [B, H, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    attn_mask: Optional[torch.Tensor] = None,  # bool/float, broadcastable to [B, H, Lq, Lk]
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    layout: Union[WindowLayout, str, None] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """SDPA with a prefix-window ``layout``; returns ``[B, H, Lq, D]`` like SDPA.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as in
            ``torch.nn.functional.scaled_dot_product_attention``.
        layout: a :class:`WindowLayout` (then ``attn_mask`` must be None, ``is_causal``
            False and ``dropout_p`` 0: the layout is the whole mask); ``"auto"`` to route
            a boolean ``attn_mask`` that exactly equals a known layout's dense mask and
            run plain SDPA otherwise; or None for plain SDPA.
        backend: ``window_attention`` backend for routed calls (None: fastest available).
    """
    if isinstance(layout, WindowLayout):
        if attn_mask is not None:
            raise ValueError("attn_mask: expected None when layout is given (the layout is the mask), got a tensor")
        if is_causal:
            raise ValueError("is_causal: expected False when layout is given (the layout is the mask), got True")
        if dropout_p != 0.0:
            raise ValueError(f"dropout_p: window_attention has no attention dropout, expected 0.0, got {dropout_p}")
        if query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
            raise ValueError(
                f"enable_gqa: expected True for {query.shape[1]} query heads and {key.shape[1]} key/value heads "
                "(as SDPA requires), got False"
            )
        return window_attention(query, key, value, layout, scale=scale, backend=backend)
    if layout == "auto":
        routed = _DEFAULT_ROUTER.try_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if routed is not None:
            return routed
    elif layout is not None:
        raise ValueError(f"layout: expected a WindowLayout, 'auto' or None, got {layout!r}")
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


# ---------------------------------------------------------------------- exact matching


def match_layout(
    attn_mask: torch.Tensor,  # bool [Lq, Lk], [H|1, Lq, Lk] or [B|1, H|1, Lq, Lk] (SDPA's broadcasting)
    candidates: Optional[Iterable[WindowLayout]] = None,
) -> Optional[WindowLayout]:
    """The layout whose ``dense_mask()`` equals ``attn_mask`` exactly, or None.

    ``candidates`` are tried in order (only those whose sizes fit the mask); by
    default they are proposed from the mask itself for the known families
    (causal, K-Forcing Single/DoubleForward, SBD, Jacobi, PTP with shared ranges).
    A mask that varies over batch or heads matches only a layout with the same
    per-batch ranges (and no head variation). True means "attends", as in SDPA.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or not 2 <= attn_mask.dim() <= 4:
        return None
    mask = _collapse_broadcast_dims(attn_mask.reshape((1,) * (4 - attn_mask.dim()) + attn_mask.shape))
    lq, lk = mask.shape[-2:]
    if lq == 0 or lk == 0:
        return None
    if candidates is None:
        candidates = _propose_layouts(mask[0, 0])
    row_counts = None
    for layout in candidates:
        if layout.n_queries != lq or layout.n_keys != lk:
            continue
        if row_counts is None:
            row_counts = mask.sum(-1)  # cheap O(L) filter before the element-wise comparison
        if _row_counts_match(row_counts, layout) and _masks_equal(mask, layout):
            return layout
    return None


def _collapse_broadcast_dims(mask: torch.Tensor) -> torch.Tensor:
    """[B, H, Lq, Lk] -> same, with expanded (stride-0) batch/head dims cut to one slice: they carry no information."""
    for d in range(2):
        if mask.shape[d] > 1 and mask.stride(d) == 0:
            mask = mask.narrow(d, 0, 1)
    return mask


def _row_counts_match(row_counts: torch.Tensor, layout: WindowLayout) -> bool:
    """row_counts: [B|1, H|1, Lq] of the mask; compared with the layout's [B'|1, 1, Lq]."""
    iv = layout.row_intervals()  # [B', Lq, J, 2]
    counts = (iv[..., 1] - iv[..., 0]).sum(-1)[:, None].to(row_counts.device)
    try:
        torch.broadcast_shapes(row_counts.shape, counts.shape)
    except RuntimeError:  # batch sizes differ
        return False
    return bool((row_counts == counts).all())


def _masks_equal(mask: torch.Tensor, layout: WindowLayout) -> bool:
    """mask: [B|1, H|1, Lq, Lk]; equal to the layout's dense mask for every batch element and head."""
    lm = layout.dense_mask().to(mask.device)
    lm = lm[:, None] if lm.dim() == 3 else lm[None, None]  # [B'|1, 1, Lq, Lk]
    try:
        torch.broadcast_shapes(mask.shape, lm.shape)
    except RuntimeError:
        return False
    return bool((mask == lm).all())


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _propose_layouts(mask: torch.Tensor) -> list[WindowLayout]:
    """Candidate layouts for one [Lq, Lk] mask: parameters read off its shape and a few rows.

    Only proposals; :func:`match_layout` accepts one after an exact comparison.
    """
    lq, lk = mask.shape
    out: list[WindowLayout] = []
    if lq == lk:
        n = lq
        out.append(WindowLayout.causal(n))
        for group in _divisors(n):  # K-Forcing SingleForward: n = N * (1 + k), one group per context token
            if group >= 2:
                out.append(WindowLayout.kforcing_single(n // group, group - 1))
        if n % 2 == 0:  # SBD over [clean (L) | masked (L)]: block 0 sees only itself
            half = n // 2
            block = int(mask[half].sum())
            if 1 <= block <= half:
                out.append(WindowLayout.sbd(half, block))
        noisy = n - int(mask[n - 1].sum())  # Jacobi: the last noisy row sees P + T keys of P + 2T
        if 1 <= noisy and n - 2 * noisy >= 1:
            out.append(WindowLayout.jacobi(n - 2 * noisy, noisy))
    elif lq < lk:
        ctx = lk - lq
        if lq % (2 * ctx) == 0:  # DoubleForward: 2Nk window queries after N cached keys
            out.append(WindowLayout.kforcing_double(ctx, lq // (2 * ctx)))
        ptp = _propose_ptp(mask, ctx)
        if ptp is not None:
            out.append(ptp)
    return out


def _propose_ptp(mask: torch.Tensor, ctx: int) -> Optional[WindowLayout]:
    """PTP: equal causal completions after ``ctx`` cached keys, each seeing one context interval."""
    lq = mask.shape[0]
    own = mask[:, ctx:]  # [Lq, Lq]: block-diagonal lower triangles of size L
    breaks = torch.nonzero(~own.diagonal(-1)).flatten()  # a row that does not see its predecessor starts a completion
    length = int(breaks[0]) + 1 if breaks.numel() else lq
    if lq % length:
        return None
    first_rows = mask[::length, :ctx]  # [n, S]: the context each completion sees
    seen = first_rows.sum(-1)
    lo = torch.where(seen > 0, first_rows.to(torch.int8).argmax(-1), torch.zeros_like(seen))
    hi = lo + seen
    if bool((hi > ctx).any()):
        return None
    return WindowLayout.ptp(ctx, hi.cpu(), length, lo.cpu()) if ctx > 0 else None


# ---------------------------------------------------------------------- routing


def _content_view(mask: torch.Tensor) -> torch.Tensor:
    """The mask without its broadcast (stride-0) dims: exactly the elements that carry information."""
    return _collapse_broadcast_dims(mask.reshape((1,) * (4 - mask.dim()) + mask.shape) if mask.dim() < 4 else mask)


def _same_content(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def _cached_elements(seen: "OrderedDict[int, tuple]") -> int:
    return sum(entry[1].numel() for entry in seen.values())


class _Router:
    """Decides whether one SDPA call can run on ``window_attention``, remembering verified masks."""

    def __init__(self, candidates: Optional[Sequence[WindowLayout]] = None, backend: Optional[str] = None):
        if candidates is not None:
            candidates = tuple(candidates)
            for i, c in enumerate(candidates):
                if not isinstance(c, WindowLayout):
                    raise ValueError(f"candidates: expected WindowLayouts, item {i} is a {type(c).__name__}")
        self.candidates = candidates
        self.backend = backend
        self._seen: OrderedDict[int, tuple] = OrderedDict()  # id(mask) -> (weakref, verified content, layout or None)

    def _match(self, mask: torch.Tensor) -> Optional[WindowLayout]:
        # A remembered verdict is reused only if the mask's content is still exactly what was
        # verified: in-place edits through .data, a numpy view or another alias do not bump the
        # version counter, so identity + version alone could hand back a stale match.
        content = _content_view(mask)
        entry = self._seen.get(id(mask))
        if entry is not None and entry[0]() is mask and _same_content(content, entry[1]):
            self._seen.move_to_end(id(mask))
            return entry[2]
        layout = match_layout(mask, self.candidates)
        if content.numel() <= _MATCH_CACHE_MAX_ELEMENTS:
            self._seen[id(mask)] = (weakref.ref(mask), content.clone(), layout)
            self._seen.move_to_end(id(mask))
        while len(self._seen) > _MATCH_CACHE_SIZE or _cached_elements(self._seen) > _MATCH_CACHE_MAX_ELEMENTS:
            self._seen.popitem(last=False)
        return layout

    def try_route(
        self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    ) -> Optional[torch.Tensor]:
        """``window_attention``'s output if this call is exactly a known layout, else None (caller runs SDPA)."""
        if torch.compiler.is_compiling() or dropout_p != 0.0 or is_causal:
            return None
        if not all(type(t) is torch.Tensor for t in (query, key, value, attn_mask)):
            return None
        if attn_mask.dtype != torch.bool or query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
            return None
        if query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
            return None
        if key.device != query.device or value.device != query.device or attn_mask.device != query.device:
            return None
        b, h, _, d = query.shape
        if key.shape[0] != b or key.shape[3] != d or h % key.shape[1] or (h != key.shape[1] and not enable_gqa):
            return None
        if scale is not None and not (scale > 0 and scale < math.inf):  # comparisons: a SymFloat has no isfinite
            return None
        full = (b, h, query.shape[2], key.shape[2])
        try:
            if torch.broadcast_shapes(attn_mask.shape, full) != full:
                return None
        except RuntimeError:  # SDPA reports the bad mask shape itself
            return None
        layout = self._match(attn_mask)
        if layout is None or (layout.batch_size is not None and layout.batch_size != b):
            return None
        return window_attention(query, key, value, layout, scale=scale, backend=self.backend)


_DEFAULT_ROUTER = _Router()


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class route_dense_masks(TorchFunctionMode):
    """Context manager: route ``F.scaled_dot_product_attention`` calls whose boolean mask is a known layout.

        with route_dense_masks() as router:
            model(x)                       # any code that calls SDPA with a dense bool mask
        router.routed, router.passed_through

    Args:
        candidates: layouts to recognise (tried in order); default: the known
            families, with parameters proposed from each mask.
        backend: ``window_attention`` backend for routed calls.

    A call is routed only when its mask equals a candidate's ``dense_mask()``
    exactly, ``dropout_p == 0``, ``is_causal`` is False and the tensors are plain
    4-D tensors on one device; every other call runs SDPA untouched. Every torch
    call inside the context passes through this mode (one Python call each), so
    wrap the model call rather than a whole loop with data loading.
    """

    def __init__(self, candidates: Optional[Iterable[WindowLayout]] = None, *, backend: Optional[str] = None):
        super().__init__()
        self._router = _Router(None if candidates is None else tuple(candidates), backend)
        self.routed = 0
        self.passed_through = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = self._router.try_route(*_sdpa_arguments(*args, **kwargs))
            if out is not None:
                self.routed += 1
                return out
            self.passed_through += 1
        return func(*args, **kwargs)

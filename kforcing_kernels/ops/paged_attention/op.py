"""``paged_attention``: one decode step's attention over a paged KV cache.

Layout of the cache: the vLLM / FlashInfer "NHD" paged layout. K and V each live
in a pool of fixed-size pages ``[num_pages, page_size, Hkv, D]``; request b's
context token t sits in page ``block_table[b, t // page_size]`` at slot
``t % page_size``. Only the first ``ceil(context_lens[b] / page_size)`` entries of
a block-table row are read; the rest may hold anything (e.g. -1 padding).

Semantics: exactly ``window_attention`` with ``WindowLayout(L_max, 1, W, 0, lens[:, None],
intra="causal", queries="windows")`` over keys ``[gathered cache | window]``: window
row i of request b sees the cached context ``[0, len_b)`` and window slots ``0..i``.
"""

from __future__ import annotations

import functools
import math
from numbers import Integral
from typing import Optional, Sequence, Union

import torch

from ..common.registry import BackendSpec, OpRegistry
from ..common.validation import ATTENTION_DTYPES, check_scale, check_tensor

SUPPORTED_DTYPES = ATTENTION_DTYPES

_HERE = "kforcing_kernels.ops.paged_attention"
REGISTRY = OpRegistry(
    "paged_attention",
    (
        BackendSpec("reference", f"{_HERE}.reference", ("*",), "gather the pages, dense masked attention: the oracle"),
        BackendSpec("composite", f"{_HERE}.composite", ("*",), "torch ops over chunks of pages, online-softmax merge"),
        BackendSpec("cpp", f"{_HERE}.cpp", ("cpu",), "the C++ CPU kernel (csrc/paged_attention.cpp)"),
        BackendSpec("triton", f"{_HERE}.triton", ("cuda",), "the Triton kernel (CPU tensors only in the interpreter)"),
    ),
    preference={"cpu": ("cpp",), "cuda": ("triton",)},
    fallback="composite",
)
PAGED_BACKENDS = REGISTRY.names


def paged_backends_available() -> dict[str, Optional[str]]:
    """``{backend: None if usable here, else the reason it is absent}``."""
    return REGISTRY.available()


def default_paged_backend(device: torch.device) -> str:
    """cpp on CPU when built, triton on CUDA when importable, else composite."""
    return REGISTRY.default(device)


def paged_attention(
    q: torch.Tensor,  # [B, H, W, D]
    k_new: torch.Tensor,  # [B, Hkv, W, D]
    v_new: torch.Tensor,  # [B, Hkv, W, D]
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_pages: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_table: torch.Tensor,  # int32 [B, max_pages]
    context_lens: Union[torch.Tensor, Sequence[int]],  # int [B]
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    check_table: bool = True,
) -> torch.Tensor:
    """Attention of a new window over each request's paged context cache and the window itself.

    Args:
        q: the window's queries ``[B, H, W, D]`` (W = 2k for a K-Forcing decode step:
            the k tokens just produced + k noise tokens; 1 for AR).
        k_new, v_new: the window's own keys/values ``[B, Hkv, W, D]``, ``H % Hkv == 0`` (GQA).
        k_pages, v_pages: the paged context cache ``[num_pages, page_size, Hkv, D]``
            (the vLLM / FlashInfer layout), read in place.
        block_table: int32 (or int64) ``[B, max_pages]``: request b's i-th page of context.
        context_lens: ``[B]`` cached context length of each request (``0 <= len_b <= max_pages * page_size``).
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: ``"reference"``, ``"composite"``, ``"cpp"``, ``"triton"`` or None (cpp on CPU when
            built, triton on CUDA, else composite).
        check_table: scan the block table and lengths (a host sync, O(B * max_pages)); a caller that
            built them itself (``PagedKVCache``) may skip it on every layer after the first. Shapes,
            dtypes and devices are always checked, and the cpp kernel checks the entries it reads.

    Returns:
        ``[B, H, W, D]`` in q's dtype: row i of request b attends to context ``[0, len_b)``
        and window slots ``0..i``. Dtypes fp32/bf16/fp16/fp64; math in fp32 (fp64 for fp64).
    """
    lens = _validate(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale, backend, check_table)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.numel() == 0:
        return torch.empty_like(q)
    module = REGISTRY.get(backend or default_paged_backend(q.device))
    return module.forward(q, k_new, v_new, k_pages, v_pages, block_table, lens, scale)


# ---------------------------------------------------------------------- the decode step's call (no checks)


def paged_attention_unchecked(
    q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale: float, backend: str
) -> torch.Tensor:
    """:func:`paged_attention` for a static decode step: no value check, no host sync, no copy of the lengths.

    The caller guarantees what :func:`paged_attention` would check: shapes and dtypes as documented there,
    ``block_table`` (int32) and ``context_lens`` (int64 ``[B]``) on q's device, every read table entry inside
    the pool (a :class:`~kforcing_kernels.app.generation.paged_cache.PagedKVCache` builds its tables so, and
    the cpp kernel still checks the entries it reads), ``backend`` a resolved name (:func:`default_paged_backend`).
    The composite backend then reads every column of the table (masked past each length) instead of
    ``ceil(max(len) / page_size)`` of them, which would need the lengths on the host: the same bits, as the
    masked chunks add exact zeros. Eager calls run the backend directly; under ``torch.compile`` the call is
    the custom op ``kforcing_kernels::paged_attention`` (opaque to the graph, fullgraph-safe).
    """
    if torch.compiler.is_compiling():
        return torch.ops.kforcing_kernels.paged_attention(
            q, k_new, v_new, k_pages, v_pages, block_table, context_lens, float(scale), backend
        )
    return _unchecked_forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale, backend)


def _unchecked_forward(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale, backend):
    fn = _UNCHECKED.get(backend)
    if fn is None:
        fn = _UNCHECKED[backend] = _resolve_unchecked(backend)
    return fn(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale)


_UNCHECKED: dict = {}  # backend name -> its forward, resolved once (a registry lookup is an import per call)


def _resolve_unchecked(backend: str):
    module = REGISTRY.get(backend)
    if backend == "composite":
        return functools.partial(module.forward, static=True)
    if backend == "cpp":  # the kernel itself: pools, table and lengths come contiguous from the static step
        kernel = module._extension.load().paged_attention_forward

        def cpp(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale):
            return kernel(
                q.contiguous(),
                k_new.contiguous(),
                v_new.contiguous(),
                k_pages.contiguous(),
                v_pages.contiguous(),
                block_table.contiguous(),
                context_lens.contiguous(),
                scale,
            )

        return cpp
    return module.forward


@torch.library.custom_op("kforcing_kernels::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str,
) -> torch.Tensor:
    return _unchecked_forward(
        q.contiguous(),
        k_new.contiguous(),
        v_new.contiguous(),
        k_pages,
        v_pages,
        block_table,
        context_lens,
        scale,
        backend,
    ).contiguous()


@_paged_attention_op.register_fake
def _(q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale, backend):
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------- validation


def _validate(
    q, k_new, v_new, k_pages, v_pages, block_table, context_lens, scale, backend, check_table=True
) -> torch.Tensor:
    """Checks every argument; returns context_lens as int64 [B] on CPU."""
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_pages", k_pages), ("v_pages", v_pages)):
        check_tensor(name, t, rank=4, dtypes=SUPPORTED_DTYPES)
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (q's), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
    b, h, w, d = q.shape
    if k_new.shape[0] != b or k_new.shape[2] != w or k_new.shape[3] != d:
        raise ValueError(f"k_new: expected [B={b}, Hkv, W={w}, D={d}] (q's B, W, D), got {tuple(k_new.shape)}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new: expected the shape of k_new {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    hkv = k_new.shape[1]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q: expected a head count that is a multiple of k_new's {hkv} (GQA), got {h}")
    if k_pages.shape[2:] != (hkv, d):
        raise ValueError(f"k_pages: expected [num_pages, page_size, Hkv={hkv}, D={d}], got {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: expected the shape of k_pages {tuple(k_pages.shape)}, got {tuple(v_pages.shape)}")
    num_pages, page_size = k_pages.shape[:2]
    if page_size < 1:
        raise ValueError(f"k_pages: expected page_size >= 1, got shape {tuple(k_pages.shape)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table: expected an int32 (or int64) tensor, "
            f"got {getattr(block_table, 'dtype', type(block_table).__name__)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table: expected shape [B={b}, max_pages], got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table: expected device {q.device} (q's), got {block_table.device}")
    lens = _as_lengths(context_lens, b)
    max_pages = block_table.shape[1]
    need = (lens + page_size - 1) // page_size  # pages each request reads
    if b and int(need.max()) > max_pages:
        i = int(torch.argmax(need))
        raise ValueError(
            f"context_lens: request {i} has length {int(lens[i])}, which needs {int(need[i])} pages of {page_size}, "
            f"but block_table has {max_pages} per request"
        )
    used = torch.arange(max_pages)[None] < need[:, None]  # [B, max_pages]
    if check_table and bool(used.any()):
        ids = block_table.cpu().long()
        bad = used & ((ids < 0) | (ids >= num_pages))
        if bool(bad.any()):
            i, j = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(
                f"block_table: request {i} page {j} is {int(ids[i, j])}, outside the pool of {num_pages} pages"
            )
    check_scale(scale)
    REGISTRY.check_name(backend)
    return lens


def _as_lengths(context_lens, b: int) -> torch.Tensor:
    if isinstance(context_lens, torch.Tensor):
        if context_lens.dtype.is_floating_point or context_lens.dtype == torch.bool or context_lens.is_complex():
            raise ValueError(f"context_lens: expected an integer tensor, got dtype {context_lens.dtype}")
        lens = context_lens.detach().to("cpu", torch.int64)
    else:
        items = list(context_lens)
        if any(isinstance(x, bool) or not isinstance(x, Integral) for x in items):
            raise ValueError(f"context_lens: expected integers, got {items!r}")
        lens = torch.tensor([int(x) for x in items], dtype=torch.int64)
    if lens.shape != (b,):
        raise ValueError(f"context_lens: expected shape [B={b}], got {tuple(lens.shape)}")
    if b and int(lens.min()) < 0:
        raise ValueError(f"context_lens: expected lengths >= 0, got min {int(lens.min())}")
    return lens

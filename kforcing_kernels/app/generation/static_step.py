"""The static decode step (issue 50): one forward pass of a fixed batch with no host work inside it.

    step = StaticDecodeStep(model, k, k_pools, v_pools, page_size)      # once per (cache, k)
    state = step.state(lengths, block_table, temperature)                # once per batch (admission)
    tokens, logits = step(state, prev, z)                                # each step: device work only

Both caches are pools of pages ``[num_pages, page_size, H, D]`` per layer: the paged cache's own
(:class:`~kforcing_kernels.app.generation.paged_cache.PagedKVCache`), and the contiguous cache as one
page of ``capacity`` tokens per request (block table ``[[0], [1], ...]``). A step reads everything from
tensors made once per batch on the model's device (:class:`DecodeState`: lengths, block table,
temperatures, the per-layer :class:`~kforcing_kernels.model.PagedPast` views), so it makes no host sync
(no ``.item()`` / ``.tolist()`` / ``bool(tensor)``), no host-to-device copy and no layout or kernel plan:

* positions: ``lengths[:, None] + arange(window)`` on the device;
* attention: :func:`~kforcing_kernels.ops.paged_attention.op.paged_attention_unchecked` over the pages, the
  window's own keys causal (the table and lengths were made by the cache, so nothing is re-checked);
* the window's context K/V (the k tokens just produced; the one token for AR) are written into their
  slots (``table[b, pos // page] * page + pos % page``, computed on the device), then the lengths advance
  by that count in place;
* tokens: K-Forcing's slot rule (:func:`~kforcing_kernels.model.decoding.decode_slots`), AR's inverse-CDF
  sample (argmax where tau is 0), through the unchecked sampler.

Eager, the blocks run without ``nn.Module`` calls (:func:`~kforcing_kernels.model.decode_paths.direct_block`, the same
bits; not when a module hook is registered) and, when the pools are views of one ``[layers, 2, ...]`` tensor
(both caches allocate so), every layer's K/V is written with one ``index_copy_``.

The same step runs eager, under ``torch.compile(fullgraph=True)`` (``compile_step=True``; mode
``"reduce-overhead"`` on CUDA, the default mode elsewhere) or captured in a ``torch.cuda.CUDAGraph``
and replayed (``compile_step="cudagraph"``, CUDA only). The host pays the Python of one step (eager),
or one graph call. Eager is the default everywhere: compiling costs seconds to minutes per batch shape,
which a short generation does not win back; on CUDA the serving benchmark decides (BENCHMARKS.md, issue 50).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union, cast

import torch

from ...model import KForcingLM
from ...model.decode_paths import PagedPast
from ...model.decoding import decode_rule, decode_slots
from ...ops.paged_attention.op import default_paged_backend
from ...ops.sampling import sampler_backend
from ...ops.sampling.op import inverse_cdf_sample_unchecked
from .paged_cache import paged_backend

if TYPE_CHECKING:
    from ...model.gpt import Block

COMPILE_MODES = (False, True, "cudagraph")
# torch.compile's backend for compile_step=True (None: inductor); tests set a counting backend.
COMPILE_BACKEND = None


def check_compile_step(compile_step, device: torch.device) -> Union[bool, str]:
    """``compile_step``: False (eager), True (``torch.compile``, fullgraph) or ``"cudagraph"`` (CUDA only)."""
    if isinstance(compile_step, bool) or compile_step == "cudagraph":
        if compile_step == "cudagraph" and device.type != "cuda":
            raise ValueError(f"compile_step: 'cudagraph' needs a CUDA model, got device {device}")
        return compile_step
    raise ValueError(f"compile_step: expected False, True or 'cudagraph', got {compile_step!r}")


class DecodeState:
    """The per-batch tensors of a static decode step, made once when the batch is formed.

    Attributes:
        lens: int64 ``[B]`` on the device: each row's context length, advanced in place by every step.
        table: int32 ``[B, max_pages]`` on the device: each row's pages (entries past a row's pages unread).
        tau: K-Forcing: fp32 ``[B]`` (the noise encoder's); AR: fp64 ``[B]`` sampler temperatures (1 where greedy).
        greedy: AR: bool ``[B]`` (tau == 0) on the device, or None.
        mode: AR: ``"sample"``, ``"greedy"`` or ``"mixed"`` (known on the host at admission); K-Forcing: None.
        views: per layer, the :class:`PagedPast` the attention reads (no checks: ``checked=False``).
    """

    def __init__(self, lens, table, tau, greedy, mode, views):
        self.lens, self.table, self.tau, self.greedy, self.mode, self.views = lens, table, tau, greedy, mode, views
        self.graph = None  # "cudagraph": (graph, static prev, static z, static outputs) once captured
        self.calls = 0


class StaticDecodeStep:
    """One decode pass for a fixed batch over fixed-capacity K/V pools (see the module docstring).

    Args:
        model: the model (eval mode).
        k: tokens per pass for K-Forcing (window ``[k tokens | k noise]``), None for AR (window: one token).
        k_pools, v_pools: per layer, the pools ``[num_pages, page_size, H, D]`` (written in place).
        page_size: tokens per page (the contiguous cache: its capacity).
        compile_step: False (eager), True (``torch.compile``, fullgraph) or ``"cudagraph"`` (CUDA only).
        kv: optional, the one tensor ``[layers, 2, num_pages, page_size, H, D]`` whose ``[l, 0]`` / ``[l, 1]`` are
            the pools (both caches allocate so): each step then writes every layer's K/V in one ``index_copy_``.
    """

    def __init__(
        self,
        model: KForcingLM,
        k: Optional[int],
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        page_size: int,
        *,
        compile_step: Union[bool, str] = False,
        kv: Optional[torch.Tensor] = None,
    ):
        self.model, self.k = model, k
        self.device = model.wte.weight.device
        self.compile_step = check_compile_step(compile_step, self.device)
        self.count = 1 if k is None else k  # context tokens appended per pass
        self.width = 1 if k is None else 2 * k  # the window's tokens
        self.k_pools, self.v_pools, self.page_size = list(k_pools), list(v_pools), page_size
        if kv is not None and not all(
            kv[i, 0].data_ptr() == kp.data_ptr() and kv[i, 1].data_ptr() == vp.data_ptr()
            for i, (kp, vp) in enumerate(zip(self.k_pools, self.v_pools))
        ):
            raise ValueError("kv: expected the tensor whose [layer, 0] / [layer, 1] are k_pools / v_pools")
        self.kv = kv
        self.heads, self.head_dim = k_pools[0].shape[2], k_pools[0].shape[3]
        self.rule = decode_rule(model)
        self.attention = paged_backend(model) or default_paged_backend(self.device)
        self.sampler = sampler_backend(self.device)
        self.offsets = torch.arange(self.width, device=self.device)
        # The blocks' math without module calls (decode_paths.direct_block, same bits) unless a hook must fire.
        # ModuleList iterates as nn.Module: KForcingLM's blocks are Blocks (model/gpt.py).
        blocks = cast("list[Block]", list(model.blocks))
        self.direct = None if _has_hooks(model.blocks) else [block.direct_weights() for block in blocks]
        self.compile_seconds = 0.0  # time spent in the first (compiling / capturing) calls
        if self.compile_step is True:
            for pool in self.k_pools + self.v_pools + ([kv] if kv is not None else []):  # written in place every
                torch._dynamo.mark_static_address(pool, guard=False)  # step: static addresses for the graphs

    # -------------------------------------------------------------- per batch

    def state(self, lengths: torch.Tensor, block_table: torch.Tensor, temperature) -> DecodeState:
        """The batch's device tensors: lengths int ``[B]``, block table ``[B, max_pages]`` (any device: copied
        once here) and the temperatures ``[B]`` (host floats or a tensor; AR: 0 is greedy)."""
        dev = self.device
        lens = lengths.to(device=dev, dtype=torch.int64).clone()
        # int64 for the cpp kernel (it would convert an int32 table on every call), int32 for triton
        table = block_table.to(device=dev, dtype=torch.int64 if self.attention == "cpp" else torch.int32).contiguous()
        taus = torch.as_tensor(temperature, dtype=torch.float64).cpu()
        greedy, mode = None, None
        if self.k is None:
            taus = taus.reshape(-1).expand(lens.shape[0])
            hot = taus > 0
            mode = "sample" if bool(hot.all()) else "greedy" if not bool(hot.any()) else "mixed"
            greedy = (~hot).to(dev)
            tau = torch.where(hot, taus, torch.ones_like(taus)).to(dev)
        else:  # a scalar stays a scalar: the noise encoder runs its tau MLP on tau's own shape
            tau = taus.to(device=dev, dtype=torch.float32)
        if self.compile_step is True:
            for t in (lens, table):
                torch._dynamo.mark_static_address(t, guard=False)
        views = [
            PagedPast(
                kp,
                vp,
                table,
                lens,
                backend=self.attention,
                check_table=False,
                checked=False,
                direct=None if self.direct is None else self.direct[layer],
            )
            for layer, (kp, vp) in enumerate(zip(self.k_pools, self.v_pools))
        ]
        return DecodeState(lens, table, tau, greedy, mode, views)

    # -------------------------------------------------------------- the step

    def __call__(self, state: DecodeState, prev: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: prev int64 ``[B, count]`` (the tokens just produced), z the pass's noise (K-Forcing
        ``[B, k]``, AR ``[B]``) -> (tokens int64 ``[B, count]``, logits ``[B, count, V]``).

        Captured or compiled steps return the graph's own output buffers: copy what you keep before the next call.
        """
        if self.compile_step == "cudagraph":
            return self._replay(state, prev, z)
        if self.compile_step is True:
            start = time.perf_counter()
            out = _compiled(self.device)(
                self.model,
                self.spec(state.mode),
                prev,
                z,
                state.lens,
                state.table,
                state.tau,
                state.greedy,
                self.offsets,
                self.k_pools,
                self.v_pools,
                self.kv,
            )
            if state.calls == 0:  # compiles (or finds the graph compiled for an earlier batch of this shape)
                self.compile_seconds += time.perf_counter() - start
            state.calls += 1
            return out
        state.calls += 1
        return self._body(prev, z, state.lens, state.table, state.tau, state.greedy, state.mode, state.views)

    def spec(self, mode: Optional[str]) -> "_Spec":
        """The step's constants (what a compiled step specialises on)."""
        return _Spec(
            self.k,
            self.count,
            self.page_size,
            self.heads,
            self.head_dim,
            self.rule,
            self.attention,
            self.sampler,
            mode,
            self.direct is not None,
        )

    def _body(self, prev, z, lens, table, tau, greedy, mode, views):
        return _step_body(
            self.model,
            self.spec(mode),
            prev,
            z,
            lens,
            table,
            tau,
            greedy,
            self.offsets,
            self.k_pools,
            self.v_pools,
            self.kv,
            views,
        )

    # -------------------------------------------------------------- CUDA graph

    def _replay(self, state: DecodeState, prev: torch.Tensor, z: torch.Tensor):
        """First call of a state: eager (warms up Triton and cuBLAS; a real pass). Second: capture, then replay.
        Later: copy prev and z into the graph's inputs and replay (the lengths advance inside the graph)."""
        args = (state.lens, state.table, state.tau, state.greedy, state.mode, state.views)
        if state.calls == 0:
            state.calls += 1
            return self._body(prev, z, *args)
        if state.graph is None:
            start = time.perf_counter()
            torch.cuda.synchronize()
            static_prev, static_z = prev.clone(), z.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self._body(static_prev, static_z, *args)
            state.graph = (graph, static_prev, static_z, outputs)
            torch.cuda.synchronize()
            self.compile_seconds += time.perf_counter() - start
        graph, static_prev, static_z, outputs = state.graph
        static_prev.copy_(prev)
        static_z.copy_(z)
        graph.replay()
        state.calls += 1
        return outputs


class _Spec(NamedTuple):
    """The constants of a step (a compiled step specialises on them: one graph per spec and batch shape)."""

    k: Optional[int]
    count: int  # type: ignore[assignment]  # the field shadows tuple.count (never called on a _Spec)
    page_size: int
    heads: int
    head_dim: int
    rule: str
    attention: str
    sampler: str
    mode: Optional[str]
    direct: bool


def _step_body(model, spec: _Spec, prev, z, lens, table, tau, greedy, offsets, k_pools, v_pools, kv=None, views=None):
    """The step itself, module-level: one compiled function serves every step object and batch (see the class)."""
    k, count = spec.k, spec.count
    if views is None:  # compiled: the views are made inside the graph (plain tensors in, no guards on objects)
        direct = [block.direct_weights() for block in model.blocks] if spec.direct else [None] * len(k_pools)
        views = [
            PagedPast(kp, vp, table, lens, backend=spec.attention, check_table=False, checked=False, direct=d)
            for kp, vp, d in zip(k_pools, v_pools, direct)
        ]
    positions = lens[:, None] + offsets  # [B, W]
    if k is None:
        x = model.wte(prev)  # [B, 1, C]
    else:
        x = torch.cat([model.wte(prev), model.embed_noise(z, tau)], 1)  # [B, 2k, C]
    h, kvs = model.trunk(x, positions, None, past=views)
    # The window's first `count` K/V of each layer into their slots (context K/V only; the noise K/V are dropped).
    page = spec.page_size
    pos = lens[:, None] + offsets[:count]  # [B, count]
    slots = (table.gather(1, pos // page).to(torch.int64) * page + pos % page).reshape(-1)
    if kv is not None:  # all layers at once: [2L, B, H, W, D] -> [2L, B * count, H, D] into [2L, pages * slots, H, D]
        new = torch.stack([t for pair in kvs for t in pair])[:, :, :, :count].transpose(2, 3)
        kv.view(2 * len(kvs), -1, spec.heads, spec.head_dim).index_copy_(
            1, slots, new.reshape(2 * len(kvs), -1, spec.heads, spec.head_dim)
        )
    else:
        for pool_k, pool_v, (kk, vv) in zip(k_pools, v_pools, kvs):
            for pool, new in ((pool_k, kk), (pool_v, vv)):
                new = new[:, :, :count].transpose(1, 2).reshape(-1, spec.heads, spec.head_dim)  # [B * count, H, D]
                pool.view(-1, spec.heads, spec.head_dim).index_copy_(0, slots, new)
    lens.add_(count)
    if k is None:
        logits = model.head(h[:, 0])  # [B, V]
        if spec.mode == "greedy":
            tokens = logits.argmax(-1)
        else:
            tokens = inverse_cdf_sample_unchecked(logits, z, tau, spec.sampler)
            if spec.mode == "mixed":
                tokens = torch.where(greedy, logits.argmax(-1), tokens)
        return tokens[:, None], logits[:, None]
    logits = model.head(h[:, k:])  # [B, k, V]
    return decode_slots(logits, z, spec.rule, sampler=spec.sampler), logits


_COMPILED: dict = {}


def _compiled(device: torch.device):
    """``torch.compile(_step_body, fullgraph=True)``, made once per (device type, backend): mode
    ``"reduce-overhead"`` (CUDA graphs) on CUDA, the default mode elsewhere."""
    backend = "inductor" if COMPILE_BACKEND is None else COMPILE_BACKEND
    key = (device.type, backend if isinstance(backend, str) else id(backend))
    if key not in _COMPILED:
        mode = "reduce-overhead" if device.type == "cuda" else None
        _COMPILED[key] = torch.compile(_step_body, fullgraph=True, dynamic=False, mode=mode, backend=backend)
    return _COMPILED[key]


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward hook (FSDP's unsharding, a user's) would fire in ``module`` or any submodule."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())

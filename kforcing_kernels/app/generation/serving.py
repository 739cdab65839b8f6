"""Continuous batching at the API level: a step function over the current set of requests, on a paged KV cache.

    gen = PagedGenerator(model, k=4, num_pages=1024)         # k=None: AR
    reqs = [Request(prompt, max_new_tokens=64, eos_id=eos) for prompt in prompts]
    while any(not r.done for r in reqs):
        finished = gen.step(reqs)                            # new requests may be appended between steps
    reqs[0].tokens                                           # the generated ids

Each ``step`` advances every live request by one forward pass: requests that have
not started are prefilled (prompt + first noise window, written into pages), the
others decode one window over their pages, read in place. A request that reaches
``max_new_tokens`` or produces ``eos_id`` is finished and its pages go back to the
pool at once. Per request the computation is that of ``generate_kforcing`` /
``generate_ar`` (same noise, same tokens), whichever other requests share the step.

A request is dropped with ``gen.cancel(request)``: its pages go back to the pool at
once, it is marked ``done`` and ``cancelled`` (its tokens so far stay), and the
next step may admit a request that the full pool refused before. A request left
out of a step's list is paused, not dropped: it keeps its pages until it is listed
again, cancelled or finished. A running request that the caller marks ``done``
itself is released (cancelled) by the next ``step`` it is listed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ...layouts import WindowLayout
from ...model import KForcingLM
from ...model.decoding import decode_rule, decode_slots
from ...ops.sampling import inverse_cdf_sample
from ..student import Student, kind_of
from .checks import check_ar, check_k, check_noise, check_temperature
from .paged_cache import PagedKVCache, PagePoolFull
from .static_step import StaticDecodeStep, check_compile_step


def window_layout(n_ctx: int, lengths: torch.Tensor, window: int, queries: str) -> WindowLayout:
    """One window per request after ``n_ctx`` context keys; request b's window sees ``[0, lengths[b])``."""
    if bool((lengths == lengths[0]).all()):  # one shared range: the backends' cheaper unbatched path
        hi = lengths[:1]
    else:
        hi = lengths[:, None]
    return WindowLayout(n_ctx, 1, window, torch.zeros_like(hi), hi, intra="causal", queries=queries)


def prefill_kforcing(
    model: KForcingLM, tokens: torch.Tensor, lengths: torch.Tensor, noise: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, list]:
    """K-Forcing's first forward over ``[padded prompts (P_max) | k noise tokens]`` (both caches use it).

    tokens int64 ``[B, P_max]`` (right-padded), lengths ``[B]`` (CPU), noise ``[B, k]``, tau ``[B]`` fp32 ->
    (hidden ``[B, P_max + k, C]``, per-layer K/V). Request b's noise slot i sits at position ``P_b + i``
    and sees the request's own prompt only.
    """
    b, p_max = tokens.shape
    k = noise.shape[1]
    positions = torch.cat([torch.arange(p_max).expand(b, p_max), lengths[:, None] + torch.arange(k)], 1).to(
        tokens.device
    )
    x = torch.cat([model.wte(tokens), model.embed_noise(noise, tau)], 1)  # [B, P_max + k, C]
    return model.trunk(x, positions, window_layout(p_max, lengths, k, "all"))


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    Args:
        prompt: token ids (1-D), at least one.
        max_new_tokens: T >= 1.
        noise: K-Forcing ``[ceil(T / k), k]`` uniforms, AR ``[T]``; drawn from ``generator`` when None.
        temperature: tau (K-Forcing: > 0, fed to the noise encoder; AR: 0 is greedy).
        eos_id: finish as soon as this id is produced (it is kept as the last token).

    ``tokens`` (the generated ids so far) is read lazily: decode steps leave their tokens on the device
    (no sync per step, unless a request of the step has an ``eos_id``), and the first read after a step
    copies them (one sync).
    """

    prompt: Union[Sequence[int], torch.Tensor]
    max_new_tokens: int
    noise: Optional[torch.Tensor] = None
    temperature: float = 1.0
    eos_id: Optional[int] = None
    generator: Optional[torch.Generator] = None
    logits: list = field(default_factory=list)  # per step [n, V] when the generator keeps logits
    done: bool = False
    cancelled: bool = False  # dropped by PagedGenerator.cancel before it finished (done is True as well)
    row: Optional[int] = None  # cache row while running
    steps: int = 0
    _tokens: list = field(default_factory=list, init=False, repr=False)
    _pending: Optional[list] = field(default=None, init=False, repr=False)  # [batch, index, first pass] on the device

    @property
    def tokens(self) -> list:
        """The generated ids so far (a list of ints)."""
        if self._pending is not None:
            _flush(self)
        return self._tokens


class _Batch:
    """The running requests of consecutive decode steps with the same rows: one static decode state.

    Made when the set of running rows changes (admission, finish, cancel, pause); holds the step's device
    state, the noise of the passes it can run before a request finishes, the previous pass's tokens and
    every pass's tokens on the device (copied to the requests' ``tokens`` when read or at the end).
    """

    def __init__(
        self,
        reqs: list[Request],
        index: torch.Tensor,
        state,
        prev: torch.Tensor,
        noise: torch.Tensor,
        left: list[int],
        version: int,
    ):
        self.reqs, self.index, self.state, self.prev, self.noise = reqs, index, state, prev, noise
        self.rows = tuple(r.row for r in reqs)
        self.left = left  # passes each request runs in this batch before it is finished by its count
        self.version = version  # the cache's table version the device table holds
        self.t = 0  # passes run
        self.chunks: list[torch.Tensor] = []  # per pass int64 [B, count] (device)
        self.host: list[list[int]] = [[] for _ in reqs]
        self.synced = 0
        self.start: list[int] = []  # tokens each request had when the batch formed (set by _new_batch)
        self.first_finish = 0  # the pass after which the first request is finished by its count
        self.eos = False  # a request of the batch has an eos_id (its tokens are read every pass)

    def sync(self) -> None:
        if self.synced < len(self.chunks):
            for row, ids in zip(self.host, torch.cat(self.chunks[self.synced :], 1).tolist()):
                row.extend(ids)
            self.synced = len(self.chunks)


def _noise_of(r: Request) -> torch.Tensor:
    """A running request's noise (drawn or checked when it was admitted)."""
    if r.noise is None:
        raise RuntimeError("request: its noise is drawn when it is admitted (PagedGenerator.step)")
    return r.noise


def _flush(r: Request) -> None:
    """Copy the request's tokens still on the device into ``r._tokens`` (cut at ``max_new_tokens``)."""
    if r._pending is None:  # nothing on the device
        return
    batch, i, start = r._pending
    batch.sync()
    count = batch.chunks[0].shape[1] if batch.chunks else 0
    ids = batch.host[i][start * count : batch.t * count]
    r._tokens.extend(ids[: r.max_new_tokens - len(r._tokens)])
    r._pending = [batch, i, batch.t] if r.row is not None else None


class PagedGenerator:
    """Runs requests on a :class:`PagedKVCache` (made here from ``page_size``/``num_pages`` unless given).

    Args:
        model: the model (eval mode).
        k: tokens per forward for K-Forcing; None for AR.
        cache: an existing pool, or None to make one with ``num_pages`` pages of ``page_size``.
        keep_logits: store each step's logits in ``Request.logits``.
        k_train: the window the model was trained with (default ``model.k_train``), as ``generate_kforcing`` takes it.
    """

    def __init__(
        self,
        model: Student,
        k: Optional[int] = None,
        *,
        cache: Optional[PagedKVCache] = None,
        page_size: int = 16,
        num_pages: Optional[int] = None,
        keep_logits: bool = False,
        k_train: Optional[int] = None,
        compile_step: Union[bool, str] = False,
    ):
        kind = kind_of(model)
        kind.check_serving(model)  # a kind whose layers the paged cache cannot hold is refused by name
        if not isinstance(model, KForcingLM):  # the pages hold KForcingLM's layers (paged_cache.py)
            raise kind.refuse("model", "claims PagedGenerator serving but is not a KForcingLM", type(model).__name__)
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"k: expected a positive int or None (AR), got {k!r}")
        if k is not None:
            # at most the trained window (k_train, default model.k_train), not on an AR model
            check_k(model, k, k_train)
        else:
            check_ar(model)  # AR steps on a K-Forcing model would decode it without its noise window
        self.model, self.k, self.keep_logits = model, k, keep_logits
        if cache is None:
            if num_pages is None:
                raise ValueError("num_pages: expected the pool size in pages when no cache is given, got None")
            cache = PagedKVCache.for_model(model, page_size=page_size, num_pages=num_pages)
        self.cache = cache
        self.device = model.wte.weight.device
        self.compile_step = check_compile_step(compile_step, self.device)
        self._running: dict[int, Request] = {}  # cache row -> the request holding it (started, not finished)
        self._step_fn: Optional[StaticDecodeStep] = None  # made at the first decode step
        self._batch: Optional[_Batch] = None

    @property
    def running(self) -> list[Request]:
        """The requests that hold pages of this generator's pool (started, neither finished nor cancelled)."""
        return list(self._running.values())

    def cancel(self, request: Request) -> None:
        """Drop ``request``: its pages go back to the pool now; it is marked ``done`` and ``cancelled``.

        The tokens generated so far stay in ``request.tokens``. A request that has not started is only
        marked; a finished or already cancelled one is left as it is. A request running on another
        generator is refused (ValueError): its row is not this pool's.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request: expected a Request, got {type(request).__name__}")
        if request.row is not None:
            if self._running.get(request.row) is not request:
                raise ValueError(f"request: holds row {request.row} of another generator's cache, not this one's")
            self._release(request)
        elif request.done:
            return
        request.done = request.cancelled = True

    def _release(self, request: Request) -> None:
        if request._pending is not None:
            _flush(request)  # its tokens so far stay
            request._pending = None
        self._batch = None  # its row may be handed out again: the next decode pass forms a new batch
        if request.row is None:  # not running: it holds no pages
            return
        del self._running[request.row]
        self.cache.free(request.row)
        request.row = None

    # -------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, requests: Sequence[Request]) -> list[Request]:
        """One forward pass for every live request in ``requests``; returns those that finished in it.

        Raises :class:`PagePoolFull` before doing anything when the pool cannot take
        this step's context tokens (nothing is computed, written or lost). A listed request that
        the caller marked ``done`` while it held pages is cancelled first (:meth:`cancel`): its
        pages go back to the pool even when the step is then refused.
        """
        for r in requests:
            if not isinstance(r, Request):
                raise ValueError(f"requests: expected Request objects, got {type(r).__name__}")
            if r.row is not None and self._running.get(r.row) is not r:
                raise ValueError(f"requests: a request holds row {r.row} of another generator's cache, not this one's")
        for r in requests:  # marked done by the caller while running: dropped, its pages returned
            if r.done and r.row is not None:
                self.cancel(r)
        live = [r for r in requests if not r.done]
        if len({id(r) for r in live}) != len(live):
            raise ValueError("requests: the same request is listed more than once in this step")
        new = [r for r in live if r.row is None]
        running = [r for r in live if r.row is not None]
        admitted = [self._admission(r) for r in new]  # every check first: a refused step changes nothing
        self._check_room_for(admitted, running)
        for r, (prompt, noise) in zip(new, admitted):
            r.prompt, r.noise = prompt, noise
        if new:
            self._finish_step(new, *self._prefill(new))
        if running:
            self._decode(running)
        return [r for r in live if r.done]

    def _admission(self, r: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """A new request's (prompt, noise), checked; the request itself is not changed here."""
        prompt = torch.as_tensor(r.prompt)
        if prompt.dim() > 1:  # a [1, P] or [B, P] tensor is not one prompt: refused, as generate_* refuses it
            raise ValueError(f"prompt: expected a 1-D sequence of token ids, got shape {tuple(prompt.shape)}")
        prompt = prompt.flatten()
        if prompt.numel() == 0 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"prompt: expected a non-empty sequence of token ids, got {r.prompt!r}")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.model.config.vocab_size:
            raise ValueError(
                f"prompt: expected token ids in [0, {self.model.config.vocab_size}), got {prompt.tolist()}"
            )
        if not isinstance(r.max_new_tokens, int) or isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {r.max_new_tokens!r}")
        check_temperature(r.temperature, allow_zero=self.k is None)
        if isinstance(r.temperature, torch.Tensor) and r.temperature.dim():
            raise ValueError(f"temperature: expected one number per request, got shape {tuple(r.temperature.shape)}")
        shape = (r.max_new_tokens,) if self.k is None else (math.ceil(r.max_new_tokens / self.k), self.k)
        noise = r.noise
        if noise is None:
            gen = r.generator
            noise = torch.rand(shape, generator=gen, device=gen.device if gen else "cpu")
        if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != shape:
            raise ValueError(f"noise: expected shape {shape}, got {tuple(getattr(noise, 'shape', ()))}")
        check_noise(noise)
        return prompt.to(torch.int64), noise

    def _check_room_for(self, new: list[tuple[torch.Tensor, torch.Tensor]], running: list[Request]) -> None:
        page, cache = self.cache.page_size, self.cache
        grow = 1 if self.k is None else self.k  # context tokens a decode step appends
        need = sum(math.ceil(prompt.numel() / page) for prompt, _ in new)
        if running:
            need += cache.pages_to_grow(torch.tensor([r.row for r in running], dtype=torch.int64), grow)
        if need > cache.free_pages:
            raise PagePoolFull(
                f"page pool full: this step needs {need} more pages of {page} tokens, {cache.free_pages} of "
                f"{cache.num_pages} free; cancel requests (PagedGenerator.cancel) or wait for some to finish, or use a "
                f"larger pool (num_pages)"
            )

    def _finish_step(self, reqs: list[Request], new_tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """new_tokens [B, n] -> each request's tokens; finished requests free their pages."""
        for r, ids, lg in zip(reqs, new_tokens.tolist(), logits):
            if r._pending is not None:
                _flush(r)
            room = r.max_new_tokens - len(r._tokens)
            ids, lg = ids[:room], lg[:room]
            if r.eos_id is not None and r.eos_id in ids:
                cut = ids.index(r.eos_id) + 1
                ids, lg, r.done = ids[:cut], lg[:cut], True
            r._tokens.extend(ids)
            if self.keep_logits:
                r.logits.append(lg)
            r.steps += 1
            if len(r._tokens) >= r.max_new_tokens:
                r.done = True
            if r.done:
                self._release(r)

    # -------------------------------------------------------------- prefill and decode

    def _temperatures(self, reqs: list[Request]) -> torch.Tensor:
        return torch.tensor([float(r.temperature) for r in reqs], dtype=torch.float64)

    def _prefill(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        model, dev, b = self.model, self.device, len(reqs)
        prompts = [torch.as_tensor(r.prompt) for r in reqs]  # tensors since admission (no copy)
        lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.int64)
        p_max = int(lengths.max())
        tokens = torch.zeros(b, p_max, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, : p.numel()] = p
        tokens = tokens.to(dev)
        rows = [self.cache.add_row() for _ in reqs]
        for r, row in zip(reqs, rows):
            r.row = row
            self._running[row] = r
        if self.k is None:
            h, kvs = model.trunk(model.wte(tokens), torch.arange(p_max, device=dev), WindowLayout.causal(p_max))
            self.cache.append(rows, kvs, lengths.tolist())  # each prompt's true tokens, straight into pages
            logits = model.head(h[torch.arange(b, device=dev), (lengths - 1).to(dev)])  # [B, V]
            return self._pick(reqs, logits, 0)[:, None], logits[:, None]
        noise = torch.stack([_noise_of(r)[0] for r in reqs]).to(dev)
        tau = self._temperatures(reqs).to(device=dev, dtype=torch.float32)
        h, kvs = prefill_kforcing(model, tokens, lengths, noise, tau)
        self.cache.append(rows, kvs, lengths.tolist())
        logits = model.head(h[:, p_max:])  # [B, k, V]
        return decode_slots(logits, noise, decode_rule(model)), logits

    def _decode(self, reqs: list[Request]) -> None:
        """One static decode pass over the running requests (StaticDecodeStep): device work only, unless the
        set of rows changed (a new batch: its state, noise and previous tokens go to the device once), a row
        crossed into a new page (its table rows are copied again) or a request has an ``eos_id`` (one sync)."""
        count = 1 if self.k is None else self.k
        batch = self._batch
        if batch is None or batch.rows != tuple(r.row for r in reqs):
            batch = self._new_batch(reqs)
        self.cache.grow(batch.index, count)  # host bookkeeping: pages and lengths
        if batch.version != self.cache.version:
            batch.state.table.copy_(self.cache.table_rows(batch.index).to(self.device, non_blocking=True))
            batch.version = self.cache.version
        z = batch.noise[:, batch.t]
        tokens, logits = self._decode_step()(batch.state, batch.prev, z)
        if self.compile_step:  # the graph's own output buffers: the next pass overwrites them
            tokens, logits = tokens.clone(), (logits.clone() if self.keep_logits else logits)
        batch.prev = tokens
        batch.chunks.append(tokens)
        batch.t += 1
        t = batch.t
        if not (self.keep_logits or batch.eos):  # the usual case: O(1) host work per request and pass
            for r in reqs:
                r.steps += 1
            if t == batch.first_finish:
                for i, r in enumerate(reqs):
                    if batch.left[i] == t:
                        r.done = True
                        self._release(r)
            return
        for i, r in enumerate(reqs):
            r.steps += 1
            take = min(count, r.max_new_tokens - batch.start[i] - (t - 1) * count)  # the pass's tokens it keeps
            if self.keep_logits:
                r.logits.append(logits[i, :take])
            if r.eos_id is not None:  # this pass's tokens are read now (one sync)
                new = r.tokens[-take:]
                if r.eos_id in new:
                    cut = new.index(r.eos_id) + 1
                    del r._tokens[len(r._tokens) - take + cut :]
                    if self.keep_logits:
                        r.logits[-1] = r.logits[-1][:cut]
                    r.done = True
            if batch.left[i] == t:
                r.done = True
            if r.done:
                self._release(r)

    def _new_batch(self, reqs: list[Request]) -> _Batch:
        """The device state of a new set of running rows (admission-time work: copies to the device, one sync).

        Requests of an earlier batch keep their tokens there until read (``Request.tokens`` copies them)."""
        count = 1 if self.k is None else self.k
        index = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        start = [len(r.tokens) for r in reqs]
        left = [math.ceil((r.max_new_tokens - n) / count) for r, n in zip(reqs, start)]
        passes = min(left)
        first = [r.steps for r in reqs]  # the noise of pass s of request r: r.noise[r.steps + s]
        noise = torch.stack([_noise_of(r)[f : f + passes] for r, f in zip(reqs, first)]).to(self.device)
        prev = torch.tensor([r.tokens[-count:] for r in reqs], dtype=torch.int64, device=self.device)
        temperature = [0.0 if self.k is None and float(r.temperature) == 0 else float(r.temperature) for r in reqs]
        state = self._decode_step().state(self.cache._lens[index], self.cache.table_rows(index), temperature)
        batch = _Batch(reqs, index, state, prev, noise, left, self.cache.version)
        batch.start, batch.first_finish = start, passes
        batch.eos = any(r.eos_id is not None for r in reqs)
        for i, r in enumerate(reqs):
            r._pending = [batch, i, 0]
        self._batch = batch
        return batch

    def _decode_step(self) -> StaticDecodeStep:
        """The static decode step over this generator's pool, made at the first decode pass."""
        if self._step_fn is None:
            self._step_fn = StaticDecodeStep(
                self.model,
                self.k,
                self.cache.k,
                self.cache.v,
                self.cache.page_size,
                compile_step=self.compile_step,
                kv=self.cache.kv,
            )
        return self._step_fn

    def _pick(self, reqs: list[Request], logits: torch.Tensor, step: Optional[int]) -> torch.Tensor:
        """AR sampling: argmax where tau == 0, else inverse-CDF at each request's noise for this step."""
        tau = self._temperatures(reqs).to(logits.device)
        z = torch.stack([_noise_of(r)[len(r.tokens) if step is None else step] for r in reqs]).to(logits.device)
        out = logits.argmax(-1)
        hot = tau > 0
        if bool(hot.any()):
            idx = hot.nonzero().flatten()
            out[idx] = inverse_cdf_sample(logits[idx], z[idx], tau[idx])
        return out

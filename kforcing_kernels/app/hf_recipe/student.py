"""A Hugging Face causal LM as the trainer's model: the AR teacher, and the PFLM student initialised from it.

:class:`HFStudent` wraps an ``AutoModelForCausalLM`` loaded with ``attn_implementation="kforcing"`` and a
:class:`~kforcing_kernels.integrations.hf_noise.NoiseEmbedding`, and offers what the trainer, the
objectives, the evaluation and generation use of :class:`~kforcing_kernels.model.KForcingLM`, with the
same semantics:

* ``model(tokens, cu_seqlens=)``: AR logits ``[B, N, V]`` (causal layout, per-document positions);
* ``model(tokens, noise, tau, cu_seqlens=)`` / ``single_forward``: SingleForward (eq. 18), logits
  ``[B, N, k, V]``; ``single_forward`` also returns the context cache (an HF ``DynamicCache`` cropped to
  the N context tokens) that ``double_forward`` (eq. 19) reuses and crops back after itself;
* ``model(tokens, noise, tau, cu_seqlens=, context_parallel=cp)``: this rank's rows under context parallelism,
  ``(logits [B, R, V], rows)`` (:meth:`HFStudent.context_parallel_forward`, as ``KForcingLM``'s);
* ``config.vocab_size``, ``wte`` (the input embeddings), ``noise_encoder``, ``reset_noise_encoder``, ``k_train``;
* ``return_hidden=True`` on every forward and :meth:`HFStudent.output_head`: the final hidden states (the base
  model's ``last_hidden_state``) in place of the logits, for a loss that applies the head chunk by chunk
  (``app/training/linear_ce.py``); offered when the model's logits are exactly ``lm_head(hidden)``.

Every call passes its ``WindowLayout`` (``kforcing_layout``) and ``position_ids``: the layout is the mask,
packed documents included. The HF model is kept in eval mode (no dropout) even while the wrapper trains:
K-Forcing's targets are deterministic given the noise, and ``--resume`` must repeat a run bit for bit.

Generation (paper Algorithm 1) runs over the model's KV cache (a full ``DynamicCache`` on every layer, also on
sliding-window layers, which see only their window through the layout): the prefill is
``[prompt | k noise]``, each step ``[k new tokens | k noise]``; the noise tokens' K/V are cropped off the
cache after every call, so only context enters it (as in ``app/generation/inference.py``). Prompts of several lengths
are run as groups of equal length (each request's tokens do not depend on the batch).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...integrations import hf as kf_hf  # registers attn_implementation="kforcing"
from ...integrations.hf_noise import NoiseEmbedding
from ...layouts import WindowLayout
from ...layouts.positions import as_cu_seqlens, context_positions, double_positions, single_positions
from ...ops.sampling import inverse_cdf_sample
from ...parallel import ContextParallel
from ...parallel.context_parallel import RankRows
from ...parallel.rank_inputs import context_parallel_inputs
from ...types import Temperature


def _cache_keyword(model: nn.Module) -> str:
    """transformers 5 takes the KV cache as ``cache``, 4.x as ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output):
    return output["cache"] if "cache" in output else output["past_key_values"]


def crop_cache(cache, length: int):
    """Keep the first ``length`` tokens of an HF cache (``DynamicCache.crop`` takes a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"length: the cache holds {cache.get_seq_length()} tokens, fewer than {length}")
    if extra:
        cache.crop(-extra)
    return cache


class HFStudent(nn.Module):
    """``hf`` (an HF causal LM with ``attn_implementation="kforcing"``) + ``noise_encoder`` as one trainable model."""

    kind = "hf"  # its ModelKind in app/student.py's registry: app/hf_recipe/kind.py
    hf_tokenizer: Any = None  # the transformers tokenizer its folder holds (set by files.load_hf_*), for its EOS

    def __init__(
        self, hf_model: PreTrainedModel, noise_encoder: Optional[NoiseEmbedding] = None, k_train: Optional[int] = None
    ):
        super().__init__()
        impl = getattr(hf_model.config, "_attn_implementation", None)
        if impl != kf_hf.ATTN_IMPLEMENTATION:
            raise ValueError(f"hf_model: expected attn_implementation='kforcing' (layouts are its masks), got {impl!r}")
        if getattr(hf_model.config, "attn_logit_softcapping", None) is not None:  # refused here, before any training
            raise ValueError(
                f"attn_logit_softcapping: not supported by attn_implementation='kforcing', got "
                f"{hf_model.config.attn_logit_softcapping!r}" + kf_hf.SOFTCAP_ADVICE
            )
        self.hf: PreTrainedModel = hf_model.eval()
        hidden = self.wte.weight.shape[1]
        self.noise_encoder = noise_encoder if noise_encoder is not None else NoiseEmbedding(hidden)
        self.k_train = k_train
        self._cache_kw = _cache_keyword(hf_model)
        self._keep_kw = "logits_to_keep" in inspect.signature(hf_model.forward).parameters

    # -------------------------------------------------------------- what the trainer reads

    @property
    def config(self):
        return self.hf.config

    @property
    def wte(self) -> nn.Embedding:
        return self.hf.get_input_embeddings()

    def train(self, mode: bool = True) -> "HFStudent":
        super().train(mode)
        self.hf.eval()  # no dropout: see the module docstring
        return self

    def decoder_layers(self) -> list[nn.Module]:
        """The HF model's decoder layers, in order: the modules of a class it names in ``_no_split_modules`` (its unit
        for sharding and offloading), outermost only, before or after ``fully_shard`` (which subclasses them)."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        # By the class's own name or a base's: fully_shard turns a layer's class into a subclass ``FSDP<name>``.
        layers = [m for m in self.hf.modules() if any(c.__name__ in names for c in type(m).__mro__)]
        inner = {id(sub) for layer in layers for sub in layer.modules() if sub is not layer}
        layers = [m for m in layers if id(m) not in inner]
        if not layers:
            raise ValueError(
                f"model: cannot find the decoder layers of {type(self.hf).__name__} (no module of a "
                f"class in its _no_split_modules {sorted(names)})"
            )
        return layers

    def tied_keys(self) -> list[str]:
        """state_dict keys whose tensor is an earlier key's (tied embeddings): saved once, restored by the tie."""
        seen, tied = set(), []
        for name, tensor in self.state_dict(keep_vars=True).items():
            if tensor.data_ptr() in seen and tensor.numel():
                tied.append(name)
            seen.add(tensor.data_ptr())
        return tied

    def output_head(self) -> Optional[nn.Linear]:
        """The ``lm_head`` that maps ``return_hidden=True``'s hidden states to logits, or None when the model's logits
        are not exactly ``lm_head(hidden)`` (a final soft-capping or logit scale, no linear head, no base model):
        then the loss takes the logits."""
        head = self.hf.get_output_embeddings()
        config = self.hf.config
        plain = (
            isinstance(head, nn.Linear)
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) in (None, 1, 1.0)
            and getattr(config, "logits_scaling", None) in (None, 1, 1.0)
            and self._base() is not None
        )
        return head if plain else None

    def _base(self) -> Optional[nn.Module]:
        base = getattr(self.hf, "base_model", None)
        return None if base is None or base is self.hf else base

    def reset_noise_encoder(self, generator: Optional[torch.Generator] = None) -> None:
        """A fresh noise embedding (Stage 1 starts from the AR teacher with one), initialised as the native one."""
        for p in self.noise_encoder.parameters():
            if p.dim() == 1:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02, generator=generator)

    # -------------------------------------------------------------- the three training-time forwards

    def _run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        layout: Union[WindowLayout, RankRows],
        keep: int = 0,
        cache=None,
        use_cache: bool = False,
        hidden: bool = False,
    ):
        b, length = embeds.shape[:2]
        kwargs: dict[str, Any] = {  # the HF model's forward keywords
            "inputs_embeds": embeds,
            "position_ids": positions.expand(b, length),
            "kforcing_layout": layout,
            "use_cache": use_cache or cache is not None,
        }
        if kwargs["use_cache"]:
            # A full cache on every layer: a sliding layer's own cache (DynamicSlidingWindowLayer) drops keys beyond
            # the window and cannot be cropped back past it, while the layouts index the whole context; the
            # attention call applies each layer's window to the layout instead (integrations/hf_masks.sliding_layout).
            kwargs[self._cache_kw] = DynamicCache() if cache is None else cache
        if hidden:  # the base model: its last hidden states, no head (output_head says when that equals the logits)
            base = self._base()
            if self.output_head() is None or base is None:  # (no base model: output_head() is None too)
                raise ValueError("return_hidden: this model's logits are not lm_head(hidden states); take its logits")
            out = base(**kwargs)
            states = out["last_hidden_state"]
            return (states[:, -keep:] if keep else states), (_cache_of(out) if kwargs["use_cache"] else None)
        if keep and self._keep_kw:
            kwargs["logits_to_keep"] = keep
        out = self.hf(**kwargs)
        logits = out["logits"]
        return (logits[:, -keep:] if keep else logits), (_cache_of(out) if kwargs["use_cache"] else None)

    def embed_noise(self, noise: torch.Tensor, tau: Temperature) -> torch.Tensor:
        """noise ``[B, *S]`` in [0, 1), tau scalar or ``[B]`` -> embeddings ``[B, *S, C]`` in the model's dtype."""
        tau = torch.as_tensor(tau, dtype=torch.float32, device=noise.device)
        if tau.dim() > 1 or (tau.dim() == 1 and tau.shape[0] != noise.shape[0]):
            raise ValueError(
                f"tau: expected a scalar or shape [{noise.shape[0]}] (one per sample), got {tuple(tau.shape)}"
            )
        return self.noise_encoder(noise, tau).to(self.wte.weight.dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        context_parallel: Optional[ContextParallel] = None,
        return_hidden: bool = False,
    ):
        """AR logits ``[B, N, V]`` when ``noise`` is None, else SingleForward logits ``[B, N, k, V]``.

        With ``context_parallel``: this rank's share, ``(logits, rows)`` (:meth:`context_parallel_forward`).
        ``return_hidden``: the final hidden states ``[..., C]`` in place of the logits (see :meth:`output_head`)."""
        if context_parallel is not None:
            return self.context_parallel_forward(
                context_parallel, tokens, noise, tau, cu_seqlens, return_hidden=return_hidden
            )
        if noise is None:
            return self.ar_forward(tokens, cu_seqlens=cu_seqlens, return_hidden=return_hidden)
        return self.single_forward(
            tokens, noise, tau, cu_seqlens=cu_seqlens, keep_cache=False, return_hidden=return_hidden
        )[0]

    def ar_forward(self, tokens: torch.Tensor, cu_seqlens=None, return_hidden: bool = False) -> torch.Tensor:
        """tokens ``[B, N]`` -> next-token logits ``[B, N, V]``; ``cu_seqlens`` packs documents (as KForcingLM)."""
        self._check_tokens("tokens", tokens)
        b, n = tokens.shape
        cu = as_cu_seqlens(cu_seqlens, n, b)
        layout = WindowLayout.causal(n, cu_seqlens=cu)
        return self._run(self.wte(tokens), context_positions(n, cu, tokens.device), layout, hidden=return_hidden)[0]

    def single_forward(
        self,
        tokens: torch.Tensor,
        noise: torch.Tensor,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        keep_cache: bool = True,
        return_hidden: bool = False,
    ):
        """SingleForward: ``(logits [B, N, k, V], the context cache (N tokens) or None)``; arguments as KForcingLM's."""
        self._check_tokens("tokens", tokens)
        b, n = tokens.shape
        if noise.dim() != 3 or noise.shape[:2] != (b, n):
            raise ValueError(f"noise: expected shape [{b}, {n}, k] (tokens' [B, N] + k), got {tuple(noise.shape)}")
        k = noise.shape[2]
        cu = as_cu_seqlens(cu_seqlens, n, b)
        embeds = torch.cat([self.wte(tokens), self.embed_noise(noise, tau).reshape(b, n * k, -1)], 1)
        logits, cache = self._run(
            embeds,
            single_positions(n, k, tokens.device, cu),
            WindowLayout.kforcing_single(n, k, cu_seqlens=cu),
            keep=n * k,
            use_cache=keep_cache,
            hidden=return_hidden,
        )
        return logits.reshape(b, n, k, -1), (None if cache is None else crop_cache(cache, n))

    def context_parallel_forward(
        self,
        cp: ContextParallel,
        tokens: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of :meth:`ar_forward` (``noise`` None) or of the SingleForward, as ``KForcingLM``'s.

        Every rank of ``cp``'s group passes the same full inputs; the HF model runs on this rank's rows of the
        layout only (their ``inputs_embeds`` and ``position_ids``; ``kforcing_layout`` is ``cp.shard(layout)``,
        whose attention all-gathers the other ranks' K/V per layer). Returns ``(logits [B, R, V], rows int64 [R])``:
        AR rows are context positions t; SingleForward rows are window tokens ``t * k + j``
        (``logits[:, i] == forward(tokens, noise, tau).flatten(1, 2)[:, rows[i]]``).
        """
        if isinstance(cp, ContextParallel):  # (else refused by context_parallel_inputs, naming the option)
            self._check_tokens("tokens", tokens)
        inputs = context_parallel_inputs(cp, tokens, noise, tau, cu_seqlens, self.wte, self.embed_noise)
        # The SingleForward keeps its window rows (logits_to_keep=0 would mean all: keep at least one, then slice).
        keep = 0 if noise is None else max(inputs.kept, 1)
        logits, _ = self._run(inputs.embeds, inputs.positions, inputs.shard, keep=keep, hidden=return_hidden)
        return logits[:, logits.shape[1] - inputs.kept :], inputs.rows

    def double_forward(
        self,
        context_kv,
        first: torch.Tensor,
        noise: torch.Tensor,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """DoubleForward on the context cache of :meth:`single_forward` (cropped back to N afterwards): ``[B, N, k, V]``
        (hidden states ``[B, N, k, C]`` with ``return_hidden``)."""
        self._check_tokens("first", first)
        b, n, k = first.shape
        if noise.shape != first.shape:
            raise ValueError(f"noise: expected the shape of first {tuple(first.shape)}, got {tuple(noise.shape)}")
        if context_kv is None or context_kv.get_seq_length() != n:
            raise ValueError(f"context_kv: expected the cache of single_forward over N={n} context tokens")
        cu = as_cu_seqlens(cu_seqlens, n, b)
        embeds = torch.cat(
            [self.wte(first).reshape(b, n * k, -1), self.embed_noise(noise, tau).reshape(b, n * k, -1)], 1
        )
        logits, _ = self._run(
            embeds,
            double_positions(n, k, first.device, cu),
            WindowLayout.kforcing_double(n, k, cu_seqlens=cu),
            keep=n * k,
            cache=context_kv,
            hidden=return_hidden,
        )
        crop_cache(context_kv, n)
        return logits.reshape(b, n, k, -1)

    def _check_tokens(self, name: str, tokens: torch.Tensor) -> None:
        vocab = self.config.vocab_size
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: expected an int64/int32 tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(f"{name}: expected ids in [0, {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")

    # -------------------------------------------------------------- generation over the HF cache

    def _window_call(self, embeds: torch.Tensor, n_ctx: int, window: int, queries: str, keep: int, cache):
        """One window after ``n_ctx`` context keys (the prompt's own, queries="all", or the cache's, "windows")."""
        layout = WindowLayout(n_ctx, 1, window, [0], [n_ctx], intra="causal", queries=queries)
        start = 0 if queries == "all" else n_ctx
        positions = torch.arange(start, n_ctx + window, device=embeds.device)
        return self._run(embeds, positions, layout, keep=keep, cache=cache, use_cache=True)

    @torch.no_grad()
    def generate_kforcing(self, prompt: torch.Tensor, k: int, steps: int, tau: torch.Tensor, noise: torch.Tensor):
        """Algorithm 1 for prompts of one length: prompt ``[B, P]``, noise ``[B, steps, k]``, tau ``[B]``
        -> (tokens ``[B, steps * k]``, logits ``[B, steps * k, V]``)."""
        b, p = prompt.shape
        x = torch.cat([self.wte(prompt), self.embed_noise(noise[:, 0], tau)], 1)
        logits, cache = self._window_call(x, p, k, "all", k, None)
        crop_cache(cache, p)
        outs, all_logits = [logits.argmax(-1)], [logits]
        for s in range(1, steps):
            length = cache.get_seq_length()
            x = torch.cat([self.wte(outs[-1]), self.embed_noise(noise[:, s], tau)], 1)  # [k new tokens | k noise]
            logits, cache = self._window_call(x, length, 2 * k, "windows", k, cache)
            crop_cache(cache, length + k)  # context K/V only
            outs.append(logits.argmax(-1))
            all_logits.append(logits)
        return torch.cat(outs, 1), torch.cat(all_logits, 1)

    @torch.no_grad()
    def generate_ar(self, prompt: torch.Tensor, new_tokens: int, temperature, noise: torch.Tensor, greedy: bool):
        """AR decoding for prompts of one length: prompt ``[B, P]``, noise ``[B, T]`` -> (tokens ``[B, T]``, logits
        ``[B, T, V]``)."""
        b, p = prompt.shape
        logits, cache = self._run(
            self.wte(prompt), torch.arange(p, device=prompt.device), WindowLayout.causal(p), keep=1, use_cache=True
        )
        outs, all_logits = [], []
        for s in range(new_tokens):
            last = logits[:, -1]
            outs.append(last.argmax(-1) if greedy else inverse_cdf_sample(last, noise[:, s], temperature))
            all_logits.append(last)
            if s + 1 < new_tokens:
                logits, cache = self._window_call(
                    self.wte(outs[-1][:, None]), cache.get_seq_length(), 1, "windows", 1, cache
                )
        return torch.stack(outs, 1), torch.stack(all_logits, 1)


def generate_grouped(
    run, tokens: torch.Tensor, lengths: torch.Tensor, width: int, *per_row
) -> tuple[torch.Tensor, torch.Tensor]:
    """``run(prompt [G, P], *rows of per_row)`` for each group of prompts of one length P, results put back in order.

    tokens ``[B, P_max]`` right-padded, lengths ``[B]``; each ``per_row`` tensor has B rows (or is None).
    Returns (tokens ``[B, width]``, logits ``[B, width, V]``).
    """
    out: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    for length in sorted(set(lengths.tolist())):
        rows = (lengths == length).nonzero()[:, 0].to(tokens.device)
        got, got_logits = run(tokens[rows, :length], *(None if t is None else t[rows] for t in per_row))
        if out is None or logits is None:
            out = torch.empty(tokens.shape[0], width, dtype=torch.int64, device=tokens.device)
            logits = torch.empty(
                tokens.shape[0], width, got_logits.shape[-1], dtype=got_logits.dtype, device=tokens.device
            )
        out[rows], logits[rows] = got[:, :width], got_logits[:, :width]
    if out is None or logits is None:
        raise ValueError("tokens: expected at least one prompt, got none")
    return out, logits

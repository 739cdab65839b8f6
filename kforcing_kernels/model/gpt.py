"""A GPT-style decoder that runs as an AR model or as a push-forward LM (PFLM).

One backbone (token embedding, pre-norm blocks with RoPE, one shared output head)
plus a noise encoder that turns a uniform noise scalar z and a temperature tau
into a token embedding (paper Section 3.3, "fully causal": one token per noise
variable, decoded by the shared head). Every attention call goes through
:func:`kforcing_kernels.window_attention`; the mask is always a ``WindowLayout``:

* AR forward: ``WindowLayout.causal(N)``;
* SingleForward (eq. 18): ``kforcing_single(N, k)`` over ``[ctx (N) | noise (N*k)]``;
* DoubleForward (eq. 19): ``kforcing_double(N, k)``; queries ``[Future-1 | Future-2]``,
  keys ``[ctx (N, K/V reused from round one) | Future-1 | Future-2]``;
* KV-cached inference: one window per request after the cached context
  (see ``kforcing_kernels.app.generation.inference``).

Positions (RoPE): context token t sits at t; slot i of the window after context
token t sits at t + 1 + i, i.e. where the token it predicts will sit once it is
appended to the context.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layouts import WindowLayout
from ..layouts.positions import as_cu_seqlens, context_positions, double_positions, single_positions
from ..ops.window_attention import window_attention
from ..parallel.context_parallel import ContextParallel, RankRows
from ..parallel.rank_inputs import context_parallel_inputs
from ..types import KV, Temperature
from .config import ModelConfig
from .decode_paths import DirectBlock, PagedPast, direct_block

# ---------------------------------------------------------------------- building blocks


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [L] or [B, L] -> (cos, sin), each fp32 [1 or B, 1, L, head_dim/2]."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [(B,) L, D/2]
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, D] by the angles of its positions (halves convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.backend = cfg.attention_backend

    def forward(
        self,
        x: torch.Tensor,  # [B, L, C]: the query tokens
        cos: torch.Tensor,  # [1 or B, 1, L, D/2]
        sin: torch.Tensor,
        layout: Union[WindowLayout, RankRows, None],
        past: Union[KV, PagedPast, None] = None,
    ) -> tuple[torch.Tensor, KV]:
        """Attention of the L query tokens over ``past`` and themselves; returns (output, their own K/V).

        ``past`` is the cached context: contiguous K/V ``[B, H, P, D]`` prepended to the keys, with
        ``layout`` describing all ``P + L`` keys; or a :class:`PagedPast` read in place, whose decode-window
        semantics replace the layout (pass None). A :class:`~kforcing_kernels.parallel.RankRows` (context
        parallelism) means x holds this rank's rows of the layout: K/V of all ranks are gathered per layer.
        """
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(past, PagedPast):
            if layout is not None:
                raise ValueError("layout: expected None with a paged past (its decode window is the mask)")
            y = past.attend(q, k, v)
        elif isinstance(layout, RankRows):
            if past is not None:
                raise ValueError("past: context parallelism runs without a cached context")
            y = layout.attend(q, k, v)
        else:
            if layout is None:
                raise ValueError("layout: expected a WindowLayout (None only with a paged past)")
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            y = window_attention(q, keys, values, layout, backend=self.backend)  # [B, H, L, D]
        return self.proj(y.transpose(1, 2).reshape(b, n, c)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layout, past=None):
        a, kv = self.attn(self.norm1(x), cos, sin, layout, past)
        x = x + a
        return x + self.mlp(self.norm2(x)), kv

    def direct_weights(self) -> "DirectBlock":
        """This block's parameters for the direct decode path (:func:`direct_block`), read once (views: in-place
        updates of the weights show through; a replaced parameter does not)."""
        a, m = self.attn, self.mlp
        return DirectBlock(
            self.norm1.weight,
            self.norm1.eps,
            a.qkv.weight.t(),
            a.proj.weight.t(),
            self.norm2.weight,
            self.norm2.eps,
            m.fc.weight.t(),
            m.proj.weight.t(),
            a.n_head,
            a.head_dim,
        )


class NoiseEncoder(nn.Module):
    """(z, tau) -> a token embedding (paper App. C.2, "temperature-conditioned noise encoder").

    z and tau need different features. z in [0, 1) picks a token through narrow
    inverse-CDF bins, so its sinusoids span periods from ~0.006 to ~60 z units.
    tau lives in about [0.5, 1.5] and changes the *shape* of the z -> token map
    (sharper or flatter), so it gets its own low-frequency features (tau - 1,
    log tau, and sinusoids with periods ~1 to ~16 tau units, all smooth over
    that range) and acts multiplicatively: a small MLP of the tau features gives a
    per-channel scale and shift of the z hidden layer (FiLM)::

        h = W_z f(z) * (1 + s(tau)) + b(tau);   out = W_out SiLU(h)

    Every slot is encoded independently of every other slot, so the encoder keeps
    the fully causal design (one token per noise variable) and the cached inference exact.
    """

    freqs: torch.Tensor  # buffers (register_buffer in _build)
    tau_freqs: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._build(cfg.n_embd, cfg.noise_features, cfg.tau_features)

    def _build(self, n_embd: int, noise_features: int, tau_features: int) -> None:
        """The layers for width ``n_embd``; also what the Hugging Face ``NoiseEmbedding`` builds
        (integrations/hf_noise.py)."""
        half = noise_features // 2 or 1
        self.register_buffer(
            "freqs", 1000.0 * torch.exp(-math.log(10000.0) * torch.arange(half) / half), persistent=False
        )
        tau_half = tau_features // 2 or 1
        # Periods from 16 down to 1 tau units: features vary smoothly, not wrap, over tau's range.
        self.register_buffer(
            "tau_freqs", 2 * math.pi * torch.logspace(-math.log10(16.0), 0.0, tau_half), persistent=False
        )
        c = n_embd
        self.z_in = nn.Linear(2 * half, c)
        self.tau_mlp = nn.Sequential(nn.Linear(2 + 2 * tau_half, c), nn.SiLU(), nn.Linear(c, 2 * c))
        self.out = nn.Linear(c, c)

    def z_features(self, z: torch.Tensor) -> torch.Tensor:
        """z [...] -> fp32 [..., 2 * (noise_features // 2)]."""
        angles = z.to(torch.float32)[..., None] * self.freqs
        return torch.cat([angles.sin(), angles.cos()], -1)

    def tau_features(self, tau: torch.Tensor) -> torch.Tensor:
        """tau [...] (> 0) -> fp32 [..., 2 + 2 * (tau_features // 2)]: tau - 1, log tau, low-frequency sinusoids."""
        tau = tau.to(torch.float32)[..., None]
        angles = tau * self.tau_freqs
        return torch.cat([tau - 1.0, tau.clamp_min(1e-3).log(), angles.sin(), angles.cos()], -1)

    def forward(self, z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """z [...] in [0, 1), tau (> 0) broadcastable to z -> [..., C]."""
        dtype = self.out.weight.dtype
        h = self.z_in(self.z_features(z).to(dtype))  # [..., C]
        # tau is usually one value per sample: run its MLP on tau's own shape, then broadcast.
        scale, shift = self.tau_mlp(self.tau_features(tau).to(dtype)).chunk(2, -1)
        return self.out(F.silu(h * (1.0 + scale) + shift))


# ---------------------------------------------------------------------- the model


class KForcingLM(nn.Module):
    """AR teacher and PFLM student in one class; see the module docstring for the masks.

    ``model(tokens)`` is the AR forward (logits ``[B, N, V]``); ``model(tokens, noise, tau)``
    is SingleForward (logits ``[B, N, k, V]`` for the k noise slots after each context token).
    ``return_hidden=True`` returns the final hidden states ``[..., C]`` in place of the logits:
    ``logits == output_head()(hidden)``, so a loss can apply the head chunk by chunk
    (``app/training/linear_ce.py``) instead of holding every row's ``[rows, V]`` at once.
    """

    kind = "native"  # the name the application's model registry knows it by (kforcing_kernels/app/student.py)
    k_train: Optional[int] = None  # the window it was trained with (0: AR), set when a stage is loaded; None: unknown

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.noise_encoder = NoiseEncoder(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.wte.weight
        self.reset_parameters()

    # -------------------------------------------------------------- parameters

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm_f.weight":
                nn.init.ones_(p)
            elif p.dim() == 1:
                nn.init.zeros_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std, generator=generator)

    def reset_noise_encoder(self, generator: Optional[torch.Generator] = None) -> None:
        """A fresh noise encoder (Stage 1 starts from the AR teacher with one)."""
        for p in self.noise_encoder.parameters():
            if p.dim() == 1:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02, generator=generator)

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder blocks, in order: the unit of activation checkpointing, compile and FSDP2 sharding."""
        return list(self.blocks)

    def tied_keys(self) -> list[str]:
        """state_dict keys whose tensor is another key's (the tied head): saved once, restored by the tie."""
        return ["head.weight"] if self.config.tie_embeddings else []

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def output_head(self) -> nn.Linear:
        """The layer that maps the final hidden states (``return_hidden=True``) to logits (tied to ``wte`` or not)."""
        return self.head

    # -------------------------------------------------------------- the shared trunk

    def trunk(
        self,
        x: torch.Tensor,  # [B, L, C] embeddings of the query tokens
        positions: torch.Tensor,  # int [L] or [B, L]
        layout: Union[WindowLayout, RankRows, None],
        past: Optional[Sequence[Union[KV, PagedPast]]] = None,  # per layer: see Attention.forward
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run all blocks; returns (final-normed hidden [B, L, C], per-layer K/V of the L query tokens).

        ``past`` holds each layer's cached context, contiguous (with a ``layout`` over cache + queries)
        or paged (:class:`PagedPast`, ``layout=None``): the same blocks serve training, the contiguous
        KV cache and the paged one.
        """
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_base)
        kvs = []
        if past is not None and isinstance(past[0], PagedPast) and past[0].direct is not None:  # a static decode step
            b, n, c = x.shape
            cos2, sin2 = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)
            x = x.reshape(b * n, c)
            for layer_past in past:
                x, kv = direct_block(x, b, n, cos2, sin2, cast(PagedPast, layer_past))
                kvs.append(kv)
            return self.norm_f(x.view(b, n, c)), kvs
        for i, block in enumerate(self.blocks):
            x, kv = block(x, cos, sin, layout, None if past is None else past[i])
            kvs.append(kv)
        return self.norm_f(x), kvs

    def embed_noise(self, noise: torch.Tensor, tau: Temperature) -> torch.Tensor:
        """noise [B, *S] in [0, 1), tau scalar or [B] -> embeddings [B, *S, C]."""
        tau = torch.as_tensor(tau, dtype=torch.float32, device=noise.device)
        if tau.dim() == 1:
            if tau.shape[0] != noise.shape[0]:
                raise ValueError(
                    f"tau: expected a scalar or shape [{noise.shape[0]}] (one per sample), got {tuple(tau.shape)}"
                )
            tau = tau.view(-1, *([1] * (noise.dim() - 1)))
        elif tau.dim() != 0:
            raise ValueError(f"tau: expected a scalar or shape [B], got {tuple(tau.shape)}")
        return self.noise_encoder(noise, tau)

    # -------------------------------------------------------------- the three training-time forwards

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
        ``return_hidden``: the final hidden states (``[..., C]``, the head's input) in place of the logits."""
        if context_parallel is not None:
            return self.context_parallel_forward(
                context_parallel, tokens, noise, tau, cu_seqlens, return_hidden=return_hidden
            )
        if noise is None:
            return self.ar_forward(tokens, cu_seqlens=cu_seqlens, return_hidden=return_hidden)
        return self.single_forward(tokens, noise, tau, cu_seqlens=cu_seqlens, return_hidden=return_hidden)[0]

    def ar_forward(self, tokens: torch.Tensor, cu_seqlens=None, return_hidden: bool = False) -> torch.Tensor:
        """tokens [B, N] -> next-token logits [B, N, V] (plain causal attention); hidden [B, N, C] if ``return_hidden``.

        ``cu_seqlens`` (FlashAttention's offsets, ``[D+1]`` or ``[B, D+1]``): the row packs
        documents; attention never crosses a boundary and positions restart at 0 in each.
        """
        _check_tokens(tokens, self.config)
        n = tokens.shape[1]
        cu = as_cu_seqlens(cu_seqlens, n, tokens.shape[0])
        layout = WindowLayout.causal(n, cu_seqlens=cu)  # equal layouts share their derived data (layouts/derived.py)
        h, _ = self.trunk(self.wte(tokens), context_positions(n, cu, tokens.device), layout)
        return h if return_hidden else self.head(h)

    def single_forward(
        self,
        tokens: torch.Tensor,
        noise: torch.Tensor,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> tuple[torch.Tensor, list[KV]]:
        """SingleForward (paper eq. 18): k tokens after every context position in one call.

        Args:
            tokens: context ``[B, N]``.
            noise: ``[B, N, k]`` uniform in [0, 1); ``noise[:, t, i]`` drives the (i+1)-th token after ``tokens[:, t]``.
            tau: temperature, scalar or ``[B]``.
            cu_seqlens: packed documents (as in :meth:`ar_forward`): windows see only their document.
            return_hidden: the windows' final hidden states ``[B, N, k, C]`` in place of their logits.

        Returns:
            (logits ``[B, N, k, V]``, per-layer context K/V ``[B, H, N, D]``, the cache DoubleForward reuses).
        """
        _check_tokens(tokens, self.config)
        b, n = tokens.shape
        if noise.dim() != 3 or noise.shape[:2] != (b, n):
            raise ValueError(f"noise: expected shape [{b}, {n}, k] (tokens' [B, N] + k), got {tuple(noise.shape)}")
        k = noise.shape[2]
        x = torch.cat([self.wte(tokens), self.embed_noise(noise, tau).reshape(b, n * k, -1)], 1)  # [B, N + N*k, C]
        cu = as_cu_seqlens(cu_seqlens, n, tokens.shape[0])
        layout = WindowLayout.kforcing_single(n, k, cu_seqlens=cu)
        h, kvs = self.trunk(x, single_positions(n, k, tokens.device, cu), layout)
        out = h[:, n:] if return_hidden else self.head(h[:, n:])
        return out.view(b, n, k, -1), [(kk[:, :, :n], vv[:, :, :n]) for kk, vv in kvs]

    def context_parallel_forward(
        self,
        cp: ContextParallel,
        tokens: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of :meth:`ar_forward` (``noise`` None) or :meth:`single_forward`, under context parallelism.

        Every rank of ``cp``'s group passes the same full inputs (token ids and noise: a few bytes per
        position); each embeds and runs the whole model on its own rows of the layout
        (``cp.split(layout)``, balanced by attended pairs), positions and documents follow the rows, and
        every attention layer gathers the other ranks' K/V. Returns ``(logits [B, R, V], rows int64 [R])``:
        AR rows are context positions t (``logits[:, i] == ar_forward(...)[:, rows[i]]``); SingleForward rows
        are window tokens ``t * k + j`` (``logits[:, i] == single_forward(...)[0].flatten(1, 2)[:, rows[i]]``);
        this rank's context rows only feed the others' attention. ``return_hidden``: hidden ``[B, R, C]`` for logits.
        """
        _check_tokens(tokens, self.config)
        inputs = context_parallel_inputs(cp, tokens, noise, tau, cu_seqlens, self.wte, self.embed_noise)
        h, _ = self.trunk(inputs.embeds, inputs.positions, inputs.shard)
        h = h[:, h.shape[1] - inputs.kept :]  # SingleForward: its window rows (its context rows fed the others)
        return (h if return_hidden else self.head(h)), inputs.rows

    def double_forward(
        self,
        context_kv: Sequence[KV],
        first: torch.Tensor,
        noise: torch.Tensor,
        tau: Temperature = 1.0,
        cu_seqlens=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """DoubleForward (paper eq. 19): the second round, conditioned on the first round's tokens.

        Args:
            context_kv: per layer, the context K/V ``[B, H, N, D]`` returned by :meth:`single_forward` (reused, not
            recomputed). first: ``[B, N, k]`` tokens predicted in round one (Future-1, embedded as ordinary tokens).
            noise: ``[B, N, k]`` fresh noise for round two (Future-2).
            tau: temperature, scalar or ``[B]``.
            cu_seqlens: the packed documents the context K/V were computed with.
            return_hidden: the final hidden states ``[B, N, k, C]`` in place of the logits.

        Returns:
            logits ``[B, N, k, V]``: ``[:, t, j]`` predicts token t + k + 1 + j given context ``<= t`` and ``first[:,
            t]``.
        """
        b, n, k = first.shape
        if noise.shape != first.shape:
            raise ValueError(f"noise: expected the shape of first {tuple(first.shape)}, got {tuple(noise.shape)}")
        if len(context_kv) != self.config.n_layer or context_kv[0][0].shape[2] != n:
            raise ValueError(f"context_kv: expected {self.config.n_layer} layers of K/V over N={n} context tokens")
        _check_tokens(first, self.config)
        x = torch.cat([self.wte(first).reshape(b, n * k, -1), self.embed_noise(noise, tau).reshape(b, n * k, -1)], 1)
        cu = as_cu_seqlens(cu_seqlens, n, b)
        layout = WindowLayout.kforcing_double(n, k, cu_seqlens=cu)
        h, _ = self.trunk(x, double_positions(n, k, first.device, cu), layout, past=context_kv)
        out = h[:, n * k :] if return_hidden else self.head(h[:, n * k :])
        return out.reshape(b, n, k, -1)


def _check_tokens(tokens: torch.Tensor, cfg: ModelConfig) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens: expected an int64/int32 tensor, got {getattr(tokens, 'dtype', type(tokens))}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        raise ValueError(
            f"tokens: expected ids in [0, {cfg.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]"
        )

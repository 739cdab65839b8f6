"""KV-cached generation: K-Forcing k tokens per forward (paper Algorithm 1) and the AR baseline.

Prompts of different lengths are right-padded. Each request keeps its own
context length ``len_b`` in the cache; its new tokens are written at ``len_b``,
so request b's valid cache is always the prefix ``[0, len_b)`` and every step is
one ``WindowLayout`` with per-request prefix ranges:

* prefill: ``[prompt (P_max) | window]``, the window of request b sees ``[0, P_b)``;
* decode: keys ``[cache (L_max) | window]``, queries the window only, the window of
  request b sees ``[0, len_b)``. For K-Forcing the window is ``[k new tokens | k noise]``
  (causal: the noise slots see all k new tokens, exactly as in SingleForward once
  those tokens are part of the context); for AR it is the one new token.

Only context K/V enter the cache; the noise tokens' K/V are dropped after each step.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from .layouts import WindowLayout
from .model import KForcingLM
from .ops.sampling import inverse_cdf_sample

Prompts = Union[torch.Tensor, Sequence[Sequence[int]], Sequence[torch.Tensor]]
Temperature = Union[float, torch.Tensor]


class KVCache:
    """Per-layer context K/V ``[B, H, capacity, D]`` and each request's length ``[B]``."""

    def __init__(self, model: KForcingLM, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        cfg = model.config
        shape = (batch, cfg.n_head, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.lengths = torch.zeros(batch, dtype=torch.int64)  # on CPU: it shapes the layouts
        self.capacity = capacity

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) ``[B, H, L_max, D]``; positions ``>= len_b`` of request b are masked by the layout."""
        n = self.max_length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self.k, self.v)]

    def append(self, kvs: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        """Write the first ``count`` tokens' K/V of each layer (``[B, H, >= count, D]``) at each request's length."""
        if int(self.lengths.max()) + count > self.capacity:
            raise RuntimeError(f"KV cache overflow: capacity {self.capacity}, need {int(self.lengths.max()) + count}")
        if bool((self.lengths == self.lengths[0]).all()):
            start = int(self.lengths[0])
            for layer, (k, v) in enumerate(kvs):
                self.k[layer][:, :, start:start + count] = k[:, :, :count]
                self.v[layer][:, :, start:start + count] = v[:, :, :count]
        else:
            device = self.k[0].device
            rows = torch.arange(len(self.lengths), device=device)[:, None]  # [B, 1]
            cols = (self.lengths[:, None] + torch.arange(count)).to(device)  # [B, count]
            for layer, (k, v) in enumerate(kvs):
                self.k[layer][rows, :, cols] = k[:, :, :count].transpose(1, 2)  # [B, count, H, D]
                self.v[layer][rows, :, cols] = v[:, :, :count].transpose(1, 2)
        self.lengths += count


def pad_prompts(prompts: Prompts, pad_id: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prompts -> (right-padded tokens ``[B, P_max]`` int64, lengths ``[B]`` int64 on CPU)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(f"prompts: expected a [B, P] tensor with P >= 1, got shape {tuple(prompts.shape)}")
        return prompts.to(device=device, dtype=torch.int64), torch.full((prompts.shape[0],), prompts.shape[1], dtype=torch.int64)
    rows = [torch.as_tensor(p, dtype=torch.int64).flatten() for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("prompts: expected at least one prompt, each with at least one token")
    lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
    tokens = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens[i, : r.numel()] = r
    return tokens.to(device), lengths


def _window_layout(n_ctx: int, lengths: torch.Tensor, window: int, queries: str) -> WindowLayout:
    """One window per request after ``n_ctx`` context keys; request b's window sees ``[0, lengths[b])``."""
    if bool((lengths == lengths[0]).all()):  # one shared range: the backends' cheaper unbatched path
        hi = lengths[:1]
    else:
        hi = lengths[:, None]
    return WindowLayout(n_ctx, 1, window, torch.zeros_like(hi), hi, intra="causal", queries=queries)


def _check_generation(model: KForcingLM, tokens: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= model.config.vocab_size):
        raise ValueError(f"prompts: expected token ids in [0, {model.config.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")


def _model_dtype(model: KForcingLM) -> torch.dtype:
    return model.wte.weight.dtype


@torch.no_grad()
def generate_kforcing(
    model: KForcingLM,
    prompts: Prompts,
    k: int,
    max_new_tokens: int,
    *,
    temperature: Temperature = 1.0,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """K-Forcing generation with a KV cache (paper Algorithm 1): k tokens per forward pass.

    Args:
        model: a PFLM trained with window ``k_train >= k``.
        prompts: ``[B, P]`` tensor or B sequences of different lengths.
        k: tokens per step (any k <= k_train).
        max_new_tokens: T; ``ceil(T / k)`` forward passes are made.
        temperature: tau fed to the noise encoder, scalar or ``[B]`` (decoding is argmax, as in the paper).
        noise: optional ``[B, ceil(T / k), k]`` uniforms; drawn from ``generator`` otherwise.

    Returns:
        int64 ``[B, T]``: the generated tokens (prompts not included).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive int, got {k!r}")
    device = model.wte.weight.device
    tokens, lengths = pad_prompts(prompts, device=device)
    _check_generation(model, tokens, max_new_tokens)
    b, p_max = tokens.shape
    steps = math.ceil(max_new_tokens / k)
    if noise is None:
        noise = torch.rand((b, steps, k), generator=generator, device=generator.device if generator else "cpu")
    if noise.shape != (b, steps, k):
        raise ValueError(f"noise: expected shape {(b, steps, k)} ([B, ceil(T/k), k]), got {tuple(noise.shape)}")
    noise = noise.to(device)
    tau = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    cache = KVCache(model, b, p_max + steps * k, _model_dtype(model), device)
    out = torch.empty(b, steps * k, dtype=torch.int64, device=device)

    # Prefill: [prompt | k noise]; request b's noise slot i sits at position P_b + i.
    positions = torch.cat([torch.arange(p_max).expand(b, p_max), lengths[:, None] + torch.arange(k)], 1).to(device)
    x = torch.cat([model.wte(tokens), model.embed_noise(noise[:, 0], tau)], 1)  # [B, P_max + k, C]
    h, kvs = model.trunk(x, positions, _window_layout(p_max, lengths, k, "all"))
    cache.append(kvs, p_max)  # the whole padded prompt; lengths are then set to the true ones
    cache.lengths = lengths.clone()
    out[:, :k] = model.head(h[:, p_max:]).argmax(-1)

    for s in range(1, steps):
        # Decode: [k tokens just produced | k fresh noise] at positions len_b .. len_b + 2k - 1.
        new = out[:, (s - 1) * k: s * k]
        x = torch.cat([model.wte(new), model.embed_noise(noise[:, s], tau)], 1)  # [B, 2k, C]
        positions = (cache.lengths[:, None] + torch.arange(2 * k)).to(device)
        h, kvs = model.trunk(x, positions, _window_layout(cache.max_length, cache.lengths, 2 * k, "windows"), past=cache.past())
        cache.append(kvs, k)  # context K/V only; the noise K/V are dropped
        out[:, s * k:(s + 1) * k] = model.head(h[:, k:]).argmax(-1)
    return out[:, :max_new_tokens]


@torch.no_grad()
def generate_ar(
    model: KForcingLM,
    prompts: Prompts,
    max_new_tokens: int,
    *,
    temperature: Temperature = 1.0,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """AR generation with a KV cache (the baseline): one token per forward pass.

    Sampling is inverse-CDF of ``softmax(logits / temperature)`` at uniform noise (``[B, T]``,
    drawn from ``generator`` when not given); ``temperature=0`` is greedy.

    Returns:
        int64 ``[B, T]``.
    """
    device = model.wte.weight.device
    tokens, lengths = pad_prompts(prompts, device=device)
    _check_generation(model, tokens, max_new_tokens)
    b, p_max = tokens.shape
    if noise is None:
        noise = torch.rand((b, max_new_tokens), generator=generator, device=generator.device if generator else "cpu")
    if noise.shape != (b, max_new_tokens):
        raise ValueError(f"noise: expected shape {(b, max_new_tokens)} ([B, T]), got {tuple(noise.shape)}")
    noise = noise.to(device)
    greedy = isinstance(temperature, (int, float)) and temperature == 0

    def pick(logits: torch.Tensor, step: int) -> torch.Tensor:  # [B, V] -> [B]
        return logits.argmax(-1) if greedy else inverse_cdf_sample(logits, noise[:, step], temperature)

    cache = KVCache(model, b, p_max + max_new_tokens, _model_dtype(model), device)
    out = torch.empty(b, max_new_tokens, dtype=torch.int64, device=device)
    h, kvs = model.trunk(model.wte(tokens), torch.arange(p_max, device=device), WindowLayout.causal(p_max))
    cache.append(kvs, p_max)
    cache.lengths = lengths.clone()
    last = h[torch.arange(b, device=device), (lengths - 1).to(device)]  # [B, C]: each prompt's last token
    out[:, 0] = pick(model.head(last), 0)
    for s in range(1, max_new_tokens):
        positions = cache.lengths[:, None].to(device)  # [B, 1]
        h, kvs = model.trunk(model.wte(out[:, s - 1: s]), positions, _window_layout(cache.max_length, cache.lengths, 1, "windows"), past=cache.past())
        cache.append(kvs, 1)
        out[:, s] = pick(model.head(h[:, 0]), s)
    return out


# ---------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> None:
    from .checkpoint import load_model

    parser = argparse.ArgumentParser(prog="python -m kforcing_kernels.inference", description="Generate from a trained stage (AR or K-Forcing).")
    parser.add_argument("model", help="a stage folder written by kforcing_kernels.train (holds model.safetensors)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--k", type=int, default=None, help="tokens per step (default: the model's k_train; AR models ignore it)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.max_new_tokens < 1:
        parser.error(f"argument --max-new-tokens: expected a positive integer, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        parser.error(f"argument --temperature: expected a number >= 0, got {args.temperature}")
    if not (Path(args.model) / "model.json").exists():
        parser.error(f"argument model: no trained model in {args.model!r} (expected {Path(args.model) / 'model.json'})")
    model, info, tokenizer = load_model(args.model)
    if tokenizer is None:
        parser.error(f"argument model: {args.model!r} has no tokenizer.json")
    gen = torch.Generator().manual_seed(args.seed)
    eos = tokenizer.token_to_id("<|eos|>")
    prompts = [tokenizer.encode(p).ids or [eos] for p in args.prompt]  # an empty prompt starts a new document
    if info["k"] == 0:
        out = generate_ar(model, prompts, args.max_new_tokens, temperature=args.temperature, generator=gen)
    else:
        k = info["k"] if args.k is None else args.k
        if not 1 <= k <= info["k"]:
            parser.error(f"argument --k: expected 1 <= k <= k_train={info['k']}, got {k}")
        if args.temperature == 0:
            parser.error("argument --temperature: K-Forcing models take tau > 0 (decoding is argmax already)")
        out = generate_kforcing(model, prompts, k, args.max_new_tokens, temperature=args.temperature, generator=gen)
    for p, o in zip(args.prompt, out.tolist()):
        print(p + tokenizer.decode(o, skip_special_tokens=False))
        print("-" * 40)


if __name__ == "__main__":
    main()

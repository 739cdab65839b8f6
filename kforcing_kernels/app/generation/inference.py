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

Two caches give the same tokens for the same noise (``cache=``): ``"paged"``
(:class:`~kforcing_kernels.app.generation.paged_cache.PagedKVCache`: pages from a pool, decode
attention reads them in place, no copy of the cache per step; the step API for
continuous batching is :class:`~kforcing_kernels.app.generation.serving.PagedGenerator`) and
``"contiguous"`` (one ``[B, H, capacity, D]`` buffer per layer; each decode step
concatenates the cache with the new keys, an O(L) copy).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ...layouts import WindowLayout
from ...model import KForcingLM
from ...model.decoding import decode_rule, decode_slots
from ...ops.sampling import inverse_cdf_sample
from ...types import Temperature
from ..student import Student, device_of, dtype_of, kind_of
from .checks import check_ar, check_generator, check_k, check_noise, check_temperature, is_greedy
from .prompt_batch import Prompts, pad_prompts
from .serving import PagedGenerator, Request, prefill_kforcing
from .static_step import StaticDecodeStep, check_compile_step

CACHES = ("paged", "contiguous")


class KVCache:
    """Per-layer context K/V of a fixed capacity, ``[B, capacity, H, D]``, and each request's length ``[B]`` (CPU).

    The decode step reads it in place as a pool of B pages of ``capacity`` tokens (one per request, block
    table ``[[0], [1], ...]``: :meth:`block_table`), through the same static step as the paged cache
    (:class:`~kforcing_kernels.app.generation.static_step.StaticDecodeStep`), which writes each pass's K/V itself.
    """

    def __init__(self, model: KForcingLM, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        cfg = model.config
        # One tensor [layer, K/V, request, position, head, dim]: a decode step writes all layers in one index_copy_.
        self.kv = torch.zeros((cfg.n_layer, 2, batch, capacity, cfg.n_head, cfg.head_dim), dtype=dtype, device=device)
        self.k = [self.kv[layer, 0] for layer in range(cfg.n_layer)]  # per layer [B, capacity, H, D]
        self.v = [self.kv[layer, 1] for layer in range(cfg.n_layer)]
        self.lengths = torch.zeros(batch, dtype=torch.int64)  # on CPU: the host's copy, set at prefill
        self.capacity = capacity

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def block_table(self) -> torch.Tensor:
        """int32 ``[B, 1]``: request b's one page is page b of each layer's ``[B, capacity, H, D]`` pool."""
        return torch.arange(len(self.lengths), dtype=torch.int32)[:, None]

    def append(self, kvs: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        """Write the first ``count`` tokens' K/V of each layer (``[B, H, >= count, D]``) at each request's length."""
        if int(self.lengths.max()) + count > self.capacity:
            raise RuntimeError(f"KV cache overflow: capacity {self.capacity}, need {int(self.lengths.max()) + count}")
        if bool((self.lengths == self.lengths[0]).all()):
            start = int(self.lengths[0])
            for layer, (k, v) in enumerate(kvs):
                self.k[layer][:, start : start + count] = k[:, :, :count].transpose(1, 2)
                self.v[layer][:, start : start + count] = v[:, :, :count].transpose(1, 2)
        else:
            device = self.k[0].device
            rows = torch.arange(len(self.lengths), device=device)[:, None]  # [B, 1]
            cols = (self.lengths[:, None] + torch.arange(count)).to(device)  # [B, count]
            for layer, (k, v) in enumerate(kvs):
                self.k[layer][rows, cols] = k[:, :, :count].transpose(1, 2)  # [B, count, H, D]
                self.v[layer][rows, cols] = v[:, :, :count].transpose(1, 2)
        self.lengths += count


def _generation_options(
    model: Student, cache: Optional[str], page_size: Optional[int], compile_step: Union[bool, str]
) -> dict:
    """``cache`` / ``page_size`` / ``compile_step`` as the model's kind honours them (an option it cannot honour is
    refused, naming the option and the kind: :meth:`ModelKind.generation_options`)."""
    if cache is not None and cache not in CACHES:
        raise ValueError(f"cache: expected one of {CACHES}, got {cache!r}")
    if page_size is not None:
        _check_page_size(page_size)
    if compile_step is not False:
        check_compile_step(compile_step, device_of(model))
    return kind_of(model).generation_options(cache, page_size, compile_step)


def _check_generation(model: Student, tokens: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= model.config.vocab_size):
        raise ValueError(
            f"prompts: expected token ids in [0, {model.config.vocab_size}), got [{int(tokens.min())}, "
            f"{int(tokens.max())}]"
        )


def _run_paged(
    model,
    requests: list[Request],
    k: Optional[int],
    page_size: Optional[int],
    return_logits: bool,
    k_train: Optional[int] = None,
    compile_step: Union[bool, str] = False,
):
    """All requests join at once; returns (tokens [B, T], logits [B, T, V] or None)."""
    page_size = _check_page_size(page_size)
    num_pages = sum(
        math.ceil((r.prompt.numel() if isinstance(r.prompt, torch.Tensor) else len(r.prompt)) / page_size)
        + math.ceil(r.max_new_tokens / page_size)
        + 1
        for r in requests
    )
    gen = PagedGenerator(
        model,
        k,
        page_size=page_size,
        num_pages=num_pages,
        keep_logits=return_logits,
        k_train=k_train,
        compile_step=compile_step,
    )
    while not all(r.done for r in requests):
        gen.step(requests)
    out = torch.tensor([r.tokens for r in requests], dtype=torch.int64, device=model.wte.weight.device)
    logits = torch.stack([torch.cat(r.logits) for r in requests]) if return_logits else None
    return out, logits


def _check_page_size(page_size) -> int:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    return page_size


def _rows(tokens: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    return [tokens[i, : int(n)].cpu() for i, n in enumerate(lengths)]


@torch.no_grad()
def generate_kforcing(
    model: Student,
    prompts: Prompts,
    k: int,
    max_new_tokens: int,
    *,
    temperature: Temperature = 1.0,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    cache: Optional[str] = None,
    page_size: Optional[int] = None,
    k_train: Optional[int] = None,
    return_logits: bool = False,
    compile_step: Union[bool, str] = False,
):
    """K-Forcing generation with a KV cache (paper Algorithm 1): k tokens per forward pass.

    Args:
        model: a PFLM trained with window ``k_train >= k``.
        prompts: ``[B, P]`` tensor, B sequences of different lengths, or one flat
            sequence / 1-D tensor of ids (one prompt).
        k: tokens per step, ``1 <= k <= k_train``.
        max_new_tokens: T; ``ceil(T / k)`` forward passes are made.
        temperature: tau > 0 fed to the noise encoder, scalar or ``[B]`` (decoding: the model's
            ``config.decode``, argmax as in the paper or ``residual``, kforcing_kernels/model/decoding.py).
        noise: optional ``[B, ceil(T / k), k]`` uniforms; drawn from ``generator`` otherwise.
        cache: ``"paged"`` (pages of ``page_size`` tokens, default 16, read in place) or ``"contiguous"``, same
            tokens; None: the kind's default (a native model: ``"paged"``). A kind that decodes over its own cache
            (a Hugging Face student) takes neither ``cache`` nor ``page_size`` (refused by name, not ignored).
        k_train: the window the model was trained with; default ``model.k_train``
            (set by ``train.load_model``), unchecked when neither is known.
        return_logits: also return the logits ``[B, T, V]`` that decided each token.
        compile_step: how the decode step runs (``static_step.py``; the package's own caches): False (eager,
            the default), True (``torch.compile(fullgraph=True)``, mode ``"reduce-overhead"`` on CUDA) or
            ``"cudagraph"`` (captured once, replayed; CUDA only). Same tokens; compiled logits within rounding.

    Returns:
        int64 ``[B, T]``: the generated tokens (prompts not included); with ``return_logits``, ``(tokens, logits)``.
    """
    check_k(model, k, k_train)
    device = device_of(model)
    tokens, lengths = pad_prompts(prompts, device=device)
    _check_generation(model, tokens, max_new_tokens)
    b = tokens.shape[0]
    check_temperature(temperature, b, allow_zero=False)
    steps = math.ceil(max_new_tokens / k)
    if noise is None:
        noise = torch.rand(
            (b, steps, k), generator=check_generator(generator), device=generator.device if generator else "cpu"
        )
    check_noise(noise)
    if noise.shape != (b, steps, k):
        raise ValueError(f"noise: expected shape {(b, steps, k)} ([B, ceil(T/k), k]), got {tuple(noise.shape)}")
    noise = noise.to(device)
    options = _generation_options(model, cache, page_size, compile_step)
    out, logits = kind_of(model).generate_kforcing(
        model,
        tokens,
        lengths,
        noise,
        temperature,
        k=k,
        max_new_tokens=max_new_tokens,
        k_train=k_train,
        return_logits=return_logits,
        **options,
    )
    return (out, logits) if return_logits else out


def cached_kforcing(
    model: KForcingLM,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    noise: torch.Tensor,
    temperature: Temperature,
    *,
    k: int,
    max_new_tokens: int,
    cache: str,
    page_size: Optional[int],
    k_train: Optional[int],
    return_logits: bool,
    compile_step: Union[bool, str] = False,
):
    """:func:`generate_kforcing`'s loop over the package's own KV caches (the native kind's, app/native.py), arguments
    checked: ``(tokens [B, T], logits [B, T, V] or None without return_logits)``."""
    (b, p_max), device, steps = tokens.shape, tokens.device, noise.shape[1]
    if cache == "paged":
        taus = torch.as_tensor(temperature, dtype=torch.float64).expand(b).tolist()
        requests = [
            Request(row, max_new_tokens, noise=noise[i], temperature=taus[i])
            for i, row in enumerate(_rows(tokens, lengths))
        ]
        return _run_paged(model, requests, k, page_size, return_logits, k_train, compile_step)

    tau = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    rule = decode_rule(model)
    kv = KVCache(model, b, p_max + steps * k, dtype_of(model), device)
    out = torch.empty(b, steps * k, dtype=torch.int64, device=device)
    all_logits = []

    # Prefill: [prompt | k noise]; the paged path runs the same function.
    h, kvs = prefill_kforcing(model, tokens, lengths, noise[:, 0], tau.expand(b) if tau.dim() == 0 else tau)
    kv.append(kvs, p_max)  # the whole padded prompt; lengths are then set to the true ones
    kv.lengths = lengths.clone()
    logits = model.head(h[:, p_max:])
    out[:, :k] = decode_slots(logits, noise[:, 0], rule)
    all_logits.append(logits)

    # Decode: [k tokens just produced | k fresh noise] at positions len_b .. len_b + 2k - 1, one static step
    # (no layout, no host work): request b's window sees its [0, len_b) of the cache, read in place.
    step = StaticDecodeStep(model, k, kv.k, kv.v, kv.capacity, compile_step=compile_step, kv=kv.kv)
    state = step.state(kv.lengths, kv.block_table(), temperature)
    for s in range(1, steps):
        new, logits = step(state, out[:, (s - 1) * k : s * k], noise[:, s])
        out[:, s * k : (s + 1) * k] = new
        if return_logits:
            all_logits.append(logits.clone() if compile_step else logits)
    return out[:, :max_new_tokens], torch.cat(all_logits, 1)[:, :max_new_tokens] if return_logits else None


@torch.no_grad()
def generate_ar(
    model: Student,
    prompts: Prompts,
    max_new_tokens: int,
    *,
    temperature: Temperature = 1.0,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    cache: Optional[str] = None,
    page_size: Optional[int] = None,
    return_logits: bool = False,
    compile_step: Union[bool, str] = False,
):
    """AR generation with a KV cache (the baseline): one token per forward pass.

    Sampling is inverse-CDF of ``softmax(logits / temperature)`` at uniform noise (``[B, T]``,
    drawn from ``generator`` when not given); ``temperature=0`` is greedy. ``prompts``,
    ``cache``, ``page_size``, ``return_logits`` and ``compile_step`` as in :func:`generate_kforcing`.

    Returns:
        int64 ``[B, T]`` (and the logits ``[B, T, V]`` with ``return_logits``).
    """
    check_ar(model)
    device = device_of(model)
    tokens, lengths = pad_prompts(prompts, device=device)
    _check_generation(model, tokens, max_new_tokens)
    b = tokens.shape[0]
    check_temperature(temperature, b, allow_zero=True)
    if noise is None:
        noise = torch.rand(
            (b, max_new_tokens), generator=check_generator(generator), device=generator.device if generator else "cpu"
        )
    check_noise(noise)  # the same checks as the paged cache's requests
    if noise.shape != (b, max_new_tokens):
        raise ValueError(f"noise: expected shape {(b, max_new_tokens)} ([B, T]), got {tuple(noise.shape)}")
    noise = noise.to(device)
    options = _generation_options(model, cache, page_size, compile_step)
    out, logits = kind_of(model).generate_ar(
        model,
        tokens,
        lengths,
        noise,
        temperature,
        max_new_tokens=max_new_tokens,
        return_logits=return_logits,
        **options,
    )
    return (out, logits) if return_logits else out


def cached_ar(
    model: KForcingLM,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    noise: torch.Tensor,
    temperature: Temperature,
    *,
    max_new_tokens: int,
    cache: str,
    page_size: Optional[int],
    return_logits: bool,
    compile_step: Union[bool, str] = False,
):
    """:func:`generate_ar`'s loop over the package's own KV caches (the native kind's), arguments checked."""
    (b, p_max), device, greedy = tokens.shape, tokens.device, is_greedy(temperature)
    if cache == "paged":
        taus = torch.as_tensor(temperature, dtype=torch.float64).expand(b).tolist()
        requests = [
            Request(row, max_new_tokens, noise=noise[i], temperature=taus[i])
            for i, row in enumerate(_rows(tokens, lengths))
        ]
        return _run_paged(model, requests, None, page_size, return_logits, compile_step=compile_step)

    def pick(logits: torch.Tensor, step: int) -> torch.Tensor:  # [B, V] -> [B]
        return logits.argmax(-1) if greedy else inverse_cdf_sample(logits, noise[:, step], temperature)

    kv = KVCache(model, b, p_max + max_new_tokens, dtype_of(model), device)
    out = torch.empty(b, max_new_tokens, dtype=torch.int64, device=device)
    h, kvs = model.trunk(model.wte(tokens), torch.arange(p_max, device=device), WindowLayout.causal(p_max))
    kv.append(kvs, p_max)
    kv.lengths = lengths.clone()
    last = h[torch.arange(b, device=device), (lengths - 1).to(device)]  # [B, C]: each prompt's last token
    all_logits = [model.head(last)]
    out[:, 0] = pick(all_logits[0], 0)
    step = StaticDecodeStep(model, None, kv.k, kv.v, kv.capacity, compile_step=compile_step, kv=kv.kv)
    state = step.state(kv.lengths, kv.block_table(), 0.0 if greedy else temperature)
    for s in range(1, max_new_tokens):
        new, logits = step(state, out[:, s - 1 : s], noise[:, s])
        out[:, s] = new[:, 0]
        if return_logits:
            all_logits.append(logits[:, 0].clone() if compile_step else logits[:, 0])
    return out, torch.stack(all_logits, 1) if return_logits else None


# ---------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The ``kforcing-generate`` command line (shared options from :mod:`kforcing_kernels.app.cli`)."""
    from ..cli import add_device, add_new_tokens, add_seed, add_temperature, add_threads, make_parser

    parser = make_parser("kforcing-generate", "Generate from a trained stage (AR or K-Forcing).")
    parser.add_argument("model", help="a stage folder written by kforcing_kernels.app.train (holds model.safetensors)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument(
        "--k", type=int, default=None, help="tokens per step (None: the model's k_train; AR models ignore it)"
    )
    add_new_tokens(parser)
    add_temperature(parser, help_extra="; 0: greedy (AR models only)")
    add_seed(parser)
    add_device(parser)
    add_threads(parser)
    parser.add_argument(
        "--out", default=None, help="also write the generations to this JSON Lines file (prompt, completion, token ids)"
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    from ..cli import apply_threads
    from ..student import load_student

    parser = build_parser()
    args = parser.parse_args(argv)
    apply_threads(args.threads)

    if not (Path(args.model) / "model.json").exists():
        parser.error(f"argument model: no trained model in {args.model!r} (expected {Path(args.model) / 'model.json'})")
    if args.out:
        _check_out(parser, args.out)  # before any work: a bad --out fails fast
    try:
        model, info, tokenizer = load_student(args.model, device=args.device)
    except ValueError as exc:  # CheckpointError too: a missing, damaged or malformed file, named with its entry
        parser.error(f"argument model: {exc}")
    if tokenizer is None:
        parser.error(f"argument model: {args.model!r} has no tokenizer.json")
    gen = torch.Generator().manual_seed(args.seed)
    eos = kind_of(model).eos_id(model, tokenizer)
    # an empty prompt starts a new document
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids or [eos] for p in args.prompt]
    if info["k"] == 0:
        out = generate_ar(model, prompts, args.new_tokens, temperature=args.temperature, generator=gen)
    else:
        k = info["k"] if args.k is None else args.k
        if not 1 <= k <= info["k"]:
            parser.error(f"argument --k: expected 1 <= k <= k_train={info['k']}, got {k}")
        if args.temperature == 0:
            parser.error("argument --temperature: K-Forcing models take tau > 0 (decoding is argmax already)")
        out = generate_kforcing(model, prompts, k, args.new_tokens, temperature=args.temperature, generator=gen)
    records = []
    for p, o in zip(args.prompt, out.tolist()):
        text = tokenizer.decode(o, skip_special_tokens=False)
        print(p + text)
        print("-" * 40)
        records.append({"prompt": p, "completion": text, "tokens": o})
    if args.out:
        _write_out(parser, args.out, records)


def _check_out(parser: argparse.ArgumentParser, path: str) -> None:
    """Fail before any work when ``path`` cannot be written (a folder, a missing or unwritable folder)."""
    from ..files import CheckpointError, check_writable

    try:
        check_writable(path, "--out")
    except CheckpointError as exc:
        parser.error(f"argument {exc}")


def _write_out(parser: argparse.ArgumentParser, path: str, records: list) -> None:
    """JSON Lines through the package's atomic writer (never a half-written file, no symlink followed, mode from
    the umask)."""
    from ..files import CheckpointError, write_text

    try:
        write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    except CheckpointError as exc:
        parser.error(f"argument --out: {exc}")


if __name__ == "__main__":
    main()

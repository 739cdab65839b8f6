"""A decode call of ``window_attention`` on K/V views of a stacked cache, under ``no_grad``: bytes copied and time.

    python -m bench decode-copy                          # B=4, H=12, context 2048, k=4, D=64, backend cpp
    python -m bench decode-copy --context 4096 --backend composite --threads 2

The K/V are one layer of a ``[layers, B, H, context + k, D]`` cache (``cache[layer]``: a contiguous view of a
larger buffer), the queries the k new tokens. Before issue 56 item 7 the eager path ran its autograd Function
even under no_grad and saved compact copies of such views (``ops/common/saved.own_storage``) that nobody kept:
the whole layer's K and V copied on every call. Prints the bytes ``aten::clone`` copied per call (profiler) and
the median ms of the call (``bench/_timing.measure``).
"""

from __future__ import annotations

import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.app.cli import positive_int

from .._timing import measure, pin_threads


def add_arguments(p) -> None:
    p.add_argument("--batch-size", type=positive_int, default=4, help="rows B")
    p.add_argument("--heads", type=positive_int, default=12, help="heads H")
    p.add_argument("--context", type=positive_int, default=2048, help="cached context length")
    p.add_argument("--k", type=positive_int, default=4, help="tokens decoded per call (the window)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim D")
    p.add_argument("--layers", type=positive_int, default=4, help="layers in the stacked cache")
    p.add_argument("--backend", default="cpp", help="window_attention backend")
    p.add_argument("--reps", type=positive_int, default=20, help="timed calls")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: all cores)")


def _clone_bytes(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = 0
    for event in prof.events():
        if event.name == "aten::clone" and event.input_shapes and event.input_shapes[0]:
            total += torch.Size(event.input_shapes[0]).numel() * 4  # fp32 inputs
    return total


def execute(args) -> int:
    threads = pin_threads(args.threads)
    b, h, n, k, d = args.batch_size, args.heads, args.context, args.k, args.head_dim
    layout = WindowLayout(
        n, 1, k, torch.zeros(1, dtype=torch.long), torch.full((1,), n), intra="causal", queries="windows"
    )
    gen = torch.Generator().manual_seed(0)
    cache_k = torch.randn(args.layers, b, h, n + k, d, generator=gen)
    cache_v = torch.randn(args.layers, b, h, n + k, d, generator=gen)
    q = torch.randn(b, h, k, d, generator=gen)
    keys, values = cache_k[1], cache_v[1]  # contiguous views of the whole cache

    def call():
        with torch.no_grad():
            window_attention(q, keys, values, layout, backend=args.backend)

    call()  # the eager cache's validating first call
    copied = _clone_bytes(call)
    timing = measure(call, warmup=2, reps=args.reps)
    print(
        f"decode call, no_grad, K/V = cache[1] of {tuple(cache_k.shape)} fp32, q {tuple(q.shape)}, "
        f"backend {args.backend}, {threads} threads"
    )
    print(
        f"  bytes cloned per call: {copied} ({copied / 2**20:.1f} MiB; K+V of one layer: "
        f"{2 * keys.numel() * 4 / 2**20:.1f} MiB)"
    )
    print(f"  median {timing['median_ms']:.2f} ms   min {timing['min_ms']:.2f} ms   ({timing['reps']} calls)")
    return 0

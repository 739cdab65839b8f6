"""K-Forcing's SingleForward under a model's sliding window: attended pairs and window_attention time.

    python -m bench sliding-window                                  # N=2048, k=4, W=512, cpp, 2 threads
    python -m bench sliding-window --n 4096 --k 4 --window 512 --backend cpp --json out.json

For each layout, ``WindowLayout.kforcing_single(N, k)`` (what a global-attention layer computes) and
``.with_sliding_window(W)`` (a sliding layer, e.g. Gemma3's local layers or Mistral): the attended
(query, key) pairs, and ``window_attention`` forward and forward + backward times (median of ``--reps``
runs after a warm-up, with the min-max spread), fp32, ``[B, H, L, D]`` inputs. The window bounds how far
back each row reaches, so a sliding layer's work grows as N * W instead of N^2 / 2.
"""

from __future__ import annotations

import json

import torch

from kforcing_kernels import BACKENDS, WindowLayout, window_attention
from kforcing_kernels.app.cli import add_batch_size, add_threads, positive_int

from .._timing import measure


def _summary(fn, reps: int) -> dict:
    t = measure(fn, warmup=1, reps=reps)
    return {key: round(t[key], 2) for key in ("median_ms", "min_ms", "max_ms")}


DEFAULT_THREADS = 2  # the README's numbers


def add_arguments(p) -> None:
    p.add_argument("--n", type=positive_int, default=2048, help="context length N")
    p.add_argument("--k", type=positive_int, default=4, help="window slots per context token")
    p.add_argument("--window", type=positive_int, default=512, help="the model's sliding window W")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads H")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim D")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="cpp",
        help="window_attention backend, on CPU tensors",
    )
    p.add_argument("--reps", type=positive_int, default=5, help="timed runs of each case after one untimed")
    add_threads(p, none=f"{DEFAULT_THREADS}")
    p.add_argument("--json", default=None, help="also write the results here")


def finish_args(p, args, argv, prog):
    if args.threads is None:
        args.threads = DEFAULT_THREADS
    return args


def execute(args) -> dict:
    torch.set_num_threads(args.threads)
    full = WindowLayout.kforcing_single(args.n, args.k)
    layouts = {"global": full, f"sliding W={args.window}": full.with_sliding_window(args.window)}
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.heads, full.n_keys, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3))
    results = {
        "n": args.n,
        "k": args.k,
        "window": args.window,
        "backend": args.backend,
        "threads": args.threads,
        "shape": list(shape),
        "layouts": {},
    }
    for name, layout in layouts.items():

        def forward(layout=layout):
            with torch.no_grad():
                window_attention(q, k, v, layout, backend=args.backend)

        def forward_backward(layout=layout):
            out = window_attention(q, k, v, layout, backend=args.backend)
            torch.autograd.grad(out.sum(), (q, k, v))

        results["layouts"][name] = {
            "pairs": int(layout.num_pairs()),
            "forward": _summary(forward, args.reps),
            "forward_backward": _summary(forward_backward, args.reps),
        }
        row = results["layouts"][name]
        print(
            f"{name:>16}: {row['pairs']:>11,} pairs  fwd {row['forward']['median_ms']:8.1f} ms "
            f"[{row['forward']['min_ms']:.1f}-{row['forward']['max_ms']:.1f}]  fwd+bwd "
            f"{row['forward_backward']['median_ms']:8.1f} ms [{row['forward_backward']['min_ms']:.1f}-"
            f"{row['forward_backward']['max_ms']:.1f}]"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results

"""The chunked loss under ``torch.no_grad()`` (``evaluate_loss``): the head requiring grad vs detached.

    python -m bench eval-loss                          # R=4096, C=256, V=8000, CPU, all cores
    python -m bench eval-loss --rows 4096 --width 256 --vocab 8000 --threads 2

``linear_cross_entropy`` under no_grad must compute the losses only (issue 56 item 2): with the weight and
hidden states requiring grad (a model evaluated between training steps) it should cost what it costs with
them detached. Before the fix it allocated the head's fp32 ``[V, C]`` gradient and ran the gradient products
of every chunk. Prints the median ms of both, round-robin (``bench/_timing.measure_many``), and their ratio.
"""

from __future__ import annotations

import torch

from kforcing_kernels.app.cli import positive_int
from kforcing_kernels.app.training.linear_ce import linear_cross_entropy

from .._timing import measure_many, paired_ratio, pin_threads


def add_arguments(p) -> None:
    p.add_argument("--rows", type=positive_int, default=4096, help="rows R (batch x positions)")
    p.add_argument("--width", type=positive_int, default=256, help="hidden width C")
    p.add_argument("--vocab", type=positive_int, default=8000, help="vocabulary V")
    p.add_argument("--reps", type=positive_int, default=5, help="timed rounds")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: all cores)")


def execute(args) -> int:
    threads = pin_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.width, generator=gen, requires_grad=True)
    weight = (torch.randn(args.vocab, args.width, generator=gen) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    row_weights = torch.full((args.rows,), 1.0 / args.rows)

    def run(h, w):
        def call():
            with torch.no_grad():
                linear_cross_entropy(h, w, None, targets, row_weights)

        return call

    fns = {"requires_grad": run(hidden, weight), "detached": run(hidden.detach(), weight.detach())}
    res = measure_many(fns, warmup=1, reps=args.reps)
    print(f"linear_cross_entropy under no_grad, R={args.rows} C={args.width} V={args.vocab}, {threads} threads")
    for key, r in res.items():
        print(f"  {key:14s} median {r['median_ms']:9.1f} ms   min {r['min_ms']:9.1f} ms   ({r['reps']} rounds)")
    ratio = paired_ratio(res["requires_grad"]["times_ms"], res["detached"]["times_ms"])
    print(f"  requires_grad / detached (median of per-round ratios): {ratio:.2f}x")
    return 0

"""EAGLE-3 training-time test: one step's attention against causal attention over L, and mask construction.

Step j of the test attends L queries over ``(j + 1) L`` keys; its attended pairs are causal's plus
``j L`` (``WindowLayout.eagle3_ttt``). Times one attention layer forward + backward of step j against
``WindowLayout.causal(L)`` on the same backend, interleaved (``measure_many``: the ratio is per round),
and the cost of building what the kernels need for a step (the layout, its row intervals and the C++
query tiles) against ``create_block_mask`` of the same mask as a FlexAttention ``mask_mod`` (SpecForge's
formula) on the CPU:

    OMP_NUM_THREADS=2 python -m bench eagle3 --length 2048 --step 4 --backend cpp
"""

from __future__ import annotations

import argparse
import json

import torch

from kforcing_kernels.app.cli import positive_int
from kforcing_kernels.layouts import WindowLayout, derived
from kforcing_kernels.ops.window_attention import window_attention

from .._timing import measure, measure_many, paired_ratio, pin_threads


def specforge_mask_mod(length: int):
    """SpecForge's EAGLE-3 flex ``mask_mod`` (every position valid): causal base, diagonal step blocks."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | ((kv_idx >= length) & ((kv_idx - q_idx) % length == 0))

    return mask_mod


def build_step(length: int, step: int):
    """A step's layout and what the cpp kernels read, built from nothing: equal layouts share derived data
    (layouts/derived.py), so the table of registered contents is emptied first, as for a new step's shapes."""
    derived.clear_interned()
    layout = WindowLayout.eagle3_ttt(length, step)
    _ = layout.row_intervals_int32, layout.cpu_query_tiles  # what the cpp kernels read, built (and cached) here
    return layout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=positive_int, default=2048, help="L, positions per pass")
    p.add_argument("--step", type=positive_int, default=4, help="the test step j (keys (j + 1) L)")
    p.add_argument("--backend", default="cpp", help="window_attention backend (a row-subset backend)")
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension D")
    p.add_argument("--reps", type=positive_int, default=5, help="interleaved rounds")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (None: all cores)")
    p.add_argument("--json", help="also write the numbers here")


def execute(args: argparse.Namespace) -> int:
    threads = pin_threads(args.threads)
    length, step, h, d = args.length, args.step, args.heads, args.head_dim
    layout, causal = WindowLayout.eagle3_ttt(length, step), WindowLayout.causal(length)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, length, d, generator=g)
    k = torch.randn(1, h, layout.n_keys, d, generator=g)
    v = torch.randn(1, h, layout.n_keys, d, generator=g)

    def fwd_bwd(lay, keys):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k[:, :, :keys], v[:, :, :keys]))
        out = window_attention(qq, kk, vv, lay, backend=args.backend)
        torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))

    timing = measure_many(
        {"eagle3": lambda: fwd_bwd(layout, layout.n_keys), "causal": lambda: fwd_bwd(causal, length)},
        warmup=1,
        reps=args.reps,
    )
    ratio = paired_ratio(timing["eagle3"]["times_ms"], timing["causal"]["times_ms"])
    pairs = layout.num_pairs() / causal.num_pairs()
    print(f"EAGLE-3 step {step}, L={length}, B=1 H={h} D={d} fp32, {threads} threads, backend={args.backend}")
    print(
        f"  attention fwd+bwd ms (min / median): step {timing['eagle3']['min_ms']:.1f} / "
        f"{timing['eagle3']['median_ms']:.1f}, causal {timing['causal']['min_ms']:.1f} / "
        f"{timing['causal']['median_ms']:.1f}; step / causal = {ratio:.2f} (attended pairs {pairs:.3f}x)"
    )

    report = {
        "length": length,
        "step": step,
        "threads": threads,
        "backend": args.backend,
        "heads": h,
        "head_dim": d,
        "eagle3_ms": timing["eagle3"],
        "causal_ms": timing["causal"],
        "step_over_causal": ratio,
        "pairs_over_causal": pairs,
    }
    builds = {"eagle3_ttt": lambda: build_step(length, step)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        mod = specforge_mask_mod(length)
        builds["create_block_mask"] = lambda: create_block_mask(mod, None, None, length, layout.n_keys, device="cpu")
    except ImportError as exc:
        print(f"  create_block_mask: not importable ({exc})")
    build_ms = {}
    for name, fn in builds.items():
        build_ms[name] = measure(fn, warmup=0, reps=args.reps)["min_ms"]
    print("  mask construction ms (min): " + ", ".join(f"{name} {ms:.2f}" for name, ms in build_ms.items()))
    report["build_ms"] = build_ms
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0

"""Mask construction per training step for block-drafter layouts (they change every step).

    python -m bench layout-build                       # N=4096 context, 16 blocks of 16, B=8 (--threads 2 as in
    BENCHMARKS) python -m bench layout-build --n 8192 --blocks 32 --block 16 --batch-size 8 --json out.json

Per step a DFlash trainer draws new anchors and keep masks, so the mask is rebuilt every step.
Timed (medians, CPU): ``WindowLayout.anchor_blocks`` + its row intervals (what the cpp and
composite backends read), + ``to_block_mask()`` (FlexAttention's BlockMask from the intervals),
+ the Triton tile plan (pure torch, from the intervals), against FlexAttention's own
``create_block_mask`` over SpecForge's DFlash ``mask_mod`` (written here from its definition),
for the full and the per-slot sliding (SpecForge) variants. ``--existing`` also times the row
intervals and tile plan of the K-Forcing layouts (the common case, to check it did not regress).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kforcing_kernels import WindowLayout
from kforcing_kernels.app.cli import add_batch_size, add_threads, positive_int

from .._timing import pin_threads


def _median_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _draw(gen: torch.Generator, batch: int, blocks: int, n: int):
    anchors = torch.randint(0, n, (batch, blocks), generator=gen)
    keep = torch.rand(batch, blocks, generator=gen) < 0.9
    return anchors, keep


def _dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, n: int, block: int, window):
    """SpecForge's DFlash visibility as a FlexAttention mask_mod (context before the anchor, own block)."""
    blocks = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        qb = (q_idx // block).clamp(max=blocks - 1)
        a = anchors[b, qb]
        ctx = (kv_idx < n) & (kv_idx < a)
        own = (kv_idx >= n) & ((kv_idx - n) // block == q_idx // block)
        if window is not None:  # SpecForge's sliding layers: per-slot lower bound, causal block
            ctx = ctx & (kv_idx >= a + q_idx % block - (window - 1))
            own = own & ((kv_idx - n) % block <= q_idx % block)
        return (ctx | own) & keep[b, qb]

    return mask_mod


def run(args) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    from kforcing_kernels.layouts.intervals import build_row_intervals
    from kforcing_kernels.ops.window_attention.triton.plan import DEFAULT_TILES, tile_plan
    from kforcing_kernels.ops.window_attention.triton.plan import build_tile_plan as build_plan

    args.threads = pin_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n, blocks, block, b = args.n, args.blocks, args.block, args.batch_size
    rows = {}
    for variant, window in (("dflash", None), ("specforge_sliding", args.window)):

        def ours_layout(window=window):
            anchors, keep = _draw(gen, b, blocks, n)
            kw = dict(window=window, window_mode="slot") if window else {}
            layout = WindowLayout.anchor_blocks(n, anchors, block, keep=keep, **kw)
            _ = layout.row_intervals_int32  # what cpp reads; composite and the plans derive from the same tensor
            return layout

        def ours_block_mask():
            ours_layout().to_block_mask()

        def ours_plan():
            tile_plan(ours_layout())

        def flex_create(window=window):
            anchors, keep = _draw(gen, b, blocks, n)
            create_block_mask(
                _dflash_mask_mod(anchors, keep, n, block, window),
                b,
                None,
                blocks * block,
                n + blocks * block,
                device="cpu",
            )

        rows[variant] = {
            "layout + row intervals": _median_ms(ours_layout, args.reps),
            "layout + to_block_mask()": _median_ms(ours_block_mask, args.reps),
            "layout + Triton tile plan": _median_ms(ours_plan, args.reps),
            "create_block_mask(mask_mod)": _median_ms(flex_create, args.reps),
        }
    if args.existing:
        for name, make in (
            ("kforcing_single", WindowLayout.kforcing_single),
            ("kforcing_double", WindowLayout.kforcing_double),
        ):
            layout = make(n, 4)
            # The builders themselves: the layout's store would answer a second call from its cache.
            rows[f"{name} N={n} k=4"] = {
                "row intervals": _median_ms(lambda layout=layout: build_row_intervals(layout), args.reps),
                "Triton tile plan": _median_ms(lambda layout=layout: build_plan(layout, DEFAULT_TILES), args.reps),
            }
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=positive_int, default=4096, help="context length S")
    p.add_argument("--blocks", type=positive_int, default=16, help="anchor blocks per sequence")
    p.add_argument("--block", type=positive_int, default=16, help="tokens per block")
    add_batch_size(p, 8, help="sequences per step")
    p.add_argument("--window", type=positive_int, default=512, help="SpecForge sliding window W")
    add_threads(p, none="all cores; the numbers in BENCHMARKS used 2")
    p.add_argument("--reps", type=positive_int, default=10, help="timed repetitions")
    p.add_argument("--existing", action="store_true", help="also time the K-Forcing layouts' intervals + plan")
    p.add_argument("--json", help="write the results here")


def execute(args) -> int:
    rows = run(args)
    print(
        f"Mask construction per step, CPU, {args.threads} threads: S={args.n}, {args.blocks} blocks of {args.block}, "
        f"B={args.batch_size} (median of {args.reps}, ms)\n"
    )
    for variant, times in rows.items():
        print(f"{variant}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0

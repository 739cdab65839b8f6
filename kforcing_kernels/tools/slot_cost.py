"""What the slot-step kernels cost against doing small windows' intra part in-tile, from the tile plan alone.

    python -m kforcing_kernels.tools.slot_cost            # N 1024..8192, k 1..8, single + double, D=128, B=1, H=16

Slot mode (windows <= SLOT_WINDOW_MAX), as the ``split``/``legacy`` kernels of 0.4 ran it
(removed after the H200 run), launches two extra kernels per pass (slot_fwd, slot_bwd) and
round-trips an fp32 partial per window row through memory: forward writes and re-reads
``out`` (D fp32) and ``lse``, backward ``dq`` (D fp32). The default kernels run the same slot
steps inside the window tiles, so they pay neither the launches nor the partial's traffic. Tile mode instead visits the
window's own keys as extra (masked) tile products of the main kernels. For each shape this prints the
forward tile products of both plans (the dQ kernel visits the same), the partial's bytes per
pass, and both costs as time at a nominal H100 rate (``--tflops`` on tensor cores, ``--tbps``
HBM): extra MMA time of tile mode vs the partial's memory time of slot mode.
"""

from __future__ import annotations

import argparse
import sys

from ..layouts import WindowLayout
from ..ops.window_attention.triton import plan as tp


def plans(layout: WindowLayout, tiles: tp.Tiles) -> tuple[tp.TilePlan, tp.TilePlan]:
    """(slot-mode plan, tile-mode plan) of ``layout``: the second with SLOT_WINDOW_MAX forced to 0."""
    slot = tp.build_tile_plan(layout, tiles)
    saved = tp.SLOT_WINDOW_MAX
    tp.SLOT_WINDOW_MAX = 0
    try:
        tile = tp.build_tile_plan(layout, tiles)
    finally:
        tp.SLOT_WINDOW_MAX = saved
    return slot, tile


def row(name: str, n: int, k: int, d: int, heads: int, tiles: tp.Tiles, tflops: float, tbps: float) -> dict:
    layout = getattr(WindowLayout, f"kforcing_{name}")(n, k)
    slot, tile = plans(layout, tiles)
    assert slot.intra_blocks > 0 and tile.intra_blocks == 0
    window_rows = layout.n_window_tokens
    fwd_bytes = heads * window_rows * (d * 4 + 4) * 2  # out + lse partial, written then read
    bwd_bytes = heads * window_rows * d * 4 * 2  # dq partial
    products_slot = int(slot.tile_products().sum())
    products_tile = int(tile.tile_products().sum())
    extra_flops = (products_tile - products_slot) * heads * 4 * tiles.block_m * tiles.block_n * d
    return {
        "layout": name,
        "n": n,
        "k": k,
        "products_slot": products_slot,
        "products_tile": products_tile,
        "extra_pct": 100.0 * (products_tile - products_slot) / products_slot,
        "partial_mib_fwd": fwd_bytes / 2**20,
        "partial_mib_bwd": bwd_bytes / 2**20,
        "extra_mma_us": extra_flops / (tflops * 1e12) * 1e6,
        "partial_us": fwd_bytes / (tbps * 1e12) * 1e6,
        "main_fwd_us": products_slot * heads * 4 * tiles.block_m * tiles.block_n * d / (tflops * 1e12) * 1e6,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layouts", nargs="+", default=["single", "double"], choices=["single", "double"])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tflops", type=float, default=500.0, help="nominal dense bf16 tensor-core rate")
    p.add_argument("--tbps", type=float, default=3.35, help="nominal HBM bandwidth (TB/s)")
    args = p.parse_args(argv)
    from ..ops.window_attention.triton.configs import TILE_SETS

    tiles = TILE_SETS["base"][args.dim]
    print(f"D={args.dim}, B=1, H={args.heads}, tiles {tiles}; times at {args.tflops:.0f} TFLOP/s, {args.tbps} TB/s")
    print(
        "| layout | N | k | fwd tile products slot / tile mode | extra | fp32 partial MiB fwd / bwd "
        "| tile mode extra MMA us | slot partial traffic us | main fwd MMA us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts:
        for n in args.n:
            for k in args.k:
                r = row(name, n, k, args.dim, args.heads, tiles, args.tflops, args.tbps)
                print(
                    f"| {name} | {n} | {k} | {r['products_slot']} / {r['products_tile']} | {r['extra_pct']:.1f}% "
                    f"| {r['partial_mib_fwd']:.0f} / {r['partial_mib_bwd']:.0f} | {r['extra_mma_us']:.1f} "
                    f"| {r['partial_us']:.1f} | {r['main_fwd_us']:.0f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

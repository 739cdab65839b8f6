"""Prefix-window attention vs its peers on one shape, in one run.

    python -m bench peers                      # K-Forcing SingleForward, N=1024, k=4
    python -m bench peers --layout double --n 512 --k 2 --json out.json

Reports forward and forward+backward for: dense-mask SDPA (what the paper's code
does), compiled FlexAttention with our analytic BlockMask (forward only on CPU:
Flex has no CPU backward), every available backend of ours, and the *ideal*:
causal SDPA over the context, scaled by |M| / (C(C+1)/2) (the non-zero pairs at
causal-attention speed; for SingleForward that is (1 + k + k(k+1)/(N+1)) x).
Ratios are only meaningful inside one run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.app.cli import (
    add_batch_size,
    add_device,
    add_threads,
    non_negative_int,
    positive_int,
)
from kforcing_kernels.layouts import ideal_causal_pairs, zoo

from .._cli import write_json
from .._timing import machine_info, measure, pin_threads

LAYOUTS = zoo.BENCH_FAMILIES  # the shared layout zoo (kforcing_kernels/layouts/zoo.py)


def mean_pairs(layout: WindowLayout) -> float:
    """|M|, averaged over the batch when the layout's prefix ranges are per batch element."""
    pairs = layout.num_pairs()
    return float(pairs) if isinstance(pairs, int) else float(pairs.float().mean())


def build_methods(layout, q, k, v, backends, flex: bool):
    """name -> (forward fn, supports backward)."""
    mask = layout.dense_mask()
    if mask.dim() == 3:
        mask = mask[:, None]
    methods = {"dense_sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), True)}
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = layout.to_block_mask(128)
        compiled = torch.compile(flex_attention, dynamic=False)
        on_gpu = q.device.type == "cuda"
        # Flex refuses inputs that require grad on CPU (no CPU backward): hand it detached ones there.
        fq, fk, fv = (q, k, v) if on_gpu else (q.detach(), k.detach(), v.detach())
        methods["flex_compiled"] = (lambda: compiled(fq, fk, fv, block_mask=block_mask), on_gpu)
    for name in backends:
        methods[name] = (lambda name=name: window_attention(q, k, v, layout, backend=name), True)
    return methods


def run(args) -> dict:
    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    layout = LAYOUTS[args.layout](args.n, args.k)
    b, h, d = args.batch_size, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    make = lambda length: torch.randn(b, h, length, d, generator=gen).to(device, dtype).requires_grad_(True)  # noqa: E731
    q, k, v = make(layout.n_queries), make(layout.n_keys), make(layout.n_keys)
    dout = torch.randn(b, h, layout.n_queries, d, generator=gen).to(device, dtype)

    available = backends_available()
    wanted = [name for name in args.backends.split(",") if name]
    ours = [name for name in wanted if available.get(name) is None]
    skipped = {name: available.get(name, "unknown backend") for name in wanted if name not in ours}

    rows = {}

    def time_method(name, fn, with_backward):
        with torch.no_grad():
            fwd = measure(fn, warmup=args.warmup, reps=args.reps)
        row = {"fwd": fwd, "fwd_bwd": None}
        if with_backward:

            def step():
                out = fn()
                torch.autograd.grad(out, (q, k, v), dout)

            row["fwd_bwd"] = measure(step, warmup=args.warmup, reps=args.reps)
        rows[name] = row

    # The ideal: causal attention over the context at the same B, H, D.
    c = layout.n_ctx
    # Fresh [B, H, C, D] tensors: with queries="windows" (ptp, double) q has no context rows.
    qc, kc, vc = make(c), make(c), make(c)
    dout_c = torch.randn(b, h, c, d, generator=gen).to(device, dtype)
    ideal_mult = mean_pairs(layout) / ideal_causal_pairs(c)

    def causal_fwd():
        return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

    with torch.no_grad():
        causal = measure(causal_fwd, warmup=args.warmup, reps=args.reps)

    def causal_step():
        torch.autograd.grad(causal_fwd(), (qc, kc, vc), dout_c)

    causal_fb = measure(causal_step, warmup=args.warmup, reps=args.reps)
    rows["ideal"] = {
        "fwd": {key: val * ideal_mult if key in ("median_ms", "min_ms") else val for key, val in causal.items()},
        "fwd_bwd": {key: val * ideal_mult if key in ("median_ms", "min_ms") else val for key, val in causal_fb.items()},
    }

    for name, (fn, bwd) in build_methods(layout, q, k, v, ours, flex=not args.no_flex).items():
        if name == "dense_sdpa" and args.skip_dense:
            continue
        time_method(name, fn, bwd)

    return {
        "config": {
            **vars(args),
            "threads": threads,
            "ideal_multiplier": ideal_mult,
            "num_pairs": int(layout.num_pairs() if isinstance(layout.num_pairs(), int) else layout.num_pairs().sum()),
        },
        "machine": machine_info(),
        "causal_over_ctx": {"fwd": causal, "fwd_bwd": causal_fb},
        "results": rows,
        "unavailable": skipped,
    }


def format_table(report: dict) -> str:
    cfg = report["config"]
    rows = report["results"]
    ideal = rows["ideal"]
    dense = rows.get("dense_sdpa")
    lines = [
        f"layout={cfg['layout']} N={cfg['n']} k={cfg['k']} B={cfg['batch']} H={cfg['heads']} D={cfg['dim']} "
        f"{cfg['dtype']} {cfg['device']} threads={cfg['threads']} (ideal = {cfg['ideal_multiplier']:.3f} x causal over "
        "C)",
        f"{'method':<16}{'fwd ms':>10}{'x ideal':>9}{'fwd+bwd ms':>12}{'x ideal':>9}{'fb vs dense':>13}",
    ]
    for name, row in rows.items():
        fwd = row["fwd"]["median_ms"]
        fb = row["fwd_bwd"]["median_ms"] if row["fwd_bwd"] else None
        fb_ratio = f"{fb / ideal['fwd_bwd']['median_ms']:>9.2f}" if fb else f"{'-':>9}"
        speed = f"{dense['fwd_bwd']['median_ms'] / fb:>12.1f}x" if fb and dense and dense["fwd_bwd"] else f"{'-':>13}"
        fb_txt = f"{fb:>12.1f}" if fb else f"{'n/a':>12}"
        lines.append(f"{name:<16}{fwd:>10.1f}{fwd / ideal['fwd']['median_ms']:>9.2f}{fb_txt}{fb_ratio}{speed}")
    for name, why in report["unavailable"].items():
        lines.append(f"{name:<16}unavailable: {why}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="single", help="mask layout")
    p.add_argument("--n", type=positive_int, default=1024, help="context length N")
    p.add_argument("--k", type=positive_int, default=4, help="window size k (block size for sbd)")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=12, help="attention heads H")
    p.add_argument("--dim", type=positive_int, default=64, help="head dim D")
    p.add_argument("--dtype", default="float32", help="torch dtype name")
    add_device(p)
    p.add_argument("--backends", default="composite,cpp,triton", help="comma-separated backends of ours")
    add_threads(p)
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs before timing")
    p.add_argument("--reps", type=positive_int, default=5, help="timed runs")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (saves the compile time)")
    p.add_argument("--skip-dense", action="store_true", help="skip dense-mask SDPA")
    p.add_argument("--json", default=None, help="write the report as JSON here")


def execute(args) -> dict:
    report = run(args)
    print(format_table(report))
    if args.json:
        write_json(report, args.json, indent=2)
    return report

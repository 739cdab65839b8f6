"""GPU benchmark: TFLOP/s per *useful* FLOP of prefix-window attention, and the self-forcing training step.

    python -m bench.triton_gpu                              # the full sweep (needs a CUDA device)
    python -m bench.triton_gpu --n 1024 --k 4 --dim 128 --methods triton sdpa_flash_causal --json out.json
    python -m bench.triton_gpu --train-step --n 1024 --k 2  # paper backbone step: dense vs ours vs zero-cost attention
    python -m bench.triton_gpu --list                       # planned shapes and useful FLOPs; runs anywhere

Timing: ``triton.testing.do_bench`` (CUDA events, warm-up, the L2 cache flushed before every
rep, no host sync inside the timed region; the median is reported). Each method runs once
before timing, so compilation and autotuning are not timed. Useful FLOPs count only the
attended pairs |M| (``layout.num_pairs()``): forward 4 |M| D per (batch, head), forward +
backward 3.5x that (FlashAttention-2's convention). Methods, bf16, same q/k/v:

* ``triton``: ``window_attention(backend="triton")`` (``--triton-tiles`` / ``--triton-kernels`` add
  runs with the tile set or the kernel variant forced: ``triton[wide]``, ``triton[legacy]``);
* ``flex``: ``torch.compile``d FlexAttention with the layout's analytic BlockMask (128x128);
* ``sdpa_flash_causal``: torch SDPA, flash kernel forced, causal over L' tokens with
  L'(L'+1)/2 ~ |M|: the same useful work at autoregressive-attention efficiency (the FA2 anchor);
* ``fa2_causal``: flash-attn's own kernel on the same L' (when flash-attn is installed);
* ``composite``: ``window_attention(backend="composite")``, its pieces in fused SDPA / flash-attn kernels;
* ``dense_sdpa``: SDPA with the layout's dense boolean mask (what a dense-mask implementation does;
  skipped when the mask would exceed ``--dense-max-elems``).

Targets (issues #24/#25, H100, bf16): triton fwd+bwd >= 1.0x flex at every (N, k, D) and >= 1.3x at
N=1024; >= 1.0x sdpa_flash_causal at N=8192, D=128; D=64 N=1024 fwd+bwd >= 100 TFLOP/s; the
training step (paper backbone, N=1024, B=4, k 2 -> 4) within 10% of the same step with zero-cost
attention (``ours_vs_zero`` <= 1.10) and >= 7x dense at N=4096, k 4 -> 8. Without CUDA this prints
why and measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from . import attention
from ._cli import write_json
from ._timing import machine_info
from .train_step_gpu import TRAIN_VARIANTS
from kforcing_kernels import WindowLayout, window_attention

LAYOUTS = {name: attention.LAYOUTS[name] for name in ("single", "double")}
FWD_BWD_FACTOR = 3.5
METHODS = ("triton", "flex", "sdpa_flash_causal", "fa2_causal", "composite", "dense_sdpa")


def useful_flops(layout: WindowLayout, batch: int, heads: int, dim: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of the attended pairs."""
    fwd = 4.0 * int(layout.num_pairs()) * dim * batch * heads
    return fwd, FWD_BWD_FACTOR * fwd


def equivalent_causal_length(pairs: int) -> int:
    """L' with L'(L'+1)/2 closest to ``pairs``: causal attention doing the same useful work."""
    return max(1, round((math.sqrt(8 * pairs + 1) - 1) / 2))


def shapes(args):
    for layout_name in args.layout:
        for n in args.n:
            for k in args.k:
                for d in args.dim:
                    yield layout_name, n, k, d


def time_ms(fn) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench (one untimed call first: compile / autotune)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


@contextlib.contextmanager
def _triton_env(tiles: str = "auto", kernels: str = "fused"):
    """KFORCING_TRITON_TILES / _KERNELS for the duration ("auto" / "fused": the dispatcher's own)."""
    want = {"KFORCING_TRITON_TILES": None if tiles == "auto" else tiles,
            "KFORCING_TRITON_KERNELS": None if kernels == "fused" else kernels}
    old = {name: os.environ.pop(name, None) for name in want}
    os.environ.update({name: value for name, value in want.items() if value})
    try:
        yield
    finally:
        os.environ.update({name: value for name, value in old.items() if value is not None})
        for name in [n for n, value in old.items() if value is None]:
            os.environ.pop(name, None)


_WIDE_DKDV_DEFAULT: list = []  # [(tiles, configs)] of the shipped wide D=128 set, saved on first use


def _use_wide_dkdv(spec: str | None) -> None:
    """Make the "wide" D=128 set's dK/dV tiles and configs ``spec`` (KEYS:STEP:W.S[,W.S...]: keys per program,
    rows per step, autotuned (warps, stages)), or the shipped ones for None, until the next other spec."""
    import dataclasses

    from kforcing_kernels.ops.window_attention.triton import launch as tk  # its tables are configs.py's

    if not _WIDE_DKDV_DEFAULT:
        _WIDE_DKDV_DEFAULT.append((tk.TILE_SETS["wide"][128], list(tk.KERNEL_CONFIGS["dkdv"][("wide", 128)])))
    want = _WIDE_DKDV_DEFAULT[0]
    if spec is not None:
        keys, step, configs = spec.split(":")
        want = (dataclasses.replace(want[0], block_n_dkdv=int(keys), block_m_dkdv=int(step)),
                [tuple(int(x) for x in c.split(".")) for c in configs.split(",")])
    if (tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["dkdv"][("wide", 128)]) != want:
        tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["dkdv"][("wide", 128)] = want[0], list(want[1])
        tk._tuned.clear()  # autotuners are keyed by the tile set's name, not its tiles


def _methods(layout, q, kk, v, args, extras):
    """{name: (forward fn, inputs, useful pairs)}; forward fns return the output to differentiate."""
    pairs = int(layout.num_pairs())
    out = {}
    for spec in args.wide_dkdv if "triton" in args.methods else ():

        def tri_dkdv(spec=spec):
            _use_wide_dkdv(spec)
            with _triton_env("wide"):
                return window_attention(q, kk, v, layout, backend="triton")

        out[f"triton[dkdv {spec}]"] = (tri_dkdv, (q, kk, v), pairs)
    runs = [(t, b) for t in args.triton_tiles for b in args.triton_kernels] if "triton" in args.methods else []
    for tiles, variant in runs:
        tags = [x for x in (tiles, variant) if x not in ("auto", "fused")]
        name = f"triton[{' '.join(tags)}]" if tags else "triton"

        def tri(tiles=tiles, variant=variant):
            if args.wide_dkdv:
                _use_wide_dkdv(None)
            with _triton_env(tiles, variant):
                return window_attention(q, kk, v, layout, backend="triton")

        out[name] = (tri, (q, kk, v), pairs)
    if "flex" in args.methods and extras.get("flex") is not None:
        block_mask = layout.to_block_mask(128, device=q.device)
        out["flex"] = (lambda: extras["flex"](q, kk, v, block_mask=block_mask), (q, kk, v), pairs)
    lc = equivalent_causal_length(pairs)
    qc, kc, vc = (torch.randn(q.shape[0], q.shape[1], lc, q.shape[3], device=q.device, dtype=q.dtype)
                  .requires_grad_(True) for _ in range(3))
    causal_pairs = lc * (lc + 1) // 2
    if "sdpa_flash_causal" in args.methods:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash_causal():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

        out["sdpa_flash_causal"] = (flash_causal, (qc, kc, vc), causal_pairs)
    if "fa2_causal" in args.methods and extras.get("fa2") is not None:
        qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (qc, kc, vc))
        out["fa2_causal"] = (lambda: extras["fa2"](qf, kf, vf, causal=True), (qf, kf, vf), causal_pairs)
    if "composite" in args.methods:
        out["composite"] = (lambda: window_attention(q, kk, v, layout, backend="composite"), (q, kk, v), pairs)
    if "dense_sdpa" in args.methods and layout.n_queries * layout.n_keys <= args.dense_max_elems:
        mask = layout.dense_mask().to(q.device)
        out["dense_sdpa"] = (lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=mask), (q, kk, v), pairs)
    return out, lc


def bench_one(layout_name, n, k, d, args, extras) -> dict:
    layout = LAYOUTS[layout_name](n, k)
    b, h = args.batch, args.heads
    dev, dt = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b, h, layout.n_queries, d, device=dev, dtype=dt).requires_grad_(True)
    kk, v = (torch.randn(b, h, layout.n_keys, d, device=dev, dtype=dt).requires_grad_(True) for _ in range(2))
    methods, lc = _methods(layout, q, kk, v, args, extras)
    rows, errors = {}, {}
    for name, (fwd, inputs, pairs) in methods.items():
        flops = 4.0 * pairs * d * b * h
        try:
            dout = torch.randn_like(fwd())

            def step(fwd=fwd, inputs=inputs, dout=dout):
                torch.autograd.grad(fwd(), inputs, dout)

            with torch.no_grad():
                fwd_ms = time_ms(fwd)
            fb_ms = time_ms(step)
        except Exception as exc:  # noqa: BLE001 - one method failing (OOM, missing kernel) must not end the sweep
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            torch.cuda.empty_cache()
            continue
        rows[name] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "fwd_tflops": flops / fwd_ms / 1e9,
                      "fwd_bwd_tflops": FWD_BWD_FACTOR * flops / fb_ms / 1e9}
    ratios = {}
    if "triton" in rows:
        for other in rows:
            if other != "triton":
                for phase in ("fwd", "fwd_bwd"):
                    ratios[f"{phase}_vs_{other}"] = rows["triton"][f"{phase}_tflops"] / rows[other][f"{phase}_tflops"]
    return {"layout": layout_name, "n": n, "k": k, "dim": d, "batch": b, "heads": h, "pairs": int(layout.num_pairs()),
            "causal_equivalent_len": lc, "results": rows, "errors": errors, "ratios": ratios}


def format_row(r: dict) -> str:
    cells = [f"{r['layout']:<7}{r['n']:>6}{r['k']:>3}{r['dim']:>5} |"]
    for name, res in r["results"].items():
        cells.append(f" {name} {res['fwd_tflops']:.0f}/{res['fwd_bwd_tflops']:.0f}")
    for name in ("sdpa_flash_causal", "flex"):
        if f"fwd_vs_{name}" in r["ratios"]:
            cells.append(f" | x{name} {r['ratios'][f'fwd_vs_{name}']:.2f}/{r['ratios'][f'fwd_bwd_vs_{name}']:.2f}")
    for name, err in r["errors"].items():
        cells.append(f" | {name} FAILED {err}")
    return "".join(cells)


HEADER = "layout      N  k    D | method fwd/fwd+bwd TFLOP/s per useful FLOP ... | x method: triton's ratio fwd/fwd+bwd"


# ---------------------------------------------------------------------- training step


def train_step(args) -> list[dict]:
    """The training-step rows (``train_step_gpu.rows``), timed with this module's ``time_ms``."""
    from .train_step_gpu import rows

    return rows(args, time_ms)


# ---------------------------------------------------------------------- sampler


def sampler_bench(args) -> list[dict]:
    """The Triton inverse-CDF sampler vs softmax + cumsum + searchsorted (fp32, fp64) on bf16 logits."""
    from .cpu_kernels import softmax_cumsum_searchsorted
    from kforcing_kernels.ops import sampling

    rows = []
    for vocab in args.sampler_vocab:
        for n_rows in args.sampler_rows:
            gen = torch.Generator(device="cuda").manual_seed(0)
            logits = (torch.randn(n_rows, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)
            z = torch.rand(n_rows, device="cuda", generator=gen)
            tau = 0.8
            methods = {
                "triton": lambda: sampling.inverse_cdf_sample(logits, z, tau),
                "softmax+cumsum+searchsorted fp32": lambda: softmax_cumsum_searchsorted(logits, z, tau, torch.float32),
                "softmax+cumsum+searchsorted fp64": lambda: softmax_cumsum_searchsorted(logits, z, tau, torch.float64),
            }
            times = {name: time_ms(fn) for name, fn in methods.items()}
            agree = float((methods["triton"]() == sampling.inverse_cdf_sample_reference(logits, z, tau)).double().mean())
            read_gb = logits.numel() * logits.element_size() / 1e9
            row = {"vocab": vocab, "rows": n_rows, "backend": sampling.sampler_backend("cuda"), "ms": times,
                   "logits_read_gb_per_s": {name: read_gb / (ms / 1e3) for name, ms in times.items()},
                   "agreement_with_fp64_reference": agree}
            rows.append(row)
            print(f"sampler V={vocab} rows={n_rows}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items())
                  + f" | triton x{times['softmax+cumsum+searchsorted fp32'] / times['triton']:.1f} vs fp32; "
                  f"agrees with fp64 on {agree:.4f}", flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=["single"])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch-size", dest="batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--triton-tiles", nargs="+", choices=("auto", "base", "hopper", "wide", "hopper128"), default=["auto"],
                   help="tile sets to run triton with (auto: the dispatcher's choice)")
    p.add_argument("--triton-kernels", nargs="+", choices=("fused", "split", "legacy"), default=["fused"],
                   help="triton kernels: fused (3 launches), split (6), legacy (split, first-generation dQ/dK-dV)")
    p.add_argument("--wide-dkdv", nargs="*", default=[], metavar="KEYS:STEP:W.S,...",
                   help="extra triton runs with the wide D=128 set's dK/dV tiles replaced (keys per program, "
                        "query rows per step, autotuned warps.stages), e.g. 64:32:8.1,8.2")
    p.add_argument("--slot-window-max", type=int, default=None,
                   help="override triton/plan.py's SLOT_WINDOW_MAX for this run (0: every window's intra part in-tile; "
                        "python -m kforcing_kernels.tools.slot_cost predicts the trade-off)")
    p.add_argument("--dense-max-elems", type=int, default=2**30, help="skip dense_sdpa above Lq*Lk mask elements")
    p.add_argument("--train-step", action="store_true", help="time the self-forcing training step instead")
    p.add_argument("--train-preset", default="paper", help="model preset for --train-step (paper: 12 layers, 768)")
    p.add_argument("--train-ours", default="triton", help="our backend for --train-step")
    p.add_argument("--train-variants", nargs="+", choices=TRAIN_VARIANTS, default=list(TRAIN_VARIANTS),
                   help="--train-step variants: dense-mask SDPA, ours, attention replaced by a zero-cost op (the limit)")
    p.add_argument("--sampler", action="store_true", help="time the Triton sampler instead")
    p.add_argument("--sampler-vocab", type=int, nargs="+", default=[32000, 152064])
    p.add_argument("--sampler-rows", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                   help="print a markdown table of the rows in these --json reports, measure nothing")
    p.add_argument("--list", action="store_true", help="print the shapes and useful FLOPs, measure nothing")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests run the row logic on CPU
    p.add_argument("--json", default=None, help="write the report as JSON here (rewritten after every row)")
    return p.parse_args(argv)


def render_markdown(paths: list[str]) -> str:
    """A markdown table (TFLOP/s per useful FLOP, fwd / fwd+bwd) of the rows in report JSON files."""
    methods = ("triton", "flex", "sdpa_flash_causal", "composite", "dense_sdpa")
    lines = ["| N | k | D | triton | flex (compiled) | SDPA-flash causal | composite | dense-mask SDPA "
             "| triton / flex | triton / SDPA-flash |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        import json

        with open(path) as f:
            report = json.load(f)
        for r in report["rows"]:
            cells = []
            for m in methods:
                res = r["results"].get(m)
                cells.append(f"{res['fwd_tflops']:.0f} / {res['fwd_bwd_tflops']:.0f}" if res else
                             ("OOM" if "OutOfMemory" in r["errors"].get(m, "") else "-"))
            ratios = [f"{r['ratios'][f'fwd_vs_{o}']:.2f} / {r['ratios'][f'fwd_bwd_vs_{o}']:.2f}"
                      if f"fwd_vs_{o}" in r["ratios"] else "-" for o in ("flex", "sdpa_flash_causal")]
            lines.append(f"| {r['n']} | {r['k']} | {r['dim']} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        print(render_markdown(args.render))
        return 0
    if args.list:
        for layout_name, n, k, d in shapes(args):
            layout = LAYOUTS[layout_name](n, k)
            fwd, fb = useful_flops(layout, args.batch, args.heads, d)
            print(f"{layout_name} N={n} k={k} D={d}: |M|={int(layout.num_pairs())} "
                  f"L'={equivalent_causal_length(int(layout.num_pairs()))} fwd {fwd / 1e9:.2f} GFLOP, fwd+bwd {fb / 1e9:.2f} GFLOP")
        return 0
    if not torch.cuda.is_available():
        print("bench/triton_gpu.py: skipped, no CUDA device here; nothing was measured (GPU-only benchmark).")
        return 0
    from kforcing_kernels import backends_available

    reason = backends_available().get("triton")
    if reason is not None:
        print(f"bench/triton_gpu.py: skipped, the triton backend is unavailable: {reason}")
        return 0
    if args.slot_window_max is not None:
        from kforcing_kernels.ops.window_attention.triton import plan as tile_plan

        tile_plan.SLOT_WINDOW_MAX = args.slot_window_max  # read when a plan is built; set before the first
    report = {"machine": machine_info(), "config": vars(args), "rows": [], "started": time.time()}
    if args.sampler:
        report["sampler"] = sampler_bench(args)
        if args.json:
            write_json(report, args.json, indent=2)
        return 0
    if args.train_step:
        report["train_step"] = train_step(args)
        if args.json:
            write_json(report, args.json, indent=2)
        return 0
    extras = {}
    if "flex" in args.methods:
        from torch.nn.attention.flex_attention import flex_attention

        # One static graph per shape: past dynamo's recompile limit (8) flex_attention would silently run
        # eagerly (dense scores, OOM at N=4096), so the limit goes up and hitting it raises.
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True
        extras["flex"] = torch.compile(flex_attention, dynamic=False)
    try:
        from flash_attn import flash_attn_func

        extras["fa2"] = flash_attn_func
    except ImportError:
        print("flash-attn is not installed: no fa2_causal (sdpa_flash_causal is torch's own flash kernel)")
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda

    report["composite_cuda"] = composite_cuda.status()
    print(HEADER)
    for layout_name, n, k, d in shapes(args):
        row = bench_one(layout_name, n, k, d, args, extras)
        report["rows"].append(row)
        print(format_row(row), flush=True)
        if args.json:
            report["composite_cuda"] = composite_cuda.status()
            write_json(report, args.json, indent=2)
    print("composite_cuda:", composite_cuda.status())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The C++ extension's CPU kernels against their baselines, in one run.

    python -m bench cpu-kernels                    # attention + sampler, 2 threads
    python -m bench cpu-kernels --only sampler --rows 1024
    python -m bench cpu-kernels --json out.json

Attention (K-Forcing SingleForward by default: B=1, H=12, D=64, fp32, N=1024, k=4;
``--layout``, ``--dtype``, ``--n``, ``--k`` change it):
``cpp`` and ``composite`` forward and forward+backward against the *ideal*, causal
SDPA over the context scaled by |M| / (N(N+1)/2) (= 1 + k + k(k+1)/(N+1)).
Sampler (V=50257, rows=4096, fp32 logits): the fused C++ sampler against
softmax + cumsum + searchsorted in float32 (the usual way) and in float64 (our
reference), with the peak resident memory each adds on top of the logits.

Methods are timed interleaved (one repetition of each in turn) and reported as
medians, so a busy machine slows them alike; compare ratios, not milliseconds.
``--threads 1 --clock cpu`` times process CPU time instead of wall time, which
other jobs on a shared machine disturb much less.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from kforcing_kernels import _extension, backends_available, window_attention
from kforcing_kernels.app.cli import add_threads, non_negative_int, positive_int
from kforcing_kernels.layouts import ideal_causal_pairs
from kforcing_kernels.ops import sampling

from .._cli import write_json
from .._timing import machine_info, pin_threads
from .peers import LAYOUTS, mean_pairs

CLOCK = time.perf_counter  # --clock cpu: time.process_time (meaningful with --threads 1)


def interleaved(methods: dict, *, warmup: int, reps: int) -> dict:
    """name -> {median_ms, min_ms} with the methods' repetitions interleaved."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            t0 = CLOCK()
            fn()
            times[name].append((CLOCK() - t0) * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t)} for name, t in times.items()}


# ---------------------------------------------------------------------- attention


def bench_attention(args) -> dict:
    layout = LAYOUTS[args.layout](args.n, args.k)
    b, h, d = 1, args.heads, args.dim
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    make = lambda length: torch.randn(b, h, length, d, generator=gen).to(dtype).requires_grad_(True)  # noqa: E731
    q, k, v = make(layout.n_queries), make(layout.n_keys), make(layout.n_keys)
    dout = torch.randn(b, h, layout.n_queries, d, generator=gen).to(dtype)
    c = layout.n_ctx
    # Fresh context tensors: with queries="windows" q holds window rows only (maybe fewer than c).
    qc, kc, vc = make(c), make(c), make(c)
    ideal_mult = mean_pairs(layout) / ideal_causal_pairs(c)

    def causal():
        return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

    fwd = {"causal_sdpa": causal}
    dout_c = torch.randn(b, h, c, d, generator=gen).to(dtype)
    step = {"causal_sdpa": lambda: torch.autograd.grad(causal(), (qc, kc, vc), dout_c)}
    backends = [name for name in ("composite", "cpp") if backends_available()[name] is None]
    for name in backends:
        fwd[name] = lambda name=name: window_attention(q, k, v, layout, backend=name)
        step[name] = lambda name=name: torch.autograd.grad(
            window_attention(q, k, v, layout, backend=name), (q, k, v), dout
        )
    with torch.no_grad():
        t_fwd = interleaved(fwd, warmup=args.warmup, reps=args.reps)
    t_step = interleaved(step, warmup=args.warmup, reps=args.reps)
    ideal_fwd = t_fwd["causal_sdpa"]["median_ms"] * ideal_mult
    ideal_fb = t_step["causal_sdpa"]["median_ms"] * ideal_mult
    rows = {"ideal": {"fwd_ms": ideal_fwd, "fwd_bwd_ms": ideal_fb}}
    for name in backends:
        rows[name] = {"fwd_ms": t_fwd[name]["median_ms"], "fwd_bwd_ms": t_step[name]["median_ms"]}
    for row in rows.values():
        row["fwd_x_ideal"] = row["fwd_ms"] / ideal_fwd
        row["fwd_bwd_x_ideal"] = row["fwd_bwd_ms"] / ideal_fb
    return {
        "config": {
            "layout": args.layout,
            "n": args.n,
            "k": args.k,
            "heads": h,
            "dim": d,
            "dtype": args.dtype,
            "ideal_multiplier": ideal_mult,
            "isa": _extension.load().isa() if _extension.load() else None,
        },
        "rows": rows,
    }


def format_attention(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"attention: layout={cfg['layout']} N={cfg['n']} k={cfg['k']} B=1 H={cfg['heads']} D={cfg['dim']} "
        f"{cfg['dtype']} "
        f"(ideal = {cfg['ideal_multiplier']:.3f} x causal SDPA over N; cpp isa={cfg['isa']})",
        "| method | fwd ms | x ideal | fwd+bwd ms | x ideal |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        lines.append(
            f"| {name} | {row['fwd_ms']:.1f} | {row['fwd_x_ideal']:.2f} | {row['fwd_bwd_ms']:.1f} | "
            f"{row['fwd_bwd_x_ideal']:.2f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- sampler


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn) -> float:
    """Peak resident memory fn adds (MiB), via the kernel's resettable high-water mark (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return float("nan")
    base = _rss_kib("VmRSS")
    result = fn()
    peak = _rss_kib("VmHWM")
    del result
    return (peak - base) / 1024


def softmax_cumsum_searchsorted(logits, z, tau, dtype):
    cdf = torch.softmax(logits.to(dtype) / tau, -1).cumsum(-1)
    return torch.searchsorted(cdf, z.to(dtype)[:, None].contiguous(), right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)


def bench_sampler(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 2
    z = torch.rand(args.rows, generator=gen)
    tau = 0.8
    methods = {
        "softmax+cumsum+searchsorted fp32": lambda: softmax_cumsum_searchsorted(logits, z, tau, torch.float32),
        "softmax+cumsum+searchsorted fp64": lambda: softmax_cumsum_searchsorted(logits, z, tau, torch.float64),
    }
    if _extension.load() is not None:
        methods["cpp fused (fp64 math)"] = lambda: sampling.inverse_cdf_sample(logits, z, tau)
    times = interleaved(methods, warmup=1, reps=args.sampler_reps)
    memory = {name: peak_extra_mib(fn) for name, fn in methods.items()}
    base = times["softmax+cumsum+searchsorted fp32"]["median_ms"]
    rows = {
        name: {"ms": t["median_ms"], "speedup_vs_fp32": base / t["median_ms"], "peak_extra_mib": memory[name]}
        for name, t in times.items()
    }
    agree = None
    if "cpp fused (fp64 math)" in methods:
        agree = float(
            (methods["cpp fused (fp64 math)"]() == methods["softmax+cumsum+searchsorted fp64"]()).double().mean()
        )
    return {
        "config": {"rows": args.rows, "vocab": args.vocab, "tau": tau, "logits_mib": logits.numel() * 4 / 2**20},
        "rows": rows,
        "agreement_with_fp64": agree,
    }


def format_sampler(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"sampler: rows={cfg['rows']} V={cfg['vocab']} fp32 logits ({cfg['logits_mib']:.0f} MiB), tau={cfg['tau']}",
        "| method | ms | speed-up vs fp32 torch | peak extra memory MiB |",
        "|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        lines.append(f"| {name} | {row['ms']:.1f} | {row['speedup_vs_fp32']:.2f}x | {row['peak_extra_mib']:.0f} |")
    if report["agreement_with_fp64"] is not None:
        lines.append(f"cpp tokens equal to the float64 torch ones: {100 * report['agreement_with_fp64']:.3f}%")
    return "\n".join(lines)


DEFAULT_THREADS = 2  # the README's and BENCHMARKS.md's CPU numbers


def add_arguments(p) -> None:
    p.add_argument(
        "--only", choices=("attention", "sampler"), default=None, help="run one part only (None: both, attention first)"
    )
    add_threads(p, none=f"{DEFAULT_THREADS}")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="single", help="attention: the layout")
    p.add_argument("--n", type=positive_int, default=1024, help="attention: context length N")
    p.add_argument("--k", type=positive_int, default=4, help="attention: window k")
    p.add_argument("--heads", type=positive_int, default=12, help="attention: heads H (batch 1)")
    p.add_argument("--dim", type=positive_int, default=64, help="attention: head dim D")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "float64"),
        default="float32",
        help="attention: q/k/v dtype",
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=2, help="attention: untimed calls of each method before timing"
    )
    p.add_argument(
        "--reps", type=positive_int, default=7, help="attention: timed calls of each method, interleaved (median)"
    )
    p.add_argument("--rows", type=positive_int, default=4096, help="sampler: rows of fp32 logits sampled at once")
    p.add_argument("--vocab", type=positive_int, default=50257, help="sampler: vocabulary size V")
    p.add_argument(
        "--sampler-reps", type=positive_int, default=3, help="sampler: timed calls of each method, interleaved (median)"
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time, robust to other jobs on the machine; use with --threads 1",
    )
    p.add_argument("--json", default=None, help="also write the report as JSON here")


def finish_args(p, args, argv, prog):
    if args.threads is None:
        args.threads = DEFAULT_THREADS
    return args


def execute(args) -> dict:
    global CLOCK
    threads = pin_threads(args.threads)
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    report = {"machine": machine_info(), "threads": threads, "clock": args.clock}
    print(
        f"threads={threads}, clock={args.clock}, torch {torch.__version__}, "
        f"cpp: {backends_available()['cpp'] or 'available'}"
    )
    if args.only in (None, "attention"):
        report["attention"] = bench_attention(args)
        print(format_attention(report["attention"]))
    if args.only in (None, "sampler"):
        report["sampler"] = bench_sampler(args)
        print(format_sampler(report["sampler"]))
    if args.json:
        write_json(report, args.json, indent=2)
    return report

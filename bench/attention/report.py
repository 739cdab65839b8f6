"""Report of an attention sweep: exponent fits, stdout tables, JSON/CSV rows and PNG plots."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Optional

from .._cli import write_csv, write_json
from .._timing import commit_label
from .methods import METHODS, OURS, PHASES

PHASE_LABEL = {"fwd": "forward", "fwd_bwd": "forward+backward"}
# A work-exponent fit needs the work itself to vary; Jacobi/SBD barely move with k.
MIN_WORK_SPREAD = 1.5


def log_log_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fit_exponents(report: dict) -> list[dict]:
    """Per (layout, D, method, phase) at the fit N: the exponent p of time ~ k^p and of
    time ~ |M|^p (an O(|M|) kernel gives 1 for the latter, dense-mask SDPA ~2 for
    SingleForward). Needs timings at two or more k.

    Three series: median times, min times, and ``causal_units`` (time over causal attention
    timed in the same rounds; ``_norm``), which cancels load drift between configurations."""
    n_fit = report["meta"]["fit_n"]
    series = defaultdict(list)
    for row in report["rows"]:
        if row["n"] == n_fit and row["k"] is not None and row["status"] == "ok" and row["phase"] in PHASES:
            series[(row["layout"], row["d"], row["method"], row["phase"])].append(row)
    fits = []
    for (layout, d, method, phase), rows in series.items():
        rows.sort(key=lambda r: r["k"])
        if len(rows) < 2:
            continue
        ks = [r["k"] for r in rows]
        medians, mins, units = (
            [r["median_ms"] for r in rows],
            [r["min_ms"] for r in rows],
            [r["causal_units"] for r in rows],
        )
        work = [r["num_pairs"] for r in rows]
        spread = max(work) / min(work) >= MIN_WORK_SPREAD
        fits.append(
            {
                "layout": layout,
                "n": n_fit,
                "d": d,
                "method": method,
                "phase": phase,
                "k": ks,
                "num_pairs": work,
                "median_ms": medians,
                "min_ms": mins,
                "causal_units": units,
                "slope_k": log_log_slope(ks, medians),
                "slope_k_min": log_log_slope(ks, mins),
                "slope_k_norm": log_log_slope(ks, units),
                "slope_work": log_log_slope(work, medians) if spread else None,
                "slope_work_min": log_log_slope(work, mins) if spread else None,
                "slope_work_norm": log_log_slope(work, units) if spread else None,
            }
        )
    return fits


# ---------------------------------------------------------------------- stdout


def _cell(row: Optional[dict], width: int, gpu: bool) -> str:
    if row is None:
        return f"{'':>{width}}"
    if row["status"] != "ok":
        return f"{row['status']:>{width}}"
    text = f"{row['median_ms']:.1f} ({row['ratio_to_ideal']:.2f}x)"
    if gpu:
        text += f" {row['tflops']:.0f}TF"
    return f"{text:>{width}}"


def _k_label(k) -> str:
    return "k=-" if k is None else f"k={k}"


def format_report(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    gpu = meta["device"].startswith("cuda")
    lines = [
        f"attention sweep: {meta['command']}",
        f"  {meta['device']} ({meta['cuda'] or meta['processor']}), {meta['dtype']}, B={meta['batch']} "
        f"H={meta['heads']}, "
        f"threads={meta['threads']} (pinned), warm-up {meta['warmup']}, up to {meta['reps']} round-robin rounds (<= "
        f"{meta['max_seconds']} s per method)",
        "  cells: median ms (x ideal = median over rounds of time / ideal time in the same round)",
        f"  torch {meta['torch']}, triton {meta['triton']}, commit {commit_label(meta)}, "
        f"{meta['timestamp']}, {meta['wall_s']:.0f} s",
        f"  load average {_load(meta['loadavg_start'])} at start, {_load(meta['loadavg_end'])} at end on "
        f"{meta['cpus']} cores"
        + (
            "  ** BUSY MACHINE: absolute times are contended; compare ratios, prefer min-based numbers; "
            "--threads 1 is steadier **"
            if _busy(meta)
            else ""
        ),
    ]
    by_block = defaultdict(list)
    for row in rows:
        by_block[(row["layout"], row["n"], row["d"])].append(row)
    width = 26 if gpu else 18
    for (layout, n, d), block in by_block.items():
        ks = sorted({r["k"] for r in block}, key=lambda k: -1 if k is None else k)
        index = {(r["method"], r["phase"], r["k"]): r for r in block}
        methods = [m for m in METHODS if any(r["method"] == m for r in block)]
        for phase in PHASES:
            lines.append("")
            lines.append(f"{layout} N={n} D={d} {PHASE_LABEL[phase]}")
            lines.append(f"{'method':<24}" + "".join(f"{_k_label(k):>{width}}" for k in ks))
            for m in methods:
                lines.append(f"{m:<24}" + "".join(_cell(index.get((m, phase, k)), width, gpu) for k in ks))
            mults = " ".join(f"{_k_label(k)}: {index[('ideal', phase, k)]['ideal_multiplier']:.2f}" for k in ks)
            lines.append(f"{'ideal = x causal(N):':<24}{mults}")

    builds = [r for r in rows if r["phase"] == "build" and r["d"] == meta["dims"][0]]
    if builds:
        lines += ["", "mask / plan build, ms median (what each method needs before its first call)"]
        cols = ("dense_sdpa", "flex_blockmask", "flex_create_block_mask")
        lines.append(
            f"{'layout':<8}{'N':>6}{'k':>4}{'dense_mask()':>15}{'to_block_mask()':>17}"
            f"{'create_block_mask':>19}{'cbm / analytic':>16}"
        )
        index = {(r["layout"], r["n"], r["k"], r["method"]): r for r in builds}
        for key in sorted({(r["layout"], r["n"], r["k"]) for r in builds}, key=lambda t: (t[0], t[1], t[2] or 0)):
            cells = [index.get(key + (c,)) for c in cols]
            text = [
                f"{c['median_ms']:.2f}" if c and c["status"] == "ok" else (c["status"] if c else "-") for c in cells
            ]
            ratio = (
                cells[2]["median_ms"] / cells[1]["median_ms"]
                if all(c and c["status"] == "ok" for c in cells[1:])
                else None
            )
            k = "-" if key[2] is None else key[2]
            lines.append(
                f"{key[0]:<8}{key[1]:>6}{k:>4}{text[0]:>15}{text[1]:>17}{text[2]:>19}"
                f"{(f'{ratio:.1f}x' if ratio else '-'):>16}"
            )

    fits = report["fits"]
    if fits:
        lines += [
            "",
            f"fitted exponents at N={meta['fit_n']}: time ~ k^p and time ~ |M|^p (an O(|M|) kernel: p_|M| = 1; "
            "dense-mask SDPA: ~2)",
            "  raw: from median ms; norm: from time / causal attention over N in the same round (cancels load drift)",
        ]
        lines.append(f"{'':<39}{'---------- raw -----------':>28}{'--------- norm -----------':>28}")
        lines.append(
            f"{'layout':<8}{'D':>5}  {'method':<24}" + f"{'p_k fwd':>8}{'f+b':>6}{'p_|M| fwd':>10}{'f+b':>6}" * 2
        )
        index = {(f["layout"], f["d"], f["method"], f["phase"]): f for f in fits}

        def fmt(f, key, width):
            return f"{f[key]:>{width}.2f}" if f and f[key] is not None else f"{'-':>{width}}"

        for layout, d in sorted(
            {(f["layout"], f["d"]) for f in fits}, key=lambda t: (meta["layouts"].index(t[0]), t[1])
        ):
            for m in METHODS:
                fw, fb = index.get((layout, d, m, "fwd")), index.get((layout, d, m, "fwd_bwd"))
                if fw or fb:
                    cells = "".join(
                        fmt(fw, f"slope_k{s}", 8)
                        + fmt(fb, f"slope_k{s}", 6)
                        + fmt(fw, f"slope_work{s}", 10)
                        + fmt(fb, f"slope_work{s}", 6)
                        for s in ("", "_norm")
                    )
                    lines.append(f"{layout:<8}{d:>5}  {m:<24}{cells}")
            best = best_of_ours(fits, layout, d)
            if best:
                lines.append(
                    f"{'':<15}best of ours (fastest f+b at the largest k): {best['method']}, p_k "
                    f"{best['slope_k']:.2f} raw / "
                    f"{best['slope_k_norm']:.2f} norm"
                    + (
                        f", p_|M| {best['slope_work']:.2f} / {best['slope_work_norm']:.2f}"
                        if best["slope_work"] is not None
                        else ""
                    )
                )

    lines += ["", "methods not timed here:"]
    absent = [(m, info["reason"]) for m, info in report["methods"].items() if info["status"] != "measured"]
    lines += [f"  {m:<24}{why}" for m, why in absent] or ["  (none)"]
    problems = defaultdict(int)
    for row in rows:
        if row["status"] in ("error", "skipped"):
            problems[(row["method"], row["status"], row["reason"])] += 1
    if problems:
        lines += ["", "rows not timed:"]
        lines += [f"  {m} {status} x{count}: {why}" for (m, status, why), count in problems.items()]
    return "\n".join(lines)


def _load(value) -> str:
    return "?" if value is None else f"{value:.1f}"


def _busy(meta: dict) -> bool:
    """Others used more than half the cores: before we started, or beyond our own threads at the end."""
    half = 0.5 * (meta.get("cpus") or 1)
    start, end = meta.get("loadavg_start"), meta.get("loadavg_end")
    return (start is not None and start > half) or (end is not None and end - meta["threads"] > half)


def best_of_ours(fits: list[dict], layout: str, d: int) -> Optional[dict]:
    """Our fastest backend's fwd+bwd fit (fastest at the largest k), if any was timed."""
    ours = [
        f for f in fits if f["layout"] == layout and f["d"] == d and f["method"] in OURS and f["phase"] == "fwd_bwd"
    ]
    return min(ours, key=lambda f: f["median_ms"][-1]) if ours else None


def print_report(report: dict) -> None:
    print(format_report(report))


# ---------------------------------------------------------------------- files


_COLORS = {
    "ideal": "black",
    "dense_sdpa": "tab:red",
    "flex_blockmask": "tab:purple",
    "flex_create_block_mask": "tab:pink",
    "flash_attn_ideal": "tab:gray",
    "composite": "tab:blue",
    "cpp": "tab:green",
    "triton": "tab:orange",
}


def _plain_log_ticks(ax) -> None:
    """Log y axis labelled 1, 2, 5, 10, 20, ... in plain numbers."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)


def plot_time_vs_k(report: dict, d: int, path: str) -> bool:
    """Log-log time vs k at the fit N, one panel per layout that sweeps k, fitted slope in the legend."""
    plt = _pyplot()
    meta = report["meta"]
    fits = {(f["layout"], f["method"], f["phase"]): f for f in report["fits"] if f["d"] == d}
    layouts = [lay for lay in meta["layouts"] if any(key[0] == lay for key in fits)]
    if not layouts:
        return False
    fig, axes = plt.subplots(2, len(layouts), figsize=(4.2 * len(layouts), 7.5), squeeze=False)
    for col, layout in enumerate(layouts):
        for r, phase in enumerate(PHASES):
            ax = axes[r][col]
            for m in METHODS:
                f = fits.get((layout, m, phase))
                if f is None:
                    continue
                style = "--" if m == "ideal" else "-"
                ax.plot(
                    f["k"],
                    f["median_ms"],
                    style,
                    marker="o",
                    color=_COLORS.get(m),
                    label=f"{m} (p={f['slope_k']:.2f}, norm {f['slope_k_norm']:.2f})",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(meta["k"], [str(k) for k in meta["k"]])
            _plain_log_ticks(ax)
            ax.set_title(f"{layout}, {PHASE_LABEL[phase]}", fontsize=10)
            ax.set_xlabel("k")
            ax.set_ylabel("ms (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"time vs k at N={meta['fit_n']}, D={d} ({meta['device']}, {meta['dtype']}, B={meta['batch']} "
        f"H={meta['heads']}, "
        f"{meta['threads']} threads)\np = fitted log-log slope of these medians; norm = the same for time / "
        "same-round causal time",
        fontsize=10,
    )
    _save(fig, path)
    return True


def plot_ratio_to_ideal(report: dict, d: int, path: str) -> bool:
    """Bars of time / ideal per backend and k at the fit N, one panel per layout and phase."""
    plt = _pyplot()
    meta = report["meta"]
    rows = [
        r
        for r in report["rows"]
        if r["d"] == d
        and r["n"] == meta["fit_n"]
        and r["status"] == "ok"
        and r["phase"] in PHASES
        and r["method"] != "ideal"
    ]
    layouts = [lay for lay in meta["layouts"] if any(r["layout"] == lay for r in rows)]
    if not layouts:
        return False
    fig, axes = plt.subplots(2, len(layouts), figsize=(4.2 * len(layouts), 7.0), squeeze=False)
    for col, layout in enumerate(layouts):
        for r_i, phase in enumerate(PHASES):
            ax = axes[r_i][col]
            sel = [r for r in rows if r["layout"] == layout and r["phase"] == phase]
            ks = sorted({r["k"] for r in sel}, key=lambda k: -1 if k is None else k)
            methods = [m for m in METHODS if any(r["method"] == m for r in sel)]
            width = 0.8 / max(1, len(methods))
            for j, m in enumerate(methods):
                xs, ys = [], []
                for i, k in enumerate(ks):
                    hit = [r for r in sel if r["method"] == m and r["k"] == k]
                    if hit:
                        xs.append(i + (j - (len(methods) - 1) / 2) * width)
                        ys.append(hit[0]["ratio_to_ideal"])
                bars = ax.bar(xs, ys, width, color=_COLORS.get(m), label=m)
                ax.bar_label(bars, fmt="%.2g", fontsize=6)
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_yscale("log")
            _plain_log_ticks(ax)
            ax.set_xticks(range(len(ks)), [_k_label(k) for k in ks])
            ax.set_title(f"{layout}, {PHASE_LABEL[phase]}", fontsize=10)
            ax.set_ylabel("time / ideal")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            if sel:
                ax.legend(fontsize=7)
    fig.suptitle(
        f"time / ideal at N={meta['fit_n']}, D={d} ({meta['device']}, {meta['dtype']}, B={meta['batch']} "
        f"H={meta['heads']}, "
        f"{meta['threads']} threads)\n1 = the non-zero pairs at causal-attention speed (median of per-round "
        "ratios)",
        fontsize=10,
    )
    _save(fig, path)
    return True


def write_outputs(report: dict, out: str, *, plots: bool = True) -> list[str]:
    """attention.json, attention.csv and (with ``plots``) the PNGs under ``out``; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "attention.json"), os.path.join(out, "attention.csv")]
    write_json(report, paths[0])
    write_csv(report, paths[1])
    if plots:
        paths += write_plots(report, out)
    return paths


def write_plots(report: dict, out: str) -> list[str]:
    """time_vs_k_d<D>.png and ratio_to_ideal_d<D>.png per head dim under ``out``; returns the paths drawn."""
    paths = []
    for d in report["meta"]["dims"]:
        for name, plot in (("time_vs_k", plot_time_vs_k), ("ratio_to_ideal", plot_ratio_to_ideal)):
            path = os.path.join(out, f"{name}_d{d}.png")
            if plot(report, d, path):
                paths.append(path)
    return paths


def add_arguments(p) -> None:
    p.add_argument("report", help="attention.json written by the sweep")
    p.add_argument("--out", default=None, help="where to draw the plots (None: next to the JSON)")


def execute(args) -> int:
    with open(args.report) as f:
        report = json.load(f)
    print_report(report)
    out = args.out or os.path.dirname(os.path.abspath(args.report))
    os.makedirs(out, exist_ok=True)
    for path in write_plots(report, out):
        print(f"drew {path}")
    return 0

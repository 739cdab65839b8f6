"""The evaluation's report: the paper's Table 1 / Table 2 style tables and the speed/quality plot,
from the summary :func:`~kforcing_kernels.app.evaluation.evaluate.evaluate_pipeline` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..files import atomic_write_file

# the baseline an HF user runs: transformers' own sampling loop on the teacher folder
HF_GENERATE = "HF generate (sdpa)"
# The quality row of the Stage-1 PFLM(1) student itself (the k rows decode the final PFLM).
STAGE1_ROW = "Stage-1 PFLM(1), k=1"


def _ratio(q: dict, ar: dict) -> str:
    return f"{q['ppl'] / ar['ppl']:.2f}x"


def format_table1(summary: dict) -> str:
    """Throughput, speed-up and judge-scored quality at the main tau (markdown)."""
    bs = summary["batch_sizes"]
    head = (
        "| method | k | "
        + " | ".join(f"tok/s @ B={b}" for b in bs)
        + " | "
        + " | ".join(f"speedup @ B={b}" for b in bs)
    )
    head += " | judge NLL | judge PPL | PPL / AR | distinct-4 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ar = summary["quality"]["AR"]
    for name, row in summary["throughput"].items():
        k = "1" if name == "AR" else name.split("=")[1]
        q = summary["quality"][name]
        cells = [f"{row[str(b)]:,.0f}" for b in bs] + [f"{summary['speedup'][name][str(b)]:.2f}x" for b in bs]
        lines.append(
            f"| {name} | {k} | " + " | ".join(cells) + f" | {q['nll']:.3f} | {q['ppl']:.2f} | {_ratio(q, ar)} "
            f"| {q['distinct4']:.3f} |"
        )
    ref = summary["quality"]["data (held-out text)"]
    blank = " | ".join("-" for _ in bs)
    for name, q in summary["quality"].items():  # untimed rows (the Stage-1 student's own samples)
        if name not in summary["throughput"] and name != "data (held-out text)":
            lines.append(
                f"| {name} | 1 | {blank} | {blank} | {q['nll']:.3f} | {q['ppl']:.2f} | {_ratio(q, ar)} | "
                f"{q['distinct4']:.3f} |"
            )
    lines.append(
        f"| data (held-out text) | - | {blank} | {blank} | {ref['nll']:.3f} | {ref['ppl']:.2f} | "
        f"{_ratio(ref, ar)} | {ref['distinct4']:.3f} |"
    )
    return "\n".join(lines)


def format_tau_table(summary: dict) -> str:
    """Judge perplexity (ratio to AR at the same tau) and distinct-4 of every method at every tau of the sweep."""
    taus = list(summary["tau_sweep"])
    head = "| method | " + " | ".join(f"tau={t}: judge PPL (x AR), distinct-4" for t in taus) + " |"
    lines = [head, "|" + "---|" * (len(taus) + 1)]
    for name in summary["tau_sweep"][taus[0]]:
        cells = []
        for t in taus:
            q, ar = summary["tau_sweep"][t][name], summary["tau_sweep"][t]["AR"]
            cells.append(f"{q['ppl']:.2f} ({_ratio(q, ar)}), {q['distinct4']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stage1 = summary.get("tau_sweep_stage1")
    if stage1:
        cells = [
            f"{stage1['scores'][t]['ppl']:.2f} ({_ratio(stage1['scores'][t], summary['tau_sweep'][t]['AR'])}), "
            f"{stage1['scores'][t]['distinct4']:.3f}"
            for t in taus
        ]
        lines.append(f"| {stage1['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# What "samples like its teacher" means in numbers (judge perplexity over the AR teacher's at the same tau, and
# distinct-4): the Stage-1 student within this band at every tau, with this share of the teacher's distinct-4;
# the final PFLM(k) at most this far above the teacher, with this share of the held-out text's distinct-4.
STAGE1_PPL_BAND = (0.8, 1.25)
STAGE1_DISTINCT4_SHARE = 0.9
FINAL_PPL_MAX = 1.5
FINAL_DISTINCT4_SHARE = 0.9


def target_checks(summary: dict) -> list[dict]:
    """Each sampling target as ``{"target", "value", "met"}`` (``met`` None: not decidable), from the summary's own
    numbers; [] when the rows are missing.

    The Stage-1 rows need the Stage-1 student's samples (``quality`` row :data:`STAGE1_ROW`); the tau row needs the
    tau sweep; the final rows need the ``K-Forcing k=<final_k>`` row and the held-out text.
    """
    quality, checks = summary["quality"], []
    ar = quality["AR"]
    lo, hi = STAGE1_PPL_BAND
    if STAGE1_ROW in quality:
        stage1 = quality[STAGE1_ROW]
        r = stage1["ppl"] / ar["ppl"]
        checks.append(
            {
                "target": f"Stage-1 student: judge PPL {lo}-{hi}x AR at tau {summary['temperature']}",
                "value": f"{r:.2f}x",
                "met": lo <= r <= hi,
            }
        )
        checks.append(
            _share_check(
                f"Stage-1 student: distinct-4 >= {STAGE1_DISTINCT4_SHARE}x AR's",
                stage1["distinct4"],
                ar["distinct4"],
                STAGE1_DISTINCT4_SHARE,
            )
        )
        sweep = (summary.get("tau_sweep_stage1") or {}).get("scores")
        if sweep:
            # Following tau is rising with it (a hotter sampler writes less likely text): a perplexity flat across tau
            # ignores the temperature, whatever its ratios to the teacher's.
            taus = sorted(sweep, key=float)
            ppls = [sweep[t]["ppl"] for t in taus]
            ratios = {t: sweep[t]["ppl"] / summary["tau_sweep"][t]["AR"]["ppl"] for t in taus}
            rising = len(ppls) > 1 and all(a < b for a, b in zip(ppls, ppls[1:]))
            checks.append(
                {
                    "target": f"Stage-1 student: PPL follows tau (rises with it, {lo}-{hi}x AR at tau "
                    + " / ".join(taus)
                    + ")",
                    "value": " / ".join(f"{p:.2f} ({r:.2f}x)" for p, r in zip(ppls, ratios.values())),
                    "met": rising and all(lo <= r <= hi for r in ratios.values()),
                }
            )
    final = f"K-Forcing k={summary['final_k']}"
    if final in quality and summary["final_k"] > 1:
        r = quality[final]["ppl"] / ar["ppl"]
        checks.append(
            {"target": f"{final}: judge PPL <= {FINAL_PPL_MAX}x AR", "value": f"{r:.2f}x", "met": r <= FINAL_PPL_MAX}
        )
        data = quality.get("data (held-out text)")
        if data:
            checks.append(
                _share_check(
                    f"{final}: distinct-4 >= {FINAL_DISTINCT4_SHARE}x the held-out text's",
                    quality[final]["distinct4"],
                    data["distinct4"],
                    FINAL_DISTINCT4_SHARE,
                )
            )
    return checks


def _share_check(target: str, value: float, reference: float, share: float) -> dict:
    """``value >= share * reference``; not decidable (``met`` None) when the reference is 0 (samples too short for a
    4-gram)."""
    if reference <= 0:
        return {"target": target, "value": f"{value:.3f} (reference {reference:.3f})", "met": None}
    return {"target": target, "value": f"{value:.3f} ({value / reference:.2f}x)", "met": value >= share * reference}


def format_targets(summary: dict) -> str:
    """The sampling targets as a markdown table (empty when :func:`target_checks` has none)."""
    checks = target_checks(summary)
    if not checks:
        return ""
    lines = ["| sampling target | this run | met |", "|---|---|---|"]
    lines += [
        f"| {c['target']} | {c['value']} | {'-' if c['met'] is None else 'yes' if c['met'] else 'NO'} |" for c in checks
    ]
    return "\n".join(lines)


def format_report(summary: dict) -> str:
    """All tables with captions that say what is measured (markdown): what the demo and ``evaluate RUN`` print."""
    bs = summary["batch_sizes"]
    judge = summary.get("judge", "the run's Stage-0 AR teacher")
    caption1 = (
        f"Generation: prompts of {summary['prompt_len']} held-out tokens, {summary['new_tokens']} new tokens, "
        f"tau={summary['temperature']}, KV cache, {summary['threads']} threads, "
        f"median of {summary.get('reps', '?')} timed runs "
        f"after one warm-up. K-Forcing k uses the final PFLM(k={summary['final_k']}); the Stage-1 row "
        "(untimed) is the Stage-1 "
        f"student's own samples, one token per step. Quality of the {max(bs)} completions of the "
        f"largest batch, all scored by one fixed judge, {judge}: its mean NLL and perplexity of the generated "
        "tokens "
        "given the prompt (cut at the first EOS), and that perplexity over the AR teacher's at the same tau. "
        "Judge-scored, "
        "NOT the paper's GPT-2-large Gen-PPL. distinct-4 = unique 4-grams / all 4-grams (low = repetitive; "
        "repetitive text can score a low perplexity). Which way is bad: a student that samples like its "
        "teacher "
        "has PPL / AR near 1.00x AND distinct-4 near the AR row's. Far BELOW 1.00x is not better than the "
        "teacher: with a lower distinct-4 it is mode collapse (the student emits the teacher's likely tokens, "
        "not its samples); far ABOVE 1.00x is text the teacher finds unlikely. The held-out text row is "
        "real data, not a target (the judge is the teacher, so its own samples score lower). "
        f"The PFLMs decode by {summary.get('decode', 'argmax')} (model/decoding.py); an argmax PFLM collapses "
        "until it resolves its noise to the width of the teacher's CDF intervals, which takes far more Stage-1 "
        "steps than the default demo's (BENCHMARKS.md, \"Stage 1: the fixes tried, and the budget the targets "
        'need").'
    )
    caption_tau = (
        f"Temperature sweep: the same {max(bs)} prompts and noise at each tau, scored by the same judge; "
        "the "
        "student's perplexity should rise with tau like the AR teacher's (the noise encoder is conditioned "
        "on tau); a "
        "ratio that falls as tau rises (flat student perplexity) means the student ignores tau and its "
        "noise."
    )
    caption2 = (
        "Per-position validation NLL of each student against its own teacher's targets (paper Table 2), and "
        "how often "
        "the student's argmax equals the target; the AR row is the teacher's next-token NLL on held-out text."
    )
    parts = [format_table1(summary), caption1]
    if summary.get("tau_sweep"):
        parts += [format_tau_table(summary), caption_tau]
    targets = format_targets(summary)
    if targets:
        caption_targets = (
            "Does each student sample like its teacher? Targets checked on this run's numbers above. Where a Stage-1 "
            "row says NO: a PFLM(1) decoded by argmax emits its teacher's mode until it resolves its noise to the "
            "width "
            "of the teacher's CDF intervals, and the measured curve over Stage-1 steps and model width "
            '(`python -m bench stage1`; BENCHMARKS.md, "Stage 1 over steps and width") puts that far past the '
            "default demo's budget."
        )
        parts += [targets, caption_targets]
    parts += [format_nll_table(summary), caption2]
    return "\n\n".join(parts) + "\n"


def format_nll_table(summary: dict) -> str:
    rows = summary["per_position_nll"]
    kmax = max(r["k"] for r in rows)
    head = (
        "| model | "
        + " | ".join(f"NLL j={j}" for j in range(1, kmax + 1))
        + " | "
        + " | ".join(f"agree j={j}" for j in range(1, kmax + 1))
        + " |"
    )
    lines = [head, "|" + "---|" * (2 * kmax + 1)]
    for r in rows:
        nll = [f"{v:.3f}" for v in r["nll"]] + ["-"] * (kmax - len(r["nll"]))
        agree = [f"{v:.3f}" for v in (r["agreement"] or [])]
        agree += ["-"] * (kmax - len(agree))
        lines.append(f"| {r['model']} | " + " | ".join(nll) + " | " + " | ".join(agree) + " |")
    return "\n".join(lines)


def timing_report(summary: dict) -> str:
    """Lines on how stable the timings are and, for an HF model, K-Forcing against transformers' own ``generate``."""
    lines = []
    for name, per_batch in summary.get("timing", {}).items():
        for b, t in per_batch.items():
            lines.append(
                f"  {name:<22} batch {b}: {t['runs']} runs, median {t['median_s'] * 1e3:.1f} ms "
                f"(min {t['min_s'] * 1e3:.1f}, max {t['max_s'] * 1e3:.1f}, spread {100 * t['spread']:.0f}%)"
            )
    text = "Timed runs (seconds per generation of the whole batch):\n" + "\n".join(lines) if lines else ""
    if "hf_generate" in summary:
        rows = [
            f"  {name:<22} " + ", ".join(f"batch {b}: {v:.2f}x" for b, v in per_batch.items())
            for name, per_batch in summary["speedup_vs_hf_generate"].items()
        ]
        text += (
            f"\nAgainst {HF_GENERATE} ("
            + ", ".join(f"batch {b}: {v:.0f} tokens/s" for b, v in summary["hf_generate"].items())
            + "), the baseline an HF user runs:\n"
            + "\n".join(rows)
        )
    return text


def plot_summary(summary: dict, path: str | Path) -> Optional[str]:
    """Speed-up and judge-scored perplexity vs k; returns None, or why no plot was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib unavailable ({exc})"
    names = [n for n in summary["throughput"] if n != "AR"]
    ks = [int(n.split("=")[1]) for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for b in summary["batch_sizes"]:
        ax1.plot(ks, [summary["speedup"][n][str(b)] for n in names], marker="o", label=f"batch {b}")
    ax1.axhline(1.0, color="gray", linestyle="--", label="AR")
    ax1.set(xlabel="k (tokens per forward)", ylabel="speed-up over AR (tokens/s)", xticks=ks, title="Throughput")
    ax1.legend()
    ppl = [summary["quality"][n]["ppl"] for n in names]
    ax2.plot(ks, ppl, marker="o", label="K-Forcing (distinct-4 beside each point)")
    for k, p, n in zip(ks, ppl, names):
        ax2.annotate(f" {summary['quality'][n]['distinct4']:.2f}", (k, p))
    ax2.axhline(summary["quality"]["AR"]["ppl"], color="gray", linestyle="--", label="AR teacher samples")
    ax2.axhline(summary["quality"]["data (held-out text)"]["ppl"], color="green", linestyle=":", label="held-out text")
    ax2.set(
        xlabel="k (tokens per forward)",
        ylabel="perplexity under the judge",
        xticks=ks,
        title=f"Quality (tau={summary['temperature']}); not GPT-2 Gen-PPL",
    )
    ax2.legend()
    fig.tight_layout()
    atomic_write_file(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    plt.close(fig)
    return None


def judge_description(folder: Path, info: dict, given: bool) -> str:
    """How the report names the judge: which model (the run's own AR teacher or one given), its folder, and how it was
    trained (its steps; a pretrained source folder, ``--model``'s, was not trained by this package and says so)."""
    from ..student import find_kind

    kind = find_kind(folder)
    option = kind.source_option(folder) if kind is not None else None
    if option is not None:  # a source folder (--model): pretrained elsewhere, no steps of ours
        what = "a pretrained model" if given else f"the run's AR teacher, the pretrained {option} model"
        return f"{what} ({folder})"
    steps = (info.get("train_config") or {}).get("steps")
    what = "a separately trained AR model" if given else "the run's Stage-0 AR teacher"
    return f"{what} ({folder}, {steps} steps)" if steps is not None else f"{what} ({folder})"

"""The README's GPU table (``python -m bench gpu --render FILE ...``) from bench/gpu/triton_gpu.py report JSON."""

from __future__ import annotations

import json


def render_markdown(paths: list[str]) -> str:
    """A markdown table (TFLOP/s per useful FLOP, fwd / fwd+bwd) of the rows in report JSON files."""
    methods = ("triton", "flex", "sdpa_flash_causal", "composite", "dense_sdpa")
    lines = [
        "| N | k | D | triton | flex (compiled) | SDPA-flash causal | composite | dense-mask SDPA "
        "| triton / flex | triton / SDPA-flash |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for r in report["rows"]:
            cells = []
            for m in methods:
                res = r["results"].get(m)
                cells.append(
                    f"{res['fwd_tflops']:.0f} / {res['fwd_bwd_tflops']:.0f}"
                    if res
                    else ("OOM" if "OutOfMemory" in r["errors"].get(m, "") else "-")
                )
            ratios = [
                f"{r['ratios'][f'fwd_vs_{o}']:.2f} / {r['ratios'][f'fwd_bwd_vs_{o}']:.2f}"
                if f"fwd_vs_{o}" in r["ratios"]
                else "-"
                for o in ("flex", "sdpa_flash_causal")
            ]
            lines.append(f"| {r['n']} | {r['k']} | {r['dim']} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)

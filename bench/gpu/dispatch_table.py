"""Write the CUDA dispatch table (kforcing_kernels/ops/window_attention/dispatch_table.json) from measurements.

    python -m bench dispatch-table gpu-out/bench_flex_single.json --command "bash bench/gpu/gpu_check.sh"
    python -m bench dispatch-table report.json --out /tmp/table.json   # elsewhere (the dry run does this)

Reads ``bench/gpu/triton_gpu.py --json`` reports whose rows measured both ``triton`` and ``flex_backend``
(``window_attention(backend="flex")``, what a user would get) forward + backward, and writes, per
(GPU capability, dtype, head dim, length bucket, layout family), the faster of the two, with both
times and the provenance (GPU, torch, Triton, date, command). Rows already in the table for other
keys stay; a measured key replaces its old row. Where two measured shapes fall into one key (two
k at one N), the backend must win both to be written, else the key keeps ``triton``.
"""

from __future__ import annotations

import json

from kforcing_kernels.ops.window_attention import dispatch

from .triton_gpu import LAYOUTS

CANDIDATES = dispatch.BENCH_METHOD  # backend -> the bench method that measures it


def rows_from_report(report: dict, command: str) -> list[dict]:
    """The table rows a triton_gpu report decides (see the module docstring)."""
    machine = report["machine"]
    provenance = {
        "gpu": machine.get("cuda") or report["capability"],
        "torch": machine["torch"],
        "triton": machine.get("triton") or "none",
        "date": machine["timestamp"],
        "command": f"{command} ({report['command']})" if command else report["command"],
    }
    if machine.get("git_commit"):
        provenance["commit"] = machine["git_commit"] + ("-dirty" if machine.get("git_dirty") else "")
    dtype = "float32" if report["config"].get("dry_run") else "bfloat16"
    by_key: dict = {}
    for r in report["rows"]:
        times = {
            backend: r["results"][method]["fwd_bwd_ms"]
            for backend, method in CANDIDATES.items()
            if r["results"].get(method, {}).get("fwd_bwd_ms")
        }
        if len(times) < 2:
            continue  # one side missing (failed, or a CPU dry run's flex without backward): decides nothing
        layout = LAYOUTS[r["layout"]](r["n"], r["k"])
        key = (
            report["capability"],
            dtype,
            r["dim"],
            dispatch.length_bucket(layout.n_ctx),
            dispatch.layout_family(layout),
        )
        winner = min(times, key=times.get)
        entry = by_key.setdefault(key, {"winners": set(), "fwd_bwd_ms": {}})
        entry["winners"].add(winner)
        for backend, ms in times.items():
            entry["fwd_bwd_ms"][f"{CANDIDATES[backend]} N={r['n']} k={r['k']}"] = ms
    rows = []
    for (cap, dt, dim, bucket, family), entry in by_key.items():
        backend = entry["winners"].pop() if len(entry["winners"]) == 1 else "triton"
        ms = {
            method: min(v for k, v in entry["fwd_bwd_ms"].items() if k.startswith(method + " "))
            for method in CANDIDATES.values()
        }
        rows.append(
            {
                "capability": cap,
                "dtype": dt,
                "head_dim": dim,
                "length_bucket": bucket,
                "family": family,
                "backend": backend,
                "fwd_bwd_ms": ms,
                "measured": entry["fwd_bwd_ms"],
                "provenance": provenance,
            }
        )
    return rows


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", help="bench/gpu/triton_gpu.py --json reports")
    p.add_argument("--out", default=None, help="the table to update (default: the package's dispatch_table.json)")
    p.add_argument("--command", default="", help="the command that produced the reports, for the provenance")


def execute(args) -> int:
    rows = []
    for path in args.reports:
        with open(path) as f:
            rows += rows_from_report(json.load(f), args.command)
    out = args.out or dispatch.TABLE_PATH
    try:
        table = dispatch.load(out)
    except FileNotFoundError:
        table = dispatch.empty_table()
    path = dispatch.write(dispatch.merge(table, rows), out)
    for row in rows:
        print(
            f"dispatch table: sm {row['capability']} {row['dtype']} D={row['head_dim']} N<={row['length_bucket']} "
            f"{row['family']}: {row['backend']} (fwd+bwd ms {row['fwd_bwd_ms']})"
        )
    print(f"dispatch table: {len(rows)} row(s) written to {path}")
    return 0

"""How the demo's training budget is best split between stages: several pipeline allocations, trained side by side.

Each variant is the demo's pipeline (tiny model, k_final = 4, the demo's data and evaluation)
with its own steps per stage; the variants run as parallel processes on one device (a GPU
holds several tiny runs at once) and each is scored by the demo's evaluation with its own
Stage-0 teacher as judge, or by one shared teacher with ``--shared-stage0``. The report is
the k = 4 judge perplexity over the AR teacher's at every tau, with distinct-4.

    kforcing-bench allocation --device cuda --shared-stage0 1000 \\
        --variant a=450,300,3000 --variant b=450,300,2400 --variant c=200,150,240,distill_batch=8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench._cli import command_line, default_out
from kforcing_kernels.cli_common import add_device, make_parser

_KEYS = ("distill_batch", "seed")


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S]`` (S0 is ignored with --shared-stage0; write any number)."""
    name, sep, spec = text.partition("=")
    parts = spec.split(",") if sep else []
    steps = [p for p in parts if "=" not in p]
    extra = dict(p.split("=", 1) for p in parts if "=" in p)
    if not name or len(steps) != 4 or not all(s.isdigit() and int(s) > 0 for s in steps) or set(extra) - set(_KEYS) \
            or not all(v.isdigit() for v in extra.values()):
        raise argparse.ArgumentTypeError(f"expected NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S] with positive step counts, got {text!r}")
    s0, s1, k2, k4 = (int(s) for s in steps)
    return name, dict(steps_stage0=s0, steps_stage1=s1, steps_stage2=(k2, k4),
                      batch_size_distill=int(extra["distill_batch"]) if "distill_batch" in extra else None,
                      seed=int(extra.get("seed", 0)))


def train_and_score(spec: dict, out: Path, device: str) -> dict:
    """One variant: the demo pipeline with ``spec``'s steps in ``out``, then the demo's evaluation."""
    from kforcing_kernels.demo import DEMO
    from kforcing_kernels.evaluate import evaluate_pipeline, format_report
    from kforcing_kernels.pipeline import run_pipeline

    base = dataclasses.replace(DEMO["train"], device=device, progress=False, seed=spec["seed"])
    pipe = dataclasses.replace(DEMO["pipeline"], out=str(out), steps_stage0=spec["steps_stage0"], steps_stage1=spec["steps_stage1"],
                               steps_stage2=spec["steps_stage2"], batch_size_distill=spec["batch_size_distill"])
    t0 = time.perf_counter()
    run_pipeline(pipe, base)
    seconds = time.perf_counter() - t0
    summary = evaluate_pipeline(out, device=device, log=lambda s: None, **dataclasses.asdict(DEMO["eval"]))
    (out / "tables.md").write_text(format_report(summary))
    sweep = summary["tau_sweep"]
    return {
        "spec": spec, "train_seconds": seconds,
        "judge_ppl": {tau: {m: q["ppl"] for m, q in row.items()} for tau, row in sweep.items()},
        "ppl_over_ar": {tau: {m: q["ppl"] / row["AR"]["ppl"] for m, q in row.items()} for tau, row in sweep.items()},
        "distinct4": {tau: {m: q["distinct4"] for m, q in row.items()} for tau, row in sweep.items()},
        "per_position_nll": summary["per_position_nll"],
    }


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = dict(args.variant)
    if args.shared_stage0:
        from kforcing_kernels.demo import DEMO
        from kforcing_kernels.train import train

        shared = out / "shared" / "stage0"
        if not (shared / "model.json").exists():
            train(dataclasses.replace(DEMO["train"], device=args.device, progress=False, stage="stage0", out=str(shared),
                                      steps=args.shared_stage0, lr=DEMO["pipeline"].lr_stage0))
        for name, spec in variants.items():
            spec["steps_stage0"] = args.shared_stage0
            if not (out / name / "stage0").exists():
                shutil.copytree(shared, out / name / "stage0")
    procs = {}
    for name, spec in variants.items():
        (out / name).mkdir(exist_ok=True)
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", "import json, sys; from bench.demo_allocation import _child; _child(*sys.argv[1:])",
             json.dumps(spec), str(out / name), args.device],
            stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    rows = {}
    for name, proc in procs.items():
        if proc.wait() != 0:
            rows[name] = {"spec": variants[name], "status": f"failed (exit {proc.returncode}): see {out / (name + '.log')}"}
        else:
            rows[name] = json.loads((out / name / "allocation.json").read_text())
    return {"command": args.command, "device": args.device, "shared_stage0": args.shared_stage0, "variants": rows}


def _child(spec_json: str, out: str, device: str) -> None:
    row = train_and_score(json.loads(spec_json), Path(out), device)
    (Path(out) / "allocation.json").write_text(json.dumps(row, indent=1))


def format_report(report: dict) -> str:
    lines = ["| variant | stage0, stage1, k=2, k=4 steps | distill batch | seed | train s | "
             "k=4 PPL / AR at tau 0.5, 0.8, 1.0 | k=4 distinct-4 at tau 0.8 | AR judge PPL at tau 0.8 |", "|---" * 8 + "|"]
    for name, row in report["variants"].items():
        spec = row["spec"]
        steps = f"{spec['steps_stage0']}, {spec['steps_stage1']}, {spec['steps_stage2'][0]}, {spec['steps_stage2'][1]}"
        if "status" in row:
            lines.append(f"| {name} | {steps} | {spec['batch_size_distill'] or '-'} | {spec['seed']} | {row['status']} | | | |")
            continue
        ratios = ", ".join(f"{r['K-Forcing k=4']:.2f}x" for r in row["ppl_over_ar"].values())
        lines.append(f"| {name} | {steps} | {spec['batch_size_distill'] or '-'} | {spec['seed']} | {row['train_seconds']:.0f} | {ratios} | "
                     f"{row['distinct4']['0.8']['K-Forcing k=4']:.3f} | {row['judge_ppl']['0.8']['AR']:.2f} |")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--variant", action="append", type=parse_variant, required=True, metavar="NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S]",
                   help="one allocation (repeatable); the variants train in parallel processes")
    p.add_argument("--shared-stage0", type=int, default=None, metavar="STEPS",
                   help="train one Stage-0 teacher with this many steps and give it to every variant (one judge for all)")
    p.add_argument("--out", default=None, help="output folder (None: runs/bench-allocation-<time>)")
    add_device(p)


def finish_args(p, args, argv, prog):
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        p.error(f"argument --variant: expected distinct names, got {names}")
    args.out = args.out or default_out("bench-allocation-")
    args.command = command_line(prog, argv)
    return args


def execute(args) -> dict:
    report = run(args)
    print(format_report(report))
    Path(args.out, "allocation.json").write_text(json.dumps(report, indent=1))
    Path(args.out, "allocation.md").write_text(format_report(report) + "\n")
    return report


def main(argv=None, prog="python bench/demo_allocation.py") -> dict:
    p = make_parser(prog, __doc__)
    add_arguments(p)
    return execute(finish_args(p, p.parse_args(argv), argv, prog))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()

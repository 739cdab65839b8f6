"""How the demo's training budget is best split between stages: several pipeline allocations, trained side by side.

Each variant is the demo's pipeline (tiny model, k_final = 4, the demo's data and evaluation)
with its own steps per stage; the variants run as parallel processes on one device (a GPU
holds several tiny runs at once) and each is scored by the demo's evaluation with its own
Stage-0 teacher as judge, or by one shared teacher with ``--shared-stage0``. The report is
the k = 4 judge perplexity over the AR teacher's at every tau, with distinct-4.

    python -m bench allocation --device cuda --shared-stage0 1000 \\
        --variant a=0,450,300,3000,distill_batch=16 --variant b=0,450,300,2400,distill_batch=16
    python -m bench allocation --device cpu --variant demo=600,200,150,240 --variant
    short_b16=600,150,100,100,distill_batch=16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kforcing_kernels.app.cli import add_device, positive_int

from .._cli import command_line, default_out

_KEYS = ("distill_batch", "seed")


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S]``: steps of Stage 0, Stage 1 and the k=2, k=4 rounds.

    S0 may be 0 only with ``--shared-stage0`` (which sets it); ``distill_batch`` defaults to the demo's.
    """
    from kforcing_kernels.app.demo import DEMO

    name, sep, spec = text.partition("=")
    parts = spec.split(",") if sep else []
    steps = [p for p in parts if "=" not in p]
    extra = dict(p.split("=", 1) for p in parts if "=" in p)
    if (
        not name
        or len(steps) != 4
        or not all(s.isdigit() for s in steps)
        or not all(int(s) > 0 for s in steps[1:])
        or set(extra) - set(_KEYS)
        or not all(v.isdigit() for v in extra.values())
        or extra.get("distill_batch") == "0"
    ):
        raise argparse.ArgumentTypeError(
            "expected NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S] with positive step counts (S0 0 with "
            f"--shared-stage0), got {text!r}"
        )
    s0, s1, k2, k4 = (int(s) for s in steps)
    distill_batch = int(extra["distill_batch"]) if "distill_batch" in extra else DEMO["pipeline"].batch_size_distill
    return name, dict(
        steps_stage0=s0,
        steps_stage1=s1,
        steps_stage2=(k2, k4),
        batch_size_distill=distill_batch,
        seed=int(extra.get("seed", 0)),
    )


def train_and_score(spec: dict, out: Path, device: str) -> dict:
    """One variant: the demo pipeline with ``spec``'s steps in ``out``, then the demo's evaluation."""
    from kforcing_kernels.app.demo import DEMO
    from kforcing_kernels.app.evaluation.evaluate import evaluate_pipeline
    from kforcing_kernels.app.evaluation.report import format_report
    from kforcing_kernels.app.training.pipeline import run_pipeline

    base = dataclasses.replace(DEMO["train"], device=device, progress=False, seed=spec["seed"])
    pipe = dataclasses.replace(
        DEMO["pipeline"],
        out=str(out),
        steps_stage0=spec["steps_stage0"],
        steps_stage1=spec["steps_stage1"],
        steps_stage2=spec["steps_stage2"],
        batch_size_distill=spec["batch_size_distill"],
    )
    t0 = time.perf_counter()
    run_pipeline(pipe, base)
    seconds = time.perf_counter() - t0
    summary = evaluate_pipeline(out, device=device, log=lambda s: None, **dataclasses.asdict(DEMO["eval"]))
    (out / "tables.md").write_text(format_report(summary))
    sweep = summary["tau_sweep"]
    return {
        "spec": spec,
        "train_seconds": seconds,
        "judge_ppl": {tau: {m: q["ppl"] for m, q in row.items()} for tau, row in sweep.items()},
        "ppl_over_ar": {tau: {m: q["ppl"] / row["AR"]["ppl"] for m, q in row.items()} for tau, row in sweep.items()},
        "distinct4": {tau: {m: q["distinct4"] for m, q in row.items()} for tau, row in sweep.items()},
        "per_position_nll": summary["per_position_nll"],
    }


def _shared_stage0(out: Path, steps: int, seed: int, device: str) -> Path:
    """The one Stage-0 teacher of every variant with this seed (trained on first use)."""
    from kforcing_kernels.app.demo import DEMO
    from kforcing_kernels.app.training.checkpoint import read_json
    from kforcing_kernels.app.training.config import ConfigError
    from kforcing_kernels.app.training.loop import train
    from kforcing_kernels.app.training.provenance import changed_settings

    folder = out / f"shared_seed{seed}" / "stage0"
    cfg = dataclasses.replace(
        DEMO["train"],
        device=device,
        progress=False,
        seed=seed,
        stage="stage0",
        out=str(folder),
        steps=steps,
        lr=DEMO["pipeline"].lr_stage0,
    )
    if (folder / "model.json").exists():
        for key, used, wanted in changed_settings(read_json(folder / "model.json")["train_config"], cfg):
            raise ConfigError(
                f"shared_stage0: {folder} holds a teacher trained with {key}={used!r}, this run asks for "
                f"{wanted!r}; "
                "use another --out"
            )
    else:
        train(cfg)
    return folder


def run(args) -> dict:
    out = Path(args.out).resolve()  # the variants run with the repository root as their working directory
    out.mkdir(parents=True, exist_ok=True)
    variants = dict(args.variant)
    for name, spec in variants.items():
        if args.shared_stage0:
            spec["steps_stage0"] = args.shared_stage0
            if not (out / name / "stage0").exists():
                shutil.copytree(
                    _shared_stage0(out, args.shared_stage0, spec["seed"], args.device), out / name / "stage0"
                )
        elif spec["steps_stage0"] == 0:
            raise SystemExit(f"--variant {name}: Stage 0 needs steps (S0 = 0 only with --shared-stage0)")
    # Parallel CPU variants share the cores: each gets its share, and waits without spinning (see demo.py).
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(variants)))
    procs, logs = {}, {}
    for name, spec in variants.items():
        (out / name).mkdir(exist_ok=True)
        logs[name] = open(out / f"{name}.log", "w")
        procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import sys; from {__package__}.demo_allocation import _child; _child(*sys.argv[1:])",
                json.dumps(spec),
                str(out / name),
                args.device,
            ],
            stdout=logs[name],
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
            env=env,
        )
    rows = {}
    for name, proc in procs.items():
        proc.wait()
        logs[name].close()
        if proc.returncode != 0:
            rows[name] = {
                "spec": variants[name],
                "status": f"failed (exit {proc.returncode}): see {out / (name + '.log')}",
            }
        else:
            rows[name] = json.loads((out / name / "allocation.json").read_text())
    return {"command": args.command, "device": args.device, "shared_stage0": args.shared_stage0, "variants": rows}


def _child(spec_json: str, out: str, device: str) -> None:
    row = train_and_score(json.loads(spec_json), Path(out), device)
    (Path(out) / "allocation.json").write_text(json.dumps(row, indent=1))


def format_report(report: dict) -> str:
    lines = [
        "| variant | stage0, stage1, k=2, k=4 steps | distill batch | seed | train s | "
        "k=4 PPL / AR at tau 0.5, 0.8, 1.0 | k=4 distinct-4 at tau 0.8 | AR judge PPL at tau 0.8 |",
        "|---" * 8 + "|",
    ]
    for name, row in report["variants"].items():
        spec = row["spec"]
        steps = f"{spec['steps_stage0']}, {spec['steps_stage1']}, {spec['steps_stage2'][0]}, {spec['steps_stage2'][1]}"
        if "status" in row:
            lines.append(
                f"| {name} | {steps} | {spec['batch_size_distill'] or '-'} | {spec['seed']} | {row['status']} | | | |"
            )
            continue
        ratios = ", ".join(f"{r['K-Forcing k=4']:.2f}x" for r in row["ppl_over_ar"].values())
        lines.append(
            f"| {name} | {steps} | {spec['batch_size_distill'] or '-'} | {spec['seed']} | "
            f"{row['train_seconds']:.0f} | {ratios} | "
            f"{row['distinct4']['0.8']['K-Forcing k=4']:.3f} | {row['judge_ppl']['0.8']['AR']:.2f} |"
        )
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        required=True,
        metavar="NAME=S0,S1,K2,K4[,distill_batch=B][,seed=S]",
        help="one allocation (repeatable); the variants train in parallel processes",
    )
    p.add_argument(
        "--shared-stage0",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="train one Stage-0 teacher (per seed) with this many steps and give it to every variant: one "
        "judge for all",
    )
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

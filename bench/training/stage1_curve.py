"""The Stage-1 student (PFLM(1)) over training steps and model width: what it resolves of its noise, and how its
samples compare with its teacher's at every tau (issue 39).

For each width, Stage 0 trains an AR teacher at the demo's settings (``--stage0-steps``, the demo's data, batch and
learning rate) with ``--n-embd`` set to that width; for each step count, Stage 1 trains a PFLM(1) from it at the
demo's Stage-1 settings (batch 8, lr 2e-3). Both run as the documented CLI commands (``kforcing-train stage0`` /
``stage1``), in ``OUT/w<width>/stage0`` and ``OUT/w<width>/s1_<steps>``; finished stages are reused, so an interrupted
sweep continues where it stopped. Each student is then measured:

* ``noise_diagnosis.diagnose`` at tau 0.8: noise sensitivity against the teacher's ``1 - sum p^2``, the nats of u
  it uses, accuracy on narrow CDF intervals, distinct tokens over a u sweep;
* ``noise_diagnosis.decode_bracket`` at every ``--taus``: the judge (its own teacher) perplexity and distinct-4 of its
  k=1 samples decoded by argmax (the paper's PFLM decoding) and by the residual rule, against the teacher's samples.

    python -m bench stage1 --out R                                              # widths 64,128,256; 400 and 1600 steps
    python -m bench stage1 --out R --widths 128 --steps 400,1600,6400           # the steps curve at the demo's width
    python -m bench stage1 --out R --widths 32 --steps 20 --stage0-steps 20 --taus 0.8 --batches 1 --new-tokens 4   #
    seconds

The numbers are deterministic (seeded training on the CPU); the report is ``OUT/stage1_curve.json`` and a markdown
table on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kforcing_kernels.app.cli import add_threads, positive_int

SCHEMA_ID = "kforcing-bench/stage1-curve/v1"


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive ints, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise ValueError(f"expected a comma-separated list of positive numbers, got {text!r}")
    return values


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="the sweep's folder (stages are kept and reused there)")
    p.add_argument("--widths", type=_int_list, default=[64, 128, 256], help="model widths n_embd (4 heads each)")
    p.add_argument("--steps", type=_int_list, default=[400, 1600], help="Stage-1 step counts (one run each)")
    p.add_argument("--stage0-steps", type=positive_int, default=None, help="Stage-0 steps (None: the demo's)")
    p.add_argument("--taus", type=_float_list, default=[0.5, 0.8, 1.0], help="temperatures of the judged samples")
    p.add_argument("--batches", type=positive_int, default=2, help="diagnosis batches of 16 windows")
    p.add_argument("--new-tokens", type=positive_int, default=48, help="tokens per judged sample (128 samples)")
    add_threads(p)


def _train(argv: list[str], threads) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    cmd = [
        sys.executable,
        "-m",
        "kforcing_kernels.app.train",
        *argv,
        *(["--threads", str(threads)] if threads else []),
        "--no-progress",
    ]
    print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def _model_json(folder: Path) -> dict:
    try:
        return json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return {}


def _finished(folder: Path, wanted: dict, teacher: Optional[Path] = None) -> bool:
    """Whether ``folder`` holds a finished stage trained with ``wanted`` (train_config entries), from ``teacher``'s
    current weights when given. A stage is finished when its model.json is written (the last file a stage writes,
    after its weights); a folder with only checkpoints is an interrupted run, and one trained with other settings or
    from a teacher trained again since is another measurement: each is trained again."""
    info = _model_json(folder)
    saved = info.get("train_config", {})
    if not info or not (folder / "model.safetensors").exists() or any(saved.get(k) != v for k, v in wanted.items()):
        return False
    return teacher is None or info.get("teacher_sha256") == _model_json(teacher).get("tensors", {}).get("sha256")


def measure_student(stage0: Path, stage1: Path, taus: list[float], batches: int, new_tokens: int) -> dict:
    """The diagnosis at tau 0.8 and the judged k=1 samples at every tau of one Stage-1 student."""
    from kforcing_kernels.app.evaluation.noise_diagnosis import decode_bracket, diagnose
    from kforcing_kernels.app.evaluation.run_folders import recorded_data
    from kforcing_kernels.app.student import corpus_for, load_student

    teacher, tinfo, _ = load_student(stage0)
    student, sinfo, _ = load_student(stage1)
    teacher.eval(), student.eval()
    corpus = corpus_for(str(stage0), recorded_data(stage0, tinfo), teacher.config.vocab_size)
    d = diagnose(
        teacher,
        student,
        corpus.val,
        tau=0.8,
        order=sinfo.get("cdf_order", "vocab"),
        batches=batches,
        seq_len=tinfo["train_config"]["seq_len"],
    )
    narrow = [r["accuracy"] for r in d["accuracy_by_width"][:2]]
    row = {
        "parameters": sum(p.numel() for p in student.parameters()),
        "val_loss": _last_val_loss(stage1),
        "teacher_entropy": d["teacher entropy"],
        "nats_of_u_used": d["teacher entropy"] - d["student nll"],
        "noise_sensitivity": d["noise_sensitivity"]["student"],
        "teacher_noise_sensitivity": d["noise_sensitivity"]["teacher 1 - sum p^2"],
        "accuracy_narrow_intervals": narrow,
        "distinct_tokens_u_sweep": d["u_sweep"]["distinct tokens per context (student)"],
        "teacher_distinct_tokens_u_sweep": d["u_sweep"]["distinct tokens per context (teacher)"],
        "next_token_nll_tau1": d["next_token_nll_tau1"],
        "samples": {},
    }
    for tau in taus:
        b = decode_bracket(teacher, student, corpus.val, corpus.eos_id, tau=tau, new_tokens=new_tokens)
        row["samples"][str(tau)] = {name: {"ppl": q["ppl"], "distinct4": q["distinct4"]} for name, q in b.items()}
    return row


def _row_key(row: dict) -> dict:
    """What a row was measured with: its point and settings (a row written before settings were recorded has none,
    so it matches nothing and is measured again)."""
    return {key: row.get(key) for key in ("width", "steps", "stage0_steps", "settings")}


def _last_val_loss(folder: Path):
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    vals = [json.loads(line).get("val_loss") for line in path.read_text().splitlines() if line.strip()]
    vals = [v for v in vals if v is not None]
    return vals[-1] if vals else None


def format_table(rows: list[dict]) -> str:
    taus = sorted({t for r in rows for t in r["samples"]}, key=float)
    head = [
        "width (params)",
        "Stage-1 steps",
        "val loss",
        "nats of u used",
        "noise sens. (teacher)",
        "acc. intervals <0.01 / 0.01-0.05",
    ]
    for t in taus:
        head += [f"tau {t}: argmax PPL (x AR), distinct-4", f"tau {t}: residual", f"tau {t}: AR PPL, distinct-4"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        narrow = " / ".join("-" if a is None else f"{a:.3f}" for a in r["accuracy_narrow_intervals"])
        cells = [
            f"{r['width']} ({r['parameters'] / 1e6:.2f}M)",
            str(r["steps"]),
            "-" if r["val_loss"] is None else f"{r['val_loss']:.2f}",
            f"{r['nats_of_u_used']:.2f} of {r['teacher_entropy']:.2f}",
            f"{r['noise_sensitivity']:.3f} ({r['teacher_noise_sensitivity']:.3f})",
            narrow,
        ]
        for t in taus:
            s = r["samples"].get(t)
            if s is None:  # a row measured at other temperatures
                cells += ["-", "-", "-"]
                continue
            ar = s["AR teacher"]
            cells.append(
                " | ".join(
                    f"{s[k]['ppl'] / ar['ppl']:.2f}x, {s[k]['distinct4']:.3f}"
                    for k in ("student, argmax", "student, residual")
                )
                + f" | {ar['ppl']:.2f}, {ar['distinct4']:.3f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def execute(args) -> int:
    import torch

    from kforcing_kernels.app.demo import DEMO

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe = DEMO["pipeline"]
    stage0_steps = args.stage0_steps or pipe.steps_stage0
    report_path = out / "stage1_curve.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"schema": SCHEMA_ID, "rows": []}
    # Everything that changes a row's numbers, recorded in the row: a row is reused only when all of it matches (a
    # rerun with other --taus, --batches or --new-tokens measures again and replaces the row).
    measure = {
        "taus": [float(t) for t in args.taus],
        "batches": args.batches,
        "new_tokens": args.new_tokens,
        "lr_stage0": pipe.lr_stage0,
        "lr_distill": pipe.lr_distill,
        "batch_size_distill": pipe.batch_size_distill,
    }
    wanted_rows = []
    for width in args.widths:
        stage0 = out / f"w{width}" / f"stage0_{stage0_steps}"
        if not _finished(stage0, {"steps": stage0_steps, "lr": pipe.lr_stage0, "model_overrides": {"n_embd": width}}):
            _train(
                [
                    "stage0",
                    "--out",
                    str(stage0),
                    "--steps",
                    str(stage0_steps),
                    "--lr",
                    str(pipe.lr_stage0),
                    "--n-embd",
                    str(width),
                    "--overwrite",
                ],
                args.threads,
            )
        for steps in args.steps:
            key = dict(width=width, steps=steps, stage0_steps=stage0_steps, settings=measure)
            wanted_rows.append(key)
            if any(_row_key(r) == key for r in report["rows"]):
                continue
            stage1 = stage0.parent / f"s1_{steps}_from{stage0_steps}"
            if not _finished(
                stage1, {"steps": steps, "lr": pipe.lr_distill, "batch_size": pipe.batch_size_distill}, teacher=stage0
            ):
                _train(
                    [
                        "stage1",
                        "--teacher",
                        str(stage0),
                        "--out",
                        str(stage1),
                        "--steps",
                        str(steps),
                        "--lr",
                        str(pipe.lr_distill),
                        "--batch-size",
                        str(pipe.batch_size_distill),
                        "--overwrite",
                    ],
                    args.threads,
                )
            row = dict(key, **measure_student(stage0, stage1, args.taus, args.batches, args.new_tokens))
            same_point = (width, steps, stage0_steps)  # a row of the same point measured otherwise is replaced
            report["rows"] = [r for r in report["rows"] if (r["width"], r["steps"], r["stage0_steps"]) != same_point]
            report["rows"].append(row)
            report["rows"].sort(key=lambda r: (r["width"], r["stage0_steps"], r["steps"]))
            report_path.write_text(json.dumps(report, indent=1))
            print(f"width {width}, {steps} Stage-1 steps done", file=sys.stderr, flush=True)
    # The table shows what this command asked for (the report may hold other points, measured their own way).
    report["rows"] = [r for r in report["rows"] if _row_key(r) in wanted_rows]
    print(format_table(report["rows"]))
    return 0

"""Evaluation of a trained pipeline: per-position NLL, agreement, throughput and teacher-scored quality.

    python -m kforcing_kernels.app.evaluation.evaluate runs/x            # the folder `train pipeline` wrote

* Per-position validation NLL (paper Table 2): for each student PFLM(k), the NLL of
  its j-th token against its own teacher's target (the Stage-1/Stage-2 targets, on
  held-out text, with fresh noise), and how often its argmax equals the target.
* Throughput (paper Table 1): generated tokens / wall time of KV-cached generation,
  AR (the Stage-0 teacher) vs K-Forcing with k in {1, 2, 4} from the final PFLM,
  at several batch sizes; one warm-up call is excluded and the timed calls of all
  methods are interleaved so machine-load drift does not favour any of them.
* Quality, scored by one fixed *judge* (an AR model; default: the run's Stage-0
  teacher, or any AR stage folder given as ``judge``), the same model object for
  every row: mean NLL and perplexity of each completion given its prompt, truncated
  at the first EOS, and the ratio to the AR teacher's samples at the same tau. This
  is a judge-scored perplexity, not the paper's GPT-2-large Gen-PPL. Mode-seeking,
  repetitive text also scores a low perplexity, so distinct-n (unique n-grams / all
  n-grams, n = 2 and 4) is reported beside it. The same is repeated over a sweep of
  temperatures (does the student follow tau like the teacher?).

:data:`DEMO_EVAL` is the one place that defines the demo's evaluation settings
(prompt length, new tokens, tau, seed, ...); ``evaluate RUN`` uses it as its
defaults, so it reproduces the demo's tables for the demo's run folder.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ...settings import POSITIVE, check_reals
from ..data import DataError, sample_crops
from ..files import CheckpointError, check_fields, check_writable, write_json
from ..generation.inference import generate_ar, generate_kforcing
from ..records import DISTILLED_FIELDS, RUN_TEXT_FIELDS, read_model_json
from ..student import Student, corpus_for, device_of, find_kind, kind_of, kind_of_folder, load_student
from ..training.targets import forward_distillation_targets, self_forcing_targets
from .report import HF_GENERATE, STAGE1_ROW, format_report, target_checks, timing_report
from .run_folders import ar_teacher_folder, load_judge, recorded_data, same_tokenizer


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluation measures and how; :data:`DEMO_EVAL` is the demo's (and ``evaluate RUN``'s default)."""

    batch_sizes: tuple[int, ...] = (4, 16, 128)  # throughput per batch size; quality from the largest
    ks: tuple[int, ...] = (1, 2, 4)  # decoding windows of the final PFLM
    prompt_len: int = 16  # held-out tokens per prompt
    new_tokens: int = 48
    temperature: float = 0.8  # tau of Table 1 and of the per-position NLL table
    taus: tuple[float, ...] = (0.5, 0.8, 1.0)  # the quality sweep over temperatures
    reps: int = 5  # timed runs per method (median), after one warm-up
    nll_batches: int = 8
    nll_batch_size: int = 16
    seed: int = 0  # prompts, noise and validation batches

    # The real-valued settings (kforcing_kernels/settings.py): K-Forcing conditions its noise on tau > 0.
    REAL_SETTINGS = {"temperature": POSITIVE, "taus": POSITIVE}

    def __post_init__(self) -> None:
        check_reals(self, self.REAL_SETTINGS)


DEMO_EVAL = EvalSettings()
# `kforcing-train pipeline --evaluate quick`: every table once, in seconds (its quality numbers are a smoke check of a
# run).
# Its timings are a measurement all the same: 32 new tokens and 9 timed runs per method (one run of 8 tokens gave k = 4
# "speedups" from 0.77x to 59x across models of one size); summary["timing"] reports the spread of the runs.
QUICK_EVAL = EvalSettings(
    batch_sizes=(2,), prompt_len=8, new_tokens=32, taus=(0.5, 1.0), reps=9, nll_batches=1, nll_batch_size=2
)


# ---------------------------------------------------------------------- NLL


@torch.no_grad()
def ar_validation_nll(
    model: Student, val: torch.Tensor, *, batches: int, batch_size: int, seq_len: int, seed: int = 0
) -> float:
    """Mean next-token NLL of an AR model on held-out windows (the reference row of Table 2)."""
    gen = torch.Generator().manual_seed(seed)
    device = device_of(model)
    total = 0.0
    for _ in range(batches):
        x = sample_crops(val, batch_size, seq_len + 1, gen).to(device)
        total += float(F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()))
    return total / batches


@torch.no_grad()
def per_position_nll(
    student: Student,
    teacher: Student,
    teacher_k: int,
    val: torch.Tensor,
    *,
    batches: int,
    batch_size: int,
    seq_len: int,
    tau: float,
    seed: int = 0,
) -> dict:
    """``{"k", "nll": [k], "agreement": [k]}`` of a student PFLM(k) against its teacher's targets.

    ``teacher_k == 0``: the AR teacher's inverse-CDF samples (Stage 1); otherwise the two-round
    self-forcing targets of the PFLM(teacher_k) teacher (Stage 2), with ``k = 2 * teacher_k``.
    """
    k = 1 if teacher_k == 0 else 2 * teacher_k
    gen = torch.Generator().manual_seed(seed)
    device = device_of(student)
    nll = torch.zeros(k, dtype=torch.float64)
    agree = torch.zeros(k, dtype=torch.float64)
    for _ in range(batches):
        ctx = sample_crops(val, batch_size, seq_len, gen).to(device)
        z = torch.rand(batch_size, seq_len, k, generator=gen).to(device)
        taus = torch.full((batch_size,), tau, device=device)
        if teacher_k == 0:
            targets = forward_distillation_targets(teacher(ctx), z[..., 0], taus)[..., None]
        else:
            targets = self_forcing_targets(teacher, ctx, z, taus)
        logits = student(ctx, z, taus).float()  # [B, N, k, V]
        per_token = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view(targets.shape)
        nll += per_token.mean((0, 1)).double().cpu()
        agree += (logits.argmax(-1) == targets).double().mean((0, 1)).cpu()
    return {"k": k, "nll": (nll / batches).tolist(), "agreement": (agree / batches).tolist()}


# ---------------------------------------------------------------------- quality under a fixed judge


def distinct_n(rows: Sequence[Sequence[int]], n: int) -> float:
    """Unique n-grams / all n-grams over token rows (n-grams do not cross rows); 0.0 when there are none."""
    if n < 1:
        raise ValueError(f"n: expected a positive integer, got {n}")
    grams = [tuple(row[i : i + n]) for row in rows for i in range(len(row) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def judge_score(judge: Student, prompts: torch.Tensor, completions: torch.Tensor, eos_id: Optional[int] = None) -> dict:
    """The judge's NLL of completions ``[B, T]`` given prompts ``[B, P]``, each cut after its first EOS.

    Returns ``{"nll": mean per scored token, "ppl": exp(nll), "distinct2", "distinct4": unique/total
    n-grams of the scored tokens, "tokens": scored}``.
    """
    device = device_of(judge)
    # Callers pass prompts and completions from either device (held-out text stays on the CPU).
    prompts, completions = prompts.to(device), completions.to(device)
    p = prompts.shape[1]
    seq = torch.cat([prompts, completions], 1)
    logp = torch.log_softmax(judge(seq[:, :-1]).float(), -1)  # [B, P+T-1, V]
    token_logp = logp[:, p - 1 :].gather(-1, seq[:, p:, None])[..., 0]  # [B, T]
    keep = torch.ones_like(completions, dtype=torch.bool)
    if eos_id is not None:
        is_eos = completions == eos_id
        after_first = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
        keep = ~after_first
    n = int(keep.sum())
    nll = float(-(token_logp * keep).sum() / max(n, 1))
    rows = [[t for t, m in zip(row, mask) if m] for row, mask in zip(completions.tolist(), keep.tolist())]
    return {
        "nll": nll,
        "ppl": math.exp(nll),
        "distinct2": distinct_n(rows, 2),
        "distinct4": distinct_n(rows, 4),
        "tokens": n,
    }


# ---------------------------------------------------------------------- throughput


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_timings(
    fns: dict[str, Callable[[], object]], reps: int, device: torch.device
) -> dict[str, list[float]]:
    """One warm-up call each, then ``reps`` rounds calling every fn once per round; seconds per call.

    A tqdm bar (calls done/total, rate, ETA) on a terminal; it updates between timed calls, never inside one.
    """
    from tqdm import tqdm

    bar = tqdm(
        total=len(fns) * (reps + 1),
        desc="[eval] timed generations",
        unit="call",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
    for fn in fns.values():
        fn()
        bar.update()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            bar.update()
    bar.close()
    return times


# ---------------------------------------------------------------------- the whole run


def evaluate_pipeline(
    run: str | Path,
    *,
    batch_sizes: Sequence[int] = DEMO_EVAL.batch_sizes,
    ks: Sequence[int] = DEMO_EVAL.ks,
    prompt_len: int = DEMO_EVAL.prompt_len,
    new_tokens: int = DEMO_EVAL.new_tokens,
    temperature: float = DEMO_EVAL.temperature,
    taus: Sequence[float] = DEMO_EVAL.taus,
    reps: int = DEMO_EVAL.reps,
    nll_batches: int = DEMO_EVAL.nll_batches,
    nll_batch_size: int = DEMO_EVAL.nll_batch_size,
    judge: Union[str, Path, Student, None] = None,
    device: str = "cpu",
    seed: int = DEMO_EVAL.seed,
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluate the stage folders of a pipeline run (``stage0``, ``stage1``, ``stage2_k*``).

    ``judge``: the AR model that scores every generated text (a stage folder or a model);
    None uses the run's Stage-0 teacher. Defaults are :data:`DEMO_EVAL`'s.
    """
    # The real-valued settings are refused by name before any model is loaded (EvalSettings' check; no taus: no sweep).
    EvalSettings(temperature=temperature, taus=tuple(taus))
    run = Path(run)
    batch_sizes = sorted(batch_sizes)  # quality is scored on the outputs of the last (largest) batch
    ar_folder = ar_teacher_folder(run)
    teacher, tinfo, tokenizer = load_student(ar_folder, device)
    judge_model, judge_text = load_judge(run, judge, device, tokenizer)
    text_folder = ar_folder
    if kind_of_folder(ar_folder).is_source(ar_folder):  # a pretrained model: the run's text and settings are stage1's
        text_folder = run / "stage1"
        stage1 = read_model_json(text_folder)
        tinfo = {**tinfo, **{key: stage1[key] for key in ("data", "train_config") if key in stage1}}
    check_fields(text_folder / "model.json", tinfo, RUN_TEXT_FIELDS)
    data = recorded_data(text_folder, tinfo)
    try:
        corpus = corpus_for(str(ar_folder), data, teacher.config.vocab_size)
    except DataError as exc:  # the message of --data, an option evaluate does not have: say what this run needs
        why = str(exc).removeprefix("source (--data): ")
        raise ValueError(
            f"run: the text {text_folder} was trained on ({data!r}, recorded in its model.json) cannot be "
            f"read ({why}); put it back there to evaluate this run"
        ) from None
    if same_tokenizer(corpus.tokenizer, tokenizer) is False:
        raise ValueError(
            f"run: the text of its --data {tinfo['data']!r} changed since {ar_folder} was trained (it now "
            "gives another tokenizer); restore it to evaluate this run"
        )
    if judge_model.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"judge: its vocabulary ({judge_model.config.vocab_size}) is not the run's ({teacher.config.vocab_size})"
        )
    stages = [run / "stage1"] + sorted(run.glob("stage2_k*"), key=lambda p: int(p.name.split("_k")[1]))
    seq_len = tinfo["train_config"]["seq_len"]
    summary: dict = {
        "run": str(run),
        "temperature": temperature,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch_sizes": list(batch_sizes),
        "device": device,
        "threads": torch.get_num_threads(),
        "seed": seed,
        "judge": judge_text,
        "reps": reps,
    }

    # Table 2: per-position NLL of every student against its own teacher's targets.
    log("[eval] per-position validation NLL")
    nll_rows = [
        {
            "model": "AR teacher (next token, data)",
            "k": 0,
            "nll": [
                ar_validation_nll(
                    teacher, corpus.val, batches=nll_batches, batch_size=nll_batch_size, seq_len=seq_len, seed=seed
                )
            ],
            "agreement": None,
        }
    ]
    models, prev, prev_folder, prev_sha = {}, teacher, ar_folder, tinfo["tensors"]["sha256"]
    for folder in stages:
        student, info, student_tokenizer = load_student(folder, device)
        check_fields(folder / "model.json", info, DISTILLED_FIELDS)
        # Each row compares a student with the teacher it was distilled from, on the run's tokenizer.
        if same_tokenizer(student_tokenizer, tokenizer) is False:
            raise ValueError(
                f"run: {folder} has another tokenizer than {run / 'stage0'}; its stages are not one pipeline"
            )
        if info.get("teacher_sha256") not in (None, prev_sha):
            raise ValueError(
                f"run: {folder} was distilled from another teacher than the {prev_folder} in this folder "
                "(retrained since?); retrain the later stages (`kforcing-train pipeline --overwrite`)"
            )
        prev_folder, prev_sha = folder, info["tensors"]["sha256"]
        row = per_position_nll(
            student,
            prev,
            info["teacher_k"],
            corpus.val,
            batches=nll_batches,
            batch_size=nll_batch_size,
            seq_len=seq_len,
            tau=temperature,
            seed=seed,
        )
        nll_rows.append({"model": f"PFLM(k={info['k']}) [{folder.name}]", **row})
        models[info["k"]] = student
        prev = student
    summary["per_position_nll"] = nll_rows
    final_k = max(models)
    pflm = models[final_k]
    summary["decode"] = kind_of(pflm).decode_rule(pflm)  # the rule of model/decoding.py its PFLMs decode by
    ks = [k for k in ks if k <= final_k]

    # Table 1: throughput per batch size, quality from the largest batch (most samples).
    gen = torch.Generator().manual_seed(seed + 1)
    prompts_all = sample_crops(corpus.val, max(batch_sizes), prompt_len, gen)
    noise_ar = torch.rand(max(batch_sizes), new_tokens, generator=gen)
    noise_kf = {k: torch.rand(max(batch_sizes), math.ceil(new_tokens / k), k, generator=gen) for k in ks}

    def generators(prompts: torch.Tensor, tau: float, b: int, outputs: dict) -> dict:
        fns: dict[str, Callable[..., None]] = {
            "AR": lambda: outputs.__setitem__(
                "AR", generate_ar(teacher, prompts, new_tokens, temperature=tau, noise=noise_ar[:b])
            )
        }
        for k in ks:
            fns[f"K-Forcing k={k}"] = lambda k=k: outputs.__setitem__(
                f"K-Forcing k={k}",
                generate_kforcing(pflm, prompts, k, new_tokens, temperature=tau, noise=noise_kf[k][:b]),
            )
        return fns

    throughput: dict[str, dict[int, float]] = {"AR": {}, **{f"K-Forcing k={k}": {} for k in ks}}
    outputs: dict[str, torch.Tensor] = {}
    hf_model = kind_of(teacher).reference_generator(ar_folder, device)  # HF's own generate, for an HF teacher
    timing: dict[str, dict[str, dict]] = {}
    for b in batch_sizes:
        log(f"[eval] throughput at batch {b}")
        fns = generators(prompts_all[:b].to(device), temperature, b, outputs)
        if hf_model is not None:
            fns[HF_GENERATE] = lambda b=b: _hf_generate(
                hf_model, prompts_all[:b].to(device), new_tokens, temperature, corpus.eos_id
            )
        t_batch = time.perf_counter()
        times = interleaved_timings(fns, reps, torch.device(device))
        log(f"[eval] batch {b}: {len(fns)} methods x {reps} runs in {time.perf_counter() - t_batch:.0f}s")
        for name, ts in times.items():
            throughput.setdefault(name, {})[b] = b * new_tokens / statistics.median(ts)
            timing.setdefault(name, {})[str(b)] = {
                "runs": len(ts),
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "max_s": max(ts),
                "spread": (max(ts) - min(ts)) / statistics.median(ts),
            }
    hf_throughput = throughput.pop(HF_GENERATE, None)
    prompts_dev = prompts_all.to(device)
    # The "K-Forcing k=1" row decodes the FINAL PFLM one token per step; the Stage-1 student's own samples
    # (what forward distillation produced, before self-forcing) get a row of their own, untimed.
    stage1_name = STAGE1_ROW if final_k > 1 else None
    if stage1_name:
        outputs[stage1_name] = generate_kforcing(
            models[1], prompts_dev, 1, new_tokens, temperature=temperature, noise=noise_kf[1]
        )
    log(f"[eval] judging {len(outputs) + 1} x {max(batch_sizes)} samples")
    quality = {name: judge_score(judge_model, prompts_dev, out, corpus.eos_id) for name, out in outputs.items()}
    reference = sample_crops(
        corpus.val, max(batch_sizes), prompt_len + new_tokens, torch.Generator().manual_seed(seed + 2)
    )
    quality["data (held-out text)"] = judge_score(
        judge_model, reference[:, :prompt_len].to(device), reference[:, prompt_len:], corpus.eos_id
    )
    summary["throughput"] = {name: {str(b): v for b, v in row.items()} for name, row in throughput.items()}
    summary["speedup"] = {name: {str(b): row[b] / throughput["AR"][b] for b in row} for name, row in throughput.items()}
    # Seconds per timed run: median, min, max and spread ((max - min) / median) over the ``reps`` runs, per batch size.
    summary["timing"] = timing
    if hf_throughput is not None:  # HF's generate beside the package's AR: the speedup an HF user sees
        summary["hf_generate"] = {str(b): v for b, v in hf_throughput.items()}
        summary["speedup_vs_hf_generate"] = {
            name: {str(b): row[b] / hf_throughput[b] for b in row} for name, row in throughput.items()
        }
    summary["quality"] = quality
    summary["samples"] = {
        name: corpus.decode(torch.cat([prompts_all[0], out[0].cpu()]).tolist()) for name, out in outputs.items()
    }

    # The temperature sweep: same prompts and noise, every method at every tau, one judge.
    log(f"[eval] quality over tau in {list(taus)}")
    sweep: dict[str, dict[str, dict]] = {}
    stage1_sweep: dict[str, dict] = {}
    for tau in taus:
        outs: dict[str, torch.Tensor] = {}
        for fn in generators(prompts_dev, tau, max(batch_sizes), outs).values():
            fn()
        if stage1_name:  # kept apart from the timed methods' rows (tau_sweep holds exactly those)
            out1 = generate_kforcing(models[1], prompts_dev, 1, new_tokens, temperature=tau, noise=noise_kf[1])
            stage1_sweep[str(tau)] = judge_score(judge_model, prompts_dev, out1, corpus.eos_id)
        sweep[str(tau)] = {
            name: judge_score(judge_model, prompts_dev, out, corpus.eos_id) for name, out in outs.items()
        }
    summary["tau_sweep"] = sweep
    if stage1_sweep:
        summary["tau_sweep_stage1"] = {"name": stage1_name, "scores": stage1_sweep}
    summary["final_k"] = final_k
    summary["targets"] = target_checks(summary)  # the sampling targets, met or not (report.py)
    return summary


@torch.no_grad()
def _hf_generate(model, prompts: torch.Tensor, new_tokens: int, temperature: float, eos_id: int) -> torch.Tensor:
    """``new_tokens`` sampled tokens per prompt with transformers' ``generate`` (KV cache, no top-k/top-p, no early
    stop)."""
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=eos_id,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kforcing-evaluate`` command line; defaults are :data:`DEMO_EVAL`'s, options shared with every CLI from
    app/cli.py."""
    from ..cli import (
        add_batch_sizes,
        add_device,
        add_new_tokens,
        add_seed,
        add_temperature,
        add_threads,
        make_parser,
        positive_float_list,
        positive_int,
    )

    d = DEMO_EVAL
    parser = make_parser("kforcing-evaluate", "Evaluate a `train pipeline` run folder (defaults: the demo's settings).")
    parser.add_argument("run", help="the pipeline folder (holds stage0, stage1, stage2_k*)")
    add_batch_sizes(parser, list(d.batch_sizes), help="batch sizes of the throughput table; quality from the largest")
    parser.add_argument("--prompt-len", type=positive_int, default=d.prompt_len, help="held-out tokens per prompt")
    add_new_tokens(parser, d.new_tokens)
    add_temperature(parser, help_extra=" of the tables (K-Forcing needs > 0)")
    parser.add_argument(
        "--taus",
        type=positive_float_list,
        default=",".join(map(str, d.taus)),
        help="temperatures of the quality sweep, comma-separated (none: skip it)",
    )
    parser.add_argument(
        "--reps", type=positive_int, default=d.reps, help="timed runs per method (median), after one warm-up"
    )
    add_seed(parser)
    parser.add_argument("--judge", help="an AR stage folder that scores all methods (None: the run's stage0)")
    add_device(parser)
    add_threads(parser)
    parser.add_argument("--json", help="also write the summary here")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    from ..cli import apply_threads

    parser = build_parser()
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    if args.temperature == 0:
        parser.error("argument --temperature: expected a positive number (K-Forcing samples at tau > 0), got 0")
    if (
        not (Path(args.run) / "stage0" / "model.json").exists()
        and not (Path(args.run) / "stage1" / "model.json").exists()
    ):
        parser.error(f"argument run: no pipeline in {args.run!r} (expected {Path(args.run) / 'stage0' / 'model.json'})")
    try:
        judge_kind = find_kind(args.judge) if args.judge is not None else None
    except ValueError as exc:  # its model.json names an unknown kind, or is malformed: the message names the entry
        parser.error(f"argument --judge: {exc}")
    if args.judge is not None and judge_kind is None:
        parser.error(f"argument --judge: expected an AR stage folder holding model.json, got {args.judge!r}")
    if args.json:
        try:
            check_writable(args.json, "--json")  # before the evaluation, not after it
        except CheckpointError as exc:
            parser.error(f"argument {exc}")
    try:
        summary = evaluate_pipeline(
            args.run,
            batch_sizes=args.batch_sizes,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            temperature=args.temperature,
            taus=args.taus,
            reps=args.reps,
            seed=args.seed,
            judge=args.judge,
            device=args.device,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(format_report(summary))
    print(timing_report(summary))
    if args.json:
        try:
            write_json(args.json, summary)
        except CheckpointError as exc:
            parser.error(f"argument --json: {exc}")


if __name__ == "__main__":
    main()

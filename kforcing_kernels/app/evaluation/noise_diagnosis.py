"""Does a Stage-1 PFLM(1) student sample like its AR teacher, or emit the teacher's mode?

    python -m kforcing_kernels.app.evaluation.noise_diagnosis RUN [--temperature 0.8] [--student RUN/stage1]
    [--generate]

A push-forward student maps uniform noise u to the token the teacher's inverse CDF gives at u,
so with fresh noise its tokens should vary exactly as often as two independent teacher samples
do. This tool prints, on held-out windows of the run's text (teacher = ``RUN/stage0``):

* noise sensitivity: the fraction of positions whose student token changes when u is redrawn,
  against the teacher's ``1 - sum p^2`` (the chance two independent teacher samples differ).
  Far below the teacher's means the student ignores its noise (mode collapse).
* accuracy (student argmax = teacher target) per width of the teacher CDF interval u fell in
  (the target's probability at tau): a student that only resolves wide intervals gets the
  mode right and every rarer token wrong.
* a u sweep: per context, how many distinct tokens the student emits over a fine grid of u,
  against the teacher's inverse CDF on the same grid (what the noise features resolve in use),
  and how close the noise encoder's outputs are for nearby u.
* train/inference consistency: the student's agreement with targets built other ways (tau = 1,
  1 - u, the other vocabulary order of the CDF, the teacher's mode): the highest agreement says
  which construction the student actually learned; and whether cached generation's first
  token equals the training-time SingleForward's argmax at the same u and tau.
* the student as a language model: its softmax averaged over u, scored on real next tokens at
  tau = 1, against the teacher's next-token NLL (has the noise slot relearned next-token prediction?).
* ``--generate``: :func:`decode_bracket`, the judge perplexity of the student's k=1 samples decoded
  by argmax and by the residual rule (its own posterior at the noise's low digits), against the teacher's samples.

The metric definitions (:func:`noise_sensitivity`, :func:`collision_complement`,
:func:`accuracy_by_width`) are what ``python_tests/app/evaluation/test_noise_diagnosis.py`` holds on hand-made cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from ...model.decoding import decode_slots
from ..data import sample_crops
from ..files import CheckpointError, check_fields
from ..records import RUN_TEXT_FIELDS
from ..student import corpus_for, load_student
from ..training.targets import CDF_ORDERS, forward_distillation_targets

# Upper edges of the interval-width buckets of accuracy_by_width (the last bucket is [0.5, 1]).
WIDTH_EDGES = (0.01, 0.05, 0.2, 0.5, 1.0)


def noise_sensitivity(tokens_a: torch.Tensor, tokens_b: torch.Tensor) -> float:
    """Fraction of positions where two decodings of the same contexts under independent noise differ.

    tokens_a, tokens_b: int ``[...]`` of one shape (the same contexts, noise drawn twice).
    For exact samples of a distribution p this estimates ``1 - sum p^2`` (:func:`collision_complement`).
    """
    if tokens_a.shape != tokens_b.shape:
        raise ValueError(
            f"tokens_b: expected the shape of tokens_a {tuple(tokens_a.shape)}, got {tuple(tokens_b.shape)}"
        )
    if tokens_a.numel() == 0:
        raise ValueError("tokens_a: expected at least one position, got none")
    return float((tokens_a != tokens_b).double().mean())


def collision_complement(probs: torch.Tensor) -> float:
    """Mean over rows of ``1 - sum_v p_v^2``: the chance two independent samples of a row's distribution differ.

    probs ``[..., V]``, each row summing to 1.
    """
    if probs.dim() == 0 or probs.shape[-1] == 0:
        raise ValueError(f"probs: expected [..., V] with V >= 1, got shape {tuple(probs.shape)}")
    return float((1.0 - probs.double().pow(2).sum(-1)).mean())


def accuracy_by_width(widths: torch.Tensor, correct: torch.Tensor, edges: Sequence[float] = WIDTH_EDGES) -> list[dict]:
    """Accuracy per bucket of CDF interval width: ``[{"lo", "hi", "count", "accuracy" (None if empty)}]``.

    widths ``[...]`` in [0, 1] (the probability of the target token, i.e. the width of the CDF
    interval the noise fell in), correct bool ``[...]``; bucket i holds ``edges[i-1] <= w < edges[i]``
    (the first starts at 0, the last includes its upper edge).
    """
    if widths.shape != correct.shape:
        raise ValueError(f"correct: expected the shape of widths {tuple(widths.shape)}, got {tuple(correct.shape)}")
    w, c = widths.reshape(-1).double(), correct.reshape(-1).bool()
    rows, lo = [], 0.0
    for i, hi in enumerate(edges):
        inside = (w >= lo) & ((w <= hi) if i == len(edges) - 1 else (w < hi))
        n = int(inside.sum())
        rows.append({"lo": lo, "hi": hi, "count": n, "accuracy": float(c[inside].double().mean()) if n else None})
        lo = hi
    return rows


@torch.no_grad()
def diagnose(
    teacher,
    student,
    val: torch.Tensor,
    *,
    tau: float,
    order: str,
    batches: int = 4,
    batch_size: int = 16,
    seq_len: int = 128,
    sweep_contexts: int = 16,
    sweep_points: int = 128,
    sweep_len: int = 32,
    lm_draws: int = 8,
    seed: int = 0,
) -> dict:
    """All the numbers of the module docstring for one (AR teacher, PFLM(1) student) pair at temperature ``tau``.

    ``order``: the vocabulary order of the CDF the student was trained with (:data:`CDF_ORDERS`).
    """
    gen = torch.Generator().manual_seed(seed)
    other = [o for o in CDF_ORDERS if o != order]
    sens, tsens, collision, pmax, entropy, nll, n = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0
    agree = {
        "targets (training construction)": 0.0,
        "targets at tau=1": 0.0,
        "targets at 1-u": 0.0,
        **{f"targets in {o} order": 0.0 for o in other},
        "teacher's mode (argmax)": 0.0,
    }
    widths, correct = [], []
    for _ in range(batches):
        ctx = sample_crops(val, batch_size, seq_len, gen)
        z1 = torch.rand(batch_size, seq_len, 1, generator=gen)
        z2 = torch.rand(batch_size, seq_len, 1, generator=gen)
        taus = torch.full((batch_size,), tau)
        logits = teacher(ctx).float()
        probs = torch.softmax(logits / tau, -1)
        student_logits = student(ctx, z1, taus)[..., 0, :].float()  # [B, N, V]
        s1 = student_logits.argmax(-1)
        s2 = student(ctx, z2, taus).argmax(-1)[..., 0]
        t1 = forward_distillation_targets(logits, z1[..., 0], taus, order=order)
        t2 = forward_distillation_targets(logits, z2[..., 0], taus, order=order)
        sens += noise_sensitivity(s1, s2)
        tsens += noise_sensitivity(t1, t2)
        collision += collision_complement(probs)
        pmax += float(probs.amax(-1).mean())
        entropy += float(-(probs * torch.log_softmax(logits / tau, -1)).sum(-1).mean())
        nll += float(torch.nn.functional.cross_entropy(student_logits.flatten(0, 1), t1.flatten()))
        agree["targets (training construction)"] += float((s1 == t1).double().mean())
        agree["targets at tau=1"] += float(
            (s1 == forward_distillation_targets(logits, z1[..., 0], torch.ones_like(taus), order=order)).double().mean()
        )
        agree["targets at 1-u"] += float(
            (s1 == forward_distillation_targets(logits, (1 - z1[..., 0]).clamp(max=1 - 2**-24), taus, order=order))
            .double()
            .mean()
        )
        for o in other:
            agree[f"targets in {o} order"] += float(
                (s1 == forward_distillation_targets(logits, z1[..., 0], taus, order=o)).double().mean()
            )
        agree["teacher's mode (argmax)"] += float((s1 == logits.argmax(-1)).double().mean())
        widths.append(probs.gather(-1, t1[..., None])[..., 0])
        correct.append(s1 == t1)
        n += 1
    out = {
        "tau": tau,
        "order": order,
        "positions": batches * batch_size * seq_len,
        "noise_sensitivity": {"student": sens / n, "teacher targets": tsens / n, "teacher 1 - sum p^2": collision / n},
        "teacher mean p_max": pmax / n,
        "teacher entropy": entropy / n,
        "student nll": nll / n,
        "agreement": {k: v / n for k, v in agree.items()},
        "accuracy_by_width": accuracy_by_width(
            torch.cat([w.reshape(-1) for w in widths]), torch.cat([c.reshape(-1) for c in correct])
        ),
    }

    # The student as a language model: its posterior averaged over u (a mixture over u draws) scored on the
    # real next token at tau = 1, against the teacher's own next-token NLL. A student whose u-averaged
    # prediction is much worse than the teacher's has not yet relearned next-token prediction in its noise
    # slot (that slot sees the noise embedding, not the last context token).
    lm_teacher, lm_student = 0.0, 0.0
    for _ in range(batches):
        x = sample_crops(val, batch_size, seq_len + 1, gen)
        ctx, nxt = x[:, :-1], x[:, 1:]
        ones = torch.ones(batch_size)
        lm_teacher += float(torch.nn.functional.cross_entropy(teacher(ctx).float().flatten(0, 1), nxt.flatten()))
        mix = torch.stack(
            [
                torch.softmax(
                    student(ctx, torch.rand(batch_size, seq_len, 1, generator=gen), ones)[..., 0, :].float(), -1
                )
                for _ in range(lm_draws)
            ]
        ).mean(0)  # [B, N, V]
        lm_student += float(-mix.gather(-1, nxt[..., None]).clamp_min(1e-12).log().mean())
    out["next_token_nll_tau1"] = {
        "teacher": lm_teacher / batches,
        f"student (posterior averaged over {lm_draws} u)": lm_student / batches,
    }

    # The u sweep: the last position of short windows, every grid point of u as one more row of a batch.
    ctx = sample_crops(val, sweep_contexts, sweep_len, gen)
    grid = (torch.arange(sweep_points, dtype=torch.float32) + 0.5) / sweep_points
    rows = ctx.repeat_interleave(sweep_points, 0)  # [C * G, L]: context c with every u in turn
    z = torch.rand(rows.shape[0], sweep_len, 1, generator=gen)
    z[:, -1, 0] = grid.repeat(sweep_contexts)
    taus = torch.full((rows.shape[0],), tau)
    st = torch.cat(
        [student(r, q, t)[:, -1, 0].argmax(-1) for r, q, t in zip(rows.split(256), z.split(256), taus.split(256))]
    )
    logits = teacher(ctx).float()[:, -1].repeat_interleave(sweep_points, 0)  # [C * G, V]
    tt = forward_distillation_targets(logits[:, None], z[:, -1], taus, order=order)[:, 0]
    st, tt = st.view(sweep_contexts, sweep_points), tt.view(sweep_contexts, sweep_points)
    out["u_sweep"] = {
        "points": sweep_points,
        "contexts": sweep_contexts,
        "distinct tokens per context (student)": sum(len(set(r)) for r in st.tolist()) / sweep_contexts,
        "distinct tokens per context (teacher)": sum(len(set(r)) for r in tt.tolist()) / sweep_contexts,
        "token changes along u (student)": float((st[:, 1:] != st[:, :-1]).double().sum(1).mean()),
        "token changes along u (teacher)": float((tt[:, 1:] != tt[:, :-1]).double().sum(1).mean()),
        "agreement": float((st == tt).double().mean()),
    }
    # What the noise encoder separates: cosine similarity of its outputs at u and u + delta (tau fixed).
    u = torch.rand(512, generator=gen) * 0.9
    enc = student.noise_encoder
    base = enc(u, torch.full_like(u, tau)).float()
    out["encoder_cosine"] = {
        str(d): float(torch.cosine_similarity(base, enc(u + d, torch.full_like(u, tau)).float(), -1).mean())
        for d in (0.001, 0.01, 0.05, 0.1, 0.3)
    }

    # Cached generation must decode what SingleForward trained: the first generated token at the same u and tau.
    from ..generation.inference import generate_kforcing

    prompts = sample_crops(val, 8, 16, gen)
    noise = torch.rand(8, 1, 1, generator=gen)
    first = generate_kforcing(student, prompts, 1, 1, temperature=tau, noise=noise)[:, 0]
    z = torch.zeros(8, 16, 1)
    z[:, -1] = noise[:, 0]
    trained = student(prompts, z, torch.full((8,), tau))[:, -1, 0].argmax(-1)
    out["generation_matches_single_forward"] = bool((first == trained).all())
    return out


@torch.no_grad()
def decode_bracket(
    teacher,
    student,
    val: torch.Tensor,
    eos_id,
    *,
    tau: float,
    batch: int = 128,
    prompt_len: int = 16,
    new_tokens: int = 48,
    seed: int = 1,
) -> dict:
    """Judge (= teacher) perplexity and distinct-4 of the student's own k=1 samples, decoded two ways, against the
    teacher's.

    "argmax" is the paper's PFLM decoding. "residual" picks the token at the inverse CDF of the
    student's own softmax at the noise's low digits (:func:`~kforcing_kernels.model.decoding.decode_slots`;
    about independent of what the student resolves of u): for a calibrated student both are samples of the
    teacher; an argmax far below the teacher's perplexity with a residual decoding near or above it says the
    student is uncertain (its posterior is broad) and argmax turns that uncertainty into the mode. Same
    prompts and noise for all three.
    """
    from ..generation.inference import generate_ar
    from .evaluate import judge_score

    gen = torch.Generator().manual_seed(seed)
    prompts = sample_crops(val, batch, prompt_len, gen)
    noise = torch.rand(batch, new_tokens, generator=gen)
    taus = torch.full((batch,), tau)
    out = {
        "AR teacher": judge_score(
            teacher, prompts, generate_ar(teacher, prompts, new_tokens, temperature=tau, noise=noise), eos_id
        )
    }
    for rule in ("argmax", "residual"):
        seq = prompts
        for s in range(new_tokens):
            z = torch.zeros(batch, seq.shape[1], 1)
            z[:, -1, 0] = noise[:, s]
            logits = student(seq, z, taus)[:, -1, 0].float()
            tok = decode_slots(logits, noise[:, s], rule)
            seq = torch.cat([seq, tok[:, None]], 1)
        out[f"student, {rule}"] = judge_score(teacher, prompts, seq[:, prompt_len:], eos_id)
    return out


def format_diagnosis(d: dict) -> str:
    s = d["noise_sensitivity"]
    lines = [
        f"tau {d['tau']}, CDF order {d['order']}, {d['positions']} positions",
        f"noise sensitivity: student {s['student']:.3f} | teacher targets {s['teacher targets']:.3f} | "
        f"teacher 1 - sum p^2 {s['teacher 1 - sum p^2']:.3f} (teacher mean p_max {d['teacher mean p_max']:.3f})",
        f"student NLL of its targets {d['student nll']:.3f} nats vs the teacher's entropy "
        f"{d['teacher entropy']:.3f} (a student that ignored u would match the entropy: it uses >= "
        f"{d['teacher entropy'] - d['student nll']:.3f} nats of u)",
        "student argmax agreement with:",
    ]
    lines += [f"  {k:34s} {v:.3f}" for k, v in d["agreement"].items()]
    lm = list(d["next_token_nll_tau1"].items())
    lines.append(f"next-token NLL of real text at tau=1: {lm[0][0]} {lm[0][1]:.3f}, {lm[1][0]} {lm[1][1]:.3f}")
    lines.append("accuracy by CDF interval width (target probability at tau):")
    lines += [
        f"  [{r['lo']:.2f}, {r['hi']:.2f}{']' if r['hi'] == 1.0 else ')'}  n={r['count']:6d}  "
        f"{'-' if r['accuracy'] is None else format(r['accuracy'], '.3f')}"
        for r in d["accuracy_by_width"]
    ]
    u = d["u_sweep"]
    lines.append(
        f"u sweep ({u['points']} points, last position of {u['contexts']} windows): distinct tokens student "
        f"{u['distinct tokens per context (student)']:.1f} / teacher "
        f"{u['distinct tokens per context (teacher)']:.1f}; "
        f"changes along u student {u['token changes along u (student)']:.1f} / teacher "
        f"{u['token changes along u (teacher)']:.1f}; "
        f"agreement {u['agreement']:.3f}"
    )
    lines.append(
        "noise encoder cosine(enc(u), enc(u + d)): "
        + ", ".join(f"d={k}: {v:.3f}" for k, v in d["encoder_cosine"].items())
    )
    lines.append(f"cached generation's first token == SingleForward argmax: {d['generation_matches_single_forward']}")
    if "decode_bracket" in d:
        ar = d["decode_bracket"]["AR teacher"]["ppl"]
        lines.append(
            "k=1 samples (128 x 48 tokens), judge PPL (x teacher's), distinct-4: "
            + "; ".join(
                f"{name} {q['ppl']:.2f} ({q['ppl'] / ar:.2f}x), {q['distinct4']:.3f}"
                for name, q in d["decode_bracket"].items()
            )
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from ..cli import add_temperature, make_parser

    parser = make_parser(
        "python -m kforcing_kernels.app.evaluation.noise_diagnosis",
        "Noise sensitivity, interval-width accuracy and consistency checks of a Stage-1 student.",
    )
    parser.add_argument("run", help="a pipeline folder holding stage0 (the AR teacher) and stage1")
    parser.add_argument("--student", help="the PFLM(1) folder (None: RUN/stage1)")
    add_temperature(parser)
    parser.add_argument(
        "--order",
        choices=CDF_ORDERS,
        default=None,
        help="the CDF vocabulary order the student was trained with (None: the one its model.json records)",
    )
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generate",
        action="store_true",
        help="also judge 128 k=1 samples decoded by argmax and by the residual rule (decode_bracket; minutes on a CPU)",
    )
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    run = Path(args.run)
    teacher, tinfo, _ = load_student(run / "stage0")
    try:
        check_fields(run / "stage0" / "model.json", tinfo, RUN_TEXT_FIELDS)
    except CheckpointError as exc:
        parser.error(str(exc))
    student, sinfo, _ = load_student(Path(args.student) if args.student else run / "stage1")
    if sinfo.get("k") != 1:
        parser.error(f"argument --student: expected a PFLM(1) (stage1) folder, got k={sinfo.get('k')}")
    order = args.order or sinfo.get("cdf_order", "vocab")  # stages saved before the order was recorded used vocab order
    from .run_folders import recorded_data

    try:  # --data as the run recorded it (resolved; an older run's relative to where it was trained)
        corpus = corpus_for(str(run / "stage0"), recorded_data(run / "stage0", tinfo), teacher.config.vocab_size)
    except ValueError as exc:
        parser.error(str(exc))
    d = diagnose(
        teacher.eval(),
        student.eval(),
        corpus.val,
        tau=args.temperature,
        order=order,
        batches=args.batches,
        seq_len=tinfo["train_config"]["seq_len"],
        seed=args.seed,
    )
    if args.generate:
        d["decode_bracket"] = decode_bracket(
            teacher.eval(), student.eval(), corpus.val, corpus.eos_id, tau=args.temperature
        )
    print(format_diagnosis(d))
    if args.json:
        Path(args.json).write_text(json.dumps(d, indent=1))


if __name__ == "__main__":
    main()

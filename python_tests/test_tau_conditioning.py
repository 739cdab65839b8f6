"""The temperature-conditioned noise encoder works: a trained PFLM(1)'s output entropy follows tau like its teacher's.

A PFLM decodes argmax(student(context, z, tau)); over uniform z its token at a slot is
a sample, and Stage 1 trains that sample to be the AR teacher's inverse-CDF sample of
softmax(logits / tau). So the entropy of the student's token distribution over z should
be the teacher's entropy at tau, and should move with tau as the teacher's does.

Both distributions are read off the same stratified grid of z values (z_i = (i + 1/2) / M),
which turns an exact inverse CDF into the exact distribution up to 1/M per token; the
teacher's side is the inverse-CDF sampler (an independent implementation,
``ops.sampling.inverse_cdf_sample``) on that grid.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from kforcing_kernels.data import load_corpus, sample_windows
from kforcing_kernels.ops.sampling import inverse_cdf_sample
from kforcing_kernels.train import TrainConfig, load_model, train

TAUS = (0.5, 0.8, 1.0)
GRID = 256  # z values per context
# Stated tolerances (nats, averaged over contexts): the student's entropy is within
# ABS_TOL of the teacher's at every tau, and its change from tau=0.5 to tau=1.0 is at
# least SLOPE_MIN of the teacher's change (an encoder that ignores tau has slope ~0).
ABS_TOL = 0.25
SLOPE_MIN = 0.7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Stage 0 (AR, 300 steps) then Stage 1 (PFLM(1), 400 steps) on a small real corpus; ~1 minute on CPU."""
    root = tmp_path_factory.mktemp("tau")
    corpus_dir = root / "corpus"
    corpus_dir.mkdir()
    for path in sorted(Path(json.__file__).parent.glob("*.py")):
        corpus_dir.joinpath(path.name).write_text(path.read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        base = dict(data=str(corpus_dir), vocab_size=300, preset="micro", seq_len=16, batch_size=16, warmup_steps=20,
                    log_every=50, ckpt_every=1000, eval_batches=1, progress=False, lr=3e-3,
                    model_overrides={"n_embd": 32, "n_head": 2, "n_layer": 2})
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a micro model: one thread is fastest, and it does not oversubscribe a busy machine
        try:
            train(TrainConfig(stage="stage0", out=str(root / "stage0"), steps=300, **base))
            train(TrainConfig(stage="stage1", out=str(root / "stage1"), teacher=str(root / "stage0"), steps=400, **base))
        finally:
            torch.set_num_threads(threads)
        corpus = load_corpus(str(corpus_dir), vocab_size=300)
    teacher, _, _ = load_model(str(root / "stage0"))
    student, _, _ = load_model(str(root / "stage1"))
    return teacher, student, corpus


def _entropy(counts: torch.Tensor) -> torch.Tensor:
    p = counts / counts.sum(-1, keepdim=True)
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


@torch.no_grad()
def slot_entropies(teacher, student, context: torch.Tensor, tau: float) -> dict:
    """Mean over the contexts ``[B, N]`` of: the teacher's exact entropy at tau, the entropy of its
    inverse-CDF samples on the z grid, and the entropy of the student's argmax tokens on the same grid."""
    b, n = context.shape
    vocab = teacher.config.vocab_size
    z = (torch.arange(GRID, dtype=torch.float32) + 0.5) / GRID  # [M]
    logits = teacher(context).float()  # [B, N, V]
    logp = torch.log_softmax(logits / tau, -1)
    exact = -(logp.exp() * logp).sum(-1)  # [B, N]
    grid = z.expand(b, n, GRID)  # [B, N, M]
    t_tokens = inverse_cdf_sample(logits[:, :, None].expand(b, n, GRID, vocab), grid, torch.full_like(grid, tau))
    s_tokens = torch.stack([student(context, grid[..., i:i + 1], tau)[..., 0, :].argmax(-1) for i in range(GRID)], -1)
    hist = lambda toks: torch.zeros(b, n, vocab).scatter_add_(-1, toks, torch.ones_like(toks, dtype=torch.float32))
    return {"exact": float(exact.mean()), "teacher": float(_entropy(hist(t_tokens)).mean()),
            "student": float(_entropy(hist(s_tokens)).mean())}


def test_student_entropy_tracks_the_teacher_across_tau(trained):
    teacher, student, corpus = trained
    context = sample_windows(corpus.val, 8, 16, torch.Generator().manual_seed(0))
    rows = {tau: slot_entropies(teacher, student, context, tau) for tau in TAUS}
    report = ", ".join(f"tau={t}: teacher {r['teacher']:.3f} (exact {r['exact']:.3f}) student {r['student']:.3f}" for t, r in rows.items())
    # The oracle itself: the grid histogram is the teacher's distribution up to the grid's resolution.
    for r in rows.values():
        assert abs(r["teacher"] - r["exact"]) < 0.15, report
    # The teacher's entropy does move with tau (otherwise the test below would be vacuous).
    teacher_change = rows[1.0]["teacher"] - rows[0.5]["teacher"]
    assert teacher_change > 0.5, report
    for tau, r in rows.items():
        assert abs(r["student"] - r["teacher"]) <= ABS_TOL, f"tau={tau}: {report}"
    student_change = rows[1.0]["student"] - rows[0.5]["student"]
    assert student_change >= SLOPE_MIN * teacher_change, report
    assert rows[0.5]["student"] < rows[0.8]["student"] < rows[1.0]["student"], report
    print(report)


def test_grid_entropy_of_a_known_distribution():
    """The measurement on a distribution with a known entropy: uniform over 4 tokens at tau=1 -> log 4."""
    logits = torch.zeros(1, 1, 4)
    z = (torch.arange(GRID, dtype=torch.float32) + 0.5) / GRID
    toks = inverse_cdf_sample(logits[:, :, None].expand(1, 1, GRID, 4), z.expand(1, 1, GRID), torch.ones(1, 1, GRID))
    counts = torch.zeros(1, 1, 4).scatter_add_(-1, toks, torch.ones_like(toks, dtype=torch.float32))
    assert math.isclose(float(_entropy(counts)), math.log(4), rel_tol=1e-6)

"""``compute_loss`` per objective against targets and losses computed independently here (issue 17, item 2).

The oracles: next-token cross-entropy written out with an fp64 log-softmax; Stage-1 targets
as ``min{v : CDF(v) > z}`` of ``softmax(logits / tau_b)`` with each sequence's own sampled
temperature; noise-inversion targets as the real next-k tokens; Stage-2 targets from two
explicit, sequential teacher passes over the spelled-out sequence with a dense causal mask.
"""

import pytest
import torch

from kforcing_kernels.app.training.objectives import Batch, Objective, compute_loss, make_batch, step_generator
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.model import KForcingLM, ModelConfig

V = 37


def model(seed: int, sharpen: float = 1.0) -> KForcingLM:
    torch.manual_seed(seed)
    m = KForcingLM(ModelConfig.micro(vocab_size=V, n_embd=32, attention_backend="reference")).double().eval()
    with torch.no_grad():
        m.wte.weight *= sharpen  # tied head: larger logits, so the temperature changes many samples
    return m


# compute_loss works in fp32: rel 1e-6 below
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[target], in fp64, over every prediction."""
    logp = logits.double() - logits.double().logsumexp(-1, keepdim=True)
    return -logp.gather(-1, targets[..., None]).mean()


def inverse_cdf(logits: torch.Tensor, z: torch.Tensor, tau: float) -> torch.Tensor:
    """The smallest v with CDF(v) > z under softmax(logits / tau); logits [..., V], z [...]."""
    cdf = torch.softmax(logits.double() / tau, -1).cumsum(-1)
    return (cdf <= z[..., None].double()).sum(-1).clamp(max=logits.shape[-1] - 1)


def test_ar_loss_is_next_token_cross_entropy():
    student = model(0)
    tokens = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(1))
    loss, per_pos = compute_loss(Objective.AR, student, Batch(tokens))
    with torch.no_grad():
        expected = cross_entropy(student(tokens[:, :-1]), tokens[:, 1:])
        unshifted = cross_entropy(student(tokens[:, :-1]), tokens[:, :-1])
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert per_pos.shape == (1,) and float(per_pos[0]) == pytest.approx(float(expected), rel=1e-6)
    assert abs(float(unshifted) - float(expected)) > 1e-3  # an off-by-one target would be caught


def test_forward_distillation_uses_each_sequences_sampled_temperature():
    teacher, student = model(0, sharpen=4.0), model(1)
    gen = torch.Generator().manual_seed(2)
    b, n = 4, 16
    context = torch.randint(0, V, (b, n), generator=gen)
    z = torch.rand(b, n, 1, generator=gen, dtype=torch.float64)
    tau = torch.tensor([0.3, 0.45, 0.6, 0.75], dtype=torch.float64)
    loss, per_pos = compute_loss(Objective.FORWARD, student, Batch(context, z, tau), teacher)

    with torch.no_grad():
        t_logits = teacher(context)  # [B, N, V]
        targets = torch.stack([inverse_cdf(t_logits[i], z[i, :, 0], float(tau[i])) for i in range(b)])[..., None]
        s_logits = student(context, z, tau)  # [B, N, 1, V]
        expected = cross_entropy(s_logits, targets)
        untempered = torch.stack([inverse_cdf(t_logits[i], z[i, :, 0], 1.0) for i in range(b)])[..., None]
        with_tau_one = cross_entropy(s_logits, untempered)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert float(per_pos[0]) == pytest.approx(float(expected), rel=1e-6)
    # The test has the power to catch targets drawn at tau = 1 (or at one tau for the whole batch).
    assert int((untempered != targets).sum()) >= 10
    assert abs(float(with_tau_one) - float(loss.detach())) > 1e-3
    shared = torch.stack([inverse_cdf(t_logits[i], z[i, :, 0], float(tau[0])) for i in range(b)])[..., None]
    assert abs(float(cross_entropy(s_logits, shared)) - float(loss.detach())) > 1e-3


def test_noise_inversion_targets_are_the_real_next_tokens_with_noise_in_their_bins():
    teacher, student = model(0, sharpen=2.0), model(1)
    gen = torch.Generator().manual_seed(3)
    b, n, k = 2, 6, 3
    tokens = torch.randint(0, V, (b, n + k), generator=gen)
    tau = torch.tensor([0.5, 0.9], dtype=torch.float64)
    batch = Batch(tokens, None, tau, seed=1234)
    loss, per_pos = compute_loss(Objective.NOISE_INVERSION, student, batch, teacher, k=k)

    # Recover the z the loss used: the same public supervision function with the batch's seed.
    from kforcing_kernels.app.training.objectives import noise_inversion_supervision

    with torch.no_grad():
        context, z, targets = noise_inversion_supervision(teacher, tokens, k, tau, torch.Generator().manual_seed(1234))
        real = torch.stack([tokens[:, t + 1 : t + 1 + k] for t in range(n)], 1)  # [B, N, k]: tokens t+1 .. t+k
        assert torch.equal(context, tokens[:, :n]) and torch.equal(targets, real)
        # Each z lies in its target's CDF bin under the teacher given the real text up to t + j.
        t_logits = teacher(tokens[:, :-1])
        for i in range(b):
            for t in range(n):
                for j in range(k):
                    cdf = torch.softmax(t_logits[i, t + j] / tau[i], -1).cumsum(-1)
                    lo = 0.0 if real[i, t, j] == 0 else float(cdf[real[i, t, j] - 1])
                    assert lo - 1e-12 <= float(z[i, t, j]) < float(cdf[real[i, t, j]]) + 1e-12
        s_logits = student(context, z, tau)  # [B, N, k, V]
        expected = cross_entropy(s_logits, real)
        expected_pos = [float(cross_entropy(s_logits[:, :, j], real[:, :, j])) for j in range(k)]
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert per_pos.tolist() == pytest.approx(expected_pos, rel=1e-6)


def naive_window(teacher, context, prefix, noise, tau):
    """One window decoded the obvious way: a causal pass over [context ; prefix ; noise tokens], argmax of the last
    k."""
    x = torch.cat([teacher.wte(context), teacher.wte(prefix), teacher.embed_noise(noise[None], tau)[0]], 0)[None]
    h, _ = teacher.trunk(x, torch.arange(x.shape[1]), WindowLayout.causal(x.shape[1]))
    return teacher.head(h[0, -noise.numel() :]).argmax(-1)


def test_self_forcing_loss_against_two_sequential_teacher_rounds():
    teacher, student = model(0, sharpen=2.0), model(1)
    gen = torch.Generator().manual_seed(4)
    b, n, k = 2, 5, 2  # a PFLM(2) teacher, a PFLM(4) student
    context = torch.randint(0, V, (b, n), generator=gen)
    z = torch.rand(b, n, 2 * k, generator=gen, dtype=torch.float64)
    tau = torch.tensor([0.6, 1.0], dtype=torch.float64)
    loss, per_pos = compute_loss(Objective.SELF_FORCING, student, Batch(context, z, tau), teacher)

    with torch.no_grad():
        targets = torch.empty(b, n, 2 * k, dtype=torch.long)
        for i in range(b):
            for t in range(n):
                ctx = context[i, : t + 1]
                first = naive_window(teacher, ctx, ctx[:0], z[i, t, :k], tau[i])
                second = naive_window(teacher, ctx, first, z[i, t, k:], tau[i])
                targets[i, t] = torch.cat([first, second])
        s_logits = student(context, z, tau)  # [B, N, 2k, V]
        expected = cross_entropy(s_logits, targets)
        expected_pos = [float(cross_entropy(s_logits[:, :, j], targets[:, :, j])) for j in range(2 * k)]
        one_round = torch.cat([targets[..., :k], targets[..., :k]], -1)  # a second round that ignored the first
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert per_pos.tolist() == pytest.approx(expected_pos, rel=1e-6)
    assert abs(float(cross_entropy(s_logits, one_round)) - float(loss.detach())) > 1e-3


def test_compute_loss_is_told_the_objective_and_checks_its_inputs():
    teacher, student = model(0), model(1)
    tokens = torch.randint(0, V, (2, 6))
    z, tau = torch.rand(2, 6, 1, dtype=torch.float64), torch.full((2,), 0.7, dtype=torch.float64)
    with pytest.raises(ValueError, match="teacher: objective stage1_forward distils a teacher"):
        compute_loss(Objective.FORWARD, student, Batch(tokens, z, tau))
    with pytest.raises(ValueError, match="teacher: objective ar trains on the data alone"):
        compute_loss(Objective.AR, student, Batch(tokens), teacher)
    with pytest.raises(ValueError, match="batch.noise"):
        compute_loss(Objective.SELF_FORCING, student, Batch(tokens, None, tau), teacher)
    with pytest.raises(ValueError, match="batch.noise: self-forcing needs 2k"):
        compute_loss(Objective.SELF_FORCING, student, Batch(tokens, z, tau), teacher)
    with pytest.raises(ValueError, match="batch.noise: forward distillation trains PFLM"):
        compute_loss(Objective.FORWARD, student, Batch(tokens, torch.rand(2, 6, 2, dtype=torch.float64), tau), teacher)
    with pytest.raises(ValueError, match="batch.tau"):
        compute_loss(Objective.FORWARD, student, Batch(tokens, z, None), teacher)
    with pytest.raises(ValueError, match="k: noise inversion"):
        compute_loss(Objective.NOISE_INVERSION, student, Batch(tokens, None, tau, seed=1), teacher)
    with pytest.raises(ValueError, match="stage2_typo"):
        compute_loss("stage2_typo", student, Batch(tokens, z, tau), teacher)
    # The same batch under two explicit objectives gives two different losses: nothing is inferred.
    assert (
        compute_loss("ar", student, Batch(tokens))[0]
        != compute_loss("stage1_forward", student, Batch(tokens, z, tau), teacher)[0]
    )


def test_objective_of_each_stage_and_batch_shapes():
    assert [
        Objective.of(s, sup)
        for s, sup in [
            ("stage0", "forward"),
            ("stage1", "forward"),
            ("stage1", "noise_inversion"),
            ("stage2", "forward"),
        ]
    ] == [Objective.AR, Objective.FORWARD, Objective.NOISE_INVERSION, Objective.SELF_FORCING]
    with pytest.raises(ValueError, match="stage: expected"):
        Objective.of("stage3")
    stream = torch.arange(500)
    shapes = {}
    for objective, k in [
        (Objective.AR, 0),
        (Objective.FORWARD, 1),
        (Objective.NOISE_INVERSION, 3),
        (Objective.SELF_FORCING, 4),
    ]:
        batch = make_batch(objective, stream, 4, 10, k, (0.5, 0.8), step_generator(0, 7))
        shapes[objective] = (tuple(batch.tokens.shape), None if batch.noise is None else tuple(batch.noise.shape))
        # windows of the stream: consecutive ids
        assert torch.equal(
            batch.tokens - batch.tokens[:, :1], torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
        )
        if objective is not Objective.AR:
            assert bool(((batch.tau >= 0.5) & (batch.tau <= 0.8)).all())
    assert shapes == {
        Objective.AR: ((4, 11), None),
        Objective.FORWARD: ((4, 10), (4, 10, 1)),
        Objective.NOISE_INVERSION: ((4, 13), None),
        Objective.SELF_FORCING: ((4, 10), (4, 10, 4)),
    }

"""``evaluate.per_position_nll`` against a student that is right only at position j (issue 17, item 2).

The student computes its teacher's own targets from the noise it is given (the same
``self_forcing_targets`` / ``forward_distillation_targets`` the evaluation uses) and puts
a huge logit on the target at slot j only; elsewhere its logits are flat. So the reported
NLL must be ~0 at j and log V at every other slot, agreement 1 at j - in that order.
"""

import math

import pytest
import torch
from torch import nn

from kforcing_kernels.app.evaluation.evaluate import per_position_nll
from kforcing_kernels.app.evaluation.report import format_nll_table
from kforcing_kernels.app.training.objectives import forward_distillation_targets, self_forcing_targets
from kforcing_kernels.model import KForcingLM, ModelConfig

V = 29
SURE = 40.0  # logit of the target at the right slot: its NLL is ~ V * exp(-40)


class RightOnlyAt(nn.Module):
    def __init__(self, teacher: KForcingLM, teacher_k: int, j: int):
        super().__init__()
        self.teacher, self.teacher_k, self.j = teacher, teacher_k, j
        self.wte = teacher.wte  # per_position_nll reads the device from it

    def forward(self, ctx, z, taus):
        if self.teacher_k == 0:
            targets = forward_distillation_targets(self.teacher(ctx), z[..., 0], taus)[..., None]
        else:
            targets = self_forcing_targets(self.teacher, ctx, z, taus)
        logits = torch.zeros(*targets.shape, V)
        logits[..., self.j, :].scatter_(-1, targets[..., self.j, None], SURE)
        return logits


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(5)
    m = KForcingLM(ModelConfig.micro(vocab_size=V, n_embd=16, attention_backend="reference")).eval()
    with torch.no_grad():
        m.wte.weight *= 20  # varied argmax targets, so a flat student is wrong
    return m


VAL = torch.randint(0, V, (400,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("teacher_k,j", [(2, 0), (2, 3), (2, 1), (0, 0)])
def test_low_nll_is_reported_at_the_right_position(teacher, teacher_k, j):
    student = RightOnlyAt(teacher, teacher_k, j)
    row = per_position_nll(student, teacher, teacher_k, VAL, batches=2, batch_size=3, seq_len=8, tau=0.8, seed=1)
    k = 1 if teacher_k == 0 else 2 * teacher_k
    assert row["k"] == k and len(row["nll"]) == k and len(row["agreement"]) == k
    for i in range(k):
        if i == j:
            assert row["nll"][i] < 1e-6 and row["agreement"][i] == 1.0
        else:
            assert row["nll"][i] == pytest.approx(math.log(V), rel=1e-6)


def test_the_table_keeps_the_order():
    summary = {"per_position_nll": [{"model": "s", "k": 3, "nll": [0.25, 1.5, 2.75], "agreement": [1.0, 0.5, 0.0]}]}
    row = format_nll_table(summary).splitlines()[2]
    assert row == "| s | 0.250 | 1.500 | 2.750 | 1.000 | 0.500 | 0.000 |"

"""The samplers vs a plain loop over ``min{v : F(v) > z}``, with z exactly on CDF steps (issue 17, item 2).

Rows whose probabilities are dyadic (flat logits over a support, -inf elsewhere) have an
exactly representable CDF, so ``z = F(v)`` can be hit exactly: the strict ``>`` then
decides the token (``>=`` would pick v, or a zero-probability token at z = 0). The
oracle is exact rational arithmetic in a Python loop; it shares no code with the samplers.
"""

from fractions import Fraction

import pytest
import torch

from kforcing_kernels import _extension
from kforcing_kernels.ops.sampling import inverse_cdf_sample
from kforcing_kernels.ops.sampling.op import inverse_cdf_sample_reference

EXT = _extension.load()

SUPPORTS = [  # V = 8; which tokens have probability > 0 (equal on the support)
    [0, 1, 2, 3, 4, 5, 6, 7],
    [1, 2, 5, 6],
    [0, 3],
    [2, 7],
    [4],
    [1, 3, 4, 6],
]
V = 8


def loop_oracle(support: list[int], z: Fraction) -> int:
    """min{v : F(v) > z} by walking the vocabulary, F in exact rationals."""
    cdf = Fraction(0)
    for v in range(V):
        cdf += Fraction(1, len(support)) if v in support else 0
        if cdf > z:
            return v
    return V - 1


def step_cases():
    """(logits [R, V], z [R], expected [R]): every row at each of its exact CDF values (and 0)."""
    logits, zs, expected = [], [], []
    for support in SUPPORTS:
        row = torch.full((V,), float("-inf"))
        row[support] = 1.5  # any common value: exp(0) after the max is subtracted
        for i in range(len(support)):  # z = 0, F at each step below 1
            z = Fraction(i, len(support))
            logits.append(row)
            zs.append(float(z))
            expected.append(loop_oracle(support, z))
    return torch.stack(logits), torch.tensor(zs), torch.tensor(expected)


SAMPLERS = {"reference": inverse_cdf_sample_reference, "dispatch": inverse_cdf_sample}
if EXT is not None:
    SAMPLERS["cpp"] = lambda logits, z, tau: EXT.inverse_cdf_sample(
        logits, z, torch.as_tensor(tau, dtype=torch.float64)
    )


def test_the_cpp_sampler_is_under_test():
    if EXT is None:
        pytest.skip(f"C++ extension: {_extension.reason()}")
    assert "cpp" in SAMPLERS


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_z_on_a_cdf_step_takes_the_next_token(name, dtype, tau):
    logits, z, expected = step_cases()
    got = SAMPLERS[name](logits.to(dtype), z, tau)
    assert torch.equal(got, expected), [(i, int(a), int(b)) for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    # The cases cover both conventions' disagreement: some z = F(v) would pick v under ">=".
    assert (expected != torch.tensor([loop_ge(s, zz) for s, zz in _rows()])).any()


def loop_ge(support, z):
    cdf = Fraction(0)
    for v in range(V):
        cdf += Fraction(1, len(support)) if v in support else 0
        if cdf >= z:
            return v
    return V - 1


def _rows():
    return [(s, Fraction(i, len(s))) for s in SUPPORTS for i in range(len(s))]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_random_rows_match_the_loop(name):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 33, generator=gen, dtype=torch.float64) * 3
    z = torch.rand(64, generator=gen, dtype=torch.float64)
    tau = 0.7
    got = SAMPLERS[name](logits, z, tau)
    for r in range(64):  # the loop in plain Python floats: exp, sum, walk
        m = max(logits[r].tolist())
        w = [pow(2.718281828459045, (x - m) / tau) for x in logits[r].tolist()]
        total, cdf, pick = sum(w), 0.0, 32
        for v, wv in enumerate(w):
            cdf += wv / total
            if cdf > float(z[r]):
                pick = v
                break
        assert int(got[r]) == pick, r

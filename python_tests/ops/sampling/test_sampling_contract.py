"""Every sampler backend accepts and refuses exactly the same inputs, and samples min{v : F(v) > z}.

Backends: ``reference`` (torch, the fallback without the extension), ``cpp`` (the
extension) and ``triton`` (in Triton's interpreter, in a subprocess). The same
module also runs in a subprocess with the extension disabled. The oracle is a
plain loop over the vocabulary with an exact (rational) CDF.
"""

import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from helpers import REPO
from kforcing_kernels import _extension
from kforcing_kernels.ops.sampling import op

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = str(REPO)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
INF, NAN = float("inf"), float("nan")

BACKENDS = ["reference"] + (["cpp"] if _extension.load() is not None else []) + (["triton"] if INTERPRETING else [])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Routes the public functions to one backend."""
    monkeypatch.setattr(op, "sampler_backend", lambda device="cpu": request.param)
    return request.param


GOOD = torch.tensor([[0.0, 1.0, 2.0], [3.0, -INF, 0.5]])
Z = torch.tensor([0.25, 0.75])

REFUSED_SAMPLES = {
    "row all -inf": (
        torch.tensor([[0.0, 1.0, 2.0], [-INF, -INF, -INF]]),
        Z,
        "logits: expected every row to define a distribution",
    ),
    "NaN logit": (
        torch.tensor([[0.0, NAN, 2.0], [0.0, 1.0, 2.0]]),
        Z,
        "logits: expected every row to define a distribution",
    ),
    "+inf logit": (
        torch.tensor([[0.0, 1.0, 2.0], [INF, 1.0, 2.0]]),
        Z,
        "logits: expected every row to define a distribution",
    ),
    "z = 1": (GOOD, torch.tensor([0.5, 1.0]), r"z: expected values in \[0, 1\)"),
    "z < 0": (GOOD, torch.tensor([-1e-9, 0.5]), r"z: expected values in \[0, 1\)"),
    "z > 1": (GOOD, torch.tensor([0.5, 7.0]), r"z: expected values in \[0, 1\)"),
    "z NaN": (GOOD, torch.tensor([NAN, 0.5]), r"z: expected values in \[0, 1\)"),
    "z +inf": (GOOD, torch.tensor([INF, 0.5]), r"z: expected values in \[0, 1\)"),
    "integer z": (GOOD, torch.tensor([0, 0]), "z: expected a floating dtype"),
    "V = 0": (torch.zeros(2, 0), Z, r"logits: expected shape \[..., V\] with V >= 1"),
    "z shape": (GOOD, torch.tensor([0.5]), "z: expected shape"),
}


@pytest.mark.parametrize("case", list(REFUSED_SAMPLES))
def test_sampling_refuses_the_same_inputs(backend, case):
    logits, z, match = REFUSED_SAMPLES[case]
    with pytest.raises(ValueError, match=match):
        op.inverse_cdf_sample(logits, z)


def test_overflowing_temperature_is_refused_alike(backend):
    # finite logits / a tiny temperature overflow to +inf: no distribution either
    with pytest.raises(ValueError, match="logits: expected every row to define a distribution"):
        op.inverse_cdf_sample(torch.tensor([[1e300, 0.0]], dtype=torch.float64), torch.tensor([0.5]), 1e-300)


REFUSED_INVERSIONS = {
    "row all -inf": (
        torch.tensor([[-INF, -INF, -INF], [0.0, 1.0, 2.0]]),
        torch.tensor([0, 1]),
        "logits: expected every row",
    ),
    "NaN logit": (torch.tensor([[0.0, NAN, 2.0], [0.0, 1.0, 2.0]]), torch.tensor([0, 1]), "logits: expected every row"),
    "token >= V": (GOOD, torch.tensor([0, 3]), r"tokens: expected ids in \[0, 3\)"),
    "token < 0": (GOOD, torch.tensor([-1, 0]), r"tokens: expected ids in \[0, 3\)"),
    "float tokens": (GOOD, torch.tensor([0.0, 1.0]), "tokens: expected an integer dtype"),
}


@pytest.mark.parametrize("case", list(REFUSED_INVERSIONS))
def test_noise_inversion_refuses_the_same_inputs(backend, case):
    logits, tokens, match = REFUSED_INVERSIONS[case]
    with pytest.raises(ValueError, match=match):
        op.noise_inversion(logits, tokens)


def test_edge_inputs_that_are_valid_are_accepted(backend):
    # -inf entries in a row with a finite max, z = 0 and z just below 1 are all valid.
    logits = torch.tensor([[-INF, 0.0, -INF, 0.0], [5.0, -INF, -INF, -INF]])
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    ids = op.inverse_cdf_sample(logits, torch.stack([torch.tensor(0.0), below_one]))
    assert ids.tolist() == [1, 0]


# ---------------------------------------------------------------------- oracle


def oracle_sample(row: list[float], z: float, tau: float = 1.0) -> int:
    """min{v : F(v) > z} with F the exact cumulative sum of softmax(row / tau) (rational arithmetic)."""
    scaled = [x / tau for x in row]
    top = max(scaled)
    weights = [Fraction(math.exp(x - top)) if x != -INF else Fraction(0) for x in scaled]
    total = sum(weights)
    running = Fraction(0)
    for v, w in enumerate(weights):
        running += w
        if running / total > Fraction(z):
            return v
    return len(row) - 1


def _uniform_on(support: list[int], vocab: int) -> list[float]:
    return [0.0 if v in support else -INF for v in range(vocab)]


@pytest.mark.parametrize("vocab,support_size", [(8, 4), (37, 8), (3000, 1024)])
def test_exact_cdf_steps(backend, vocab, support_size):
    """z exactly equal to a cumulative sum j/n: the sample is the *next* token with mass (F(v) > z, not >=)."""
    gen = torch.Generator().manual_seed(vocab)
    support = sorted(torch.randperm(vocab, generator=gen)[:support_size].tolist())
    row = _uniform_on(support, vocab)  # every probability is 1/n exactly, so F steps are exact binary fractions
    zs = [j / support_size for j in range(support_size)]
    if backend == "triton" and support_size > 64:  # the interpreter runs one Python program per row: sample the steps
        zs = zs[:8] + zs[support_size // 2 - 4 : support_size // 2 + 4] + zs[-8:]
        support = [support[round(z * support_size)] for z in zs]
    got = op.inverse_cdf_sample(
        torch.tensor([row] * len(zs), dtype=torch.float64), torch.tensor(zs, dtype=torch.float64)
    )
    want = [oracle_sample(row, z) for z in zs]
    assert want == support  # z = j/n lands on the step of support[j - 1], so the answer is support[j]
    assert got.tolist() == want


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_random_rows_match_the_loop_oracle(backend, tau):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 50, generator=gen, dtype=torch.float64) * 3
    logits[::5, ::3] = -INF
    z = torch.rand(24, generator=gen, dtype=torch.float64)
    got = op.inverse_cdf_sample(logits, z, tau).tolist()
    for r in range(24):
        row = logits[r].tolist()
        want = oracle_sample(row, z[r].item(), tau)
        if got[r] != want:  # allowed only when z sits within rounding of a CDF step
            near = [oracle_sample(row, z[r].item() + d, tau) for d in (-1e-12, 1e-12)]
            assert got[r] in near, (r, got[r], want)


# ---------------------------------------------------------------------- other processes


def _run_module(select: str, **env):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        os.path.join(HERE, "test_sampling_contract.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        select,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.skipif(INTERPRETING or os.environ.get("KFORCING_DISABLE_EXT") == "1", reason="already in a subprocess")
def test_other_process_extension_disabled():
    out = _run_module("not other_process", KFORCING_DISABLE_EXT="1")
    assert "skipped" not in out.splitlines()[-1]


@pytest.mark.skipif(INTERPRETING or os.environ.get("KFORCING_DISABLE_EXT") == "1", reason="already in a subprocess")
def test_other_process_triton_interpreter():
    pytest.importorskip("triton")
    _run_module("triton and not other_process", TRITON_INTERPRET="1")


# ---------------------------------------------------------------------- noise inversion at the top of the CDF

BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # the largest float32 z the sampler takes


def test_noise_inversion_never_returns_one(backend):
    """Issue #29 item 11: the last token's bin [F(V-2), 1) narrower than a float32 ulp below 1 holds no float32 z
    in [0, 1); the inversion rounded up to z = 1.0, which the sampler refuses (and the PTP baseline trained on).
    It returns the largest float32 below 1 instead (documented: such a bin maps to the token before it)."""
    gen = torch.Generator().manual_seed(3)
    rows = 64
    for gap in (40.0, 25.0, 17.5):  # p(last) = e^-gap: 4e-18, 1.4e-11, 2.5e-8 (< 2^-24 = 6e-8, the ulp below 1)
        logits = torch.tensor([[0.0, -gap]] * rows, dtype=torch.float64)
        tokens = torch.ones(rows, dtype=torch.int64)
        z = op.noise_inversion(logits, tokens, 1.0, generator=gen)
        assert z.dtype == torch.float32
        assert bool(((z >= 0) & (z < 1)).all()), (gap, z.max().item())
        assert bool((z == BELOW_ONE).all()), gap
        op.inverse_cdf_sample(logits, z)  # accepted: z is a valid sampler input
    # A last bin that holds a float32 (p = e^-15 = 3e-7: about five ulps) maps back to the last token.
    logits = torch.tensor([[0.0, -15.0]] * rows, dtype=torch.float64)
    z = op.noise_inversion(logits, torch.ones(rows, dtype=torch.int64), 1.0, generator=gen)
    assert bool((z < 1).all())
    assert op.inverse_cdf_sample(logits, z).tolist() == [1] * rows
    # Many tokens, several of them at the top with almost no mass, in float32 and bfloat16 logits.
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.cat([torch.zeros(rows, 5), torch.full((rows, 4), -60.0)], 1).to(dtype)
        tokens = torch.randint(0, 9, (rows,), generator=gen)
        z = op.noise_inversion(logits, tokens, 1.0, generator=gen)
        assert bool(((z >= 0) & (z < 1)).all()), (dtype, z.max().item())
        back = op.inverse_cdf_sample(logits, z)
        live = tokens < 5
        assert torch.equal(back[live], tokens[live])


@pytest.mark.parametrize("bad", ["1", True, torch.tensor(True), None])
def test_temperature_of_the_wrong_type_is_refused_by_name(bad):
    """A string or a bool (Python or tensor) would convert silently to a temperature; each is an error.
    Integer tensors are real temperatures (generation's checks take them on both caches)."""
    from kforcing_kernels.ops.sampling.op import inverse_cdf_sample

    logits, z = torch.randn(3, 7), torch.rand(3)
    with pytest.raises(ValueError, match="temperature: expected"):
        inverse_cdf_sample(logits, z, temperature=bad)
    import numpy as np

    assert torch.equal(
        inverse_cdf_sample(logits, z, temperature=np.float32(0.5)), inverse_cdf_sample(logits, z, temperature=0.5)
    )
    assert torch.equal(
        inverse_cdf_sample(logits, z, temperature=torch.tensor([1, 2, 1])),
        inverse_cdf_sample(logits, z, temperature=torch.tensor([1.0, 2.0, 1.0])),
    )


def test_every_backend_names_the_first_row_without_a_distribution():
    """Several bad rows: the error names the first (the cpp kernels' threads once named whichever came last)."""
    from kforcing_kernels.ops.sampling.op import inverse_cdf_sample, inverse_cdf_sample_reference

    logits = torch.randn(64, 9)
    logits[[5, 17, 40, 63]] = float("-inf")
    z = torch.rand(64)
    for fn in (inverse_cdf_sample, inverse_cdf_sample_reference):
        with pytest.raises(ValueError, match="row 5 has no finite maximum"):
            fn(logits, z)

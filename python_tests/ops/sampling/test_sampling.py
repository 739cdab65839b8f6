"""Inverse-CDF sampler and noise inversion: exactness vs float64, distribution, round trips, validation.

Runs against whichever implementation ``sampler_backend('cpu')`` picks (the C++ one
when the extension is built; the torch reference otherwise, e.g. in the fallback run
of test_cpp_fallback.py), plus the C++ one explicitly and per instruction-set build.
"""

import pytest
import torch

from kforcing_kernels import _extension
from kforcing_kernels.ops import sampling
from kforcing_kernels.ops.sampling import inverse_cdf_sample, noise_inversion, sampler_backend

EXT = _extension.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=f"C++ extension: {_extension.reason()}")


def reference64(logits, z, tau):
    """min{v : F(v) > z} with F the float64 cumulative sum of softmax(logits / tau) (searchsorted)."""
    tau = torch.as_tensor(tau, dtype=torch.float64)
    cdf = torch.softmax(logits.double() / (tau[..., None] if tau.dim() else tau), -1).cumsum(-1)
    ids = torch.searchsorted(cdf, z.double()[..., None].contiguous(), right=True)[..., 0]
    return ids.clamp(max=logits.shape[-1] - 1)


def random_logits(rows, V, dtype, *, seed):
    """Random logits with ties (repeated values, integer-valued rows) and -inf entries."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g, dtype=torch.float64) * 3
    if V > 1:
        logits[:, 1] = logits[:, 0]  # a tie
        logits[::4] = torch.randint(-3, 3, (logits[::4].shape), generator=g).double()  # many ties
    if V > 3:
        logits[:, 2::5] = float("-inf")  # impossible tokens
        logits[1::3, -1] = float("-inf")  # ... also at the end
    return logits.to(dtype)


def special_z(rows, *, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(rows, generator=g)
    z[0] = 0.0
    z[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # just below 1
    z[2] = 0.5
    return z


# The float64 reference on bfloat16 logits is exact too: both see the same bf16 values.
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.mark.parametrize("tau", [0.01, 1.0, 5.0])
@pytest.mark.parametrize("V", [1, 2, 7, 1000, 2500])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_matches_float64_reference_exactly(V, tau, dtype):
    logits = random_logits(64, V, dtype, seed=V)
    z = special_z(64, seed=V + 1)
    got = inverse_cdf_sample(logits, z, tau)
    assert got.dtype == torch.int64 and got.shape == (64,)
    assert torch.equal(got, reference64(logits, z, tau))


@pytest.mark.parametrize("V", [7, 1000])
def test_sample_edges_z_zero_and_just_below_one(V):
    logits = random_logits(16, V, torch.float32, seed=3)
    nonzero = torch.isfinite(logits)
    first = nonzero.float().argmax(-1)
    last = V - 1 - nonzero.flip(-1).float().argmax(-1)
    assert torch.equal(inverse_cdf_sample(logits, torch.zeros(16), 1.0), first)  # first token with mass
    below_one = torch.full((16,), 1.0).nextafter(torch.tensor(0.0))
    # At a high temperature every finite logit has mass above float32 resolution.
    assert torch.equal(inverse_cdf_sample(logits, below_one, 5.0), last)  # last token with mass


def test_per_row_temperature_and_batch_shape():
    logits = random_logits(24, 300, torch.float32, seed=5).view(2, 3, 4, 300)
    z = special_z(24, seed=6).view(2, 3, 4)
    tau = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(7)) * 4 + 0.05
    got = inverse_cdf_sample(logits, z, tau)
    assert got.shape == (2, 3, 4)
    assert torch.equal(got, reference64(logits, z, tau))


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_chi_square_frequencies_match_softmax(tau):
    """Sampling with uniform z reproduces softmax(logits / tau): chi-square test at p = 0.001."""
    g = torch.Generator().manual_seed(11)
    V, n = 12, 20000
    logits = torch.randn(V, generator=g) * 1.5
    z = torch.rand(n, generator=g)
    tokens = inverse_cdf_sample(logits.expand(n, V), z, tau)
    counts = torch.bincount(tokens, minlength=V).double()
    expected = torch.softmax(logits.double() / tau, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 31.26, f"chi2 = {chi2:.1f} with {V - 1} degrees of freedom"  # 0.999 quantile of chi2(11)


@pytest.mark.parametrize("tau", [0.01, 1.0, 5.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_inversion_round_trips(tau, dtype):
    logits = random_logits(200, 3000, dtype, seed=13)
    tokens = inverse_cdf_sample(logits, torch.rand(200, generator=torch.Generator().manual_seed(14)), tau)
    z = noise_inversion(logits, tokens, tau, generator=torch.Generator().manual_seed(15))
    assert z.shape == tokens.shape and bool(((z >= 0) & (z < 1)).all())
    assert torch.equal(inverse_cdf_sample(logits, z, tau), tokens)


def test_noise_inversion_every_token_with_mass_round_trips():
    """Every token whose bin holds a float32 comes back, including ties and the last token."""
    logits = random_logits(1, 500, torch.float32, seed=17)[0]
    probs = torch.softmax(logits.double(), -1)
    tokens = torch.nonzero(probs > 1e-6)[:, 0]
    rows = logits.expand(len(tokens), 500)
    z = noise_inversion(rows, tokens, 1.0, generator=torch.Generator().manual_seed(18))
    assert torch.equal(inverse_cdf_sample(rows, z, 1.0), tokens)


def test_noise_inversion_is_uniform_inside_the_bin():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    n = 4000
    z = noise_inversion(logits.expand(n, 4), torch.full((n,), 2), generator=torch.Generator().manual_seed(19)).double()
    lower, upper = cdf[1].item(), cdf[2].item()
    assert bool(((z >= lower - 1e-7) & (z < upper)).all())
    frac = (z - lower) / (upper - lower)
    assert abs(frac.mean().item() - 0.5) < 0.02 and abs(frac.var().item() - 1 / 12) < 0.01


def test_noise_inversion_generator_is_reproducible():
    logits = random_logits(8, 100, torch.float32, seed=21)
    tokens = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(22))
    tokens = torch.where(torch.isfinite(logits.gather(-1, tokens[:, None]))[:, 0], tokens, 0)
    a = noise_inversion(logits, tokens, 1.0, generator=torch.Generator().manual_seed(5))
    b = noise_inversion(logits, tokens, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: inverse_cdf_sample(torch.randn(3, 5), torch.rand(2)),
            r"z: expected shape \(3,\) \(logits without V\), got \(2,\)",
        ),
        (lambda: inverse_cdf_sample(torch.randn(3, 5), torch.rand(3), 0.0), "temperature: expected finite values > 0"),
        (
            lambda: inverse_cdf_sample(torch.randn(3, 5), torch.rand(3), torch.ones(2)),
            r"temperature: expected a scalar or shape \(3,\)",
        ),
        (lambda: inverse_cdf_sample(torch.randint(0, 5, (3, 5)), torch.rand(3)), "logits: expected a floating tensor"),
        (
            lambda: noise_inversion(torch.randn(3, 5), torch.zeros(4, dtype=torch.long)),
            r"tokens: expected shape \(3,\)",
        ),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@needs_ext
def test_cpp_sampler_validation_names_the_argument():
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 5\), got 5"):
        EXT.noise_inversion(torch.randn(2, 5), torch.tensor([0, 5]), torch.tensor(1.0), torch.rand(2))
    with pytest.raises(ValueError, match=r"z: expected values in \[0, 1\], got 1.5"):
        EXT.inverse_cdf_sample(torch.randn(2, 5), torch.tensor([0.1, 1.5]), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"logits: expected every row to define a distribution, row 1"):
        EXT.inverse_cdf_sample(torch.tensor([[0.0, 1.0], [float("-inf")] * 2]), torch.rand(2), torch.tensor(1.0))
    with pytest.raises(ValueError, match="logits: expected a CPU tensor, got device meta"):
        EXT.inverse_cdf_sample(torch.randn(2, 5, device="meta"), torch.rand(2), torch.tensor(1.0))


@needs_ext
def test_dispatch_uses_the_extension_on_cpu():
    assert sampler_backend("cpu") == "cpp"
    assert sampler_backend("meta") == "reference"


@needs_ext
@pytest.mark.parametrize("isa", EXT.available_isas().split(",") if EXT else [])
def test_every_isa_build_samples_exactly(isa):
    before = EXT.isa()
    EXT.set_isa(isa)
    try:
        logits = random_logits(64, 2100, torch.float32, seed=23)
        z = special_z(64, seed=24)
        got = inverse_cdf_sample(logits, z, 0.7)
        tokens_z = noise_inversion(logits, got, 0.7, generator=torch.Generator().manual_seed(25))
        back = inverse_cdf_sample(logits, tokens_z, 0.7)
    finally:
        EXT.set_isa(before)
    assert torch.equal(got, reference64(logits, z, 0.7))
    assert torch.equal(back, got)


def test_torch_reference_matches_float64_exactly():
    """The fallback (used where no fused sampler runs) is exact too, and round-trips with its inversion."""
    logits = random_logits(64, 1000, torch.float32, seed=27)
    z = special_z(64, seed=28)
    tokens = sampling.inverse_cdf_sample_reference(logits, z, 1.0)
    assert torch.equal(tokens, reference64(logits, z, 1.0))
    back = sampling.noise_inversion_reference(logits, tokens, 1.0, generator=torch.Generator().manual_seed(29))
    assert back.dtype == torch.float32
    assert torch.equal(sampling.inverse_cdf_sample_reference(logits, back, 1.0), tokens)

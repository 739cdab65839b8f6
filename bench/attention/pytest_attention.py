"""pytest-benchmark entry points: one shape, every method of the sweep (not part of ``make test``).

    .venv/bin/python -m pytest bench/attention/pytest_attention.py --benchmark-only
    --benchmark-columns=min,median,rounds
    KF_BENCH_N=1024 KF_BENCH_K=8 KF_BENCH_THREADS=1 .venv/bin/python -m pytest bench/attention/pytest_attention.py
    --benchmark-only

The sweep CLI (``python -m bench attention``) is the source of the reported numbers;
this file is for pytest-benchmark's own tooling (``--benchmark-compare``, histograms).
Methods that are not present here are skipped with the reason.
"""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from kforcing_kernels import window_attention
from kforcing_kernels.layouts import ideal_causal_pairs

from ..__main__ import parse_command
from .._timing import phase_step, pin_threads
from .peers import LAYOUTS
from .sweep import OURS, method_availability

N = int(os.environ.get("KF_BENCH_N", 512))
K = int(os.environ.get("KF_BENCH_K", 4))
D = int(os.environ.get("KF_BENCH_D", 64))
HEADS = int(os.environ.get("KF_BENCH_HEADS", 4))
LAYOUT = os.environ.get("KF_BENCH_LAYOUT", "single")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


@pytest.fixture(scope="module")
def problem():
    pin_threads(int(os.environ["KF_BENCH_THREADS"]) if "KF_BENCH_THREADS" in os.environ else None)
    layout = LAYOUTS[LAYOUT](N, K)
    gen = torch.Generator().manual_seed(0)

    def rand(length, grad=True):
        return torch.randn(1, HEADS, length, D, generator=gen).to(DEVICE, DTYPE).requires_grad_(grad)

    avail = method_availability(parse_command("attention", ["--device", DEVICE.type]), DEVICE, DTYPE)
    return layout, rand, avail


def _run(benchmark, fn, inputs, dout, phase):
    step = phase_step(fn) if phase == "fwd" else phase_step(fn, inputs, dout)
    step()  # warm-up (compilation, caches)
    benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("phase", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("method", ["ideal_causal", "dense_sdpa", "flex_blockmask", *OURS])
def test_attention(benchmark, problem, method, phase):
    layout, rand, avail = problem
    benchmark.group = f"{LAYOUT} N={N} k={K} D={D} H={HEADS} {phase}"
    if method == "ideal_causal":
        # Causal SDPA over N; the ideal is this x |M| / causal(N), recorded in extra_info.
        benchmark.extra_info["ideal_multiplier"] = layout.num_pairs() / ideal_causal_pairs(layout.n_ctx)
        q, k, v = rand(layout.n_ctx), rand(layout.n_ctx), rand(layout.n_ctx)
        _run(
            benchmark,
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            (q, k, v),
            rand(layout.n_ctx, False),
            phase,
        )
        return
    if avail[method] is not None:
        pytest.skip(avail[method])
    q, k, v = rand(layout.n_queries), rand(layout.n_keys), rand(layout.n_keys)
    dout = rand(layout.n_queries, False)
    if method == "dense_sdpa":
        mask = layout.dense_mask().to(DEVICE)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    elif method == "flex_blockmask":
        if phase == "fwd_bwd" and DEVICE.type != "cuda":
            pytest.skip("FlexAttention has no CPU backward")
        from torch.nn.attention.flex_attention import flex_attention

        warnings.filterwarnings("ignore")
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = layout.to_block_mask(128, device=DEVICE)
        fq, fk, fv = (q, k, v) if phase == "fwd_bwd" else (q.detach(), k.detach(), v.detach())
        fn = lambda: compiled(fq, fk, fv, block_mask=block_mask)  # noqa: E731
    else:
        fn = lambda: window_attention(q, k, v, layout, backend=method)  # noqa: E731
    _run(benchmark, fn, (q, k, v), dout, phase)

"""The captured decode step on CUDA (issue 50): a CUDA-graph replay gives the eager step's bits (the same kernels),
the compiled step (``torch.compile``, reduce-overhead) the eager tokens and logits within rounding, for AR and
K-Forcing on both caches. Skipped without a GPU (the CPU side: test_static_step.py)."""

import math

import pytest
import torch

from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
from kforcing_kernels.model import KForcingLM, ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = ModelConfig(vocab_size=512, n_layer=2, n_head=4, n_embd=128, seq_len=64)
LENGTHS = (5, 17, 9, 12)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KForcingLM(CFG).to("cuda", torch.bfloat16).eval()


def run(model, k, cache, compile_step, t=12):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in LENGTHS]
    if k is None:
        noise = torch.rand(len(prompts), t, generator=gen)
        return generate_ar(model, prompts, t, noise=noise, cache=cache, return_logits=True, compile_step=compile_step)
    noise = torch.rand(len(prompts), math.ceil(t / k), k, generator=gen)
    return generate_kforcing(
        model, prompts, k, t, noise=noise, cache=cache, return_logits=True, compile_step=compile_step
    )


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("k", [None, 4])
def test_a_cuda_graph_replay_gives_the_eager_bits(model, k, cache):
    ref, ref_logits = run(model, k, cache, False)
    out, logits = run(model, k, cache, "cudagraph")
    assert out.tolist() == ref.tolist()
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("k", [None, 4])
def test_the_compiled_step_gives_the_eager_tokens(model, k, cache):
    ref, ref_logits = run(model, k, cache, False)
    out, logits = run(model, k, cache, True)
    assert out.tolist() == ref.tolist()
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=5e-2, rtol=5e-2)  # bf16 rounding

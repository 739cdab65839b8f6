"""Context parallelism for Hugging Face models: ``HFStudent(..., context_parallel=cp)`` and a ``RankRows`` as the
``kforcing_layout`` of ``attn_implementation="kforcing"``.

In process: a one-rank ``ContextParallel`` returns the whole forward's rows (sliding-window layers included) and the
refusals name their argument. Under torchrun (3 gloo processes, python_tests/workers/hf_cp_worker.py): groups of 2 and 3
ranks give every rank the single-process logits at its rows and, summed over the group, its gradients; and
``context_parallel_loss`` gives ``compute_loss``'s loss and gradients for AR, forward distillation and self-forcing.
The trainer's ``--context-parallel 2`` on an HF student (DDP and FSDP2) is held by test_train_mesh.py.
"""

import pytest
import torch
import torch.distributed as dist

from helpers import REPO
from helpers import hf_helpers as H
from helpers.train_helpers import torchrun
from kforcing_kernels.app.hf_recipe.student import HFStudent
from kforcing_kernels.integrations import hf as kf_hf
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.parallel import ContextParallel

ROOT = REPO
CONFIGS = {
    "llama_gqa": lambda **kw: H.llama(**kw),
    "gpt2": lambda **kw: H.gpt2(bos_token_id=0, eos_token_id=0, **kw),
    "mistral_sliding": lambda **kw: H.mistral(**{"sliding_window": 5, **kw}),
    "gemma3_alternating": lambda **kw: H.gemma3(
        **{"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], **kw}
    ),
}


def _student(name, **extra):
    (hf,) = H.twin_models(CONFIGS[name](**extra), "kforcing")
    torch.manual_seed(1)
    model = HFStudent(hf)
    model.reset_noise_encoder()
    return model


def _inputs(b=2, n=11, k=3):
    gen = torch.Generator().manual_seed(4)
    return (
        torch.randint(0, H.VOCAB, (b, n), generator=gen),
        torch.rand(b, n, k, generator=gen),
        torch.tensor([0.8, 1.2]),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cu", [None, [[0, 4, 11], [0, 11]]], ids=["whole", "packed"])
def test_one_rank_context_parallel_is_the_forward(name, cu):
    model = _student(name)
    tokens, noise, tau = _inputs()
    cp = ContextParallel()
    logits, rows = model(tokens, cu_seqlens=cu, context_parallel=cp)
    assert torch.equal(rows, torch.arange(11))
    torch.testing.assert_close(logits, model(tokens, cu_seqlens=cu), rtol=1e-5, atol=1e-5)
    logits, rows = model(tokens, noise, tau, cu_seqlens=cu, context_parallel=cp)
    assert torch.equal(rows, torch.arange(33))  # window tokens t * k + j
    torch.testing.assert_close(logits, model(tokens, noise, tau, cu_seqlens=cu).flatten(1, 2), rtol=1e-5, atol=1e-5)


def test_the_sliding_window_is_applied_under_context_parallel():
    """The sliding configs' windows hide keys at these lengths: the CP forward is not the unwindowed model's."""
    tokens, noise, tau = _inputs()
    for name in ("mistral_sliding", "gemma3_alternating"):
        windowed, full = _student(name), _student(name, sliding_window=64)
        got = windowed(tokens, noise, tau, context_parallel=ContextParallel())[0]
        assert not torch.allclose(got, full(tokens, noise, tau, context_parallel=ContextParallel())[0], atol=1e-4), name


def test_rank_rows_refusals_name_their_argument():
    model = _student("llama_gqa")
    tokens, noise, tau = _inputs()
    with pytest.raises(ValueError, match="context_parallel: expected a kforcing_kernels.parallel.ContextParallel"):
        model(tokens, context_parallel=2)
    with pytest.raises(ValueError, match=r"noise: expected shape \[2, 11, k\]"):
        model(tokens, noise[:, :3], tau, context_parallel=ContextParallel())
    shard = ContextParallel().shard(WindowLayout.kforcing_single(4, 2))  # 12 rows, 12 keys
    q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8)
    attn = kf_hf.kforcing_attention_forward
    out, _ = attn(None, q, k, k, None, kforcing_layout=shard)
    assert out.shape == (1, 12, 4, 8)
    with pytest.raises(ValueError, match=r"kforcing_layout: expected 12 input tokens \(this rank's rows"):
        attn(None, q[:, :, :11], k, k, None, kforcing_layout=shard)
    with pytest.raises(ValueError, match=r"kforcing_layout: expected 12 keys \(this rank's keys"):
        attn(None, q, torch.randn(1, 2, 14, 8), torch.randn(1, 2, 14, 8), None, kforcing_layout=shard)
    with pytest.raises(ValueError, match="kforcing_backend: a RankRows kforcing_layout"):
        attn(None, q, k, k, None, kforcing_layout=shard, kforcing_backend="reference")
    with pytest.raises(ValueError, match="attention_mask: expected None"):
        attn(None, q, k, k, torch.zeros(1, 1, 12, 12, dtype=torch.bool), kforcing_layout=shard)
    with pytest.raises(ValueError, match=r"sliding_window: the model's window \(1\)"):
        attn(None, q, k, k, None, kforcing_layout=shard, sliding_window=1)  # shorter than the layout's windows (2)


GLOO = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


@GLOO
def test_hf_context_parallel_matches_one_process_gloo():
    out = torchrun(3, ROOT / "python_tests" / "workers" / "hf_cp_worker.py", "gloo").stdout
    for name in CONFIGS:
        for case in ("ar", "ar_packed", "single", "single_packed"):
            assert out.count(f" world2 {name} {case}: ok") == 2, (name, case, out[-3000:])
            assert out.count(f" world3 {name} {case}: ok") == 3, (name, case, out[-3000:])
    for name in ("llama_gqa", "gpt2"):
        for case in ("ar", "forward", "self_forcing"):
            for packed in ("", "_packed"):
                assert out.count(f" loss {name} {case}{packed}: ok") == 2, (name, case + packed, out[-3000:])

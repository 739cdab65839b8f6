"""The compiled Triton backend on a real GPU (skipped without CUDA), and the GPU benchmark's CPU behaviour."""

import os
import sys

import pytest
import torch

from conftest import make_qkv
from kforcing_kernels import WindowLayout, default_backend, window_attention
from kforcing_kernels.ops.window_attention import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA device (and compiled, not interpreted, Triton)")

LAYOUTS = {
    "single": WindowLayout.kforcing_single(300, 4),
    "double": WindowLayout.kforcing_double(257, 4),
    "sbd": WindowLayout.sbd(300, 7),
    "ptp": WindowLayout.ptp(200, [[20, 120, 200], [0, 50, 199]], 48, [[0, 100, 150], [0, 50, 3]]),
    "jacobi": WindowLayout.jacobi(100, 200),
    "causal": WindowLayout.causal(333),
}


@needs_gpu
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_kernels_match_reference(name):
    """Every head dim and GPU dtype (bf16 is only checkable here: the interpreter's bf16 dot is wrong)."""
    layout = LAYOUTS[name]
    batch = layout.batch_size or 2
    for dtype in (torch.bfloat16, torch.float16):
        for d in (32, 64, 128):
            q, k, v = (t.detach().cuda().requires_grad_(True) for t in
                       make_qkv(layout, batch=batch, heads=4, kv_heads=2, head_dim=d, dtype=dtype))
            dout = torch.randn_like(q)
            out, lse = window_attention(q, k, v, layout, backend="triton", return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            ref_out, ref_lse = reference.attention(qr, kr, vr, layout, d ** -0.5)
            ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())
            tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
            for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
                assert bool(torch.isfinite(got).all()), (dtype, d, what)
                torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{dtype} D={d} {what}: {m}")


@needs_gpu
def test_cuda_tensors_dispatch_to_triton():
    assert default_backend(torch.device("cuda")) == "triton" or os.environ.get("KFORCING_BACKEND")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU benchmark")
def test_gpu_benchmark_skips_cleanly_without_cuda(capsys):
    sys.path.insert(0, ROOT)
    from bench import triton_gpu

    assert triton_gpu.main([]) == 0
    out = capsys.readouterr().out
    assert "skipped, no CUDA device" in out and "TFLOP/s" not in out
    assert triton_gpu.main(["--list", "--n", "1024", "--k", "4", "--dim", "64"]) == 0
    assert "|M|=2634240" in capsys.readouterr().out  # SingleForward N=1024, k=4: ~5 x causal + intra

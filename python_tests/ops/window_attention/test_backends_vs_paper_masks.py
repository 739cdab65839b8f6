"""Every backend, forward and all gradients, against an fp64 oracle whose mask comes from the
element-wise definitions in paper_masks.py, not from the layout's own dense_mask(): a layout
constructor bug cannot pass here by construction."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, TESTS
from helpers.paper_masks import (
    bd3lm_block_diff_mask,
    causal_packed_elementwise,
    dflash_elementwise,
    jacobi_batched_elementwise,
    jacobi_elementwise,
    kforcing_double_elementwise,
    kforcing_double_packed_elementwise,
    kforcing_single_elementwise,
    kforcing_single_packed_elementwise,
    ptp_truncated_elementwise,
    sbd_elementwise,
    sbd_packed_elementwise,
)
from kforcing_kernels import WindowLayout, backends_available, window_attention

HERE = os.path.dirname(os.path.abspath(__file__))


def _bd3lm_ours(n, block):
    perm = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return bd3lm_block_diff_mask(n, block)[perm][:, perm]


CASES = {
    "single": (lambda: WindowLayout.kforcing_single(9, 3), lambda: kforcing_single_elementwise(9, 3)),
    "double": (lambda: WindowLayout.kforcing_double(7, 2), lambda: kforcing_double_elementwise(7, 2)),
    "sbd": (lambda: WindowLayout.sbd(10, 3), lambda: sbd_elementwise(10, 3)),
    "jacobi": (lambda: WindowLayout.jacobi(4, 6), lambda: jacobi_elementwise(4, 6)),
    "ptp_doc_ends": (
        lambda: WindowLayout.ptp(9, [3, 6, 9], 4, [0, 0, 6], doc_ends=[5, 6, 9]),
        lambda: ptp_truncated_elementwise(9, [3, 6, 9], 4, [0, 0, 6], [5, 6, 9]),
    ),
    "causal_packed_block": (
        lambda: WindowLayout.causal(12, cu_seqlens=[0, 5, 12], block=2),
        lambda: causal_packed_elementwise(12, [0, 5, 12], 2),
    ),
    "single_packed": (
        lambda: WindowLayout.kforcing_single(9, 2, cu_seqlens=[0, 4, 9]),
        lambda: kforcing_single_packed_elementwise(9, 2, [0, 4, 9]),
    ),
    "double_packed": (
        lambda: WindowLayout.kforcing_double(7, 2, cu_seqlens=[0, 3, 7]),
        lambda: kforcing_double_packed_elementwise(7, 2, [0, 3, 7]),
    ),
    "sbd_packed": (
        lambda: WindowLayout.sbd(12, 3, cu_seqlens=[0, 6, 12]),
        lambda: sbd_packed_elementwise(12, 3, [0, 6, 12]),
    ),
    "sbd_packed_short_end": (
        lambda: WindowLayout.sbd(11, 3, cu_seqlens=[0, 6, 11]),
        lambda: sbd_packed_elementwise(11, 3, [0, 6, 11]),
    ),
    "bd3lm": (lambda: WindowLayout.bd3lm(12, 4), lambda: _bd3lm_ours(12, 4)),
    # Block drafters (two batch elements, as check() uses): DFlash full blocks with dropped blocks and
    # anchors at 0, at the last context token and at S; causal blocks; speculators' block window over
    # packed documents; SpecForge's per-slot sliding window.
    "dflash": (
        lambda: WindowLayout.anchor_blocks(
            9, [[0, 8, 4], [9, 3, 3]], 3, keep=[[True, True, False], [True, True, True]]
        ),
        lambda: dflash_elementwise(9, [[0, 8, 4], [9, 3, 3]], 3, keep=[[True, True, False], [True, True, True]]),
    ),
    "dflash_causal": (
        lambda: WindowLayout.anchor_blocks(9, [5, 8], 3, intra="causal"),
        lambda: dflash_elementwise(9, [[5, 8]], 3, intra="causal"),
    ),
    "dflash_window_block_packed": (
        lambda: WindowLayout.anchor_blocks(10, [[4, 9], [7, 2]], 2, window=3, cu_seqlens=[[0, 3, 10], [0, 6, 10]]),
        lambda: dflash_elementwise(10, [[4, 9], [7, 2]], 2, window=3, cu=[[0, 3, 10], [0, 6, 10]]),
    ),
    "dflash_window_slot": (
        lambda: WindowLayout.anchor_blocks(10, [[4, 9], [7, 1]], 4, window=3, window_mode="slot"),
        lambda: dflash_elementwise(10, [[4, 9], [7, 1]], 4, intra="causal", window=3, window_mode="slot"),
    ),
    "jacobi_batched": (
        lambda: WindowLayout.jacobi([3, 5], num_blocks=[2, 1], block_size=[2, 3]),
        lambda: jacobi_batched_elementwise([3, 5], [4, 3]),
    ),
}


def oracle(q, k, v, mask, scale):
    """fp64 masked attention; a row that sees no key gives 0 (FlexAttention's convention)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    return (p @ v) / p.sum(-1, keepdim=True).clamp(min=1e-300)


def check(backend, name, dtype=torch.float32, tol=2e-5):
    make_layout, make_mask = CASES[name]
    layout, mask = make_layout(), make_mask()
    torch.manual_seed(0)
    b, h, hkv, d = 2, 4, 2, 32  # 32: the smallest head dim the triton kernels take
    q = torch.randn(b, h, layout.n_queries, d, dtype=torch.float64)
    k = torch.randn(b, hkv, layout.n_keys, d, dtype=torch.float64)
    v = torch.randn(b, hkv, layout.n_keys, d, dtype=torch.float64)
    dout = torch.randn(b, h, layout.n_queries, d, dtype=torch.float64)
    ours = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = window_attention(*ours, layout, backend=backend)
    grads = torch.autograd.grad(out, ours, dout.to(dtype))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = oracle(*ref_in, mask, d**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    for label, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(a).all(), f"{backend} {name} {label}: non-finite"
        err = (a.double() - r).abs().max().item()
        assert err <= tol, f"{backend} {name} {label}: max error {err:.3g}"


CPU_BACKENDS = [name for name in ("reference", "composite", "cpp") if backends_available()[name] is None]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_matches_paper_mask(backend, name):
    check(backend, name)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter process")
def test_triton_interpreter_matches_paper_masks():
    pytest.importorskip("triton")
    code = (
        "import test_backends_vs_paper_masks as t\n"
        "for name in t.CASES:\n"
        "    t.check('triton', name)\n"
        "print('ok', len(t.CASES))\n"
    )
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(filter(None, [HERE, str(TESTS), str(REPO), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0 and f"ok {len(CASES)}" in result.stdout, (result.stdout + result.stderr)[-4000:]

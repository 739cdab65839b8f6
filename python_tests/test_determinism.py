"""Bitwise guarantees (README "Guarantees"): every CPU backend gives the same bits for any thread
count, and for a sequence alone or inside a batch (forward and all gradients)."""

import pytest
import torch

from kforcing_kernels import backends_available, window_attention
from kforcing_kernels.layouts import zoo

BACKENDS = [name for name in ("reference", "composite", "cpp") if backends_available()[name] is None]
LAYOUTS = ["single_k3_odd", "double_k2", "single_multi_chunk", "sbd_large_block", "single_packed", "ptp_doc_ends",
           "single_packed_per_batch"]


def _run(backend, layout, q, k, v, dout, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = window_attention(q, k, v, layout, backend=backend)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_across_threads_and_batch_composition(backend, name):
    layout = zoo.small()[name]
    b = layout.range_batch or 3
    q = torch.randn(b, 4, layout.n_queries, 32)
    k, v = torch.randn(b, 2, layout.n_keys, 32), torch.randn(b, 2, layout.n_keys, 32)
    dout = torch.randn_like(q)
    one = _run(backend, layout, q, k, v, dout, threads=1)
    two = _run(backend, layout, q, k, v, dout, threads=2)
    for label, a, c in zip(("out", "dq", "dk", "dv"), one, two):
        assert torch.equal(a, c), f"{label} depends on the thread count"
    for i in range(b):
        alone = _run(backend, layout.batch_element(i), *(t[i:i + 1] for t in (q, k, v, dout)), threads=2)
        for label, a, c in zip(("out", "dq", "dk", "dv"), two, alone):
            assert torch.equal(a[i:i + 1], c), f"{label} of element {i} depends on the batch it is in"

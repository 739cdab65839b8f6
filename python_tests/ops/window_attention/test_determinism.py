"""Bitwise guarantees (README "Guarantees"): every CPU backend gives the same bits for any thread
count, and for a sequence alone or inside a batch (forward and all gradients)."""

import pytest
import torch

from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.layouts import zoo

BACKENDS = [name for name in ("reference", "composite", "cpp") if backends_available()[name] is None]
LAYOUTS = [
    "single_k3_odd",
    "double_k2",
    "single_multi_chunk",
    "sbd_large_block",
    "single_packed",
    "ptp_doc_ends",
    "single_packed_per_batch",
]


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
        alone = _run(backend, layout.batch_element(i), *(t[i : i + 1] for t in (q, k, v, dout)), threads=2)
        for label, a, c in zip(("out", "dq", "dk", "dv"), two, alone):
            assert torch.equal(a[i : i + 1], c), f"{label} of element {i} depends on the batch it is in"


# Per-batch cu_seqlens (every --packed-docs step): an element's result must not depend on the
# other elements' document boundaries (issue #29 item 10: the cpp backward ordered its dK/dV
# accumulation over query tiles by batch element 0's tile costs). Layouts long enough for
# several query tiles (> 64 rows), so that the order of the tiles can matter.
_PACKED = {
    "causal": lambda n, cu: WindowLayout.causal(n, cu_seqlens=cu),
    "causal_block": lambda n, cu: WindowLayout.causal(n, cu_seqlens=cu, block=4),
    "single": lambda n, cu: WindowLayout.kforcing_single(n, 3, cu_seqlens=cu),
    "double": lambda n, cu: WindowLayout.kforcing_double(n, 2, cu_seqlens=cu),
    "sbd": lambda n, cu: WindowLayout.sbd(n, 4, cu_seqlens=cu),
    "bd3lm": lambda n, cu: WindowLayout.bd3lm(n, 4, cu_seqlens=cu),
}
_MINE = [0, 8, 60, 100, 144]  # the element under test (boundaries at multiples of 4 for the block layouts)
_OTHERS = [[0, 144], [0, 4, 8, 12, 140, 144], [0, 96, 144], [0, 20, 24, 28, 32, 36, 40, 120, 144]]


@pytest.mark.parametrize("mine", [_MINE, [0, 144]], ids=["packed", "one-document"])
@pytest.mark.parametrize("name", sorted(_PACKED))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_per_batch_documents_whatever_the_other_elements_boundaries(backend, name, mine):
    """One document too: per-batch ranges of a batch of one are that element's layout (composite once took
    another piece decomposition for them than for the same row inside a batch)."""
    make, n = _PACKED[name], 144
    alone_layout = make(n, [mine])
    g = torch.Generator().manual_seed(5)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, dout = rand(1, 2, alone_layout.n_queries, 16), rand(1, 2, alone_layout.n_queries, 16)
    k, v = rand(1, 2, alone_layout.n_keys, 16), rand(1, 2, alone_layout.n_keys, 16)
    alone = _run(backend, alone_layout, q, k, v, dout, threads=2)
    for pos, others in ((1, [_OTHERS[0]]), (1, _OTHERS[1:3]), (2, _OTHERS[1:]), (0, _OTHERS[3:])):
        cus = others[:pos] + [mine] + others[pos:]
        layout = make(n, cus)
        assert layout.range_batch == len(cus)

        def fill(t, pos=pos, cus=cus):  # the element at pos, random ones around it
            return torch.cat([rand(pos, *t.shape[1:]), t, rand(len(cus) - pos - 1, *t.shape[1:])])

        got = _run(backend, layout, fill(q), fill(k), fill(v), fill(dout), threads=2)
        for label, a, c in zip(("out", "dq", "dk", "dv"), alone, got):
            assert torch.equal(a, c[pos : pos + 1]), f"{label} of the element depends on the other elements' documents"

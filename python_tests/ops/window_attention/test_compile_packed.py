"""torch.compile(fullgraph=True) over layouts with packed documents, block-causal contexts and blank slots."""

import pytest
import torch
import torch._dynamo

from helpers.attention import make_qkv, run_with_grads
from kforcing_kernels import WindowLayout, backends_available, window_attention

CPU_BACKENDS = [name for name in ("reference", "composite", "cpp") if backends_available()[name] is None]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fullgraph_packed_layouts_match_eager(backend):
    torch._dynamo.reset()

    def fn(q, k, v, layout):
        return window_attention(q, k, v, layout, backend=backend) * 2.0

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for layout in (
        WindowLayout.kforcing_single(9, 2, cu_seqlens=[0, 4, 9]),
        WindowLayout.bd3lm(8, 2, cu_seqlens=[[0, 4, 8], [0, 8]]),
        WindowLayout.ptp(8, [2, 6], 3, [0, 4], doc_ends=[4, 8]),
    ):
        q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2)
        dout = torch.randn(2, 4, layout.n_queries, 16)
        got = run_with_grads(lambda q, k, v, lay=layout: compiled(q, k, v, lay), q, k, v, dout)
        want = run_with_grads(lambda q, k, v, lay=layout: fn(q, k, v, lay), q, k, v, dout)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()

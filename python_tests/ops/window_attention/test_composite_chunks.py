"""The composite backend's multi-chunk paths, forward and backward (issue 17, item 3).

With CHUNK_ROWS = 256 only layouts with more than 256 window (or context) rows split into
several chunks, and none of the small test layouts has non-staircase ranges that large.
Patching CHUNK_ROWS down makes every layout below walk several chunks whose key spans
overlap, so a chunk's dK/dV must be added to, not written over, the previous chunks'.
"""

import pytest
import torch

from helpers.attention import make_qkv, run_with_grads
from kforcing_kernels import window_attention
from kforcing_kernels.layouts import zoo
from kforcing_kernels.ops.window_attention.composite import pieces as composite

PREFIX = ["ptp", "ptp_per_batch", "sbd_short_last", "double_packed", "blank_full_windows"]
CONTEXT = ["causal_block_packed", "causal_packed", "sbd_packed", "bd3lm"]


def overlapping_chunks(chunks) -> bool:
    spans = [(klo, khi) for _, _, klo, khi, _ in chunks]
    return len(spans) > 1 and any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])


def check_against_reference(layout):
    batch = layout.batch_size or 2
    q, k, v = make_qkv(layout, batch=batch, heads=2, kv_heads=1, head_dim=8, dtype=torch.float64)
    dout = torch.randn(batch, 2, layout.n_queries, 8, dtype=torch.float64)
    ours = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend="composite"), q, k, v, dout)
    ref = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend="reference"), q, k, v, dout)
    for label, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("name", PREFIX)
def test_prefix_chunks_with_overlapping_key_spans(monkeypatch, name):
    monkeypatch.setattr(composite, "CHUNK_ROWS", 4)
    layout = zoo.small()[name]
    assert not composite.is_staircase(layout)
    elements = [layout] if layout.batch_size is None else [layout.batch_element(b) for b in range(layout.batch_size)]
    assert any(overlapping_chunks(list(composite._prefix_chunks(e))) for e in elements)
    check_against_reference(layout)


@pytest.mark.parametrize("name", CONTEXT)
def test_context_chunks_with_overlapping_key_spans(monkeypatch, name):
    monkeypatch.setattr(composite, "CHUNK_ROWS", 4)
    layout = zoo.small()[name]
    assert not layout.has_default_context
    assert overlapping_chunks(list(composite.context_chunks(layout)))
    check_against_reference(layout)


def test_a_large_non_staircase_layout_at_the_real_chunk_size():
    """No patch: 300 SBD windows rows > CHUNK_ROWS = 256."""
    from kforcing_kernels.layouts import WindowLayout

    layout = WindowLayout.sbd(300, 3)
    assert composite.CHUNK_ROWS == 256 and len(list(composite._prefix_chunks(layout))) > 1
    check_against_reference(layout)

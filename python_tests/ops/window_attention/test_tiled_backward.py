"""The CPU backward of lse_attention (``_attend_tiled_backward``, what the composite backend's pieces run on CPU).

Against the textbook formula differentiated by autograd in fp64 (an independent oracle), with tiles patched
small so that many tiles, partial key spans, GQA groups, empty rows and empty tiles occur; its partition of
the work (each tile only over the keys it sees, the masked triangle skipped) counted from the matmuls it runs;
and its bits for 1, 2 and 3 threads, alone and through the composite backend at a size with many tiles.
"""

import pytest
import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.window_attention import lse_attention
from kforcing_kernels.ops.window_attention.lse_attention import attend, attend_backward

SCALE = 0.3


def textbook(q, k, v, allowed):
    """out by softmax over the visible keys (rows that see nothing: 0), differentiable."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = ((q @ kk.transpose(-1, -2)) * SCALE).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    return p @ vv


def _inputs(b, h, hkv, lq, lk, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, h, lq, d, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _masks(b, lq, lk):
    """Masks whose tiles see different key spans: random, a band (sliding window), blocks with empty rows and tiles."""
    gen = torch.Generator().manual_seed(1)
    rows, cols = torch.arange(lq)[:, None], torch.arange(lk)[None]
    rand = torch.rand(b, 1, lq, lk, generator=gen) > 0.6
    rand[:, :, 5] = False  # a row that sees nothing
    band = ((cols <= rows) & (cols > rows - 7)).expand(b, 1, lq, lk).clone()
    blocks = ((cols // 10) == (rows // 12)).expand(b, 1, lq, lk).clone()
    blocks[:, :, 16:40] = False  # whole tiles without a visible key
    return {"random": rand, "band": band, "blocks": blocks}


@pytest.mark.parametrize("tile_rows", [8, 12, 256])
@pytest.mark.parametrize("mask", ["causal", "random", "band", "blocks", "causal+band"])
def test_tiled_backward_matches_the_textbook_gradients(monkeypatch, tile_rows, mask):
    monkeypatch.setattr(lse_attention, "_TILE_ROWS", tile_rows)
    b, h, hkv, lq, lk = 2, 6, 2, 61, 61 if "causal" in mask else 67
    q, k, v, dout = _inputs(b, h, hkv, lq, lk)
    causal = mask.startswith("causal")
    masks = _masks(b, lq, lk)
    allowed = masks["band"] if mask == "causal+band" else None if mask == "causal" else masks[mask]
    full = torch.ones(lq, lk, dtype=torch.bool).tril() if causal else torch.ones(lq, lk, dtype=torch.bool)
    visible = full if allowed is None else full & allowed
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = attend(q, k, v, causal=causal, scale=SCALE, allowed=allowed, force_math=True)
    lse = torch.where(lse > float("-inf"), lse, float("inf"))  # as the composite backend passes rows without keys
    got = attend_backward(
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        causal=causal,
        scale=SCALE,
        allowed=allowed,
    )
    want = torch.autograd.grad(textbook(q, k, v, visible.expand(b, 1, lq, lk)), (q, k, v), dout)
    for label, a, e in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_backward_16_bit_inputs_accumulate_in_fp32(monkeypatch, dtype):
    monkeypatch.setattr(lse_attention, "_TILE_ROWS", 16)
    q, k, v, dout = _inputs(1, 4, 2, 40, 40, dtype=dtype)
    out, lse = attend(q, k, v, causal=True, scale=SCALE)
    acc = attend_backward(dout, q, k, v, out, lse, causal=True, scale=SCALE, acc_grads=True)
    plain = attend_backward(dout, q, k, v, out, lse, causal=True, scale=SCALE)
    assert [g.dtype for g in acc] == [torch.float32] * 3 and [g.dtype for g in plain] == [dtype] * 3
    for a, p in zip(acc, plain):
        assert torch.equal(a.to(dtype), p)  # one rounding at the end
    ref = attend_backward(
        *(t.double() for t in (dout, q, k, v, out)), lse.double(), causal=True, scale=SCALE, force_math=True
    )
    for a, r in zip(acc, ref):
        torch.testing.assert_close(a.double(), r, rtol=2e-2, atol=2e-2)


def test_tiles_visit_only_the_keys_they_see(monkeypatch):
    """Causal: tile i of r rows multiplies by keys [0, (i+1) r) only (what makes it the flash backward's work, half of
    the dense square); a mask: the span of the tile's visible keys; a tile that sees nothing: no product at all."""
    monkeypatch.setattr(lse_attention, "_TILE_ROWS", 32)
    shapes = []
    real_bmm = torch.bmm

    def counting_bmm(a, b, *args, **kw):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real_bmm(a, b, *args, **kw)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    q, k, v, dout = _inputs(1, 4, 2, 128, 128, dtype=torch.float32)  # GQA: 2 query heads per K/V head, 16 rows each
    out, lse = attend(q, k, v, causal=True, scale=SCALE)
    attend_backward(dout, q, k, v, out, lse, causal=True, scale=SCALE)
    scores = [b[2] for a, b in shapes if b[1] == 8 and a[2] == 8]  # Q K^T and dO V^T: [.., 32, 8] @ [.., 8, span]
    assert scores == [span for span in range(16, 129, 16) for _ in range(2)]
    assert all(a[1] == 32 for a, b in shapes if b[1] == 8 and a[2] == 8)  # 16 rows x 2 heads per tile

    shapes.clear()
    allowed = torch.zeros(1, 1, 128, 128, dtype=torch.bool)
    allowed[..., 40:60, 10:20] = True  # rows 40..59 see keys 10..19; every other row sees nothing
    out, lse = attend(q, k, v, causal=False, scale=SCALE, allowed=allowed)
    lse = torch.where(lse > float("-inf"), lse, float("inf"))
    attend_backward(dout, q, k, v, out, lse, causal=False, scale=SCALE, allowed=allowed)
    spans = [b[2] for a, b in shapes if b[1] == 8 and a[2] == 8]
    assert spans == [10] * 4  # two tiles (rows 32..47, 48..63) touch the block, two products each, over 10 keys


def _grads_with_threads(fn, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_tiled_backward_bits_do_not_depend_on_the_thread_count():
    q, k, v, dout = _inputs(2, 8, 2, 700, 700, d=32, dtype=torch.float32)
    out, lse = attend(q, k, v, causal=True, scale=SCALE)
    band = _masks(2, 700, 700)["band"]
    for causal, allowed in ((True, None), (False, band)):

        def run(causal=causal, allowed=allowed):
            return attend_backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, allowed=allowed)

        one = _grads_with_threads(run, 1)
        for threads in (2, 3):
            for label, a, c in zip(("dq", "dk", "dv"), one, _grads_with_threads(run, threads)):
                assert torch.equal(a, c), f"{label} differs between 1 and {threads} threads (causal={causal})"


@pytest.mark.parametrize(
    "layout",
    [
        WindowLayout.kforcing_single(300, 4),
        WindowLayout.kforcing_double(160, 2),
        WindowLayout.causal(400, cu_seqlens=[0, 150, 400]),
    ],
    ids=["single", "double", "packed_causal"],
)
def test_composite_backward_bits_do_not_depend_on_the_thread_count(layout):
    """The composite backend end to end, at sizes where its causal and masked pieces run many tiles."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, layout.n_queries, 32, generator=gen)
    k, v = (torch.randn(1, 4, layout.n_keys, 32, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(window_attention(qq, kk, vv, layout, backend="composite"), (qq, kk, vv), dout)

    one = _grads_with_threads(run, 1)
    for threads in (2, 3):
        for label, a, c in zip(("dq", "dk", "dv"), one, _grads_with_threads(run, threads)):
            assert torch.equal(a, c), f"{label} differs between 1 and {threads} threads"

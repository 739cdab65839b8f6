"""Row subsets (``QueryRowsLayout``) through the backends' own plans: exact, NaN-safe, bitwise on cpp, tiled.

Backends: reference, composite, cpp here; triton in the interpreter process (test_triton_interpreter_cases.py,
``test_row_subsets_match_the_fp64_reference``). Oracle: the full layout's fp64 reference attention at the subset's rows
(forward and every gradient);
for the bitwise promise, cpp's own full-layout run. Subsets are the shapes context parallelism and
EAGLE-3 produce: a balanced rank's rows (``balanced_split``), one storage stream, a random sparse set.
"""

import pytest
import torch

from kforcing_kernels.layouts import WindowLayout, zoo
from kforcing_kernels.layouts import intervals as iv
from kforcing_kernels.ops.window_attention import backends_available, window_attention
from kforcing_kernels.ops.window_attention.op import ROW_SUBSET_BACKENDS
from kforcing_kernels.parallel.balance import balanced_split

ZOO = zoo.small()
CPP = backends_available()["cpp"]
NAMES = [
    "causal_packed",
    "single_k3_odd",
    "single_large_window",
    "single_multi_chunk",
    "double_k2",
    "double_k9",
    "double_packed",
    "single_packed_per_batch",
    "ptp_per_batch",
    "anchor_blocks_sliding_slot",
    "blank_full_windows",
    "jacobi_long_window",
    "general_streams_full",
]


def _backends():
    # triton: the interpreter process (test_triton_interpreter_cases.py) runs its row subsets.
    return [
        pytest.param(b, marks=pytest.mark.skipif(b == "cpp" and CPP is not None, reason=f"cpp: {CPP}"))
        for b in ROW_SUBSET_BACKENDS
        if b != "triton"
    ]


def _subsets(layout) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layout.n_queries)
    n = layout.n_queries
    out = {
        "rank0of2": balanced_split(layout, 2).query_rows[0],
        "rank3of4": balanced_split(layout, 4).query_rows[3],
        "random_third": torch.randperm(n, generator=g)[: max(1, n // 3)].sort().values,
    }
    if layout.n_streams > 1:
        per = n // layout.n_streams
        out["last_stream"] = torch.arange(n - per, n)
    return out


def _qkv(layout, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = layout.range_batch or 2
    q = torch.randn(b, 4, layout.n_queries, 16, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, 2, layout.n_keys, 16, generator=g, dtype=torch.float64).to(dtype)  # GQA: 2 K/V heads
    v = torch.randn(b, 2, layout.n_keys, 16, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _grads(layout, q, k, v, weight, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = window_attention(q, k, v, layout, backend=backend)
    return (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v)))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", NAMES)
def test_subset_matches_the_full_layouts_rows_in_fp64(backend, name):
    layout = ZOO[name]
    q, k, v = _qkv(layout, torch.float64)
    weight = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for label, rows in _subsets(layout).items():
        # The oracle: the full layout's reference attention, its gradients from a loss on these rows only.
        w_full = torch.zeros_like(weight)
        w_full[:, :, rows] = weight[:, :, rows]
        want = _grads(layout, q, k, v, w_full, "reference")
        got = _grads(layout.restrict_rows(rows), q[:, :, rows], k, v, weight[:, :, rows], backend)
        torch.testing.assert_close(got[0], want[0][:, :, rows], rtol=1e-10, atol=1e-10, msg=f"{label} out")
        torch.testing.assert_close(got[1], want[1][:, :, rows], rtol=1e-10, atol=1e-10, msg=f"{label} dq")
        torch.testing.assert_close(got[2], want[2], rtol=1e-10, atol=1e-10, msg=f"{label} dk")
        torch.testing.assert_close(got[3], want[3], rtol=1e-10, atol=1e-10, msg=f"{label} dv")


@pytest.mark.parametrize("backend", _backends())
def test_subset_in_fp32_and_fp16(backend):
    layout = ZOO["double_packed"]
    rows = balanced_split(layout, 2).query_rows[1]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        q, k, v = _qkv(layout, dtype)
        want = window_attention(q.double(), k.double(), v.double(), layout, backend="reference")[:, :, rows]
        got = window_attention(q[:, :, rows], k, v, layout.restrict_rows(rows), backend=backend)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(CPP is not None, reason=f"cpp: {CPP}")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_cpp_rows_have_the_same_bits_in_the_full_layout_and_any_subset(name):
    layout = ZOO[name]
    q, k, v = _qkv(layout, torch.float32, seed=3)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    qf = q.detach().requires_grad_()
    out, lse = window_attention(qf, k, v, layout, backend="cpp", return_lse=True)
    (dq,) = torch.autograd.grad((out * weight).sum(), (qf,))
    for label, rows in _subsets(layout).items():
        qs = q[:, :, rows].detach().requires_grad_()
        o, lse_r = window_attention(qs, k, v, layout.restrict_rows(rows), backend="cpp", return_lse=True)
        (g,) = torch.autograd.grad((o * weight[:, :, rows]).sum(), (qs,))
        assert torch.equal(o, out[:, :, rows]), (name, label, "out")
        assert torch.equal(lse_r, lse[:, :, rows]), (name, label, "lse")
        assert torch.equal(g, dq[:, :, rows]), (name, label, "dq")


@pytest.mark.parametrize("backend", _backends())
def test_nonfinite_values_at_masked_keys_never_reach_a_subset_row(backend):
    # Two documents: rows of the second never see the first one's keys, which hold NaN and inf.
    layout = WindowLayout.kforcing_single(24, 3, cu_seqlens=[0, 10, 24])
    q, k, v = _qkv(layout, torch.float32)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    first_doc_keys = torch.cat([torch.arange(0, 10), torch.arange(24, 24 + 10 * 3)])
    poisoned_k[:, :, first_doc_keys[::2]] = float("nan")
    poisoned_v[:, :, first_doc_keys[1::2]] = float("inf")
    rows = torch.cat([torch.arange(10, 24), torch.arange(24 + 30, layout.n_queries)])[::2]  # second document
    sub = layout.restrict_rows(rows)
    weight = torch.randn(q[:, :, rows].shape, generator=torch.Generator().manual_seed(5))
    clean = _grads(sub, q[:, :, rows], k, v, weight, backend)
    dirty = _grads(sub, q[:, :, rows], poisoned_k, poisoned_v, weight, backend)
    torch.testing.assert_close(dirty[0], clean[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dirty[1], clean[1], rtol=1e-5, atol=1e-6)
    seen = ~torch.isin(torch.arange(layout.n_keys), first_doc_keys)
    for g_dirty, g_clean in zip(dirty[2:], clean[2:]):
        torch.testing.assert_close(g_dirty[:, :, seen], g_clean[:, :, seen], rtol=1e-5, atol=1e-6)
        assert not bool(g_dirty[:, :, ~seen].any())  # no row of the subset sees those keys


def test_backend_is_honoured_or_refused_by_name(monkeypatch):
    from kforcing_kernels.ops.window_attention import backends, composite

    layout = ZOO["double_k2"]
    sub = layout.restrict_rows(torch.arange(0, layout.n_queries, 2))
    q, k, v = _qkv(layout, torch.float32)
    calls = []
    real = composite.forward
    monkeypatch.setattr(composite, "forward", lambda *a: calls.append("composite") or real(*a))
    window_attention(q[:, :, sub.rows], k, v, sub, backend="composite")
    assert calls == ["composite"]
    from kforcing_kernels.ops.window_attention import op

    # A registered backend without a row-subset plan (e.g. one added later) is refused by name, never ignored.
    monkeypatch.setattr(op, "ROW_SUBSET_BACKENDS", ("reference",))
    with pytest.raises(ValueError, match=r"^backend: 'composite' cannot run a QueryRowsLayout"):
        window_attention(q[:, :, sub.rows], k, v, sub, backend="composite")
    with pytest.raises(ValueError, match=r"^backend"):
        window_attention(q[:, :, sub.rows], k, v, sub, backend="nope")
    assert backends.REGISTRY is not None


def test_a_subset_of_no_rows_gives_empty_outputs():
    layout = ZOO["single_k3_odd"]
    q, k, v = _qkv(layout, torch.float32)
    out = window_attention(q[:, :, :0], k, v, layout.restrict_rows([]))
    assert out.shape == (2, 4, 0, 16)


# ---------------------------------------------------------------------- work accounting


def _area(layout, order, begin) -> int:
    rows_iv = layout.row_intervals(copy=False)
    return int(iv.tile_area(rows_iv, order, begin, direct_windows=iv.uses_direct_windows(layout)).sum())


def _parent_area_on(layout, rows) -> int:
    """The key area the full layout's C++ plan spends on ``rows``: each row's share of its tile's spans."""
    order, begin = (t.to(torch.int64) for t in layout.cpu_query_tiles)
    tile_of_row = torch.empty(layout.n_queries, dtype=torch.int64)
    tile_of_row[order] = torch.repeat_interleave(torch.arange(begin.numel() - 1), begin[1:] - begin[:-1])
    rv = layout.row_intervals(copy=False)
    direct = iv.uses_direct_windows(layout)
    walked = rv[:, :, :1] if direct else rv
    spans = iv.reduce_over_tiles(walked, tile_of_row, begin.numel() - 1)
    seen = walked[..., 1] > walked[..., 0]
    per_row = (seen * (spans[..., 1] - spans[..., 0])[:, tile_of_row]).sum(-1)
    if direct:
        per_row = per_row + (rv[:, :, 1:, 1] - rv[:, :, 1:, 0]).clamp(min=0).sum(-1)
    return int(per_row[:, rows].sum())


ACCOUNTING = {
    **{name: ZOO[name] for name in sorted(ZOO)},
    **{f"bench_{name}": layout for name, layout in zoo.bench(256, 4).items()},
}


@pytest.mark.parametrize("name", sorted(ACCOUNTING))
def test_subset_tiles_visit_at_most_115_percent_of_the_full_plans_area_on_their_rows(name):
    layout = ACCOUNTING[name]
    subsets = {f"rank{r}of{w}": rows for w in (2, 4) for r, rows in enumerate(balanced_split(layout, w).query_rows)}
    if layout.n_streams > 1:
        per = layout.n_queries // layout.n_streams
        subsets["last_stream"] = torch.arange(layout.n_queries - per, layout.n_queries)
    for label, rows in subsets.items():
        if rows.numel() == 0:  # a rank of a one-row layout
            continue
        sub = layout.restrict_rows(rows)
        order, begin = sub.cpu_query_tiles
        assert sorted(order.tolist()) == list(range(rows.numel())), label  # every row in exactly one tile
        assert int((begin[1:] - begin[:-1]).max()) <= iv.CPU_TILE_ROWS, label
        assert _area(sub, order, begin) <= 1.15 * _parent_area_on(layout, rows), (name, label)


def test_an_eagle3_step_fills_whole_tiles():
    # One slot per window: 16 rows from each parent tile at step 4; neighbouring windows share 64-row tiles.
    step = WindowLayout.eagle3_ttt(1024, 4)
    _, begin = step.cpu_query_tiles
    sizes = (begin[1:] - begin[:-1]).tolist()
    # Only the first windows (short context spans, where merging would double a tile's area) stay apart.
    assert sum(s for s in sizes if s == iv.CPU_TILE_ROWS) >= 0.8 * step.n_queries, sizes


def test_kforcing_backend_switch_is_honoured_or_refused_on_a_subset(monkeypatch):
    """KFORCING_BACKEND naming a backend with no row-subset plan (flex) is refused by name, not replaced."""
    layout = ZOO["single_k3_odd"]
    sub = layout.restrict_rows(torch.arange(1, layout.n_queries, 3))
    q, k, v = _qkv(layout, torch.float64)
    monkeypatch.setenv("KFORCING_BACKEND", "flex")
    with pytest.raises(ValueError, match=r"^KFORCING_BACKEND: 'flex' cannot run a QueryRowsLayout"):
        window_attention(q[:, :, sub.rows], k, v, sub)
    from kforcing_kernels.ops.window_attention import composite

    calls = []
    real = composite.forward
    monkeypatch.setattr(composite, "forward", lambda *a: calls.append("composite") or real(*a))
    monkeypatch.setenv("KFORCING_BACKEND", "composite")  # not the CPU default (cpp): the switch decides
    got = window_attention(q[:, :, sub.rows], k, v, sub)
    assert calls == ["composite"]
    want = window_attention(q, k, v, layout, backend="reference")[:, :, sub.rows]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

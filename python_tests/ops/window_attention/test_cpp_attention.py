"""The ``cpp`` backend (kforcing_kernels._C) vs the dense-mask reference: outputs and gradients."""

import pytest
import torch

from helpers.attention import assert_within_2x_torch_error, compare_with_reference, make_qkv, run_with_grads
from kforcing_kernels import WindowLayout, _extension, backends_available, window_attention
from kforcing_kernels.layouts import zoo

pytestmark = pytest.mark.skipif(
    backends_available()["cpp"] is not None, reason=f"cpp backend: {backends_available()['cpp']}"
)

LAYOUTS = zoo.small()


def _assert_close(ours, ref, atol, rtol):
    for label, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert torch.isfinite(a).all(), label
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, label=label: f"{label}: {m}")


def _other_isas():
    ext = _extension.load()
    return [name for name in ext.available_isas().split(",") if name != ext.isa()] if ext else []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cpp_matches_reference_fp32(name):
    ours, ref64, _ = compare_with_reference(LAYOUTS[name], "cpp")
    assert ours[0].dtype == torch.float32
    _assert_close(ours, ref64, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "name", ["causal", "single_k3_odd", "double_k9", "ptp_per_batch", "jacobi_long_window", "general_streams_full"]
)
@pytest.mark.parametrize("isa", _other_isas())
def test_cpp_other_isa_builds_match_reference(name, isa):
    """The narrower instruction-set builds of the kernels (picked on older CPUs) are exercised here too."""
    ext = _extension.load()
    before = ext.isa()
    ext.set_isa(isa)
    try:
        ours, ref64, _ = compare_with_reference(LAYOUTS[name], "cpp")
    finally:
        ext.set_isa(before)
    _assert_close(ours, ref64, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "name", ["single_k3_odd", "double_k9", "ptp_per_batch", "jacobi_long_window", "general_streams_full"]
)
def test_cpp_matches_reference_fp64(name):
    ours, ref64, _ = compare_with_reference(LAYOUTS[name], "cpp", dtype=torch.float64)
    assert ours[0].dtype == torch.float64
    _assert_close(ours, ref64, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name",
    ["single_k3_odd", "single_k16", "double_k2", "double_k9", "sbd_short_last", "ptp_per_batch", "jacobi_long_window"],
)
def test_cpp_low_precision_within_2x_torch_error(name, dtype):
    """Our error vs fp64 is at most 2x PyTorch's own low-precision error (plus a small floor)."""
    ours, ref64, ref_lp = compare_with_reference(LAYOUTS[name], "cpp", dtype=dtype)
    assert_within_2x_torch_error(ours, ref64, ref_lp, dtype)


@pytest.mark.parametrize("head_dim", [1, 24, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_cpp_head_dims_and_gqa(head_dim, heads, kv_heads):
    ours, ref64, _ = compare_with_reference(
        WindowLayout.kforcing_single(12, 4), "cpp", heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    _assert_close(ours, ref64, atol=3e-5, rtol=3e-5)


def test_cpp_lse_and_scale_match_reference():
    layout = LAYOUTS["double_k2"]
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, dtype=torch.float32, requires_grad=False)
    out, lse = window_attention(q, k, v, layout, backend="cpp", return_lse=True, scale=0.37)
    ref_out, ref_lse = window_attention(
        q.double(), k.double(), v.double(), layout, backend="reference", return_lse=True, scale=0.37
    )
    assert lse.shape == (2, 4, layout.n_queries) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


def test_cpp_forward_does_not_depend_on_thread_count():
    layout = LAYOUTS["single_multi_chunk"]
    q, k, v = make_qkv(layout, batch=1, heads=2, head_dim=32, requires_grad=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = window_attention(q, k, v, layout, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, window_attention(q, k, v, layout, backend="cpp"))


@pytest.mark.parametrize("batch,heads,kv_heads", [(0, 2, 2), (1, 0, 1)])
def test_cpp_empty_batch_or_heads(batch, heads, kv_heads):
    layout = LAYOUTS["single_k3_odd"]
    q = torch.randn(batch, heads, layout.n_queries, 8, requires_grad=True)
    k = torch.randn(batch, kv_heads, layout.n_keys, 8, requires_grad=True)
    out = window_attention(q, k, k, layout, backend="cpp")
    dq, dk = torch.autograd.grad(out.sum(), (q, k), allow_unused=True)
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape
    assert not bool(dk.any())


def test_cpp_large_logits_stay_finite():
    """Scores far from 0 (large q, k) must not overflow the online softmax."""
    layout = LAYOUTS["single_k3_odd"]
    q, k, v = make_qkv(layout, batch=1, heads=2, head_dim=16, scale_std=30.0)
    dout = torch.randn(1, 2, layout.n_queries, 16, dtype=torch.float64)
    ours = run_with_grads(lambda q, k, v: window_attention(q, k, v, layout, backend="cpp"), q, k, v, dout)
    ref = run_with_grads(
        lambda q, k, v: window_attention(q, k, v, layout, backend="reference"), *(t.double() for t in (q, k, v)), dout
    )
    for a, b in zip(ours, ref):
        assert torch.isfinite(a).all()
        # Scores ~ 30^2 * 16 / 4: fp32 rounding of q.k is amplified; compare relative to the gradient scale.
        assert (a.double() - b).abs().max() <= 2e-3 * (1 + b.abs().max())


# ---------------------------------------------------------------------- C++-side validation

_LAYOUT = WindowLayout.kforcing_single(5, 2)
_GEOM = dict(
    n_ctx=_LAYOUT.n_ctx,
    num_windows=_LAYOUT.num_windows,
    window_size=_LAYOUT.window_size,
    last_window_size=_LAYOUT.last_window_size,
    n_streams=_LAYOUT.n_streams,
    queries_all=True,
)


def _forward_args(**override):
    q, k, v = make_qkv(_LAYOUT, batch=1, heads=2, head_dim=8, requires_grad=False)
    row_order, tile_begin = _LAYOUT.cpu_query_tiles
    args = dict(
        q=q,
        k=k,
        v=v,
        row_intervals=_LAYOUT.row_intervals_int32,
        row_order=row_order,
        tile_begin=tile_begin,
        **_GEOM,
        scale=0.5,
    )
    args.update(override)
    return args


def _intervals_with(row, interval, lo, hi):
    iv = _LAYOUT.row_intervals_int32.clone()
    iv[0, row, interval] = torch.tensor([lo, hi], dtype=torch.int32)
    return iv


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(q=torch.randn(1, 2, 14, 8)), r"q: expected length 15 .* got 14"),
        (dict(q=torch.randn(1, 2, 15, 8, dtype=torch.float64)), r"k, v: expected dtype Double \(q's\), got k Float"),
        (
            dict(k=torch.randn(1, 3, 15, 8), v=torch.randn(1, 3, 15, 8)),
            r"q: expected a head count that is a multiple of k's 3",
        ),
        (dict(q=torch.randn(2, 2, 15, 8)), r"k: expected batch 2 \(q's\), got 1"),
        (dict(v=torch.randn(1, 2, 15, 4)), r"v: expected the shape of k"),
        (dict(q=torch.randn(1, 2, 15, 8, device="meta")), r"q: expected a CPU tensor, got device meta"),
        (
            dict(q=torch.randn(1, 2, 15, 8).to(torch.int32)),
            r"q: expected dtype float32, bfloat16, float16 or float64, got Int",
        ),
        (dict(row_intervals=_intervals_with(7, 0, 4, 2)), r"row_intervals: expected 0 <= lo <= hi <= 15, got \[4, 2\)"),
        (
            dict(row_intervals=_intervals_with(7, 1, 3, 16)),
            r"row_intervals: expected 0 <= lo <= hi <= 15, got \[3, 16\)",
        ),
        (
            dict(row_intervals=_LAYOUT.row_intervals_int32[:, :14]),
            r"row_intervals: expected shape \[1 or 1, 15, 2, 2\]",
        ),
        (dict(row_intervals=_LAYOUT.row_intervals_int32.long()), r"row_intervals: expected dtype int32, got Long"),
        (dict(row_order=_LAYOUT.cpu_query_tiles[0].long()), r"row_order: expected dtype int32, got Long"),
        (
            dict(row_order=_LAYOUT.cpu_query_tiles[0][:14]),
            r"row_order: expected length 15 \(the layout's queries\), got 14",
        ),
        (
            dict(row_order=torch.zeros(15, dtype=torch.int32)),
            r"row_order: expected each row once \(a permutation\), got row 0 again",
        ),
        (
            dict(row_order=torch.arange(1, 16, dtype=torch.int32)),
            r"row_order: expected rows in \[0, 15\), got 15 at index 14",
        ),
        (
            dict(tile_begin=torch.tensor([0, 14], dtype=torch.int32)),
            r"tile_begin: expected offsets from 0 to 15, got 0 \.\. 14",
        ),
        (
            dict(tile_begin=torch.tensor([0, 5, 5, 15], dtype=torch.int32)),
            r"tile_begin: expected increasing offsets \(non-empty tiles\)",
        ),
        (dict(tile_begin=torch.tensor([15], dtype=torch.int32)), r"tile_begin: expected at least 2 offsets"),
        (dict(tile_begin=torch.tensor([[0, 15]], dtype=torch.int32)), r"tile_begin: expected rank 1"),
        (dict(n_streams=3), r"n_streams: expected a divisor of window_size=2, got 3"),
        (dict(last_window_size=3), r"last_window_size: expected a value in \[1, 2\], got 3"),
        (dict(scale=-1.0), r"scale: expected a positive finite number, got -1"),
    ],
)
def test_cpp_validation_names_the_argument(override, match):
    with pytest.raises(ValueError, match=match):
        _extension.load().attention_forward(**_forward_args(**override))


def test_cpp_backward_validation():
    a = _forward_args()
    out, lse = _extension.load().attention_forward(**a)
    geom = {key: a[key] for key in ("row_intervals", "row_order", "tile_begin", *_GEOM, "scale")}
    with pytest.raises(ValueError, match=r"lse: expected shape \[1, 2, 15\] \(\[B, H, Lq\]\), got \[1, 2\]"):
        _extension.load().attention_backward(out, a["q"], a["k"], a["v"], out, lse[..., 0], **geom)
    with pytest.raises(ValueError, match=r"dout: expected shape \[1, 2, 15, 8\] \(q's\)"):
        _extension.load().attention_backward(out[:, :1], a["q"], a["k"], a["v"], out, lse, **geom)


def test_cpp_isa_selection():
    ext = _extension.load()
    assert ext.isa() in ext.available_isas().split(",")
    with pytest.raises(ValueError, match="isa: expected one of generic, avx2, avx512"):
        ext.set_isa("sse9")


def test_default_backend_prefers_cpp_only_with_a_vector_build():
    """The portable build is slower than composite (bench/attention/cpu_kernels.py), so it is not the default."""
    from kforcing_kernels import default_backend

    ext = _extension.load()
    before = ext.isa()
    try:
        ext.set_isa("generic")
        assert default_backend(torch.device("cpu")) == "composite"
        for isa in set(ext.available_isas().split(",")) - {"generic"}:
            ext.set_isa(isa)
            assert default_backend(torch.device("cpu")) == "cpp"
    finally:
        ext.set_isa(before)


# ---------------------------------------------------------------------- query tiles (from Python)


@pytest.mark.parametrize(
    "name", ["single_multi_chunk", "double_k9", "sbd_large_block", "jacobi_long_window", "ptp_per_batch"]
)
def test_cpu_query_tiles_policy(name):
    """What the kernels are given: a permutation of the rows, tiles of <= 64 rows, context and
    window rows never mixed, windows of w <= 64 whole (16 windows of k = 4 a tile)."""
    from kforcing_kernels.layouts.intervals import CPU_TILE_ROWS

    layout = LAYOUTS[name]
    order, begin = layout.cpu_query_tiles
    assert order.dtype == begin.dtype == torch.int32
    assert torch.equal(order.sort().values, torch.arange(layout.n_queries, dtype=torch.int32))
    sizes = begin.diff()
    assert (
        begin[0] == 0
        and begin[-1] == layout.n_queries
        and bool((sizes >= 1).all())
        and bool((sizes <= CPU_TILE_ROWS).all())
    )
    key_of_row = order.long() + layout.query_offset
    keys = layout.window_token_keys
    window_of_key = torch.full((layout.n_keys,), -1)
    window_of_key[keys[keys >= 0]] = torch.arange(layout.num_windows)[:, None].expand_as(keys)[keys >= 0]
    for t in range(begin.numel() - 1):
        win = window_of_key[key_of_row[begin[t] : begin[t + 1]]]
        assert bool((win < 0).all()) or bool((win >= 0).all()), f"tile {t} mixes context and window rows"
        if layout.window_size <= CPU_TILE_ROWS and bool((win >= 0).all()):
            for m in win.unique():  # whole windows
                assert int((win == m).sum()) == int((keys[m] >= 0).sum())
    assert layout.cpu_query_tiles[0] is order  # cached on the layout
    assert int(WindowLayout.kforcing_single(64, 4).cpu_query_tiles[1].diff()[-1]) == 64  # 16 windows of 4


@pytest.mark.parametrize("grouping", ["one_row_tiles", "reversed", "strided"])
def test_cpp_any_query_grouping_is_correct(grouping):
    """The grouping only decides which rows share products: any permutation and tiling gives the same attention."""
    layout = LAYOUTS["single_multi_chunk"]
    n = layout.n_queries
    if grouping == "one_row_tiles":
        order, begin = torch.arange(n), torch.arange(n + 1)
    elif grouping == "reversed":
        order, begin = torch.arange(n).flip(0), torch.tensor([0, 100, 101, n])
    else:
        order = torch.cat([torch.arange(s, n, 7) for s in range(7)])
        begin = torch.cat([torch.arange(0, n, 50), torch.tensor([n])])
    q, k, v = make_qkv(layout, batch=1, heads=2, head_dim=16, dtype=torch.float64, requires_grad=False)
    dout = torch.randn_like(q)
    args = (layout.row_intervals_int32, order.to(torch.int32), begin.to(torch.int32), *_geometry_of(layout), 0.25)
    out, lse = _extension.load().attention_forward(q, k, v, *args)
    grads = _extension.load().attention_backward(dout, q, k, v, out, lse, *args)
    ref = run_with_grads(
        lambda q, k, v: window_attention(q, k, v, layout, backend="reference", scale=0.25), q, k, v, dout
    )
    for a, b in zip((out, *grads), ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


def _geometry_of(layout):
    return (
        layout.n_ctx,
        layout.num_windows,
        layout.window_size,
        layout.last_window_size,
        layout.n_streams,
        layout.queries == "all",
    )

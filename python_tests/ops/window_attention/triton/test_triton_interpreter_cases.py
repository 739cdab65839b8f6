"""The fused Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1) against the reference backend.

Every case checks out, LSE and dq/dk/dv against the dense-mask reference (fp64),
that nothing is NaN, and, with the kernels instrumented, that exactly the tile
products and slot steps of the plan ran. fp32 and fp16 only: the Triton 3.9
interpreter's tl.dot is wrong for bf16 (bf16 is covered by the AOT compile).

Triton picks interpreter vs compiled when triton.language is first imported, so
this module only runs in a process started with TRITON_INTERPRET=1:
``test_triton_interpreter.py`` launches it that way (or run
``TRITON_INTERPRET=1 pytest python_tests/ops/window_attention/triton/test_triton_interpreter_cases.py``).
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_triton_interpreter.py", allow_module_level=True)
pytest.importorskip("triton")

from helpers.attention import make_qkv  # noqa: E402
from kforcing_kernels import WindowLayout, window_attention  # noqa: E402
from kforcing_kernels.ops.window_attention import reference  # noqa: E402
from kforcing_kernels.ops.window_attention.triton.configs import TILE_SETS  # noqa: E402
from kforcing_kernels.ops.window_attention.triton.plan import DEFAULT_TILES, Tiles, tile_plan  # noqa: E402
from kforcing_kernels.ops.window_attention.triton.steps import step_plan  # noqa: E402

SMALL = Tiles(16, 16, 16, 16)
MID = Tiles(32, 32, 16, 32)
# dK/dV programs that step through each query tile in 16-row steps (the H100 "wide" set's scheme).
STEPPED = Tiles(32, 16, 32, 16, block_m_dkdv=16)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, built for the interpreter."""
    from kforcing_kernels.ops.window_attention import triton as backend

    assert backend.available() is None
    module = backend.kernels()
    assert module.interpreting()
    return module


# ---------------------------------------------------------------------- the case matrix


def _cases():
    cases = []

    def add(name, layout, tiles):
        i = len(cases)
        # Cycle head dim, dtype and head layout (MHA, GQA, batch 2 + MHA) through the cases.
        d = (32, 64)[i % 2]
        dtype = (torch.float32, torch.float16)[(i // 2) % 2]
        batch, heads, kv_heads = ((1, 2, 2), (1, 2, 1), (2, 1, 1))[i % 3]
        if layout.batch_size:
            batch = layout.batch_size
        if tiles.block_n_dkdv > 32 and d == 32:
            d = 64  # wide dK/dV tiles are the D >= 64 sets' (they are never dispatched at D = 32)
        cases.append(
            pytest.param(
                layout,
                tiles,
                d,
                dtype,
                batch,
                heads,
                kv_heads,
                id=f"{name}-D{d}-{str(dtype)[6:]}-B{batch}H{heads}/{kv_heads}",
            )
        )

    # (N, k, tiles): every k at small N, a few at larger N (slot steps are the interpreter's slow part,
    # so long windows get larger slot blocks).
    grid = [(1, k, SMALL) for k in (1, 2, 3, 4, 8)] + [(17, k, SMALL) for k in (1, 2, 3, 4)]
    grid += [
        (17, 8, MID),
        (64, 2, MID),
        (64, 3, MID),
        (64, 8, DEFAULT_TILES),
        (130, 1, DEFAULT_TILES),
        (130, 4, DEFAULT_TILES),
    ]
    for n, k, tiles in grid:
        add(f"single-N{n}-k{k}", WindowLayout.kforcing_single(n, k), tiles)
        add(f"double-N{n}-k{k}", WindowLayout.kforcing_double(n, k), tiles)
    add("single-N130-k8", WindowLayout.kforcing_single(130, 8), DEFAULT_TILES)
    for n, block, tiles in (
        (1, 4, SMALL),
        (17, 2, SMALL),
        (17, 8, SMALL),
        (64, 3, MID),
        (130, 1, DEFAULT_TILES),
        (130, 8, MID),
    ):
        add(f"sbd-N{n}-b{block}", WindowLayout.sbd(n, block), tiles)
    add("ptp-shared", WindowLayout.ptp(40, [5, 17, 40, 22], 6, [0, 5, 30, 22]), SMALL)
    add("ptp-batched", WindowLayout.ptp(33, [[0, 12, 33], [7, 7, 30]], 5, [[0, 3, 20], [0, 7, 1]]), SMALL)
    add("ptp-long-batched", WindowLayout.ptp(30, [[10, 30], [4, 17]], 24, [[0, 12], [4, 2]]), MID)
    add("jacobi-slots", WindowLayout.jacobi(17, 8), SMALL)
    add("jacobi-long", WindowLayout.jacobi(64, 40), MID)
    add("jacobi-N1", WindowLayout.jacobi(1, 130), DEFAULT_TILES)
    for n, tiles in ((1, SMALL), (17, SMALL), (64, MID), (130, DEFAULT_TILES)):
        add(f"causal-N{n}", WindowLayout.causal(n), tiles)
    add("single-N64-k4-stepped", WindowLayout.kforcing_single(64, 4), STEPPED)
    add("double-N17-k3-stepped", WindowLayout.kforcing_double(17, 3), STEPPED)
    add("sbd-N64-b3-stepped", WindowLayout.sbd(64, 3), STEPPED)
    add("ptp-batched-stepped", WindowLayout.ptp(33, [[0, 12, 33], [7, 7, 30]], 5, [[0, 3, 20], [0, 7, 1]]), STEPPED)
    add("causal-N130-stepped", WindowLayout.causal(130), Tiles(64, 64, 64, 32, block_m_dkdv=16))
    # The shipped D=64 and wide tiles (64 / 128-key dK/dV programs; 32-row steps in the wide set).
    add("single-N130-k4-hopper64", WindowLayout.kforcing_single(130, 4), TILE_SETS["hopper"][64])
    add("double-N70-k2-hopper64", WindowLayout.kforcing_double(70, 2), TILE_SETS["hopper"][64])
    add("causal-N200-wide", WindowLayout.causal(200), TILE_SETS["wide"][128])
    add("double-N40-k8-wide", WindowLayout.kforcing_double(40, 8), TILE_SETS["wide"][128])
    add("single-N40-k2-wide", WindowLayout.kforcing_single(40, 2), TILE_SETS["wide"][128])  # slot steps inline
    add(
        "packed-single-hopper64",
        WindowLayout.kforcing_single(90, 2, cu_seqlens=[0, 30, 61, 90]),
        TILE_SETS["hopper"][64],
    )
    add(
        "packed-causal-per-batch-wide",
        WindowLayout.causal(150, cu_seqlens=[[0, 70, 150], [0, 33, 150]]),
        TILE_SETS["wide"][128],
    )
    # The D=128 candidate: 64-key dK/dV programs stepping 64 rows.
    add("double-N40-k8-wide-n64", WindowLayout.kforcing_double(40, 8), TILE_SETS["wide_n64"][128])
    add("single-N70-k2-wide-n64", WindowLayout.kforcing_single(70, 2), TILE_SETS["wide_n64"][128])
    general = {
        "empty-ranges": WindowLayout(12, 5, 3, [0, 4, 4, 0, 7], [0, 9, 4, 12, 7], last_window_size=2),
        "full-streams": WindowLayout(9, 4, 6, [0, 2, 3, 1], [3, 5, 9, 9], intra="full", queries="windows", n_streams=2),
        "long-streams": WindowLayout(20, 3, 40, [0, 5, 20], [10, 20, 20], queries="all", n_streams=2),
        "long-full-short-last": WindowLayout(11, 3, 37, [2, 0, 3], [9, 11, 3], last_window_size=5, intra="full"),
        "no-context": WindowLayout(0, 4, 5, [0, 0, 0, 0], [0, 0, 0, 0]),
        # The context start moves inside one query tile while the rows share keys (issue 40: a plan that marks
        # such a partly masked tile full skips its mask): a sliding-window context, per-slot sliding blocks.
        "sliding-context": WindowLayout(
            48,
            2,
            3,
            [5, 0],
            [30, 48],
            queries="all",
            context_lo=(torch.arange(48) - 20).clamp(min=0),
            context_hi=torch.arange(1, 49),
        ),
        "anchor-sliding-slot": WindowLayout.anchor_blocks(48, [20, 45], 16, window=21, window_mode="slot"),
    }
    for name, layout in general.items():
        add(f"general-{name}", layout, SMALL)
    return cases


def _reference(q, k, v, dout, layout, scale):
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(q, k, v, layout, scale)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out, lse, grads


def _expected_counts(plan, layout, tiles, batch, heads):
    per_bh = plan.tile_products().sum() * (heads if plan.bounds.shape[0] > 1 else batch * heads)
    slot = plan.slot_steps() * batch * heads
    # The window tiles run their rows' slot steps inline (forward, and the backward's dQ part).
    fwd_slot = plan.inline_slot_steps() * batch * heads
    # One dK/dV count per (key tile, row step, head).
    dkdv = step_plan(layout, plan).products().sum() * (heads if plan.key_ptr.shape[0] > 1 else batch * heads)
    return [int(per_bh), fwd_slot, int(per_bh), fwd_slot + slot, int(dkdv)]


@pytest.mark.parametrize("layout, tiles, d, dtype, batch, heads, kv_heads", _cases())
def test_matches_reference(kernels, layout, tiles, d, dtype, batch, heads, kv_heads):
    q, k, v = make_qkv(
        layout, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=dtype, requires_grad=False
    )
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    scale = d**-0.5
    counters = torch.zeros(len(kernels.COUNTER_NAMES), dtype=torch.int32)
    out, lse = kernels.attention_forward(q, k, v, layout, scale, tiles=tiles, counters=counters)
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, layout, scale, tiles=tiles, counters=counters)

    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, layout, scale)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    want = {"out": ref_out, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
    for name, t in got.items():
        assert bool(torch.isfinite(t).all()), f"{name} has non-finite values"
        assert t.dtype == (torch.float32 if name == "lse" else dtype)
        torch.testing.assert_close(t.double(), want[name], **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")
    plan = tile_plan(layout, tiles)
    assert counters.tolist() == _expected_counts(plan, layout, tiles, batch, heads), dict(
        zip(kernels.COUNTER_NAMES, counters.tolist())
    )


def test_step_loop_with_carried_entries_matches_reference(kernels):
    """The dK/dV step loop reads each step's table entry one item ahead (loop-carried, so Triton prefetches
    q/dO): over full and masked steps, a GQA group of 2 (consecutive items share an entry), short last steps
    and key tiles without full steps it runs every planned step once and matches the reference. Windows of
    6 > slot_window_max take tile products, so masked steps read intervals 0 and 1 from the carried entry."""
    layout = WindowLayout(37, 4, 6, [0, 9, 20, 37], [9, 20, 37, 37], last_window_size=3)
    tiles = Tiles(32, 16, 32, 16, block_m_dkdv=16, slot_window_max=4)
    assert sorted(set(step_plan(layout, tile_plan(layout, tiles)).entries[:, 2].tolist())) == [0, 1]
    q, k, v = make_qkv(layout, heads=4, kv_heads=2, head_dim=32, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).float()
    scale = 32**-0.5
    out, lse = kernels.attention_forward(q, k, v, layout, scale, tiles=tiles)
    counters = torch.zeros(len(kernels.COUNTER_NAMES), dtype=torch.int32)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, layout, scale, tiles=tiles, counters=counters)
    assert counters[4].item() == int(step_plan(layout, tile_plan(layout, tiles)).products().sum()) * 4
    _, _, want = _reference(q, k, v, dout, layout, scale)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(got.double(), ref, **TOL[torch.float32], msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------- work accounting at the contract's shape


@pytest.mark.parametrize("which", ["single", "double"])
def test_instrumented_forward_runs_the_planned_products_at_n1024_k4(kernels, which):
    """The kernels run exactly the tile products the work-accounting test counts (ratio <= 1.10 there)."""
    layout = (WindowLayout.kforcing_single if which == "single" else WindowLayout.kforcing_double)(1024, 4)
    q, k, v = make_qkv(layout, heads=1, head_dim=32, requires_grad=False)
    counters = torch.zeros(len(kernels.COUNTER_NAMES), dtype=torch.int32)
    out, _ = kernels.attention_forward(q, k, v, layout, 32**-0.5, counters=counters)
    plan = tile_plan(layout, DEFAULT_TILES)
    assert counters[0].item() == int(plan.tile_products()) == {"single": 680, "double": 1088}[which]
    # Window tiles x slots: 1024 windows of w = 4, 16 per 64-row tile; double: 2 streams, w = 8, 8 per tile.
    assert counters[1].item() == plan.inline_slot_steps() == {"single": 64 * 4, "double": 128 * 8}[which]
    assert plan.waste_ratio(layout.num_pairs()) <= 1.10
    # Spot-check the output on a few rows (the full reference is O(L^2) memory at this size).
    rows = torch.tensor([0, 1, layout.n_queries // 2, layout.n_queries - 1])
    mask = layout.dense_mask()[rows]
    s = (q[0, 0, rows].double() @ k[0, 0].double().T) * 32**-0.5
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[0, 0].double()
    torch.testing.assert_close(out[0, 0, rows].double(), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- the public op


@pytest.mark.parametrize("layout", [WindowLayout.kforcing_single(9, 2), WindowLayout.kforcing_double(7, 3)], ids=str)
def test_public_op_with_autograd(kernels, layout):
    q, k, v = make_qkv(layout, heads=2, kv_heads=1, head_dim=32)
    dout = torch.randn(q.shape, dtype=torch.float64).float()
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, layout, 32**-0.5)
    first = None
    for _ in range(2):  # the second call takes the op's cached eager path (op._eager_entry): the same bits
        out, lse = window_attention(q, k, v, layout, backend="triton", return_lse=True)
        got = (out, lse, *torch.autograd.grad(out, (q, k, v), dout))
        for a, want in zip(got, (ref_out, ref_lse, *ref_grads)):
            torch.testing.assert_close(a.double(), want, atol=1e-4, rtol=1e-4)
        assert first is None or all(torch.equal(a, b) for a, b in zip(got, first))
        first = got


def test_cpu_tensors_never_dispatch_to_triton_by_default(kernels):
    from kforcing_kernels import default_backend

    assert default_backend(torch.device("cpu")) != "triton"


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("d", [16, 48, 256])
def test_unsupported_head_dim_raises(kernels, d):
    layout = WindowLayout.kforcing_single(4, 2)
    q, k, v = make_qkv(layout, head_dim=d, requires_grad=False)
    with pytest.raises(ValueError, match=r"head dims \(32, 64, 128\)"):
        window_attention(q, k, v, layout, backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_unsupported_dtype_in_interpreter_raises(kernels, dtype):
    layout = WindowLayout.kforcing_single(4, 2)
    q, k, v = make_qkv(layout, head_dim=32, dtype=dtype, requires_grad=False)
    with pytest.raises(ValueError, match="q: the triton backend takes dtype"):
        window_attention(q, k, v, layout, backend="triton")


# ---------------------------------------------------------------------- row subsets (QueryRowsLayout)


def _subset_cases():
    from kforcing_kernels.parallel.balance import balanced_split

    single, double = WindowLayout.kforcing_single(40, 3), WindowLayout.kforcing_double(24, 2, cu_seqlens=[0, 9, 24])
    packed = WindowLayout.kforcing_single(30, 2, cu_seqlens=[[0, 30], [0, 11, 30]])
    return {
        "single-rank0of2": single.restrict_rows(balanced_split(single, 2).query_rows[0]),
        "double-packed-rank1of4": double.restrict_rows(balanced_split(double, 4).query_rows[1]),
        "double-packed-last-stream": double.restrict_rows(torch.arange(double.n_queries // 2, double.n_queries)),
        "single-per-batch-every-third": packed.restrict_rows(torch.arange(0, packed.n_queries, 3)),
        "eagle3-step3-packed-drop": WindowLayout.eagle3_ttt(
            40, 3, valid_lengths=[40, 31], drop_per_step=1, cu_seqlens=[0, 13, 40]
        ),
        "eagle3-step2-sliding": WindowLayout.eagle3_ttt(37, 2, window=8),
        "eagle3-step20": WindowLayout.eagle3_ttt(9, 20),  # windows of 20 slots: intra part as tile products
    }


SUBSETS = _subset_cases()


@pytest.mark.parametrize("tiles", [SMALL, MID], ids=["small", "mid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(SUBSETS))
def test_row_subsets_match_the_fp64_reference(kernels, monkeypatch, name, dtype, tiles):
    """A row subset (context-parallel rank, one stream, EAGLE-3 step) through the Triton kernels over its own
    tile-mode plan, forward and every gradient, against the reference on the subset in fp64; GQA."""
    layout = SUBSETS[name]
    batch = layout.range_batch or 2
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(batch, 2, layout.n_queries, 32, generator=g).to(dtype).requires_grad_()
    k = torch.randn(batch, 1, layout.n_keys, 32, generator=g).to(dtype).requires_grad_()
    v = torch.randn(batch, 1, layout.n_keys, 32, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(q.shape, generator=g).to(dtype)
    out, lse = kernels.attention_forward(q.detach(), k.detach(), v.detach(), layout, 32**-0.5, tiles=tiles)
    grads = kernels.attention_backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, layout, 32**-0.5, tiles=tiles
    )
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = window_attention(q64, k64, v64, layout, backend="reference", return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        finite = torch.isfinite(want)  # lse is -inf on rows that see nothing, on both sides
        assert torch.equal(finite, torch.isfinite(got.double())), label
        torch.testing.assert_close(got.double()[finite], want[finite], **TOL[dtype], msg=label)
    # The default backend choice and window_attention's own dispatch take the same kernels.
    got = window_attention(q, k, v, layout, backend="triton")
    torch.testing.assert_close(got.double(), ref_out, **TOL[dtype])


def test_row_subset_plan_covers_its_mask(kernels):
    """Every attended (row, key) pair of a subset lies in a tile product of its plan (and a full tile is full)."""
    layout = SUBSETS["double-packed-rank1of4"]
    plan = tile_plan(layout, SMALL)
    mask = layout.dense_mask()
    covered = torch.zeros_like(mask)
    full_ok = True
    for t, (q0, ql, _) in enumerate(plan.query_tiles.tolist()):
        for j in range(plan.bounds.shape[2]):
            key_start, n, f0, f1 = plan.bounds[0, t, j].tolist()
            for i in range(n):
                k0 = key_start + i * SMALL.block_n
                covered[q0 : q0 + ql, k0 : k0 + SMALL.block_n] = True
                if f0 <= i < f1:
                    full_ok &= bool(mask[q0 : q0 + ql, k0 : k0 + SMALL.block_n].all())
    assert bool(covered[mask].all()) and full_ok


def test_autocast_rule_holds_for_triton():
    """Issue 56 item 3 (test_autocast.py for the CPU backends): under fp16 autocast, fp32 inputs are cast at the op's
    entry: fp16 out, the bits of triton on hand-cast inputs, an fp16-class error against fp64."""
    layout = WindowLayout.kforcing_single(n_ctx=12, k=3)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, layout.n_queries, 32, generator=gen) for _ in range(3))
    with torch.autocast("cpu", torch.float16):
        out = window_attention(q, k, v, layout, backend="triton")
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out, window_attention(q.half(), k.half(), v.half(), layout, backend="triton"), atol=0, rtol=0
    )
    scores = (q.double() @ k.double().transpose(-1, -2)) / 32**0.5
    want = torch.softmax(scores.masked_fill(~layout.dense_mask(), float("-inf")), -1) @ v.double()
    assert 1e-5 < (out.double() - want).abs().max().item() < 1e-2

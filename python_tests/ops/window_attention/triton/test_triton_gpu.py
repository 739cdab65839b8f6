"""The compiled Triton backend on a real GPU (skipped without CUDA), and the GPU benchmark's CPU behaviour."""

import os

import pytest
import torch

from helpers import REPO
from helpers.attention import make_qkv
from kforcing_kernels import WindowLayout, default_backend, window_attention
from kforcing_kernels.ops.window_attention import reference

ROOT = str(REPO)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device (and compiled, not interpreted, Triton)",
)

LAYOUTS = {
    "single": WindowLayout.kforcing_single(300, 4),
    "double": WindowLayout.kforcing_double(257, 4),
    "sbd": WindowLayout.sbd(300, 7),
    "ptp": WindowLayout.ptp(200, [[20, 120, 200], [0, 50, 199]], 48, [[0, 100, 150], [0, 50, 3]]),
    "jacobi": WindowLayout.jacobi(100, 200),
    "causal": WindowLayout.causal(333),
    # A context start that moves inside one query tile while the rows share keys (issue 40): partly masked tiles.
    "sliding_context": WindowLayout(
        300,
        4,
        4,
        [0, 50, 100, 260],
        [40, 160, 300, 300],
        queries="all",
        context_lo=(torch.arange(300) - 100).clamp(min=0),
        context_hi=torch.arange(1, 301),
    ),
    "anchor_sliding_slot": WindowLayout.anchor_blocks(
        300, [[64, 200, 299], [17, 150, 250]], 16, window=70, window_mode="slot"
    ),
}


@needs_gpu
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_kernels_match_reference(name):
    """Every head dim and GPU dtype (bf16 is only checkable here: the interpreter's bf16 dot is wrong)."""
    layout = LAYOUTS[name]
    batch = layout.batch_size or 2
    for dtype in (torch.bfloat16, torch.float16):
        for d in (32, 64, 128):
            q, k, v = (
                t.detach().cuda().requires_grad_(True)
                for t in make_qkv(layout, batch=batch, heads=4, kv_heads=2, head_dim=d, dtype=dtype)
            )
            dout = torch.randn_like(q)
            out, lse = window_attention(q, k, v, layout, backend="triton", return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            ref_out, ref_lse = reference.attention(qr, kr, vr, layout, d**-0.5)
            ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())
            tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
            for what, got, want in zip(
                ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
            ):
                assert bool(torch.isfinite(got).all()), (dtype, d, what)
                torch.testing.assert_close(
                    got.double(), want, **tol, msg=lambda m, dtype=dtype, d=d, what=what: f"{dtype} D={d} {what}: {m}"
                )


@needs_gpu
def test_cuda_tensors_dispatch_to_triton():
    assert default_backend(torch.device("cuda")) == "triton" or os.environ.get("KFORCING_BACKEND")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU benchmark")
def test_gpu_benchmark_skips_cleanly_without_cuda(capsys):
    from bench.__main__ import run_command

    assert run_command("gpu", []) == 0
    out = capsys.readouterr().out
    assert "skipped, no CUDA device" in out and "TFLOP/s" not in out
    assert run_command("gpu", ["--list", "--n", "1024", "--k", "4", "--dim", "64"]) == 0
    assert "|M|=2634240" in capsys.readouterr().out  # SingleForward N=1024, k=4: ~5 x causal + intra


@pytest.mark.parametrize("name", ["bench_ab", "bench_single_d128", "bench_composite_dense"])
def test_gpu_tables_render_from_the_committed_h200_json(capsys, name):
    """The README's GPU tables are `--render` of bench/results/gpu-h200/gc/*.json (the H200 run of 6f25b35)."""
    from bench.__main__ import run_command

    path = os.path.join(ROOT, "bench", "results", "gpu-h200", "gc", f"{name}.json")
    assert run_command("gpu", ["--render", path]) == 0
    table = capsys.readouterr().out.strip()
    assert table.count("\n") >= 5  # header, rule, shapes
    with open(os.path.join(ROOT, "README.md")) as f:
        assert table in f.read()


def test_wide_dkdv_variants_swap_and_restore_the_tile_set():
    from bench.gpu import triton_gpu
    from kforcing_kernels.ops.window_attention.triton import configs as tk

    shipped = tk.TILE_SETS["wide"][128], list(tk.KERNEL_CONFIGS["bwd"][("wide", 128)])
    try:
        triton_gpu.use_wide_dkdv("64:32:8.1,8.2")
        assert (tk.TILE_SETS["wide"][128].block_n_dkdv, tk.TILE_SETS["wide"][128].block_m_dkdv) == (64, 32)
        assert tk.KERNEL_CONFIGS["bwd"][("wide", 128)] == [(8, 1), (8, 2)]
        triton_gpu.use_wide_dkdv(None)
        assert (tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["bwd"][("wide", 128)]) == shipped
    finally:
        tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["bwd"][("wide", 128)] = shipped


def test_gpu_benchmark_row_logic_on_cpu(monkeypatch):
    """bench_one's methods, FLOP accounting and failure capture, with the timer replaced (do_bench needs CUDA)."""
    from bench.__main__ import parse_command
    from bench.gpu import triton_gpu

    calls = []

    def fake_time(fn):
        fn()
        calls.append(fn)
        return 2.0  # ms

    monkeypatch.setattr(triton_gpu, "time_ms", fake_time)
    args = parse_command(
        "gpu",
        [
            "--n",
            "64",
            "--k",
            "2",
            "--dim",
            "32",
            "--heads",
            "2",
            "--device",
            "cpu",
            "--methods",
            "triton",
            "sdpa_flash_causal",
            "composite",
            "dense_sdpa",
        ],
    )
    row = triton_gpu.bench_one("single", 64, 2, 32, args, {})
    layout = WindowLayout.kforcing_single(64, 2)
    pairs = int(layout.num_pairs())
    assert row["pairs"] == pairs and set(row["results"]) == {"sdpa_flash_causal", "composite", "dense_sdpa"}
    want = 4.0 * pairs * 32 * 1 * 2 / 2.0 / 1e9
    assert row["results"]["composite"]["fwd_tflops"] == pytest.approx(want)
    assert row["results"]["dense_sdpa"]["fwd_bwd_tflops"] == pytest.approx(3.5 * want)
    lc = row["causal_equivalent_len"]
    assert abs(lc * (lc + 1) // 2 - pairs) <= lc  # the anchor does the same useful work
    assert "triton" in row["errors"]  # no CUDA and no interpreter here: reported, the sweep goes on
    assert len(calls) == 2 * 3


def _grads_vs_reference(layout, backend, dtype, d, device, heads=4, kv_heads=2):
    batch = layout.batch_size or 2
    q, k, v = (
        t.detach().to(device).requires_grad_(True)
        for t in make_qkv(layout, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=dtype)
    )
    dout = torch.randn_like(q)
    out = window_attention(q, k, v, layout, backend=backend)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref_out, _ = reference.attention(qr, kr, vr, layout, d**-0.5)
    want = (ref_out, *torch.autograd.grad(ref_out, (qr, kr, vr), dout.double()))
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.device == q.device and bool(torch.isfinite(a).all()), what
        torch.testing.assert_close(
            a.double(), b, atol=3e-2, rtol=3e-2, msg=lambda m, what=what: f"{backend} {what}: {m}"
        )
    return got


@needs_gpu
@pytest.mark.parametrize("tiles", ["base", "wide"])
def test_both_tile_sets_at_d128_are_right_and_bitwise_repeatable(tiles, monkeypatch):
    monkeypatch.setenv("KFORCING_TRITON_TILES", tiles)
    for name in ("single", "double", "sbd", "causal"):
        layout = LAYOUTS[name]
        _grads_vs_reference(layout, "triton", torch.bfloat16, 128, "cuda")
        q, k, v = (
            t.detach().cuda().requires_grad_(True)
            for t in make_qkv(
                layout, batch=layout.batch_size or 2, heads=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16
            )
        )
        dout = torch.randn_like(q)
        runs = []
        for _ in range(2):
            out = window_attention(q, k, v, layout, backend="triton")
            runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), name  # no atomics: a difference is a race


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_second_device_run_there():
    with torch.cuda.device(0):  # the current device differs from the tensors'
        _grads_vs_reference(LAYOUTS["single"], "triton", torch.bfloat16, 64, "cuda:1")
        _grads_vs_reference(LAYOUTS["sbd"], "composite", torch.bfloat16, 64, "cuda:1")


@needs_gpu
def test_side_stream_gets_its_own_plan_tensors():
    layout = LAYOUTS["double"]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _grads_vs_reference(layout, "triton", torch.bfloat16, 64, "cuda")
    side.synchronize()
    _grads_vs_reference(layout, "triton", torch.bfloat16, 64, "cuda")


@needs_gpu
def test_a_cuda_graph_replays_the_eager_step_and_a_cold_layout_is_refused_by_name():
    """window_attention + autograd.grad captured in a CUDA graph after a warm-up on a side stream (the plan's device
    copies are the warm-up's: no upload during capture, plan_device.device_copy) replays the eager bits; a layout
    no call has warmed up is refused naming the warm-up, instead of a host-to-device copy inside the capture."""
    layout = WindowLayout.kforcing_single(256, 4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(2, 4, layout.n_queries, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)
    )
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def step(lay=layout):
        out = window_attention(q, k, v, lay, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, autotune, the plan's copies
            eager = [t.clone() for t in step()]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static, eager):
        assert torch.equal(got, want)
    cold = WindowLayout(layout.n_ctx, layout.num_windows, 4, layout.prefix_hi // 2, layout.prefix_hi)  # another content
    with pytest.raises(RuntimeError) as info:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step(cold)
    messages = str(info.value) + str(info.value.__context__)
    assert "capturing a CUDA graph" in messages and "warm-up" in messages


@needs_gpu
@pytest.mark.parametrize("name", ["single", "double", "sbd", "ptp"])
def test_composite_cuda_path_matches_reference_with_fused_kernels(name):
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda

    for d in (64, 128):
        _grads_vs_reference(LAYOUTS[name], "composite", torch.bfloat16, d, "cuda")
    status = composite_cuda.status()
    assert status["sdpa_flash"] is None and status["sdpa_efficient"] is None, status
    assert status["disabled"] == {}, status["disabled"]


def test_gpu_check_bench_commands_parse(tmp_path):
    """bench/gpu/check.py's `python -m bench gpu` command lines parse (python_tests/bench/test_gpu_check.py parses
    every step's, and its dry run runs them all on CPU): the README table's grid with its baselines."""
    from bench.__main__ import parse_command
    from bench.gpu import check

    tables = 0
    for step in check.STEPS:
        if step.command != "gpu":
            continue
        args = parse_command("gpu", check.expand(step.argv, str(tmp_path))[3:])  # accepted, and what it asks
        # The README tables render from the A/B steps (issue 53): the full grid, every baseline beside ours.
        if os.path.basename(args.json) in ("ab_d64.json", "ab_d128.json"):
            assert (sorted(args.n), sorted(args.k)) == ([1024, 4096, 8192], [2, 4, 8])
            assert {"triton", "flex", "flex_backend", "sdpa_flash_causal", "dense_sdpa"} <= set(args.methods)
            tables += 1
    assert tables == 2


def test_training_step_bench_times_dense_ours_and_the_zero_cost_limit_on_cpu(monkeypatch):
    """The training-step rows (bench/gpu/triton_gpu.py --train-step) on the micro model with the timer
    replaced: three variants of one step, the ratios from their times, and a zero-cost variant that
    really runs no attention (while the others do). "Ours" is backend "cpp": without the C++ extension (a
    source-tree import, as on the H200 run) the test skips, naming why."""
    from bench.__main__ import parse_command
    from bench.gpu import triton_gpu
    from kforcing_kernels import backends_available
    from kforcing_kernels.model import gpt

    missing = backends_available()["cpp"]
    if missing is not None:
        pytest.skip(f"--train-ours cpp needs the C++ extension, not usable here: {missing}")

    calls = {"attention": 0}
    real = gpt.window_attention

    def counting(*args, **kwargs):
        calls["attention"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt, "window_attention", counting)
    seen = {}

    def fake_time(fn):
        before = calls["attention"]
        fn()
        seen[len(seen)] = calls["attention"] - before
        return {0: 40.0, 1: 10.0, 2: 8.0}[len(seen) - 1]  # dense, ours, zero

    monkeypatch.setattr(triton_gpu, "time_ms", fake_time)
    args = parse_command(
        "gpu",
        [
            "--train-step",
            "--n",
            "16",
            "--k",
            "1",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--train-preset",
            "micro",
            "--train-ours",
            "cpp",
        ],
    )
    (row,) = triton_gpu.train_step(args)
    assert (row["dense_ms"], row["ours_ms"], row["zero_ms"]) == (40.0, 10.0, 8.0)
    assert row["speedup"] == pytest.approx(4.0) and row["ours_vs_zero"] == pytest.approx(1.25)
    assert (row["teacher_k"], row["student_k"], row["n"], row["batch"]) == (1, 2, 16, 2)
    # dense replaces the op by masked SDPA, zero by nothing: only "ours" calls window_attention.
    assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0
    assert gpt.window_attention is counting  # every replacement undone

"""The ``flex`` backend (FlexAttention over the analytic BlockMask) and the measured CUDA dispatch table.

On CPU the flex backend runs eager ``flex_attention`` forward only; its forward is checked against the
float64 reference on every layout of the zoo, and its refusal of a backward is checked by name. Its
gradients come from FlexAttention's own autograd where FlexAttention has a backward (CUDA); with torch's CPU
guard lifted, that path runs here too (FlexAttention's eager math backward) and is checked against the
reference. The
dispatch table's format, provenance and the choice ``backend=None`` makes from it are checked with the
device capability replaced (no GPU needed).
"""

import json

import pytest
import torch

from helpers.attention import make_qkv
from kforcing_kernels import WindowLayout, backends_available, window_attention
from kforcing_kernels.layouts import zoo
from kforcing_kernels.ops.window_attention import backend_limits, dispatch, flex, op
from kforcing_kernels.ops.window_attention.backends import REGISTRY

ZOO = zoo.small()
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def test_backends_available_lists_flex_and_its_limit():
    assert backends_available()["flex"] is None  # torch has FlexAttention: usable (forward anywhere)
    assert "no backward on CPU" in backend_limits()["flex"]
    assert "cpp" not in backend_limits()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_flex_cpu_forward_equals_reference_on_the_zoo(name):
    layout = ZOO[name]
    q, k, v = make_qkv(
        layout, batch=layout.batch_size or 2, heads=4, kv_heads=2, head_dim=16, dtype=torch.float64, requires_grad=False
    )
    out, lse = window_attention(q, k, v, layout, backend="flex", scale=0.3, return_lse=True)
    want, want_lse = window_attention(q, k, v, layout, backend="reference", scale=0.3, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)  # -inf where a row sees nothing, in both


def test_flex_cpu_forward_in_fp32_with_grad_inputs_and_the_backward_refused_by_name():
    layout = ZOO["double_k2"]
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, head_dim=16, requires_grad=True)
    out = window_attention(q, k, v, layout, backend="flex")
    torch.testing.assert_close(out, window_attention(q, k, v, layout, backend="reference"), atol=2e-6, rtol=2e-6)
    with pytest.raises(RuntimeError, match="backend 'flex': FlexAttention has no backward on cpu"):
        out.sum().backward()


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """FlexAttention's own autograd on CPU: torch refuses CPU inputs that need grad (``_validate_device``), yet its
    eager backward (the dense math of ``sdpa_dense_backward``) runs there; lift that guard and let the backend
    treat CPU as a device with a backward, so the CUDA code path (``flex.differentiable``) runs here."""
    from torch.nn.attention import flex_attention as flex_module

    if not hasattr(flex_module, "_validate_device"):
        pytest.skip("this torch's FlexAttention has no _validate_device guard to lift")
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    monkeypatch.setattr(flex, "NO_BACKWARD_DEVICES", ())
    op.clear_eager_cache()  # an earlier CPU call's cached resolution (the op's Function) must not answer
    yield
    op.clear_eager_cache()


@pytest.mark.parametrize(
    "name", ["single_k3_odd", "double_k2", "sbd_short_last", "ptp_per_batch", "ptp_empty_prefixes"]
)
def test_flex_grads_come_from_flexattentions_own_autograd(flex_backward_on_cpu, name):
    """backend="flex" on a device with a FlexAttention backward: the output's grad_fn is FlexAttention's own
    (no recomputed forward), its grads equal the float64 reference's, and the LSE keeps its semantics
    (natural log, detached, -inf where a row sees nothing)."""
    layout = ZOO[name]
    q, k, v = make_qkv(layout, batch=layout.batch_size or 2, heads=4, kv_heads=2, head_dim=16, dtype=torch.float64)
    window_attention(q, k, v, layout, backend="flex", scale=0.3)  # a repeated call too (the op's eager cache)
    out, lse = window_attention(q, k, v, layout, backend="flex", scale=0.3, return_lse=True)
    assert "FlexAttention" in type(out.grad_fn).__name__, type(out.grad_fn).__name__
    assert not lse.requires_grad and lse.dtype == torch.float64
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_out, want_lse = window_attention(q, k, v, layout, backend="reference", scale=0.3, return_lse=True)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    for what, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, what=what: f"{what}: {m}")


def test_flex_without_its_own_backward_keeps_the_refusal_path(monkeypatch):
    """Where FlexAttention has no backward (CPU, as shipped) the op's Function runs the forward and refuses the
    backward by name; compiled calls and transforms always take the op's custom-op pair."""
    layout = ZOO["double_k2"]
    q, k, v = make_qkv(layout, batch=2, heads=4, kv_heads=2, head_dim=16)
    assert not flex.has_own_backward(q)
    out = window_attention(q, k, v, layout, backend="flex")
    assert "FlexAttention" not in type(out.grad_fn).__name__
    called = []
    monkeypatch.setattr(flex, "differentiable", lambda *a: called.append(a))
    window_attention(q, k, v, layout, backend="flex")
    assert not called


def test_flex_block_mask_is_built_once_per_layout_content():
    layout = WindowLayout.kforcing_single(40, 3)
    first = flex.block_mask(layout, "cpu")
    assert flex.block_mask(WindowLayout.kforcing_single(40, 3), "cpu") is first
    assert flex.block_mask(WindowLayout.kforcing_single(40, 4), "cpu") is not first
    assert torch.equal(first.to_dense(), layout.to_block_mask(flex.BLOCK_SIZE).to_dense())


def test_flex_kernel_backend_switch_is_checked(monkeypatch):
    monkeypatch.setenv("KFORCING_FLEX_BACKEND", "NOT_A_BACKEND")
    with pytest.raises(ValueError, match="KFORCING_FLEX_BACKEND"):
        flex.kernel_options()
    monkeypatch.setenv("KFORCING_FLEX_BACKEND", "TRITON")
    from torch.nn.attention import flex_attention as flex_module

    if hasattr(flex_module, "_Backend"):
        assert flex.kernel_options() == {"BACKEND": "TRITON"}


# ---------------------------------------------------------------------- the dispatch table

PROVENANCE = {
    "gpu": "NVIDIA H200",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "date": "2026-11-27T10:00:00Z",
    "command": "bash bench/gpu/gpu_check.sh",
}


def _row(backend="flex", capability="9.0", dim=128, bucket=1024, family="single", dtype="bfloat16"):
    return {
        "capability": capability,
        "dtype": dtype,
        "head_dim": dim,
        "length_bucket": bucket,
        "family": family,
        "backend": backend,
        "fwd_bwd_ms": {"triton": 1.3, "flex_backend": 1.1},
        "provenance": dict(PROVENANCE),
    }


def test_committed_table_is_valid_and_every_row_has_its_provenance():
    table = dispatch.load(dispatch.TABLE_PATH)
    for row in table["rows"]:
        assert all(row["provenance"][key] for key in dispatch.PROVENANCE_KEYS), row


def test_committed_table_holds_the_h200_rows_and_the_pending_d128_key():
    """The H200 run's rows (issue 47), with the commit they measured; D=128 N<=8192 waits for a re-measurement with
    backend="flex" on FlexAttention's own autograd, so it has no row and backend=None keeps the registry's choice."""
    table = dispatch.load(dispatch.TABLE_PATH)
    keys = {dispatch.row_key(row): row for row in table["rows"]}
    assert set(keys) == {
        ("9.0", "bfloat16", 64, 1024, "single"),
        ("9.0", "bfloat16", 64, 8192, "single"),
        ("9.0", "bfloat16", 128, 1024, "single"),
    }
    assert all(row["backend"] == "triton" and row["provenance"]["commit"] == "6f25b35" for row in keys.values())
    assert [dispatch.row_key(p) for p in table["pending"]] == [("9.0", "bfloat16", 128, 8192, "single")]
    settled = dispatch.merge(table, [_row(backend="triton", dim=128, bucket=8192)])
    assert settled["pending"] == [] and len(settled["rows"]) == 4


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda t: t.pop("format"), "format"),
        (lambda t: t["rows"][0].pop("provenance"), "missing"),
        (lambda t: t["rows"][0]["provenance"].pop("command"), "provenance"),
        (lambda t: t["rows"][0].update(family="diagonal"), "family"),
        (lambda t: t["rows"][0].update(length_bucket=1500), "length_bucket"),
        (lambda t: t["rows"][0].update(backend="cpp"), "backend"),
        (lambda t: t["rows"].append(_row()), "second row"),
        # Rows that could never match an input (issue 46): refused, not silently ignored.
        (lambda t: t["rows"][0].update(capability=9.0), r"rows\[0\]\.capability: expected \"major.minor\""),
        (lambda t: t["rows"][0].update(capability=[9, 0]), r"rows\[0\]\.capability"),
        (lambda t: t["rows"][0].update(capability="sm90"), r"rows\[0\]\.capability"),
        (lambda t: t["rows"][0].update(dtype="bf16"), r"rows\[0\]\.dtype: expected one of"),
        (lambda t: t["rows"][0].update(dtype="torch.bfloat16"), r"rows\[0\]\.dtype"),
        (lambda t: t["rows"][0].update(head_dim=True), r"rows\[0\]\.head_dim"),
        (
            lambda t: t["rows"][0].update(fwd_bwd_ms={"triton": 1.0, "flex_backend": float("nan")}),
            r"rows\[0\]\.fwd_bwd_ms",
        ),
        (lambda t: t["rows"].append(["9.0", "bfloat16"]), r"rows\[1\]: expected an object .*got a JSON array"),
        (lambda t: t["rows"].append("flex"), r"rows\[1\]: expected an object .*got a JSON string"),
    ],
)
def test_table_validation_names_the_bad_field(change, field):
    table = {"format": dispatch.FORMAT, "rows": [_row()]}
    dispatch.validate(table)
    change(table)
    with pytest.raises(ValueError, match=field):
        dispatch.validate(table)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"format": 1, "rows": [', "not valid JSON"),
        ("", "not valid JSON"),
        ('{"format": 1, "rows": [[1, 2]]}', r"rows\[0\]: expected an object"),
        ('{"format": 1, "rows": [' + json.dumps(_row(dtype="bf16")) + "]}", r"rows\[0\]\.dtype"),
    ],
)
def test_a_bad_table_named_by_the_environment_is_refused_naming_the_file(tmp_path, monkeypatch, text, message):
    """What a user meets: backend=None on a GPU reads KFORCING_DISPATCH_TABLE; a broken table is one clear error that
    names the file and the variable, never a bare JSONDecodeError or TypeError."""
    path = tmp_path / "table.json"
    path.write_text(text)
    monkeypatch.setenv("KFORCING_DISPATCH_TABLE", str(path))
    monkeypatch.delenv("KFORCING_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda index: (9, 0))
    dispatch.clear_cache()
    try:
        with pytest.raises(ValueError, match=message) as caught:
            _default(WindowLayout.kforcing_single(1024, 4))
        assert str(path) in str(caught.value) and "KFORCING_DISPATCH_TABLE" in str(caught.value)
        monkeypatch.setenv("KFORCING_DISPATCH_TABLE", str(tmp_path / "absent.json"))
        dispatch.clear_cache()
        with pytest.raises(FileNotFoundError, match="absent.json .KFORCING_DISPATCH_TABLE.: no such file"):
            _default(WindowLayout.kforcing_single(1024, 4))
    finally:
        dispatch.clear_cache()


def _bucket_oracle(n: int) -> int:
    """The bucket of context length n, computed independently: the next power of two, at least 1024."""
    return max(dispatch.SMALLEST_BUCKET, 1 << (n - 1).bit_length())


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_each_length_finds_its_own_buckets_row_at_every_boundary(order):
    """Adjacent buckets in one table, each with its own backend: every n at and around each boundary gets the row
    of its bucket, whichever order the rows are in (a boundary one step off reads n = 1024 as the 2048 bucket)."""
    buckets = [1024 << i for i in range(5)]
    rows = tuple(("9.0", "bfloat16", 128, b, "single", f"b{b}") for b in buckets)
    rows = rows if order == "ascending" else rows[::-1]
    for n in sorted({1, 2, 600} | {b + d for b in buckets for d in (-1, 0, 1)}):
        want = f"b{_bucket_oracle(n)}" if _bucket_oracle(n) <= buckets[-1] else None
        assert dispatch.length_bucket(n) == _bucket_oracle(n), n
        assert dispatch.choose(rows, "9.0", "bfloat16", 128, n, "single") == want, n
        assert [b for b in buckets if dispatch.in_bucket(n, b)] == ([_bucket_oracle(n)] if want else []), n


def test_a_lone_row_of_the_next_bucket_does_not_take_the_boundary_length(table_on_a_fake_h200):
    """Through the op: a table with only a 2048-bucket row leaves n_ctx = 1024 to the registry's default."""
    dispatch.write({"format": dispatch.FORMAT, "rows": [_row(bucket=2048)]}, table_on_a_fake_h200)
    dispatch.clear_cache()
    registry_default = REGISTRY.default(torch.device("cuda"), torch.bfloat16, 128)
    assert registry_default != "flex"
    assert _default(WindowLayout.kforcing_single(1024, 4)) == registry_default
    assert _default(WindowLayout.kforcing_single(1025, 4)) == "flex"
    assert _default(WindowLayout.kforcing_single(2048, 4)) == "flex"
    assert _default(WindowLayout.kforcing_single(2049, 4)) == registry_default


def test_lookups_of_several_dtypes_in_one_process_each_get_their_own_rows(table_on_a_fake_h200):
    """The rows are cached per dtype: a float16 lookup after a bfloat16 one (and back) gets the float16 rows, as a
    fresh process would (the oracle: the table filtered by hand)."""
    rows = [
        _row(dtype=dtype, dim=dim, backend=backend)
        for dtype, dim, backend in [
            ("bfloat16", 128, "flex"),
            ("float16", 64, "flex"),
            ("float16", 128, "triton"),
            ("float32", 32, "flex"),
        ]
    ]
    dispatch.write({"format": dispatch.FORMAT, "rows": rows}, table_on_a_fake_h200)
    dispatch.clear_cache()
    usable = lambda: {"flex", "triton"}  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float16, torch.bfloat16):
        want = {(r["dtype"], r["head_dim"], r["backend"]) for r in rows if r["dtype"] == dispatch.dtype_name(dtype)}
        got = {(dt, dim, backend) for _, dt, dim, _, _, backend in dispatch.measured_rows(0, dtype, usable)}
        assert got == want, dtype


def test_buckets_and_families():
    assert [dispatch.length_bucket(n) for n in (1, 1024, 1025, 4096, 5000)] == [1024, 1024, 2048, 4096, 8192]
    assert dispatch.in_bucket(600, 1024) and not dispatch.in_bucket(1025, 1024) and dispatch.in_bucket(1025, 2048)
    assert dispatch.layout_family(WindowLayout.kforcing_single(64, 4)) == "single"
    assert dispatch.layout_family(WindowLayout.kforcing_double(64, 4)) == "streams"
    assert dispatch.layout_family(WindowLayout.sbd(64, 4)) == "full"


@pytest.fixture
def table_on_a_fake_h200(tmp_path, monkeypatch):
    """A table with one flex row and one triton row, read through KFORCING_DISPATCH_TABLE, on a GPU reporting sm_90."""
    path = tmp_path / "table.json"
    dispatch.write({"format": dispatch.FORMAT, "rows": [_row(), _row(backend="triton", dim=64)]}, path)
    monkeypatch.setenv("KFORCING_DISPATCH_TABLE", str(path))
    monkeypatch.delenv("KFORCING_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda index: (9, 0))
    dispatch.clear_cache()
    yield path
    dispatch.clear_cache()


def _default(layout, dim=128, dtype=torch.bfloat16):
    return op.default_backend_for(torch.device("cuda", 0), dtype, dim, layout)


def test_backend_none_on_cuda_picks_the_tables_winner_and_falls_back(table_on_a_fake_h200, monkeypatch):
    registry_default = REGISTRY.default(torch.device("cuda"), torch.bfloat16, 128)  # triton where it is usable
    single_1024 = WindowLayout.kforcing_single(1024, 4)
    assert _default(single_1024) == "flex"  # the measured winner
    assert _default(WindowLayout.kforcing_single(300, 2)) == "flex"  # same bucket (N <= 1024), same family
    assert _default(WindowLayout.kforcing_single(2048, 4)) == registry_default  # another length bucket: no row
    assert _default(WindowLayout.kforcing_double(1024, 4)) == registry_default  # another family
    triton_usable = REGISTRY.load("triton")[1] is None  # a triton row counts only where triton runs
    assert _default(single_1024, dim=64) == (
        "triton" if triton_usable else REGISTRY.default(torch.device("cuda"), torch.bfloat16, 64)
    )
    assert _default(single_1024, dtype=torch.float16) == REGISTRY.default(torch.device("cuda"), torch.float16, 128)
    monkeypatch.setattr(dispatch, "device_capability", lambda index: (8, 0))
    dispatch.clear_cache()
    assert _default(single_1024) == registry_default  # another GPU: the table has nothing for it
    monkeypatch.setenv("KFORCING_BACKEND", "composite")
    assert _default(single_1024) == "composite"  # the environment still overrides


def test_a_row_whose_backend_is_absent_here_is_ignored(tmp_path, monkeypatch, table_on_a_fake_h200):
    dispatch.write({"format": dispatch.FORMAT, "rows": [_row()]}, table_on_a_fake_h200)
    dispatch.clear_cache()
    monkeypatch.setattr(flex, "available", lambda: "no flex_attention in this torch")
    assert _default(WindowLayout.kforcing_single(1024, 4)) == REGISTRY.default(
        torch.device("cuda"), torch.bfloat16, 128
    )


def test_gpu_check_writer_turns_measurements_into_rows_with_provenance(tmp_path):
    from bench.__main__ import run_command

    def result(ms):
        return {"fwd_ms": ms / 3, "fwd_bwd_ms": ms, "fwd_tflops": 1.0, "fwd_bwd_tflops": 1.0}

    def bench_row(n, k, dim, triton_ms, flex_ms, layout="single"):
        return {
            "layout": layout,
            "n": n,
            "k": k,
            "dim": dim,
            "errors": {},
            "results": {"triton": result(triton_ms), "flex_backend": result(flex_ms), "flex": result(0.1)},
        }

    report = {
        "machine": {
            "cuda": "NVIDIA H200",
            "torch": "2.11.0+cu130",
            "triton": "3.6.0",
            "timestamp": "2026-11-27T10:00:00Z",
        },
        "capability": "9.0",
        "command": "python -m bench gpu --n 1024 8192",
        "config": {"dry_run": False},
        "rows": [
            bench_row(1024, 2, 128, 2.0, 1.0),
            bench_row(1024, 4, 128, 2.0, 1.5),  # flex wins both
            bench_row(8192, 2, 128, 1.0, 2.0),
            bench_row(8192, 4, 128, 3.0, 2.0),  # split: triton
            bench_row(1024, 4, 64, 1.0, 2.0, layout="double"),
        ],
    }
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(report))
    out = tmp_path / "table.json"
    assert run_command("dispatch-table", [str(src), "--out", str(out), "--command", "bash bench/gpu/gpu_check.sh"]) == 0
    table = dispatch.load(out)
    got = {dispatch.row_key(r): r["backend"] for r in table["rows"]}
    assert got == {
        ("9.0", "bfloat16", 128, 1024, "single"): "flex",
        ("9.0", "bfloat16", 128, 8192, "single"): "triton",
        ("9.0", "bfloat16", 64, 1024, "streams"): "triton",
    }
    provenance = table["rows"][0]["provenance"]
    assert provenance["gpu"] == "NVIDIA H200" and provenance["command"].startswith(
        "bash bench/gpu/gpu_check.sh (python -m"
    )
    rows = tuple((*dispatch.row_key(r), r["backend"]) for r in table["rows"])
    assert dispatch.choose(rows, "9.0", "bfloat16", 128, 700, "single") == "flex"
    assert dispatch.choose(rows, "9.0", "bfloat16", 128, 5000, "single") == "triton"
    assert dispatch.choose(rows, "9.0", "bfloat16", 128, 2000, "single") is None

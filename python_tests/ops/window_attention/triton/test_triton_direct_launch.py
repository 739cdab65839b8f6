"""The Triton launchers' steady-state path (ops/window_attention/triton/direct.py) on CPU.

A real launch needs a GPU, so this checks what decides it: the switch, the key against Triton's own
specialisation (an independent oracle: ``native_specialize_impl`` through the JIT's binder), the
argument packing against the JIT's bound arguments, and, with bench/gpu/triton_stub_driver.py installed
as Triton's driver (kernels really compile for sm_90a; only the C launcher is stubbed), that a
direct launch hands the launcher exactly what the autotuner path hands it. On CUDA, direct and
autotuner launches give bitwise equal results.
"""

import gc
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kforcing_kernels.ops.window_attention.triton import direct, launch  # noqa: E402
from kforcing_kernels.tools import aot_report  # noqa: E402

ENV = "KFORCING_TRITON_DIRECT_LAUNCH"
compiled_kernels = pytest.mark.skipif(launch.interpreting(), reason="kernels were built for the interpreter")


@triton.jit(do_not_specialize=["n"])
def _scale_kernel(X, Y, n, stride, alpha, HEAD_DIM: tl.constexpr):  # HEAD_DIM: the autotuner key launch.py uses
    offs = tl.program_id(0) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    ok = offs < n
    tl.store(Y + offs * stride, tl.load(X + offs, mask=ok) * alpha, mask=ok)


def test_switch_parsing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert direct.direct_launch_enabled()
    for value, expected in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv(ENV, value)
        assert direct.direct_launch_enabled() is expected
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        direct.direct_launch_enabled()


def test_switches_follow_os_environ_at_once(monkeypatch):
    """env.py reads CPython's encoded environ dict instead of os.environ.get (per launch): every way of
    changing the variable through os.environ shows on the next call, and a replaced os.environ is read."""
    import os

    from kforcing_kernels import env
    from kforcing_kernels.ops.window_attention.triton import configs

    monkeypatch.setenv(ENV, "0")
    assert direct.direct_launch_enabled() is False
    os.environ[ENV] = "1"
    assert direct.direct_launch_enabled() is True
    os.environ[ENV] = "0"  # a new value object with the same text as two steps ago
    assert direct.direct_launch_enabled() is False
    del os.environ[ENV]
    assert direct.direct_launch_enabled() is True and env.triton_direct_launch() is None
    monkeypatch.setenv("KFORCING_TRITON_AUTOTUNE", "")  # empty: an error, not "unset"
    with pytest.raises(ValueError, match="KFORCING_TRITON_AUTOTUNE"):
        configs.autotune_enabled()
    monkeypatch.setattr(os, "environ", {ENV: "0", "KFORCING_TRITON_AUTOTUNE": "1"})  # not an os._Environ
    assert direct.direct_launch_enabled() is False and configs.autotune_enabled() is True


def test_trusted_plan_tables_are_int32_aligned_and_left_out_of_the_key():
    """The launchers' plan tables are passed for PLAN_POINTERS parameters only, and device_int32 makes
    each one int32 and 16-byte aligned (even from a misaligned view), so the key may skip them; every
    other tensor (here the caller's Counters and a misaligned q) still changes the key."""
    from kforcing_kernels.ops.window_attention.triton import plan_device
    from kforcing_kernels.ops.window_attention.triton.jit_common import PLAN_POINTERS

    misaligned = torch.arange(9, dtype=torch.int64)[1:]
    table = plan_device.device_int32(misaligned, torch.device("cpu"))
    assert table.dtype == torch.int32 and table.data_ptr() % 16 == 0 and table.tolist() == list(range(1, 9))
    fn = launch.KERNELS["fwd"]
    assert {p.name for p in fn.params if p.name in PLAN_POINTERS} == {
        "QueryTiles",
        "Bounds",
        "Order",
        "RowIv",
        "WindowKeys",
        "RowSlot0",
    }
    names = [p.name for p in fn.params if not p.is_constexpr]
    base = {
        name: (torch.zeros(8, dtype=torch.int32) if name in PLAN_POINTERS or name == "Counters" else torch.zeros(8))
        if name[0].isupper()
        else (0.5 if name in launch.FLOAT_ARGS else 32)
        for name in names
    }
    signer = direct.ArgSignature(fn, PLAN_POINTERS)
    key = signer(tuple(base.values()))
    other_table = dict(base, Bounds=torch.zeros(8, dtype=torch.int64)[1:])  # never passed: not checked
    assert signer(tuple(other_table.values())) == key
    for name, t in (
        ("Counters", torch.zeros(9, dtype=torch.int32)[1:]),
        ("Q", torch.zeros(9)[1:]),
        ("Q", torch.zeros(8, dtype=torch.float16)),
    ):
        assert signer(tuple(dict(base, **{name: t}).values())) != key, name
    untrusting = direct.ArgSignature(fn)
    assert untrusting(tuple(other_table.values())) != untrusting(tuple(base.values()))


def _triton_specialisation(fn, args, kwargs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    bound, specialization, _ = binder(*args, **kwargs)
    return bound, [tuple(s) for s in specialization]


@compiled_kernels
def test_signature_distinguishes_whatever_triton_specialises_on():
    """Equal keys must mean equal Triton specialisations (else a direct launch could run a kernel
    compiled for other arguments): checked over tensors of three dtypes, aligned or not, and ints at
    every boundary Triton uses, in a specialised (stride) and an unspecialised (n) parameter."""
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base.to(torch.float16), base.to(torch.bfloat16)[2:]]
    ints = [0, 1, 2, 16, 17, -16, 2**31 - 16, 2**31, 2**63, -(2**31) - 16]
    signer = direct.ArgSignature(_scale_kernel)
    by_key = {}
    for x, y, n, stride, alpha in itertools.product(tensors, tensors[:2], ints, ints, (0.5, 2)):
        args = (x, y, n, stride, alpha)
        key = signer(args)
        assert key is not None
        spec = _triton_specialisation(_scale_kernel, args, {"HEAD_DIM": 32})[1]
        assert by_key.setdefault(key, spec) == spec, args
    assert len(by_key) > 20  # the key is not trivially coarse... nor useless: many args share a key
    assert signer((base, base, 3, 16, 0.5)) == signer((base.clone(), base.clone(), 5, 32, 0.25))
    assert signer((base, base, 3, 16, "x")) is None  # an unhandled type: the autotuner path
    assert direct.ArgSignature(object())((base, 3)) is None  # not a JITFunction: never direct


@triton.jit(do_not_specialize=["n"])
def _interleaved_kernel(X, n, Y, stride, alpha, Z, HEAD_DIM: tl.constexpr):  # tensors apart: itemgetter plans
    offs = tl.program_id(0) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    ok = offs < n
    tl.store(Z + offs * stride, tl.load(X + offs, mask=ok) * alpha + tl.load(Y + offs, mask=ok), mask=ok)


@compiled_kernels
def test_signature_follows_changing_argument_types():
    """One signer reused across calls whose argument types change back and forth (it reuses the previous
    call's plan while the types are equal): equal keys still mean equal Triton specialisations, and a
    fresh signer gives the same key as the reused one."""
    base = torch.zeros(64, dtype=torch.float32)
    calls = [
        (base, 7, base, 16, 0.5, base),
        (base, 7, base, 16, 2, base),
        (base, 7, base[1:], 16, 0.5, base),
        (base, 2**31, base, 16, 0.5, base),
        (base, 7, base, 17, 0.5, base.half()),
        (base, 7, base, 1, 0.5, base),
        (base, 7, base, True, 0.5, base),
        (base, 7.0, base, 16, 0.5, base),
    ]
    signer = direct.ArgSignature(_interleaved_kernel)
    by_key = {}
    for args in calls + calls[::-1] + calls:
        key = signer(args)
        assert key[1:] == direct.ArgSignature(_interleaved_kernel)(args)[1:]
        spec = _triton_specialisation(_interleaved_kernel, args, {"HEAD_DIM": 32})[1]
        assert by_key.setdefault(key, spec) == spec, args
    assert len(by_key) == len(calls)  # each call differs from the first in something Triton specialises on


@compiled_kernels
@pytest.mark.parametrize("kernel_name", sorted(launch.KERNELS))
def test_packing_matches_the_jit_bound_arguments(kernel_name):
    """pack_tail puts the keyword constexprs where JITFunction.run's binder puts them, for every
    kernel the launchers call (positional arguments, then constexprs by keyword, as launch.py does)."""
    fn = launch.KERNELS[kernel_name]
    constexprs = aot_report._constexprs(kernel_name, 64)
    positional = [p.name for p in fn.params if not p.is_constexpr]
    assert fn.arg_names[: len(positional)] == positional  # constexprs come last in every kernel
    t = torch.zeros(16)
    args = tuple(t if name[0].isupper() else (0.5 if name in launch.FLOAT_ARGS else 7) for name in positional)
    kwargs = dict(reversed(list(constexprs.items())))  # keyword order must not matter
    tail = direct.pack_tail(fn, len(args), kwargs)
    bound, _ = _triton_specialisation(fn, args, kwargs)
    assert list(bound.values()) == [*args, *tail]
    assert direct.pack_tail(fn, len(args), {**kwargs, "extra": 1}) is None
    assert direct.pack_tail(fn, len(args) - 1, kwargs) is None


class _FakeCompiledKernel:
    function, packed_metadata = "function-handle", ("packed",)

    def __init__(self):
        self.calls = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, *call):  # CompiledKernel.run is a property returning the launcher
        self.calls.append(call)


def test_direct_launch_calls_the_launcher_like_jit_run(monkeypatch):
    """DirectLaunch passes (grid x3, stream, function, packed metadata, launch metadata, hooks, *args in
    parameter order), JITFunction.run's order in Triton 3.6 .. 3.9; metadata only with a hook."""
    from triton import knobs

    kernel = _FakeCompiledKernel()
    entry = direct.DirectLaunch(kernel, (64, True))
    entry((3, 5), ("q", 7, 0.5), stream=11)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    assert kernel.calls[-1] == (3, 5, 1, 11, "function-handle", ("packed",), None, enter, leave, "q", 7, 0.5, 64, True)
    hook = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hook, "calls", [lambda *a: None])  # a registered hook (a profiler) gets the metadata
    entry((3, 5), ("q",), stream=11)
    assert kernel.calls[-1][6] == ("metadata", (3, 5), 11)


@compiled_kernels
@pytest.mark.skipif(aot_report.tools_missing() is not None, reason=f"{aot_report.tools_missing()}")
@pytest.mark.parametrize("autotune", ["1", "0"])
def test_direct_launch_hands_the_launcher_what_the_autotuner_path_does(monkeypatch, autotune):
    from bench.gpu.triton_stub_driver import stub_driver

    monkeypatch.setitem(launch.KERNELS, "scale", _scale_kernel)
    monkeypatch.setitem(launch.KERNEL_CONFIGS, "scale", {("base", 64): [(4, 1), (2, 1)]})
    monkeypatch.setattr(launch, "_direct", direct.DirectCache())
    monkeypatch.setattr(launch, "_tuned", {})
    monkeypatch.setenv("KFORCING_TRITON_AUTOTUNE", autotune)
    jit_runs = []
    real_run = _scale_kernel.run
    monkeypatch.setattr(_scale_kernel, "run", lambda *a, **k: jit_runs.append(1) or real_run(*a, **k))
    x, y = torch.ones(100), torch.empty(300)
    tune_key = ("base", 64, 1024, "tile-full")
    records = []
    with stub_driver() as driver:
        driver.on_launch = lambda *launched: records.append(launched)

        def call(*args):
            before = len(jit_runs)
            launch._launch("scale", (4, 1), tune_key, *args, HEAD_DIM=32)
            return records[-1], len(jit_runs) - before

        monkeypatch.setenv(ENV, "1")
        first, through_jit = call(x, y, 100, 1, 0.5)
        assert through_jit >= 1 and len(launch._direct) == 1
        second, through_jit = call(x, y, 100, 1, 0.5)
        assert through_jit == 0 and second == first  # same grid, stream, function, arguments
        assert first[1] == (4, 1, 1) and first[4] == (x, y, 100, 1, 0.5, 32)
        other, through_jit = call(x, y, 99, 3, 0.5)  # stride 3: another specialisation, a new key
        assert through_jit == 1 and len(launch._direct) == 2 and other[4][2:4] == (99, 3)
        # Back and forth between the two keys (each kernel remembers its previous key): both direct.
        for args, expected in (((x, y, 100, 1, 0.5), first), ((x, y, 99, 3, 0.5), other), ((x, y, 100, 1, 0.5), first)):
            again, through_jit = call(*args)
            assert through_jit == 0 and again == expected
        monkeypatch.setenv(ENV, "0")
        slow, through_jit = call(x, y, 100, 1, 0.5)
        assert through_jit == 1 and slow == first
        # Free the stub-loaded kernels while the stub is Triton's driver (3.9 unloads them through it).
        records.clear()
        launch._direct.clear()
        _scale_kernel.device_caches.clear()
        gc.collect()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_direct_and_autotuner_launches_agree_bitwise(monkeypatch):
    from kforcing_kernels import WindowLayout

    monkeypatch.setenv("KFORCING_TRITON_AUTOTUNE", "0")
    layout = WindowLayout.kforcing_single(300, 4)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(rows):
        return torch.randn(2, 4, rows, 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = make(layout.n_queries), make(layout.n_keys), make(layout.n_keys)
    dout = make(layout.n_queries)
    results = {}
    for value in ("0", "1", "1"):  # the second "1" runs on the direct path
        monkeypatch.setenv(ENV, value)
        out, lse = launch.attention_forward(q, k, v, layout, 0.125)
        grads = launch.attention_backward(dout, q, k, v, out, lse, layout, 0.125)
        results[value] = (out, lse, *grads)
    for a, b in zip(results["0"], results["1"]):
        assert torch.equal(a, b)

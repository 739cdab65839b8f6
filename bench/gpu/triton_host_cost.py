"""Host time of the Triton backend's forward + backward per call, with GPU launches stubbed (CPU only).

    python -m bench host-cost                                  # paper shape B=4 H=12 N=1024 k=4 D=64
    python -m bench host-cost --reps 3000 --json out.json
    python -m bench host-cost --direct 0 --autotune 1          # one mode only
    python -m bench host-cost --direct 1 --autotune 1 --op 1   # + the whole op against a trivial autograd.Function

Triton's active driver is replaced by ``bench/gpu/triton_stub_driver.py``'s: kernels really compile
(sm_90a by default, on the first call; Triton caches them on disk), and Triton's autotuner, the JIT's
argument binding and specialisation, ``CompiledKernel`` and ``launch.py`` all run as on a GPU; only
the C launcher (argument unpacking + ``cuLaunchKernel``, a few us per launch on a GPU), module
loading and device/stream queries are stubbed, and the tensors are CPU tensors. So the numbers are
the Python host path per call; a GPU adds the launcher's own cost and ``torch.cuda.device``.

Per mode (autotune on/off x direct launch on/off where ``launch.py`` has the switch
KFORCING_TRITON_DIRECT_LAUNCH), over ``--reps`` calls of one ``attention_forward`` +
``attention_backward`` (the triton backend's work for one training step of one attention layer):
its median wall time and its CPU time (this thread's ``thread_time``, which a busy machine does not
inflate by preempting the process; the number to compare across runs), the kernel launches in it,
and the time spent inside ``launch._launch`` during those steps (median per step, divided by the
launches: the per-launch cost, without plan lookups and allocations; per kernel too). Timed inside
real steps, not one call replayed in a hot loop, which reads about half as much because everything
stays in the CPU's caches.

With ``--op 1`` (the default) each mode also times the whole eager op, ``window_attention(backend="triton")``
+ ``autograd.grad``, against a trivial ``autograd.Function`` with the same inputs, outputs and saved tensors
(no work): the op's Python on top of autograd's own floor, as a ratio (both interleaved, so a busy
machine slows both alike; ratios within one run are what compare across machines).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

from kforcing_kernels.app.cli import add_batch_size

from .triton_stub_driver import stub_driver

DIRECT_ENV = "KFORCING_TRITON_DIRECT_LAUNCH"
AUTOTUNE_ENV = "KFORCING_TRITON_AUTOTUNE"


def _timer_floor(clock) -> int:
    """What an empty interval of ``clock`` reads (ns), subtracted from every per-launch interval."""
    gaps = []
    for _ in range(2000):
        t0 = clock()
        gaps.append(clock() - t0)
    return int(statistics.median(gaps))


def measure(launch, layout, batch: int, heads: int, dim: int, dtype: torch.dtype, reps: int, driver) -> dict:
    """One mode (the environment is already set): fwd+bwd per step and per launch, wall and CPU time."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, layout.n_queries, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads, layout.n_keys, dim, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn_like(q)
    scale = dim**-0.5

    def step():
        out, lse = launch.attention_forward(q, k, v, layout, scale)
        launch.attention_backward(dout, q, k, v, out, lse, layout, scale)

    t0 = time.perf_counter()
    step()  # compiles (or loads from Triton's cache) and autotunes
    first_s = time.perf_counter() - t0
    for _ in range(100):  # warm: every cache filled, the direct-launch entries made
        step()
    gc.collect()  # not inside the timing: the compile's garbage is the first call's, not a step's
    before = driver.launches
    step()
    launches = driver.launches - before

    # Whole steps: wall time per step; CPU time of this thread (what a busy machine does not inflate
    # by preempting us) per batch of 10 steps, so the clock's own cost is negligible.
    wall, cpu = [], []
    for _ in range(max(1, reps // 10)):
        c0 = time.thread_time_ns()
        for _ in range(10):
            t0 = time.perf_counter_ns()
            step()
            wall.append(time.perf_counter_ns() - t0)
        cpu.append((time.thread_time_ns() - c0) / 10)

    # Per launch: the time inside each launch._launch call during real steps (warm as in training,
    # not one call replayed in a hot loop, which reads about half as much), less the clocks' floor.
    floors = _timer_floor(time.perf_counter_ns), _timer_floor(time.thread_time_ns)
    per_kernel: dict[str, list[int]] = {}
    inside: list[list[int]] = []
    real_launch = launch._launch

    def timed(kernel_name, grid, *args, **kwargs):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        real_launch(kernel_name, grid, *args, **kwargs)
        spent = time.perf_counter_ns() - t0 - floors[0], time.thread_time_ns() - c0 - floors[1]
        if grid[0] * grid[1]:  # an empty grid returns before launching
            inside[-1][0] += spent[0]
            inside[-1][1] += spent[1]
            per_kernel.setdefault(kernel_name, []).append(spent[1])

    launch._launch = timed
    try:
        for _ in range(reps):
            inside.append([0, 0])
            step()
    finally:
        launch._launch = real_launch
    per_step_wall = statistics.median(w for w, _ in inside) / 1e3
    per_step_cpu = statistics.median(c for _, c in inside) / 1e3
    n = max(1, launches)
    return {
        "step_us": statistics.median(wall) / 1e3,
        "step_cpu_us": statistics.median(cpu) / 1e3,
        "launches_per_step": launches,
        "first_call_s": first_s,
        "us_per_launch": per_step_wall / n,
        "cpu_us_per_launch": per_step_cpu / n,
        "per_kernel_cpu_us": {name: statistics.median(ts) / 1e3 for name, ts in per_kernel.items()},
    }


class TrivialAttention(torch.autograd.Function):
    """The floor of any autograd.Function for this op: the same inputs, outputs and saved tensors as
    window_attention's eager Function, no work (empty outputs and gradients)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def triton_op_on_cpu():
    """window_attention(backend="triton") on CPU tensors under the stub driver: the backend reports itself
    available (it needs a GPU or the interpreter otherwise); the op's and the launchers' caches, which then
    hold stubbed launches, are emptied on the way out."""
    from kforcing_kernels.ops.window_attention import op
    from kforcing_kernels.ops.window_attention import triton as backend
    from kforcing_kernels.ops.window_attention.triton import launch

    available = backend.available
    backend.available = lambda: None
    try:
        yield
    finally:
        backend.available = available
        op.clear_eager_cache()
        launch.clear_host_states()


def measure_op(layout, batch: int, heads: int, dim: int, dtype: torch.dtype, rounds: int) -> dict:
    """``window_attention(backend="triton")`` + ``autograd.grad`` per call against :class:`TrivialAttention`
    on the same tensors: CPU time (this thread) per call, the two interleaved in rounds of 10 calls each so a
    busy machine slows both alike; medians over the rounds and the median of the per-round ratios."""
    from kforcing_kernels import window_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, layout.n_queries, dim, generator=gen).to(dtype).requires_grad_(True)
    k, v = (
        torch.randn(batch, heads, layout.n_keys, dim, generator=gen).to(dtype).requires_grad_(True) for _ in range(2)
    )
    dout = torch.randn_like(q)
    inputs = (q, k, v)

    def ours():
        torch.autograd.grad(window_attention(q, k, v, layout, backend="triton"), inputs, dout)

    def trivial():
        torch.autograd.grad(TrivialAttention.apply(q, k, v)[0], inputs, dout)

    for _ in range(100):  # compile / load, autotune, every cache filled
        ours()
        trivial()
    gc.collect()
    times: dict[str, list[float]] = {"op": [], "trivial": []}
    for _ in range(max(1, rounds)):
        for name, fn in (("op", ours), ("trivial", trivial)):
            c0 = time.thread_time_ns()
            for _ in range(10):
                fn()
            times[name].append((time.thread_time_ns() - c0) / 10 / 1e3)
    ratios = [a / b for a, b in zip(times["op"], times["trivial"])]
    return {
        "op_cpu_us": statistics.median(times["op"]),
        "trivial_cpu_us": statistics.median(times["trivial"]),
        "op_vs_trivial": statistics.median(ratios),
        "op_cpu_us_min": min(times["op"]),
        "trivial_cpu_us_min": min(times["trivial"]),
        "rounds": len(ratios),
    }


def format_op(result: dict) -> str:
    return (
        f"  window_attention(backend='triton') + autograd.grad: {result['op_cpu_us']:.0f} us CPU (best round "
        f"{result['op_cpu_us_min']:.0f}) vs a trivial autograd.Function {result['trivial_cpu_us']:.0f} us "
        f"(best {result['trivial_cpu_us_min']:.0f}): {result['op_vs_trivial']:.2f}x (median of "
        f"{result['rounds']} interleaved rounds)"
    )


def run(args) -> dict:
    import triton

    from kforcing_kernels.layouts import zoo

    os.environ.pop("TRITON_INTERPRET", None)
    layout = zoo.BENCH_FAMILIES[args.layout](args.n, args.k)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    saved = {name: os.environ.get(name) for name in (DIRECT_ENV, AUTOTUNE_ENV)}
    modes = []
    with stub_driver(args.capability) as driver:
        from kforcing_kernels.ops.window_attention.triton import launch

        has_switch = hasattr(launch, "direct_launch_enabled")
        directs = [d for d in (["1", "0"] if args.direct == "both" else [args.direct])] if has_switch else [None]
        autotunes = ["1", "0"] if args.autotune == "both" else [args.autotune]
        try:
            for autotune in autotunes:
                for direct in directs:
                    os.environ[AUTOTUNE_ENV] = autotune
                    if direct is None:
                        os.environ.pop(DIRECT_ENV, None)
                    else:
                        os.environ[DIRECT_ENV] = direct
                    result = measure(launch, layout, args.batch_size, args.heads, args.dim, dtype, args.reps, driver)
                    if args.op:
                        with triton_op_on_cpu():
                            result["op"] = measure_op(
                                layout, args.batch_size, args.heads, args.dim, dtype, args.reps // 10
                            )
                    modes.append(
                        {
                            "autotune": autotune == "1",
                            "direct_launch": None if direct is None else direct == "1",
                            **result,
                        }
                    )
                    if not args.quiet:
                        print(format_mode(modes[-1]), flush=True)
                        if args.op:
                            print(format_op(result["op"]), flush=True)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return {
        "config": {
            "layout": args.layout,
            "n": args.n,
            "k": args.k,
            "batch": args.batch_size,
            "heads": args.heads,
            "dim": args.dim,
            "dtype": args.dtype,
            "reps": args.reps,
            "target": f"sm_{args.capability}",
            "triton": triton.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "launch_has_direct_switch": has_switch,
        },
        "modes": modes,
    }


def format_mode(mode: dict) -> str:
    direct = {None: "n/a (no switch)", True: "on", False: "off"}[mode["direct_launch"]]
    kernels = ", ".join(f"{name} {us:.1f}" for name, us in mode["per_kernel_cpu_us"].items())
    return (
        f"autotune {'on' if mode['autotune'] else 'off'}, direct launch {direct}: fwd+bwd {mode['step_us']:.0f} us "
        f"wall / {mode['step_cpu_us']:.0f} us CPU, {mode['launches_per_step']} launches; per launch "
        f"{mode['us_per_launch']:.1f} us wall / {mode['cpu_us_per_launch']:.1f} us CPU (CPU per kernel: {kernels})"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default="single", help="a bench layout family (kforcing_kernels/layouts/zoo.py)")
    p.add_argument("--n", type=int, default=1024, help="context length N")
    p.add_argument("--k", type=int, default=4, help="window k")
    add_batch_size(p, 4)
    p.add_argument("--heads", type=int, default=12, help="query heads")
    p.add_argument("--dim", type=int, default=64, help="head dim D")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="q/k/v dtype")
    p.add_argument("--reps", type=int, default=2000, help="timed calls per median")
    p.add_argument("--capability", type=int, default=90, help="compile target, e.g. 90 (sm_90a) or 80")
    p.add_argument("--autotune", choices=("1", "0", "both"), default="both", help="KFORCING_TRITON_AUTOTUNE")
    p.add_argument(
        "--direct",
        choices=("1", "0", "both"),
        default="both",
        help=f"{DIRECT_ENV} (ignored when launch.py has no such switch)",
    )
    p.add_argument(
        "--op",
        type=int,
        choices=(0, 1),
        default=1,
        help="also time window_attention(backend='triton') + autograd.grad against a trivial "
        "autograd.Function on the same tensors (1: yes)",
    )
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--quiet", action="store_true", help="no per-mode lines")


def execute(args) -> int:
    if args.layout not in __import__("kforcing_kernels.layouts.zoo", fromlist=["zoo"]).BENCH_FAMILIES:
        print(f"host-cost: --layout: unknown family {args.layout!r}", file=sys.stderr)
        return 2
    report = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0

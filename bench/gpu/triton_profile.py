"""Where a Triton fwd+bwd spends its time: per-kernel GPU time and the host's launch time.

    python -m bench profile --layout single --n 1024 8192 --k 4 --dim 128   # CUDA only
    python -m bench profile --variants bench/gpu/gpu_variants.txt --methods triton flex_backend  # every variant

For each shape: the GPU time of every kernel in one forward + backward (torch.profiler,
averaged over ``--reps`` steps after a warm-up that compiles and autotunes), their sum
against the wall time of a synchronised step, and the host time to enqueue one step
(no sync): when the enqueue time is close to the wall time, the step is launch-bound and
bigger kernels will not help; when the kernel sum is, the kernels are the place to work.

Each kernel's time is also summed per part (``parts_ms``): ``fwd``, ``delta``, ``bwd_fused`` (the fused
backward: dQ and dK/dV programs in one launch, which a profiler cannot split; ``bench/gpu/bwd_registers.py``
compiles each kind alone), FlexAttention's ``flex_fwd`` / ``flex_bwd``, and ``other`` (copies, fills).
``--variants FILE`` profiles every triton variant of bench/gpu/gpu_variants.txt too (``triton[NAME]``),
``--methods flex_backend`` the flex backend;
``--dry-run`` runs the same code on CPU (Triton interpreter, fp32, tiny shapes; CPU profiler events,
so the parts say only that the path ran).
"""

from __future__ import annotations

import collections
import time

import torch

from kforcing_kernels import window_attention
from kforcing_kernels.app.cli import add_batch_size, positive_int

from .._cli import write_json
from ..attention import peers as attention

# Kernel-name fragments -> part, first match wins (names from triton/jit_*.py and inductor's flex templates).
PARTS = (
    ("_delta", "delta"),
    ("_bwd_kernel", "bwd_fused"),
    ("_fwd", "fwd"),
    ("flex_attention_backward", "flex_bwd"),
    ("flex_attention", "flex_fwd"),
)


def part_of(kernel_name: str) -> str:
    for fragment, part in PARTS:
        if fragment in kernel_name:
            return part
    return "other"


def profile_one(
    layout_name: str,
    n: int,
    k: int,
    d: int,
    batch: int,
    heads: int,
    reps: int,
    method: str = "triton",
    assignments: dict | None = None,
    dry_run: bool = False,
) -> dict:
    from .gpu_variants import triton_switches

    layout = attention.LAYOUTS[layout_name](n, k)
    dev, dt = (torch.device("cpu"), torch.float32) if dry_run else (torch.device("cuda"), torch.bfloat16)
    backend = "flex" if method == "flex_backend" else "triton"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    q = torch.randn(batch, heads, layout.n_queries, d, device=dev, dtype=dt, requires_grad=True)
    kk, v = (torch.randn(batch, heads, layout.n_keys, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        if dev.type == "cpu" and backend == "flex":  # FlexAttention has no CPU backward: forward only
            with torch.no_grad():
                window_attention(q, kk, v, layout, backend=backend)
            return
        out = window_attention(q, kk, v, layout, backend=backend)
        torch.autograd.grad(out, (q, kk, v), dout)

    # The dry run calls each piece once: the profiled call (interpreter steps take seconds).
    warmups, timed, reps = (0, 0, 1) if dry_run else (3, reps, reps)
    activity = torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    device_type = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else torch.autograd.DeviceType.CPU
    # The variant's switches are set once around every call, never inside a timed step (setting them costs
    # host time and empties the launchers' cached host state per call).
    with triton_switches(extra=assignments):
        for _ in range(warmups):  # compile, autotune, caches
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(timed):
            step()
        enqueue_ms = (time.perf_counter() - t0) * 1e3 / max(timed, 1)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / max(timed, 1)
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(reps):
                step()
            sync()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == device_type:
            per_kernel[ev.name] += (ev.device_time if dev.type == "cuda" else ev.cpu_time) / 1e3 / reps  # ms/step
    kernels = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    parts: dict[str, float] = collections.defaultdict(float)
    for name, ms in kernels.items():
        parts[part_of(name)] += ms
    return {
        "layout": layout_name,
        "n": n,
        "k": k,
        "dim": d,
        "batch": batch,
        "heads": heads,
        "method": method,
        "variant": assignments or {},
        "wall_ms": wall_ms,
        "enqueue_ms": enqueue_ms,
        "kernel_sum_ms": sum(kernels.values()),
        "parts_ms": dict(parts),
        "kernels_ms": kernels,
    }


def add_arguments(p) -> None:
    p.add_argument(
        "--layout", nargs="+", choices=sorted(attention.LAYOUTS), default=["single"], help="attention layouts"
    )
    p.add_argument("--n", type=positive_int, nargs="+", default=[1024, 8192], help="context lengths N")
    p.add_argument("--k", type=positive_int, nargs="+", default=[4], help="windows k")
    p.add_argument("--dim", type=positive_int, nargs="+", default=[128], help="head dims D")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=16, help="attention heads H")
    p.add_argument(
        "--reps", type=positive_int, default=10, help="profiled fwd+bwd steps per shape, after an untimed warm-up"
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=("triton", "flex_backend"),
        default=["triton"],
        help="window_attention(backend='triton') and/or backend='flex'",
    )
    p.add_argument(
        "--variants",
        default=None,
        metavar="FILE",
        help="also profile every triton variant of FILE (bench/gpu/gpu_variants.txt); unknown ones are skipped",
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, fp32, tiny shapes (no numbers)")
    p.add_argument("--json", default=None, help="write the rows as JSON here (rewritten after every row)")


def execute(args) -> int:
    if args.dry_run:
        from .triton_gpu import DRY_RUN_N

        args.n, args.k, args.batch_size, args.heads = [min(DRY_RUN_N, args.n[0])], [min(args.k)], 1, 2
        args.dim = [min(args.dim)]  # the interpreter's tile set is base at every head dim: one is the same Python
    elif not torch.cuda.is_available():
        print("bench/gpu/triton_profile.py: skipped, no CUDA device here; nothing was measured.")
        return 0
    from .gpu_variants import read_variants, repeats_the_default, variant_backend, variant_problem

    runs = [(m, m, None) for m in args.methods]
    for name, assignments in read_variants(args.variants) if args.variants else ():
        problem = variant_problem(assignments)
        if problem:
            print(f"variant {name}: SKIPPED, {problem}")
        else:
            method = "flex_backend" if variant_backend(assignments) == "flex" else "triton"
            if method in args.methods:
                runs.append((f"{'flex' if method == 'flex_backend' else 'triton'}[{name}]", method, assignments))
    rows, failures = [], 0
    for layout_name in args.layout:
        for n in args.n:
            for k in args.k:
                for d in args.dim:
                    for label, method, assignments in runs:
                        layout = attention.LAYOUTS[layout_name](n, k)
                        device = torch.device("cpu" if args.dry_run else "cuda")
                        if assignments and repeats_the_default(assignments, d, layout.n_queries, device):
                            continue  # the dispatcher's own tile set here: the default's run profiles it
                        try:
                            r = profile_one(
                                layout_name,
                                n,
                                k,
                                d,
                                args.batch_size,
                                args.heads,
                                args.reps,
                                method,
                                assignments,
                                args.dry_run,
                            )
                        except Exception as exc:  # noqa: BLE001 - report, profile the others
                            failures += 1
                            print(f"{label} {layout_name} N={n} k={k} D={d}: FAILED {type(exc).__name__}: {exc}")
                            continue
                        r["label"] = label
                        rows.append(r)
                        parts = ", ".join(
                            f"{part} {ms:.3f}" for part, ms in sorted(r["parts_ms"].items(), key=lambda x: -x[1])
                        )
                        print(
                            f"{label} {layout_name} N={n} k={k} D={d} B={args.batch_size} H={args.heads}: wall "
                            f"{r['wall_ms']:.3f} ms, host enqueue {r['enqueue_ms']:.3f} ms, kernels "
                            f"{r['kernel_sum_ms']:.3f} ms ({parts})"
                        )
                        for name, ms in list(r["kernels_ms"].items())[:8]:
                            print(f"    {ms:8.3f} ms  {name[:90]}")
                        if args.json:
                            write_json({"rows": rows}, args.json, indent=2)
    return 1 if failures else 0

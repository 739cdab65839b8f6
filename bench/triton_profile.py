"""Where a Triton fwd+bwd spends its time: per-kernel GPU time and the host's launch time.

    python -m bench.triton_profile --layout single --n 1024 8192 --k 4 --dim 128   # CUDA only

For each shape: the GPU time of every kernel in one forward + backward (torch.profiler,
averaged over ``--reps`` steps after a warm-up that compiles and autotunes), their sum
against the wall time of a synchronised step, and the host time to enqueue one step
(no sync): when the enqueue time is close to the wall time, the step is launch-bound and
bigger kernels will not help; when the kernel sum is, the kernels are the place to work.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch


from . import attention
from ._cli import write_json
from kforcing_kernels import window_attention


def profile_one(layout_name: str, n: int, k: int, d: int, batch: int, heads: int, reps: int) -> dict:
    layout = attention.LAYOUTS[layout_name](n, k)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(batch, heads, layout.n_queries, d, device=dev, dtype=dt, requires_grad=True)
    kk, v = (torch.randn(batch, heads, layout.n_keys, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        out = window_attention(q, kk, v, layout, backend="triton")
        torch.autograd.grad(out, (q, kk, v), dout)

    for _ in range(3):  # compile, autotune, caches
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    enqueue_ms = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / reps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time / 1e3 / reps  # us -> ms per step
    kernels = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    return {"layout": layout_name, "n": n, "k": k, "dim": d, "batch": batch, "heads": heads,
            "wall_ms": wall_ms, "enqueue_ms": enqueue_ms, "kernel_sum_ms": sum(kernels.values()), "kernels_ms": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", nargs="+", choices=sorted(attention.LAYOUTS), default=["single"])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--k", type=int, nargs="+", default=[4])
    p.add_argument("--dim", type=int, nargs="+", default=[128])
    p.add_argument("--batch-size", dest="batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/triton_profile.py: skipped, no CUDA device here; nothing was measured.")
        return 0
    rows = []
    for layout_name in args.layout:
        for n in args.n:
            for k in args.k:
                for d in args.dim:
                    r = profile_one(layout_name, n, k, d, args.batch, args.heads, args.reps)
                    rows.append(r)
                    print(f"{layout_name} N={n} k={k} D={d} B={args.batch} H={args.heads}: wall {r['wall_ms']:.3f} ms, "
                          f"host enqueue {r['enqueue_ms']:.3f} ms, kernels {r['kernel_sum_ms']:.3f} ms")
                    for name, ms in r["kernels_ms"].items():
                        print(f"    {ms:8.3f} ms  {name[:90]}")
                    if args.json:
                        write_json({"rows": rows}, args.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

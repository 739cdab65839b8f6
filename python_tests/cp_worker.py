"""Worker of the torchrun context-parallel tests (python_tests/test_context_parallel_torchrun.py).

Every rank builds the same full q/k/v (fp64, one seed), runs its rows through
``context_parallel_attention`` and checks the output and every gradient (dq of its rows, dk/dv of
its keys) against single-process ``window_attention`` with the ``reference`` backend (dense mask).
"""

import os
import sys

import torch
import torch.distributed as dist

from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.ops.window_attention import window_attention
from kforcing_kernels.parallel import ContextParallel, context_parallel_attention

CASES = {
    "single": (WindowLayout.kforcing_single(24, 3), 4, 4),
    "double": (WindowLayout.kforcing_double(12, 3), 4, 4),
    "packed": (WindowLayout.kforcing_single(20, 2, cu_seqlens=[0, 7, 7, 20]), 4, 4),
    "packed_per_batch": (WindowLayout.causal(30, cu_seqlens=[[0, 11, 30], [0, 30]]), 4, 4),
    "gqa": (WindowLayout.kforcing_single(16, 4), 6, 2),
    "causal": (WindowLayout.causal(37), 2, 1),
}


def check(name, layout, heads, kv_heads, cp, device):
    torch.manual_seed(1234)
    b = layout.range_batch or 2
    q = torch.randn(b, heads, layout.n_queries, 8, dtype=torch.float64, device=device)
    k = torch.randn(b, kv_heads, layout.n_keys, 8, dtype=torch.float64, device=device)
    v = torch.randn(b, kv_heads, layout.n_keys, 8, dtype=torch.float64, device=device)
    dout = torch.randn_like(q)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = window_attention(*full, layout, backend="reference")
    ref.backward(dout)
    split = cp.split(layout)
    rows, keys = split.query_rows[cp.rank].to(device), split.key_rows[cp.rank].to(device)
    mine = [q[:, :, rows].clone().requires_grad_(), k[:, :, keys].clone().requires_grad_(), v[:, :, keys].clone().requires_grad_()]
    out = context_parallel_attention(*mine, split, cp.rank, cp.group)
    out.backward(dout[:, :, rows])
    torch.testing.assert_close(out, ref[:, :, rows].detach(), rtol=1e-10, atol=1e-10, msg=f"{name}: out")
    for label, got, want in (("dq", mine[0].grad, full[0].grad[:, :, rows]), ("dk", mine[1].grad, full[1].grad[:, :, keys]),
                             ("dv", mine[2].grad, full[2].grad[:, :, keys])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name}: {label}")
    assert split.imbalance() <= 0.05 or layout.n_queries < 64, (name, split.pairs)
    print(f"rank {cp.rank} {name}: ok (pairs {list(split.pairs)}, rows {[r.numel() for r in split.query_rows]})", flush=True)


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cp = ContextParallel(rank, world, dist.new_group(list(range(world))))
    for name, (layout, heads, kv_heads) in CASES.items():
        check(name, layout, heads, kv_heads, cp, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker of the torchrun context-parallel tests (python_tests/app/training/test_context_parallel_torchrun.py).

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
    mine = [
        q[:, :, rows].clone().requires_grad_(),
        k[:, :, keys].clone().requires_grad_(),
        v[:, :, keys].clone().requires_grad_(),
    ]
    out = context_parallel_attention(*mine, split, cp.rank, cp.group)
    out.backward(dout[:, :, rows])
    torch.testing.assert_close(out, ref[:, :, rows].detach(), rtol=1e-10, atol=1e-10, msg=f"{name}: out")
    for label, got, want in (
        ("dq", mine[0].grad, full[0].grad[:, :, rows]),
        ("dk", mine[1].grad, full[1].grad[:, :, keys]),
        ("dv", mine[2].grad, full[2].grad[:, :, keys]),
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name}: {label}")
    assert split.imbalance() <= 0.05 or layout.n_queries < 64, (name, split.pairs)
    print(
        f"rank {cp.rank} {name}: ok (pairs {list(split.pairs)}, rows {[r.numel() for r in split.query_rows]})",
        flush=True,
    )


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
    check_model(cp, device)
    dist.destroy_process_group()


def check_model(cp, device):
    """The model's CP forward (AR, SingleForward with packed documents) == its single-process forward, and the
    parameter gradients summed over the group == the single-process ones."""
    from kforcing_kernels.model import KForcingLM, ModelConfig

    torch.manual_seed(7)
    model = KForcingLM(ModelConfig.micro(attention_backend="reference")).double().to(device)
    b, n, k = 2, 13, 3
    tokens = torch.randint(0, 64, (b, n), device=device)
    noise, tau = torch.rand(b, n, k, dtype=torch.float64, device=device), torch.tensor([0.7, 1.2], device=device)
    cases = {
        "ar_packed": ((tokens,), dict(cu_seqlens=[[0, 5, 13], [0, 13]]), lambda out: out),
        "single_packed": ((tokens, noise, tau), dict(cu_seqlens=[0, 4, 9, 13]), lambda out: out.flatten(1, 2)),
    }
    for name, (args, kwargs, flat) in cases.items():
        full = flat(model(*args, **kwargs))
        weight = torch.randn(
            full.shape, dtype=full.dtype, device=device, generator=torch.Generator(device).manual_seed(3)
        )
        model.zero_grad(set_to_none=True)
        (full * weight).sum().backward()
        grad_of = lambda p: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # noqa: E731 (AR: no noise encoder)
        want = {p_name: grad_of(p) for p_name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        logits, rows = model(*args, **kwargs, context_parallel=cp)
        rows = rows.to(device)
        torch.testing.assert_close(logits, full[:, rows].detach(), rtol=1e-9, atol=1e-9, msg=f"{name}: logits")
        (logits * weight[:, rows]).sum().backward()
        for p_name, p in model.named_parameters():
            grad = cp.all_reduce(grad_of(p))
            torch.testing.assert_close(grad, want[p_name], rtol=1e-9, atol=1e-11, msg=f"{name}: grad {p_name}")
        print(f"rank {cp.rank} model {name}: ok ({rows.numel()} rows)", flush=True)


if __name__ == "__main__":
    main()

"""Worker of python_tests/parallel/test_hf_context_parallel.py: context parallelism for Hugging Face models (torchrun,
gloo).

Launched with 3 processes: CP groups of 2 (ranks 0, 1) and 3 ranks (all) split the same sequences.

* ``forward``: every rank's ``HFStudent(..., context_parallel=cp)`` logits equal the corresponding rows of the
  single-process forward and the parameter gradients summed over the group equal the single-process ones (fp64),
  for AR and SingleForward, unpacked and packed (``cu_seqlens``), on Llama (GQA), GPT-2, Mistral (sliding window on
  every layer) and Gemma 3 (alternating sliding / full layers);
* ``loss``: ``context_parallel_loss`` on 2 ranks (fp32) gives ``compute_loss``'s loss and, averaged over the ranks
  as the trainer's DDP averages them, its gradients, for AR, forward distillation and self-forcing.
"""

import sys

import torch
import torch.distributed as dist

from helpers import hf_helpers as H
from kforcing_kernels.app.hf_recipe.student import HFStudent
from kforcing_kernels.app.training.context_parallel import context_parallel_loss
from kforcing_kernels.app.training.objectives import Batch, Objective, compute_loss
from kforcing_kernels.parallel import ContextParallel

CONFIGS = {
    "llama_gqa": lambda: H.llama(),
    "gpt2": lambda: H.gpt2(bos_token_id=0, eos_token_id=0),
    "mistral_sliding": lambda: H.mistral(sliding_window=5),
    "gemma3_alternating": lambda: H.gemma3(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
}


def student(name, dtype, seed=0, k_train=None):
    (hf,) = H.twin_models(CONFIGS[name](), "kforcing", seed=seed)
    model = HFStudent(hf, k_train=k_train)
    torch.manual_seed(seed + 100)
    model.reset_noise_encoder()
    return model.to(dtype)


def grads(model):
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def check_forward(cp, tag):
    b, n, k = 2, 13, 3
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, H.VOCAB, (b, n), generator=gen)
    noise = torch.rand(b, n, k, dtype=torch.float64, generator=gen)
    tau = torch.tensor([0.7, 1.3])
    cases = {
        "ar": ((tokens,), None),
        "ar_packed": ((tokens,), [[0, 5, 13], [0, 13]]),
        "single": ((tokens, noise, tau), None),
        "single_packed": ((tokens, noise, tau), [0, 4, 9, 13]),
    }
    for name in CONFIGS:
        model = student(name, torch.float64)
        tol = 1e-5 if name.startswith("gemma3") else 1e-8  # Gemma's RMSNorm computes in fp32 even in an fp64 model
        for case, (args, cu) in cases.items():
            full = model(*args, cu_seqlens=cu)
            full = full.flatten(1, 2) if full.dim() == 4 else full
            weight = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(3))
            model.zero_grad(set_to_none=True)
            (full * weight).sum().backward()
            want = grads(model)
            model.zero_grad(set_to_none=True)
            logits, rows = model(*args, cu_seqlens=cu, context_parallel=cp)
            assert rows.dtype == torch.int64 and logits.shape[1] == rows.numel() > 0, (case, rows)
            torch.testing.assert_close(
                logits, full[:, rows].detach(), rtol=1e-9, atol=1e-9, msg=f"{tag} {name} {case}: logits"
            )
            (logits * weight[:, rows]).sum().backward()
            for p_name, got in grads(model).items():
                torch.testing.assert_close(
                    cp.all_reduce(got), want[p_name], rtol=tol, atol=tol / 10, msg=f"{tag} {name} {case}: grad {p_name}"
                )
            print(f"rank {cp.rank} {tag} {name} {case}: ok ({rows.numel()} rows)", flush=True)


def check_loss(cp):
    b, n, k, sep = 2, 12, 2, 7
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, H.VOCAB, (b, n + 1), generator=gen)
    tokens[0, 4], tokens[1, 8] = sep, sep  # packed documents when the batch has a separator
    tau = torch.tensor([0.8, 1.25])
    for name in ("llama_gqa", "gpt2"):
        ar_teacher = student(name, torch.float32, seed=1, k_train=0).requires_grad_(False)
        pflm_teacher = student(name, torch.float32, seed=2, k_train=k).requires_grad_(False)
        cases = {
            "ar": (Objective.AR, Batch(tokens), None),
            "forward": (Objective.FORWARD, Batch(tokens[:, :n], torch.rand(b, n, 1, generator=gen), tau), ar_teacher),
            "self_forcing": (
                Objective.SELF_FORCING,
                Batch(tokens[:, :n], torch.rand(b, n, 2 * k, generator=gen), tau),
                pflm_teacher,
            ),
        }
        for case, (objective, batch, teacher) in list(cases.items()):
            cases[case + "_packed"] = (objective, Batch(batch.tokens, batch.noise, batch.tau, separator=sep), teacher)
        model = student(name, torch.float32)
        for case, (objective, batch, teacher) in cases.items():
            model.zero_grad(set_to_none=True)
            loss, _ = compute_loss(objective, model, batch, teacher)
            loss.backward()
            want = grads(model)
            model.zero_grad(set_to_none=True)
            backward, group_loss, _ = context_parallel_loss(objective, model, batch, teacher, cp)
            backward.backward()
            assert abs(float(group_loss) - float(loss)) <= 1e-5 * abs(float(loss)), (
                case,
                float(group_loss),
                float(loss),
            )
            for p_name, got in grads(model).items():  # DDP over the group's ranks: the mean of their gradients
                torch.testing.assert_close(
                    cp.all_reduce(got) / cp.world,
                    want[p_name],
                    rtol=1e-4,
                    atol=1e-7,
                    msg=f"loss {name} {case}: grad {p_name}",
                )
            assert any(float(g.abs().max()) > 0 for g in want.values())
            print(f"rank {cp.rank} loss {name} {case}: ok ({float(loss):.5f})", flush=True)


def main():
    dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, world
    pair, trio = dist.new_group([0, 1]), dist.new_group([0, 1, 2])  # every rank creates every group
    if rank < 2:
        check_forward(ContextParallel(rank, 2, pair), "world2")
    check_forward(ContextParallel(rank, 3, trio), "world3")
    if rank < 2:
        check_loss(ContextParallel(rank, 2, pair))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

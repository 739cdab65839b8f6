"""Per-rank memory and communication of one FSDP2 self-forcing step, with and without activation checkpointing.

    python -m bench memory                              # the paper backbone (12 x 768, GPT-2 vocabulary), worlds 1 and 2
    python -m bench memory --preset micro --seq-len 16  # seconds: a check of the script itself

For each world size W (a ``torchrun --nproc_per_node W`` launch, gloo on CPU) and each of AC off / on, rank r
runs one Stage-2 step exactly as the trainer does with ``--parallel fsdp`` (``kforcing_kernels.app.training.parallel``:
every block and the root ``fully_shard``-ed, the teacher replicated, ``compute_loss`` + backward + AdamW) on a
micro-batch of ``--batch-per-rank`` sequences, and counts bytes, not allocator statistics (so CPU numbers are
the numbers a GPU would hold, fp32):

* parameters, gradients, AdamW state: the bytes of this rank's local shards (``DTensor.to_local()``);
* activations: the bytes of the tensors autograd saves for backward during the student's forward and loss
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters excluded: FSDP2
  re-gathers those). Under activation checkpointing the blocks' insides are not saved; what each checkpointed
  block keeps (its inputs) is counted from a forward pre-hook;
* communication: the buffers FSDP2 hands to ``all_gather_single`` (forward and backward) and
  ``reduce_scatter_single`` (gradients); a rank sends or receives (W-1)/W of each. The ideal is one all-gather
  of the parameters per forward and per backward and one reduce-scatter of the gradients: 3 (W-1)/W P x 4
  bytes per rank (DDP's all-reduce: 2 (W-1)/W P x 4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kforcing_kernels.app.cli import add_preset, add_threads, int_list, make_parser, positive_int

SCHEMA_ID = "kforcing-bench/train-memory/v1"
MIB = 2**20


def add_arguments(p) -> None:
    add_preset(p, "paper", help="model size of teacher and student")
    p.add_argument("--seq-len", type=positive_int, default=128, help="context length N (the student attends over N(1+k) tokens)")
    p.add_argument("--k", type=positive_int, default=2, help="student window (stage 2: twice the teacher's; even)")
    p.add_argument("--batch-per-rank", type=positive_int, default=1, help="sequences per rank (the micro-batch)")
    p.add_argument("--worlds", type=int_list, default="1,2", help="world sizes (comma-separated); one torchrun launch each")
    add_threads(p)
    p.add_argument("--out", default=None, help="write the report as JSON here (None: only print it)")
    p.add_argument("--worker-out", default=None, help="internal: run as a torchrun worker and write this rank's numbers here")


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if torch.is_tensor(t))


class _Collectives:
    """Counts the bytes of the buffers FSDP2 passes to torch.distributed's all-gather and reduce-scatter."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.gathered, self.scattered = dist, 0, 0
        self.original = dist.all_gather_single, dist.reduce_scatter_single

    def __enter__(self):
        def all_gather(output_tensor, input_tensor, *args, **kwargs):
            self.gathered += output_tensor.nbytes
            return self.original[0](output_tensor, input_tensor, *args, **kwargs)

        def reduce_scatter(output, input, *args, **kwargs):
            self.scattered += input.nbytes
            return self.original[1](output, input, *args, **kwargs)

        self.dist.all_gather_single, self.dist.reduce_scatter_single = all_gather, reduce_scatter
        return self

    def __exit__(self, *exc):
        self.dist.all_gather_single, self.dist.reduce_scatter_single = self.original


class _SavedTensors:
    """Bytes autograd saves for backward (each storage once, the student's parameters not counted)."""

    def __init__(self, model, checkpointed: bool):
        self.model, self.storages, self.block_inputs = model, {}, {}
        self.hooks = [block.register_forward_pre_hook(self._block_input) for block in model.blocks] if checkpointed else []

    def _block_input(self, module, args):
        for t in args:
            if torch.is_tensor(t):  # the hidden state and RoPE tables a checkpointed block keeps for its recompute
                self.block_inputs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def _pack(self, t):
        storage = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if not hasattr(p, "to_local")}
        if storage.data_ptr() not in params and storage.nbytes():
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        for hook in self.hooks:
            hook.remove()
        return sum({**self.storages, **self.block_inputs}.values())


def measure(preset: str, seq_len: int, k: int, batch: int, checkpointed: bool, device: torch.device) -> dict:
    """One Stage-2 FSDP2 step on this rank (a process group must exist); the bytes it holds and moves."""
    import torch.distributed as dist

    from kforcing_kernels.app.training.objectives import Objective, compute_loss, make_batch
    from kforcing_kernels.app.training.parallel import parallelize, setup_parallel
    from kforcing_kernels.model import PRESETS, KForcingLM

    cfg = PRESETS[preset](seq_len=seq_len)
    torch.manual_seed(0)
    teacher = KForcingLM(cfg).to(device).eval().requires_grad_(False)  # replicated (see app/training/parallel.py)
    student = KForcingLM(cfg).to(device).train()
    n_params = student.num_parameters()
    dims = setup_parallel(device.type, parallel="fsdp")  # the mesh over the existing process group
    parallelize(student, dims, activation_checkpointing=checkpointed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    stream = torch.randint(0, cfg.vocab_size, (64 * seq_len,), generator=torch.Generator().manual_seed(1))
    data = make_batch(Objective.SELF_FORCING, stream, batch, seq_len, k, (0.5, 1.0),
                      torch.Generator().manual_seed(2 + dist.get_rank())).to(device)
    saved = _SavedTensors(student, checkpointed)
    with _Collectives() as forward_comm, saved.context():
        loss, _ = compute_loss(Objective.SELF_FORCING, student, data, teacher)
    with _Collectives() as backward_comm:
        loss.backward()
    optimizer.step()
    world = dist.get_world_size()
    return {
        "world": world, "rank": dist.get_rank(), "activation_checkpointing": checkpointed, "preset": preset,
        "seq_len": seq_len, "k": k, "batch_per_rank": batch, "parameters": n_params,
        "param_bytes": _bytes(student.parameters()), "grad_bytes": _bytes(p.grad for p in student.parameters()),
        "optimizer_bytes": _bytes(v for state in optimizer.state.values() for v in state.values()),
        "activation_bytes": saved.total, "teacher_bytes": _bytes(teacher.parameters()),
        "all_gather_forward_bytes": forward_comm.gathered, "all_gather_backward_bytes": backward_comm.gathered,
        "reduce_scatter_bytes": backward_comm.scattered + forward_comm.scattered,
        "ideal_comm_bytes_per_rank": 3 * (world - 1) * n_params * 4 // world, "loss": float(loss.detach()),
    }


def _worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = [measure(args.preset, args.seq_len, args.k, args.batch_per_rank, ac, torch.device("cpu")) for ac in (False, True)]
    Path(args.worker_out, f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(args) -> list[dict]:
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as folder:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), "-m", "bench",
                   "memory", "--worker-out", folder, "--preset", args.preset, "--seq-len", str(args.seq_len), "--k", str(args.k),
                   "--batch-per-rank", str(args.batch_per_rank)] + (["--threads", str(args.threads)] if args.threads else [])
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
            result = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"world {world}: torchrun failed\n{result.stderr[-4000:]}")
            rows += [row for rank in range(world) for row in json.loads(Path(folder, f"rank{rank}.json").read_text())]
    return rows


def format_report(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"{first['preset']} ({first['parameters'] / 1e6:.1f}M parameters), stage 2 step, N={first['seq_len']}, "
             f"k={first['k']}, {first['batch_per_rank']} sequence(s) per rank, fp32; MiB per rank (rank 0)", "",
             "| W | AC | params | grads | AdamW | activations | sum | teacher (replicated) | all-gather fwd / bwd | reduce-scatter | on the wire per rank (ZeRO-3 model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rank"]:
            continue
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        wire = (r["all_gather_forward_bytes"] + r["all_gather_backward_bytes"] + r["reduce_scatter_bytes"]) * (r["world"] - 1) // r["world"]
        lines.append(f"| {r['world']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['param_bytes'] / MIB:.1f} | "
                     f"{r['grad_bytes'] / MIB:.1f} | {r['optimizer_bytes'] / MIB:.1f} | {r['activation_bytes'] / MIB:.1f} | "
                     f"{(state + r['activation_bytes']) / MIB:.1f} | {r['teacher_bytes'] / MIB:.1f} | "
                     f"{r['all_gather_forward_bytes'] / MIB:.1f} / {r['all_gather_backward_bytes'] / MIB:.1f} | "
                     f"{r['reduce_scatter_bytes'] / MIB:.1f} | {wire / MIB:.1f} ({r['ideal_comm_bytes_per_rank'] / MIB:.1f}) |")
    return "\n".join(lines)


def execute(args) -> list:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker_out:
        _worker(args)
        return 0
    if args.k % 2:
        raise SystemExit(f"--k: expected an even student window (twice the teacher's), got {args.k}")
    rows = run(args)
    print(format_report(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"schema": SCHEMA_ID, "rows": rows}, indent=1))
    return 0


def main(argv=None, prog="python -m bench.train_memory") -> int:
    p = make_parser(prog, __doc__)
    add_arguments(p)
    return execute(p.parse_args(argv))

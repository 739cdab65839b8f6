"""Per-rank memory and communication of one FSDP2 self-forcing step, with and without activation checkpointing.

    python -m bench memory                              # the paper backbone (12 x 768, GPT-2 vocabulary), worlds 1 and
    2 python -m bench memory --preset micro --seq-len 16  # seconds: a check of the script itself
    python -m bench memory --hf-llama 100m --seq-len 64 --worlds 1,2,4 --teacher-parallel replicate,fsdp --ac off
                                                        # a 109.5M-parameter Hugging Face Llama
                                                        (bench/training/_train_models.py)

For each world size W, teacher placement (``--teacher-parallel``) and AC setting (one ``torchrun --nproc_per_node W``
launch each, gloo on CPU), rank r builds the pair as the trainer does (native, or a Hugging Face model through
``build_from_config``) and runs one Stage-2 step as the trainer does with ``--parallel fsdp``
(``kforcing_kernels.app.training.parallel``: every decoder layer and the root ``fully_shard``-ed, the teacher replicated
or
sharded by ``place_teacher``, ``compute_loss`` + backward + AdamW) on a micro-batch of ``--batch-per-rank`` sequences,
and counts bytes, not allocator statistics (so CPU numbers are
the numbers a GPU would hold, fp32):

* parameters, gradients, AdamW state: the bytes of this rank's local shards (``DTensor.to_local()``);
* activations: the bytes of the tensors autograd saves for backward during the student's forward and loss
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters excluded: FSDP2
  re-gathers those). Under activation checkpointing the blocks' insides are not saved; what each checkpointed
  block keeps (its inputs) is counted from a forward pre-hook;
* communication: the buffers FSDP2 hands to ``all_gather_single`` (forward and backward) and
  ``reduce_scatter_single`` (gradients); a rank sends or receives (W-1)/W of each. The ideal is one all-gather
  of the parameters per forward and per backward and one reduce-scatter of the gradients: 3 (W-1)/W P x 4
  bytes per rank (DDP's all-reduce: 2 (W-1)/W P x 4). The all-gathers inside the teacher's passes are counted
  apart (``teacher_all_gather_bytes``: 0 for a replicated teacher);
* the teacher: the bytes of its local parameters after the step; peak RSS: ``getrusage`` of the rank's process
  (each launch measures one setting, so it is that setting's peak; it includes the unsharded models every rank
  builds before sharding them, as the trainer does, and the libraries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kforcing_kernels.app.cli import add_threads, int_list, positive_int
from kforcing_kernels.app.training.parallel import decoder_layers

from ._train_models import (
    Collectives,
    add_model_arguments,
    build_pair,
    execute_launcher,
    model_argv,
    model_name,
    rss_bytes,
    tensor_bytes,
)

SCHEMA_ID = "kforcing-bench/train-memory/v2"
MIB = 2**20
TEACHER_MODES = ("replicate", "fsdp")


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated values of {', '.join(choices)}, got {text!r}")
        return values

    return parse


def add_arguments(p) -> None:
    add_model_arguments(p, "paper")
    p.add_argument(
        "--seq-len", type=positive_int, default=128, help="context length N (the student attends over N(1+k) tokens)"
    )
    p.add_argument("--k", type=positive_int, default=2, help="student window (stage 2: twice the teacher's; even)")
    p.add_argument("--batch-per-rank", type=positive_int, default=1, help="sequences per rank (the micro-batch)")
    p.add_argument(
        "--worlds", type=int_list, default="1,2", help="world sizes (comma-separated); one torchrun launch each"
    )
    p.add_argument(
        "--teacher-parallel",
        type=_choice_list(TEACHER_MODES),
        default="replicate",
        help="teacher placements to measure (comma-separated: replicate,fsdp), as the trainer's --teacher-parallel",
    )
    p.add_argument(
        "--ac",
        type=_choice_list(("off", "on")),
        default="off,on",
        help="activation checkpointing settings (comma-separated)",
    )
    add_threads(p, none="1 per worker process (OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=None, help="write the report as JSON here (None: only print it)")
    p.add_argument(
        "--worker-out", default=None, help="internal: run as a torchrun worker and write this rank's numbers here"
    )


class _SavedTensors:
    """Bytes autograd saves for backward (each storage once, the student's parameters not counted)."""

    def __init__(self, model, checkpointed: bool):
        self.model, self.storages, self.block_inputs = model, {}, {}
        self.hooks = (
            [layer.register_forward_pre_hook(self._block_input, with_kwargs=True) for layer in decoder_layers(model)]
            if checkpointed
            else []
        )

    def _block_input(self, module, args, kwargs):
        # the hidden state and RoPE tables (HF: position_embeddings, masks) a checkpointed layer keeps for its recompute
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if torch.is_tensor(t):
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


def measure(
    spec,
    seq_len: int,
    k: int,
    batch: int,
    checkpointed: bool,
    device: torch.device,
    teacher_parallel: str = "replicate",
) -> dict:
    """One Stage-2 FSDP2 step on this rank (a process group must exist); the bytes it holds and moves.

    ``spec``: the model options (``preset``, ``hf_llama``, ``model_config``; see bench/training/_train_models.py)."""
    import torch.distributed as dist

    from kforcing_kernels.app.training.objectives import Objective, compute_loss, make_batch
    from kforcing_kernels.app.training.parallel import parallelize, place_teacher, setup_parallel

    teacher, student = build_pair(spec, seq_len, k, device)
    n_params, n_teacher = (sum(p.numel() for p in m.parameters()) for m in (student, teacher))
    dims = setup_parallel(device.type, parallel="fsdp")  # the mesh over the existing process group
    place_teacher(teacher, dims, teacher_parallel)
    parallelize(student, dims, activation_checkpointing=checkpointed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    stream = torch.randint(0, student.config.vocab_size, (64 * seq_len,), generator=torch.Generator().manual_seed(1))
    data = make_batch(
        Objective.SELF_FORCING,
        stream,
        batch,
        seq_len,
        k,
        (0.5, 1.0),
        torch.Generator().manual_seed(2 + dist.get_rank()),
    ).to(device)
    saved = _SavedTensors(student, checkpointed)
    comm = Collectives()
    comm.watch_teacher(teacher)
    with comm, saved.context():
        loss, _ = compute_loss(Objective.SELF_FORCING, student, data, teacher)
    forward = (comm.gathered, comm.scattered, comm.teacher_gathered)
    comm.reset()
    with comm:
        loss.backward()
    optimizer.step()
    rss, peak_rss = rss_bytes()
    world = dist.get_world_size()
    return {
        "world": world,
        "rank": dist.get_rank(),
        "activation_checkpointing": checkpointed,
        "model": model_name(spec),
        "teacher_parallel": teacher_parallel,
        "seq_len": seq_len,
        "k": k,
        "batch_per_rank": batch,
        "parameters": n_params,
        "teacher_parameters": n_teacher,
        "param_bytes": tensor_bytes(student.parameters()),
        "grad_bytes": tensor_bytes(p.grad for p in student.parameters()),
        "optimizer_bytes": tensor_bytes(v for state in optimizer.state.values() for v in state.values()),
        "activation_bytes": saved.total,
        "teacher_bytes": tensor_bytes(teacher.parameters()),
        "all_gather_forward_bytes": forward[0],
        "all_gather_backward_bytes": comm.gathered,
        "reduce_scatter_bytes": comm.scattered + forward[1],
        "teacher_all_gather_bytes": forward[2],
        "ideal_comm_bytes_per_rank": 3 * (world - 1) * n_params * 4 // world,
        "loss": float(loss.detach()),
        "rss_bytes": rss,
        "peak_rss_bytes": peak_rss,
    }


def _worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    row = measure(
        args,
        args.seq_len,
        args.k,
        args.batch_per_rank,
        args.ac == ["on"],
        torch.device("cpu"),
        args.teacher_parallel[0],
    )
    Path(args.worker_out, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def run(args) -> list[dict]:
    """One torchrun launch per (world, teacher placement, AC): each row's peak RSS is its own process's."""
    rows = []
    for world in args.worlds:
        for teacher in args.teacher_parallel:
            for ac in args.ac:
                with tempfile.TemporaryDirectory() as folder:
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc_per_node",
                        str(world),
                        "-m",
                        "bench",
                        "memory",
                        "--worker-out",
                        folder,
                        *model_argv(args),
                        "--seq-len",
                        str(args.seq_len),
                        "--k",
                        str(args.k),
                        "--batch-per-rank",
                        str(args.batch_per_rank),
                        "--teacher-parallel",
                        teacher,
                        "--ac",
                        ac,
                    ] + (["--threads", str(args.threads)] if args.threads else [])
                    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
                    result = subprocess.run(
                        cmd, env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True
                    )
                    if result.returncode:
                        raise SystemExit(
                            f"world {world}, teacher {teacher}, AC {ac}: torchrun failed\n{result.stderr[-4000:]}"
                        )
                    rows += [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world)]
    return rows


def format_report(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        f"{first['model']} ({first['parameters']:,} parameters), stage 2 step, N={first['seq_len']}, "
        f"k={first['k']}, {first['batch_per_rank']} sequence(s) per rank, fp32; MiB per rank (rank 0; peak RSS: "
        "the largest rank's)",
        "",
        "| W | teacher | AC | params | grads | AdamW | activations | sum | teacher | teacher all-gather | "
        "all-gather fwd / bwd | reduce-scatter | on the wire per rank (ZeRO-3 model) | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["rank"]:
            continue
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        wire = (
            (r["all_gather_forward_bytes"] + r["all_gather_backward_bytes"] + r["reduce_scatter_bytes"])
            * (r["world"] - 1)
            // r["world"]
        )
        peak = max(
            o["peak_rss_bytes"]
            for o in rows
            if (o["world"], o["teacher_parallel"], o["activation_checkpointing"])
            == (r["world"], r["teacher_parallel"], r["activation_checkpointing"])
        )
        lines.append(
            f"| {r['world']} | {r['teacher_parallel']} | {'on' if r['activation_checkpointing'] else 'off'} | "
            f"{r['param_bytes'] / MIB:.1f} | {r['grad_bytes'] / MIB:.1f} | {r['optimizer_bytes'] / MIB:.1f} | "
            f"{r['activation_bytes'] / MIB:.1f} | {(state + r['activation_bytes']) / MIB:.1f} | "
            f"{r['teacher_bytes'] / MIB:.1f} | {r['teacher_all_gather_bytes'] / MIB:.1f} | "
            f"{r['all_gather_forward_bytes'] / MIB:.1f} / {r['all_gather_backward_bytes'] / MIB:.1f} | "
            f"{r['reduce_scatter_bytes'] / MIB:.1f} | "
            f"{wire / MIB:.1f} ({r['ideal_comm_bytes_per_rank'] / MIB:.1f}) | "
            f"{peak / MIB:.0f} |"
        )
    return "\n".join(lines)


def execute(args) -> int:
    return execute_launcher(args, _worker, run, format_report, lambda rows: {"schema": SCHEMA_ID, "rows": rows})

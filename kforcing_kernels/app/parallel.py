"""How the trainer spreads the student over ranks: DDP (a full copy per rank) or FSDP2 (``fully_shard``),
and per-block activation checkpointing. The trainer calls :func:`prepare_student` before it builds the
optimizer and :func:`data_parallel` where it used to wrap DDP; nothing here changes what a step computes.

FSDP2 (``--parallel fsdp``): every transformer block is one ``fully_shard`` unit and the root (embedding,
noise encoder, final norm, tied head) another, over a 1-D device mesh of all ranks. Parameters, gradients
and AdamW state are sharded (dim 0, ``1/world`` each); a unit's full parameters exist only while its
forward or backward runs. On CUDA the policy computes in bf16 and reduces in fp32 (``--precision`` auto or
bf16); on CPU everything stays fp32. A single process (no torchrun) gets a one-rank process group, so
``--parallel fsdp`` means the same code and the same checkpoint format at every world size.

The frozen teacher (stages 1 and 2) is **replicated**, not sharded: it has no gradients and no optimizer
state, so it costs 4 bytes per parameter (fp32) against the student's 16 (weights, gradients, two Adam
moments) before sharding, and a self-forcing step runs it twice (SingleForward, DoubleForward). Sharding it
would add an all-gather of every teacher layer per teacher pass (two per step, more than the student's own
forward traffic) to save those 4 bytes per parameter per rank; with the paper's backbone (~124M parameters
with a GPT-2 vocabulary) that is ~0.5 GB, which every GPU that trains the student has.

Activation checkpointing (``--activation-checkpointing``): each block's forward runs under
``torch.utils.checkpoint`` (non-reentrant), so only the block's inputs are kept and its inside is
recomputed in backward. The recomputation runs the same ops on the same inputs (no dropout, no random
state in the model), so loss and gradients are bitwise those without it (python_tests/test_train_fsdp.py).
The wrapper replaces the block's ``forward`` on the instance: parameter names (and checkpoints) do not change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

PARALLEL_MODES = ("ddp", "fsdp")


def _is_fsdp(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


# ---------------------------------------------------------------------- process group


def ensure_process_group(parallel: str, device: torch.device) -> Optional[str]:
    """FSDP2 needs a process group even for one process: create a one-rank group (a file store in a temporary
    folder) when none exists. Returns that folder when it created one (hand it to :func:`release_process_group`),
    else None."""
    if parallel != "fsdp" or dist.is_initialized():
        return None
    store_dir = tempfile.mkdtemp(prefix="kforcing-pg-")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return store_dir


def release_process_group(store_dir: Optional[str]) -> None:
    """Destroy the one-rank group :func:`ensure_process_group` created (nothing when it created none)."""
    if store_dir is not None:
        dist.destroy_process_group()
        shutil.rmtree(store_dir, ignore_errors=True)


def broadcast_value(value, src: int = 0):
    """``value`` of rank ``src`` on every rank (itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------- wrapping


def checkpoint_blocks(model) -> None:
    """Activation checkpointing per block: each ``model.blocks[i]`` recomputes its forward in backward."""
    for block in model.blocks:
        forward = block.forward  # the bound method of the class

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed


def mixed_precision(device: torch.device, amp: Optional[torch.dtype]):
    """The FSDP2 policy: None (fp32) on CPU or without autocast; bf16 parameters, fp32 gradient reduction on CUDA.

    Forward inputs are never cast: the noise ``z`` feeds sinusoids up to ~1000 radians per unit, which bf16
    would quantise away (the noise encoder casts after its features, as it does under autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda" or amp is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard(model, device: torch.device, amp: Optional[torch.dtype] = None) -> None:
    """``fully_shard`` every block, then the root, over a mesh of all ranks (in place; needs a process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The blocks return K/V views and the root returns logits views; nothing modifies them in place, which is
    # what FSDP2's warning about view outputs is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision(device, amp)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def prepare_student(student, parallel: str, activation_checkpointing: bool, device: torch.device,
                    amp: Optional[torch.dtype]) -> None:
    """Before the optimizer is built: activation checkpointing (any mode), then FSDP2 sharding (``fsdp``)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel: expected one of {PARALLEL_MODES}, got {parallel!r}")
    if activation_checkpointing:
        checkpoint_blocks(student)
    if parallel == "fsdp":
        shard(student, device, amp)


def data_parallel(student, parallel: str, world: int, device: torch.device):
    """The module a step calls: DDP around the student (``ddp``, more than one rank), else the student itself."""
    if parallel == "ddp" and world > 1:
        return torch.nn.parallel.DistributedDataParallel(
            student, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    return student


@contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gradient_sync(model, sync: bool):
    """The context of one micro-batch's forward and backward: gradients are reduced only when ``sync``."""
    if sync:
        return nullcontext()
    if _is_fsdp(model):
        return _fsdp_no_sync(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()


# ---------------------------------------------------------------------- full tensors (collectives under FSDP)


def local_value(x: torch.Tensor) -> torch.Tensor:
    """A DTensor as its full tensor (a collective unless replicated); a plain tensor as itself."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def full_gradients(student) -> dict[str, torch.Tensor]:
    """name -> full gradient; under FSDP every rank must call it (each sharded gradient is all-gathered)."""
    return {n: local_value(p.grad) for n, p in student.named_parameters() if p.grad is not None}


def full_copy(student, main: bool):
    """A plain (unsharded, fp32, CPU) copy of the student on rank 0, None elsewhere; every rank must call it."""
    if not _is_fsdp(student):
        return student if main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..model import KForcingLM

    state = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not main:
        return None
    copy = KForcingLM(student.config)
    copy.load_state_dict(state)
    copy.k_train = getattr(student, "k_train", None)
    return copy

"""Where every rank sits, and how the models are spread over the ranks: one :class:`ParallelDims` and one
named ``DeviceMesh`` for every parallelism, one :func:`parallelize` step for both model kinds.

**The world.** ``torchrun --nproc_per_node W`` gives W ranks, laid out as a ``dp x cp`` mesh (named dims
``"dp"``, ``"cp"``; ``tp`` has room to come as a third dim). The ``cp`` ranks of a row share each sequence
(context parallelism, :mod:`kforcing_kernels.app.training.context_parallel`: its group is ``mesh["cp"]``); the ``dp``
rows get different sequences. Ranks of one CP group are consecutive: rank ``r`` is ``(r // cp, r % cp)``.
The same code runs on gloo (CPU) and nccl (CUDA).

**The student** (:func:`parallelize`, in this order, as torchtitan applies them):

1. activation checkpointing per decoder layer (native: ``model.blocks``; Hugging Face: the model's own layer
   class, ``_no_split_modules``): each layer's forward runs under ``torch.utils.checkpoint`` (non-reentrant),
   so only its inputs are kept and its inside is recomputed in backward. The recomputation runs the same ops
   on the same inputs (no dropout, no random state), so loss and gradients are bitwise those without it. The
   wrapper replaces the layer's ``forward`` on the instance: parameter names (and checkpoints) do not change;
2. ``torch.compile`` per decoder layer (``--compile``);
3. ``--parallel fsdp``: FSDP2 ``fully_shard`` per decoder layer, then the root (embeddings, noise encoder, final
   norm, head), over all ``dp x cp`` ranks (the mesh's ``("dp", "cp")`` flattened: CP ranks hold the same
   parameters, so they shard them too). Parameters, gradients and AdamW state are ``1/W`` each per rank. On
   CUDA the policy computes in the autocast dtype and reduces in fp32; on CPU everything stays fp32.
   ``--parallel ddp``: ``DistributedDataParallel`` over the world (more than one rank).

Either way a step averages gradients over all W ranks; context parallelism scales each rank's share of its
group's loss by ``cp`` (see :mod:`kforcing_kernels.app.training.context_parallel`), so the step's gradient is the
mean over dp groups of each group's whole-sequence gradient, as in a single process. A single process
(no torchrun) with ``--parallel fsdp`` gets a one-rank process group: the same code and checkpoint format at
every world size.

**The frozen teacher** (stages 1 and 2, :func:`place_teacher`): ``--teacher-parallel replicate`` (default) keeps
a full copy per rank; ``fsdp`` shards it like the student (per layer, then the root; its parameters are
gathered for each teacher pass and freed after). A replicated teacher costs 4 bytes per parameter per rank in
fp32 (2 in bf16) and no communication; a sharded one costs ``1/W`` of that plus an all-gather of every
parameter per teacher pass (a self-forcing step runs it twice: SingleForward, DoubleForward). BENCHMARKS.md
("Teacher: replicated or sharded") has the measured cost; replicate while the teacher fits beside the student.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from torch import nn
from torch.utils.checkpoint import checkpoint

from ... import env
from ...parallel import ContextParallel
from ..student import kind_of

PARALLEL_MODES = ("ddp", "fsdp")
TEACHER_MODES = ("replicate", "fsdp")
MESH_DIMS = ("dp", "cp")


def _is_fsdp(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


# ---------------------------------------------------------------------- the world


@dataclass
class ParallelDims:
    """This rank's place in a ``dp x cp`` world, and the mesh that names it (None: one process, nothing sharded).

    Build it with :func:`setup_parallel`; release it with :meth:`close` (it destroys a one-rank group it made).
    """

    dp: int
    cp: int
    shard: bool  # FSDP2: the student's parameters, gradients and optimizer state are sharded over all ranks
    rank: int
    device: torch.device
    mesh: Optional["DeviceMesh"] = None  # dims MESH_DIMS
    _own_store: Optional[str] = field(default=None, repr=False)
    _context_parallel: Optional[ContextParallel] = field(default=None, repr=False)

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data-parallel shard of the batch this rank (and its CP group) trains on."""
        return self.rank // self.cp

    @property
    def context_parallel(self) -> Optional[ContextParallel]:
        """This rank's CP group (``mesh["cp"]``), or None without context parallelism."""
        if self.cp > 1 and self._context_parallel is None:
            if self.mesh is None:
                raise RuntimeError("mesh: context parallelism needs the dp x cp mesh (make it with init_parallel)")
            self._context_parallel = ContextParallel(self.rank % self.cp, self.cp, self.mesh["cp"].get_group())
        return self._context_parallel

    def shard_mesh(self):
        """The 1-D mesh FSDP2 shards over: every rank (``("dp", "cp")`` flattened when both are > 1)."""
        if self.cp == 1:
            return self.mesh["dp"]
        if self.dp == 1:
            return self.mesh["cp"]
        return self.mesh["dp", "cp"]._flatten("dp_cp")

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Destroy the one-rank process group :func:`setup_parallel` created (nothing when it created none)."""
        if self._own_store is not None:
            dist.destroy_process_group()
            shutil.rmtree(self._own_store, ignore_errors=True)
            self._own_store = None


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when there is one; a bare ``cuda`` -> this rank's GPU (LOCAL_RANK) on a torchrun node."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", env.distributed_ranks()[2])
        torch.cuda.set_device(dev)
    elif dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        # Every rank of this node would take the same GPU: NCCL refuses that, or the ranks share one GPU's memory.
        raise ValueError(
            f"device: {device!r} puts all {os.environ['LOCAL_WORLD_SIZE']} torchrun processes of this "
            "node on "
            "one GPU; pass 'cuda' (each rank takes cuda:LOCAL_RANK) or CUDA_VISIBLE_DEVICES"
        )
    return dev


def init_process_group(device: torch.device) -> None:
    """The torchrun world's process group (gloo on CPU, nccl on CUDA), once; nothing outside torchrun."""
    if env.distributed_ranks()[0] > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def setup_parallel(device: str, context_parallel: int = 1, parallel: str = "ddp", group: bool = False) -> ParallelDims:
    """The world torchrun started (one process without torchrun) as ``dp x cp`` ranks on one device mesh.

    Every rank must call it (it creates the process groups). ``context_parallel`` must divide the world size.
    One process gets a one-rank process group (a file store in a temporary folder) when something is sharded
    (``parallel="fsdp"``, or ``group``: a sharded teacher), so the same code runs at every world size."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel: expected one of {PARALLEL_MODES}, got {parallel!r}")
    world, rank, _ = env.distributed_ranks()
    if not isinstance(context_parallel, int) or context_parallel < 1 or world % context_parallel:
        raise ValueError(f"context_parallel: expected a divisor of the world size {world}, got {context_parallel!r}")
    dev = resolve_device(device)
    init_process_group(dev)
    own_store = None
    if (parallel == "fsdp" or group) and not dist.is_initialized():
        own_store = tempfile.mkdtemp(prefix="kforcing-pg-")
        store = dist.FileStore(os.path.join(own_store, "store"), 1)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    mesh = None
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world // context_parallel, context_parallel), mesh_dim_names=MESH_DIMS)
    return ParallelDims(world // context_parallel, context_parallel, parallel == "fsdp", rank, dev, mesh, own_store)


def broadcast_value(value, src: int = 0):
    """``value`` of rank ``src`` on every rank (itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------- parallelize


def decoder_layers(model) -> list[nn.Module]:
    """The repeated layers of a student, in order, before or after :func:`parallelize`: its own
    :meth:`~kforcing_kernels.app.student.Student.decoder_layers` (the native model's blocks; an HF model's layers)."""
    return model.decoder_layers()


def checkpoint_layers(layers) -> None:
    """Activation checkpointing: each layer recomputes its forward in backward (non-reentrant)."""
    for layer in layers:
        forward = layer.forward  # the bound method of the class

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():  # evaluation and generation: nothing is saved, nothing to recompute
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def checkpoint_blocks(model) -> None:
    """Activation checkpointing on every decoder layer of ``model`` (native or Hugging Face)."""
    checkpoint_layers(decoder_layers(model))


def mixed_precision(device: torch.device, amp: Optional[torch.dtype]):
    """The FSDP2 policy: None (fp32) on CPU or without autocast; ``amp`` parameters, fp32 gradient reduction on CUDA.

    Forward inputs are never cast: the noise ``z`` feeds sinusoids up to ~1000 radians per unit, which bf16
    would quantise away (the noise encoder casts after its features, as it does under autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda" or amp is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _fully_shard(
    model, dims: ParallelDims, amp: Optional[torch.dtype], methods: tuple[str, ...] = (), reshard_root: bool = False
) -> None:
    """FSDP2 per decoder layer, then the root. ``reshard_root``: free the root's gathered parameters after each forward
    too (FSDP2 keeps a root's until the backward, which a frozen model never runs: they would stay gathered)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # The layers return K/V views and the root returns logits views; nothing modifies them in place, which is
    # what FSDP2's warning about view outputs is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh, policy = dims.shard_mesh(), mixed_precision(dims.device, amp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root: dict[str, Any] = {"reshard_after_forward": True} if reshard_root else {}  # else fully_shard's default
    fully_shard(model, mesh=mesh, mp_policy=policy, **root)
    for name in methods:  # methods called instead of forward must gather the root's parameters too
        register_fsdp_forward_method(model, name)


def parallelize(
    model,
    dims: ParallelDims,
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
    amp: Optional[torch.dtype] = None,
):
    """Spread the student over the ranks (in place, before the optimizer is built); returns the module a step calls.

    Activation checkpointing, then ``torch.compile``, per decoder layer, then FSDP2 (``dims.shard``) or DDP
    (more than one rank): see the module docstring. ``model`` is on ``dims.device`` already."""
    layers = decoder_layers(model)
    if activation_checkpointing:
        checkpoint_layers(layers)
    if compile:
        for layer in layers:
            layer.compile()
    if dims.shard:
        _fully_shard(model, dims, amp)
        return model
    if dims.world > 1:
        return data_parallel(model, dims)
    return model


def data_parallel(model: nn.Module, dims: ParallelDims) -> nn.parallel.DistributedDataParallel:
    """DDP over every rank, buffers not synced in forward (they are the same on every rank: RoPE and noise
    frequencies). torch 2.13 names that ``forward_sync_buffers=False`` and warns on every rank (FutureWarning)
    at the old ``broadcast_buffers=False``; older torch has only the old name."""
    import inspect

    ddp = nn.parallel.DistributedDataParallel
    no_sync: dict[str, Any] = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
        else {"broadcast_buffers": False}
    )
    return ddp(model, device_ids=[dims.device.index] if dims.device.type == "cuda" else None, **no_sync)


def place_teacher(teacher, dims: ParallelDims, mode: str, amp: Optional[torch.dtype] = None) -> None:
    """The frozen teacher on every rank: a full copy (``replicate``) or FSDP2-sharded over all ranks (``fsdp``).

    A sharded teacher's passes are collectives: every rank must run the same teacher calls."""
    if mode not in TEACHER_MODES:
        raise ValueError(f"teacher_parallel: expected one of {TEACHER_MODES}, got {mode!r}")
    if mode == "fsdp":
        if dims.mesh is None:
            raise ValueError(
                "teacher_parallel: 'fsdp' needs a process group (torchrun, or --parallel fsdp in one process)"
            )
        _fully_shard(teacher, dims, amp, methods=("single_forward", "double_forward"), reshard_root=True)


# ---------------------------------------------------------------------- during a step


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
    if isinstance(model, nn.parallel.DistributedDataParallel):
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

    state = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not main:
        return None
    copy = kind_of(student).build_like(student)
    copy.load_state_dict(state)
    copy.k_train = student.k_train
    return copy

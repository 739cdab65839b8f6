"""Run by ``torchrun --nproc_per_node 2`` from test_train_fsdp.py: the FSDP2 runs of one test module in one launch
(the two degenerate meshes of two ranks: 2 x 1, dp x cp, and 1 x 2; test_train_mesh.py runs 2 x 2).

``python fsdp_worker.py ROOT DEVICE``: ROOT holds ``corpus/``, the teacher ``s1/`` and ``w1/`` (a one-rank FSDP run
stopped after step 2); every run below writes its own folder in ROOT. All ranks run every run (FSDP2 is collective).
"""

import dataclasses
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from helpers.fsdp_settings import stage2_config
from kforcing_kernels.app.training.loop import train


def main(root: Path, device: str) -> None:
    base = stage2_config(root, device, parallel="fsdp")
    run = lambda name, **kw: train(dataclasses.replace(base, out=str(root / name), **kw))  # noqa: E731
    run("f2", dump_grads=str(root / "f2.safetensors"))  # FSDP2 step == single-process step (a 2 x 1 dp x cp mesh)
    # The degenerate 1 x 2 mesh (one data-parallel row, a CP group of two): FSDP2 must shard over the cp dim (issue 46).
    run("f2_cp", context_parallel=2, dump_grads=str(root / "f2_cp.safetensors"))
    run("f2_ac", activation_checkpointing=True, dump_grads=str(root / "f2_ac.safetensors"))  # AC == without, bitwise
    # no reduction until the last micro-batch
    run("f2_accum", grad_accum=2, steps=1, dump_grads=str(root / "f2_accum.safetensors"))
    run("f2_stop", stop_at=2)
    if dist.get_rank() == 0:  # the 2-rank checkpoint at step 2, for the one-rank resume (2 -> 1) after this launch
        shutil.copytree(root / "f2_stop", root / "f2_stop_for_1")
    dist.barrier()
    run("f2_stop", resume=True)  # 2 -> 2: bit for bit
    run("w1", resume=True)  # 1 -> 2: the one-rank checkpoint resumed on two ranks


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

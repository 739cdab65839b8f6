"""Run by ``torchrun --nproc_per_node 4`` from test_train_mesh.py: the four-rank runs of that module in one launch.

``python mesh_worker.py ROOT DEVICE``: ROOT holds ``corpus/``, the native teacher ``s1/`` and the Hugging Face
teacher ``h1/``; every run writes its own folder in ROOT. All ranks run every run (FSDP2 and CP are collective).
"""

import dataclasses
import sys
from pathlib import Path

from helpers.fsdp_settings import stage2_config
from kforcing_kernels.app.training.loop import train


def main(root: Path, device: str) -> None:
    native, hf = stage2_config(root, device), stage2_config(root, device, teacher=str(root / "h1"))

    def run(base, name, **kw):
        return train(
            dataclasses.replace(base, out=str(root / name), dump_grads=str(root / f"{name}.safetensors"), **kw)
        )

    run(native, "fsdp_cp", parallel="fsdp", context_parallel=2)  # a 2 x 2 mesh: FSDP2 over all four, CP groups of two
    run(native, "teacher_fsdp", teacher_parallel="fsdp")  # DDP student, sharded teacher
    run(hf, "hf_fsdp_ac", parallel="fsdp", activation_checkpointing=True, teacher_parallel="fsdp")
    run(hf, "hf_fsdp_cp", parallel="fsdp", context_parallel=2)  # an HF student on the 2 x 2 mesh
    run(hf, "hf_ddp_cp", context_parallel=2)  # DDP over dp, CP groups of two


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

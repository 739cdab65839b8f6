"""The settings the FSDP2 tests share (test_train_fsdp.py and the torchrun worker fsdp_worker.py)."""

from pathlib import Path

from kforcing_kernels.app.training.config import TrainConfig


def stage2_config(root: Path, device: str, **kw) -> TrainConfig:
    """Three self-forcing steps (teacher SingleForward + DoubleForward, student k=2) on packed documents, fp32,
    checkpoints at steps 2 and 3; the global batch of 8 splits into 4 per rank on two ranks."""
    base = dict(
        stage="stage2",
        teacher=str(root / "s1"),
        data=str(root / "corpus"),
        vocab_size=300,
        preset="micro",
        seq_len=16,
        batch_size=8,
        steps=3,
        ckpt_every=2,
        log_every=1,
        eval_batches=1,
        progress=False,
        packed_docs=True,
        precision="fp32",
        device=device,
        out=str(root / "unused"),
    )
    base.update(kw)
    return TrainConfig(**base)

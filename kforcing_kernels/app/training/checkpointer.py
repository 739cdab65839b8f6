"""One checkpointer per run, its format chosen once from the run's parallelism.

A sharded student (``--parallel fsdp``) is saved as DCP folders
(:mod:`~kforcing_kernels.app.training.sharded_checkpoint`:
every rank writes its shards; resumable on another world size); a whole one (``ddp``, one process) as
``step_*.safetensors`` + JSON (:mod:`~kforcing_kernels.app.training.checkpoint`, written by rank 0). Either way a
checkpoint is atomic, carries a manifest of its files, and resuming on the same world size repeats the
uninterrupted run bit for bit. The finished stage is exported whole, on rank 0, by the student's kind
(:meth:`~kforcing_kernels.app.student.ModelKind.save`: ``model.safetensors`` + ``model.json`` for the native model, a
``save_pretrained`` folder plus the noise embedding for a Hugging Face one), loadable by
:func:`~kforcing_kernels.app.student.load_student` either way.

The trainer never asks which format is in use: it calls :meth:`Checkpointer.save`, :meth:`~Checkpointer.load`
and :meth:`~Checkpointer.export` on every rank, and ranks that have no part in a whole-model write return at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..student import kind_of
from .checkpoint import load_checkpoint, read_checkpoint_meta, save_checkpoint
from .config import ConfigError
from .parallel import ParallelDims, full_copy
from .sharded_checkpoint import is_sharded, load_sharded_checkpoint, read_sharded_meta, save_sharded_checkpoint


def read_meta(path: Path) -> dict:
    """A checkpoint's settings, model config and provenance (either format), read before anything is built."""
    return (read_sharded_meta if is_sharded(path) else read_checkpoint_meta)(path)


class Checkpointer:
    """The checkpoints of the run in ``out`` (keeping the newest ``keep``), in the format ``dims`` needs."""

    def __init__(self, out: Path, dims: ParallelDims, keep: int):
        self.out, self.dims, self.keep = Path(out), dims, keep

    @property
    def sharded(self) -> bool:
        """DCP folders written by every rank (a sharded student), else whole-model files written by rank 0."""
        return self.dims.shard

    def save(self, step: int, model, optimizer, scaler, train_config: dict, info: dict) -> Optional[Path]:
        """Every rank calls it; returns the checkpoint's path on the ranks that wrote it."""
        if self.sharded:
            return save_sharded_checkpoint(self.out, step, model, optimizer, scaler, train_config, info, self.keep)
        if self.dims.main:
            return save_checkpoint(self.out, step, model, optimizer, scaler, train_config, info, self.keep)
        return None

    def load(self, path: Path, model, optimizer, scaler) -> int:
        """Restore model, optimizer and scaler state on every rank; returns the step it was saved after."""
        if is_sharded(path) != self.sharded:  # the settings check names --parallel first; this is the same refusal
            raise ConfigError(
                f"parallel: {path} is {'a sharded' if is_sharded(path) else 'a whole-model'} checkpoint; "
                f"resume it with --parallel {'fsdp' if is_sharded(path) else 'ddp'}"
            )
        return (load_sharded_checkpoint if self.sharded else load_checkpoint)(path, model, optimizer, scaler)["step"]

    def export(self, student, record: Optional[dict], corpus=None) -> None:
        """The finished stage as a model folder (``out``), written by rank 0 through the student's kind (``corpus``: the
        text it was trained on, whose tokenizer a kind may save beside it); a collective when sharded."""
        final = full_copy(student, self.dims.main)  # under FSDP every rank takes part; rank 0 gets the weights
        if self.dims.main:
            if final is None or record is None:
                raise RuntimeError("export: rank 0 holds the full model and its record")
            kind_of(final).save(self.out, final, record, corpus)

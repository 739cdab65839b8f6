"""The whole K-Forcing schedule from one config: Stage 0 -> Stage 1 -> Stage 2 (k=2) -> ... -> Stage 2 (k=k_final).

    python -m kforcing_kernels.train pipeline --out runs/x
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checkpoint import read_json
from .train import ConfigError, TrainConfig, train
from .train_config import existing_run


@dataclass
class PipelineConfig:
    """All stages from one config: 0 -> 1 -> 2 (k=2) -> ... -> 2 (k=k_final)."""

    out: str = "runs/pipeline"
    k_final: int = 4
    steps_stage0: int = 1000
    steps_stage1: int = 300
    steps_stage2: int = 300  # each self-forcing round
    lr_stage0: float = 1e-3
    lr_distill: float = 5e-4
    batch_size_distill: Optional[int] = None  # default: the stage-0 batch size

    def stage_folders(self) -> list[tuple[str, Path]]:
        out = Path(self.out)
        rounds = [("stage0", out / "stage0"), ("stage1", out / "stage1")]
        k = 2
        while k <= self.k_final:
            rounds.append(("stage2", out / f"stage2_k{k}"))
            k *= 2
        return rounds


def run_pipeline(pipe: PipelineConfig, base: TrainConfig) -> dict:
    """Train every stage in turn.

    A finished stage (model.json present) is skipped, unless ``base.overwrite`` (then every stage is
    trained again). With ``base.resume`` a stage with checkpoints continues and a stage not yet
    started starts; a partial stage without ``--resume`` or ``--overwrite`` is refused by :func:`train`.
    """
    if pipe.k_final < 1 or pipe.k_final & (pipe.k_final - 1):
        raise ConfigError(f"k_final: expected a power of two >= 1 (windows double: 1 -> 2 -> 4 ...), got {pipe.k_final}")
    summaries, teacher = {}, None
    for stage, folder in pipe.stage_folders():
        distill = stage != "stage0"
        cfg = dataclasses.replace(
            base, stage=stage, out=str(folder), teacher=str(teacher) if teacher else None,
            steps={"stage0": pipe.steps_stage0, "stage1": pipe.steps_stage1, "stage2": pipe.steps_stage2}[stage],
            lr=pipe.lr_distill if distill else pipe.lr_stage0,
            batch_size=(pipe.batch_size_distill or base.batch_size) if distill else base.batch_size,
        )
        if base.resume and not existing_run(folder):
            cfg = dataclasses.replace(cfg, resume=False)  # this stage has not started: nothing to resume
        if (folder / "model.json").exists() and not base.overwrite:
            print(f"[pipeline] {folder} is done; skipping", file=sys.stderr)
            summaries[folder.name] = read_json(folder / "model.json").get("summary", {})
        else:
            summaries[folder.name] = train(cfg)
        teacher = folder
    return summaries

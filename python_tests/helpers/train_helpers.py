"""Shared pieces of the trainer tests: small real corpora and the micro training config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO
from kforcing_kernels.app.training.config import TrainConfig

VOCAB = 300


def torchrun(nproc: int, *args, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGS`` from the repository root, one thread per rank, this
    checkout and python_tests/ importable; with ``check``, a failed launch fails the test with its output's tail."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "python_tests"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *map(str, args),
    ]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result


def write_json_package(folder: Path, one_document_per_line: bool = False) -> Path:
    """The json package's source as a corpus in ``folder`` (created if missing): one file per module, or
    one short document per non-blank line."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    if one_document_per_line:
        lines = [line for text in sources for line in text.splitlines() if line.strip()]
        for i, line in enumerate(lines):
            (folder / f"{i:05d}.py").write_text(line + "\n")
    else:
        for path in sorted(Path(json.__file__).parent.glob("*.py")):
            (folder / path.name).write_text(path.read_text())
    return folder


def micro_config(out, corpus_dir, **kw) -> TrainConfig:
    """A few steps of the micro preset on ``corpus_dir``; keywords override the defaults."""
    base = dict(
        stage="stage0",
        out=str(out),
        data=str(corpus_dir),
        vocab_size=VOCAB,
        preset="micro",
        seq_len=16,
        steps=6,
        batch_size=4,
        warmup_steps=2,
        log_every=1,
        ckpt_every=100,
        eval_batches=1,
        progress=False,
        lr=3e-3,
    )
    base.update(kw)
    return TrainConfig(**base)

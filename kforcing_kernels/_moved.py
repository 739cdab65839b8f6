"""Where the application modules of 0.2 went in 0.3: an import of an old name fails with an error that says.

0.2 kept the application at the package root (``kforcing_kernels.train``, ``.inference``, ...); 0.3 moved it into
:mod:`kforcing_kernels.app` so that the library (layouts, ops, model, parallel, integrations, sdpa) stands apart.
Nothing is aliased: importing a 0.2 module name, or ``python -m`` on one, raises ``ModuleNotFoundError`` naming its
new module and the 0.2 names of it that moved elsewhere, were renamed or were removed (:data:`MOVED_0_2`, the table
of CHANGELOG.md, "Moved in 0.3"). The finder sits last on ``sys.meta_path``: it is asked only about modules no other
finder found (a prefix test and a dict lookup).
"""

from __future__ import annotations

import importlib.abc
import sys

_PREFIX = "kforcing_kernels."

# 0.2 module (under kforcing_kernels.) -> (its 0.3 module, {0.2 name that is not found there: where it is, or why not}).
MOVED_0_2: dict[str, tuple[str, dict[str, str]]] = {
    "train": (
        "kforcing_kernels.app.train",
        {
            "evaluate_loss": "kforcing_kernels.app.training.loop.evaluate_loss",
            "learning_rate": "kforcing_kernels.app.training.loop.learning_rate",
            "DistInfo": "removed: where a rank sits is kforcing_kernels.app.training.parallel.ParallelDims",
            "setup_distributed": "removed: kforcing_kernels.app.training.parallel.setup_parallel(device, "
            "context_parallel, parallel) sets up the process group and the dp x cp device mesh",
        },
    ),
    "train_config": (
        "kforcing_kernels.app.training.config",
        {
            "validate_config": "kforcing_kernels.app.training.validation.validate_config",
            "check_splits": "kforcing_kernels.app.training.validation.check_splits",
            "changed_settings": "kforcing_kernels.app.training.provenance.changed_settings",
            "RUN_FILES": "kforcing_kernels.app.training.run_folder.RUN_FILES",
            "existing_run": "kforcing_kernels.app.training.run_folder.existing_run",
            "prepare_out": "kforcing_kernels.app.training.run_folder.prepare_out",
        },
    ),
    "pipeline": ("kforcing_kernels.app.training.pipeline", {}),
    "objectives": (
        "kforcing_kernels.app.training.objectives",
        {
            "window_tokens": "kforcing_kernels.app.training.objectives.crop_tokens",
        },
    ),
    "data": (
        "kforcing_kernels.app.data",
        {
            "sample_windows": "kforcing_kernels.app.data.sample_crops",
            "document_offsets": "kforcing_kernels.layouts.positions.document_offsets",
        },
    ),
    "checkpoint": (
        "kforcing_kernels.app.training.checkpoint",
        {
            "atomic_write": "kforcing_kernels.app.files.atomic_write",
            "append_jsonl": "kforcing_kernels.app.files.append_jsonl",
        },
    ),
    "evaluate": (
        "kforcing_kernels.app.evaluation.evaluate",
        {
            "format_table1": "kforcing_kernels.app.evaluation.report.format_table1",
            "format_tau_table": "kforcing_kernels.app.evaluation.report.format_tau_table",
            "format_nll_table": "kforcing_kernels.app.evaluation.report.format_nll_table",
            "plot_summary": "kforcing_kernels.app.evaluation.report.plot_summary",
        },
    ),
    "demo": ("kforcing_kernels.app.demo", {}),
    "inference": ("kforcing_kernels.app.generation.inference", {}),
    "serving": ("kforcing_kernels.app.generation.serving", {}),
    "paged_cache": (
        "kforcing_kernels.app.generation.paged_cache",
        {
            "paged_trunk": "removed: the model reads the paged cache in place, "
            "model.trunk(x, positions, None, past=cache.views(rows))",
        },
    ),
    "cli_common": ("kforcing_kernels.app.cli", {}),
}


def message(old: str) -> str:
    """The error of an import of ``kforcing_kernels.<old>`` (a key of :data:`MOVED_0_2`)."""
    new, names = MOVED_0_2[old]
    text = f"{_PREFIX}{old} moved to {new} in kforcing_kernels 0.3"
    if names:
        text += "; of its 0.2 names " + "; ".join(
            f"{name} is {where}" if not where.startswith("removed") else f"{name} was {where}"
            for name, where in names.items()
        )
    return text + " (CHANGELOG.md, 'Moved in 0.3')"


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX) :] in MOVED_0_2:
            raise ModuleNotFoundError(message(fullname[len(_PREFIX) :]), name=fullname)
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (called by ``kforcing_kernels/__init__.py``)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())

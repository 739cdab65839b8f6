"""Modules that moved in 0.3, still importable (and runnable with ``python -m``) under their old names.

The application (trainer, pipeline, data, checkpoints, evaluation, demo, inference, serving,
paged cache) moved from the package root into :mod:`kforcing_kernels.app` so that the library
(layouts, ops, model, integrations, sdpa) stands apart. For one release, importing an old name
gives the new module itself (``kforcing_kernels.train is kforcing_kernels.app.train``) with a
DeprecationWarning, and ``python -m kforcing_kernels.train ...`` runs the new module after a
notice on stderr. Names that moved to another module (``train()`` now lives in ``app.trainer``)
are listed in :data:`MOVED_NAMES` and are found through the old module with the same warning, as
are the names renamed in 0.3 (:data:`RENAMED`: ``data.sample_windows`` is ``data.sample_crops``).

Cost (measured with ``python -X importtime -c "import kforcing_kernels"`` on a loaded 2-core machine):
importing this module takes about 1 ms of the package's import (seconds, torch included). :func:`install`
appends one finder to ``sys.meta_path``; sitting last, it is asked only about modules the standard finders
did not find (a prefix test and a dict lookup). The renamed names cost nothing until
looked up: the modules' ``__getattr__`` runs only for names they lack. The 0.3 aliases go in 0.4.

Later in 0.3 the app's modules were grouped by job (``app/training``, ``app/generation``, ``app/evaluation``,
``app/hf_recipe``): ``kforcing_kernels.app.trainer`` is ``kforcing_kernels.app.training.loop`` and so on
(the ``"app.*"`` entries of :data:`MOVED_MODULES`), aliased the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module (under kforcing_kernels.) -> new module
MOVED_MODULES = {
    "train": "kforcing_kernels.app.train",
    "train_config": "kforcing_kernels.app.training.config",
    "pipeline": "kforcing_kernels.app.training.pipeline",
    "objectives": "kforcing_kernels.app.training.objectives",
    "data": "kforcing_kernels.app.data",
    "checkpoint": "kforcing_kernels.app.training.checkpoint",
    "evaluate": "kforcing_kernels.app.evaluation.evaluate",
    "demo": "kforcing_kernels.app.demo",
    "inference": "kforcing_kernels.app.generation.inference",
    "serving": "kforcing_kernels.app.generation.serving",
    "paged_cache": "kforcing_kernels.app.generation.paged_cache",
    "cli_common": "kforcing_kernels.app.cli",
    # the app's modules grouped by job (training/, generation/, evaluation/, hf_recipe/), later in 0.3
    "app.trainer": "kforcing_kernels.app.training.loop",
    "app.train_config": "kforcing_kernels.app.training.config",
    "app.objectives": "kforcing_kernels.app.training.objectives",
    "app.parallel": "kforcing_kernels.app.training.parallel",
    "app.context_parallel": "kforcing_kernels.app.training.context_parallel",
    "app.checkpoint": "kforcing_kernels.app.training.checkpoint",
    "app.sharded_checkpoint": "kforcing_kernels.app.training.sharded_checkpoint",
    "app.pipeline": "kforcing_kernels.app.training.pipeline",
    "app.inference": "kforcing_kernels.app.generation.inference",
    "app.paged_cache": "kforcing_kernels.app.generation.paged_cache",
    "app.serving": "kforcing_kernels.app.generation.serving",
    "app.generation_checks": "kforcing_kernels.app.generation.checks",
    "app.evaluate": "kforcing_kernels.app.evaluation.evaluate",
    "app.report": "kforcing_kernels.app.evaluation.report",
    "app.noise_diagnosis": "kforcing_kernels.app.evaluation.noise_diagnosis",
    "app.hf_student": "kforcing_kernels.app.hf_recipe.student",
    "app.hf_files": "kforcing_kernels.app.hf_recipe.files",
    "app.hf_trainer": "kforcing_kernels.app.hf_recipe.trainer",
}
# Names the old kforcing_kernels.train offered that now live in the loop's module.
MOVED_NAMES = {"kforcing_kernels.app.train": ("kforcing_kernels.app.training.loop", "kforcing_kernels.app.training.stage",
                                              "kforcing_kernels.app.training.checkpoint", "kforcing_kernels.app.training.config")}
# Names of 0.2 modules that moved to another module or were renamed in 0.3: (module, old name) -> "module:new name".
# Found through the module (old or new name) with the same DeprecationWarning; removed with the module aliases in 0.4.
RENAMED = {
    ("kforcing_kernels.app.data", "sample_windows"): "kforcing_kernels.app.data:sample_crops",
    ("kforcing_kernels.app.data", "document_offsets"): "kforcing_kernels.layouts.positions:document_offsets",
    ("kforcing_kernels.app.training.objectives", "window_tokens"): "kforcing_kernels.app.training.objectives:crop_tokens",
    ("kforcing_kernels.app.training.checkpoint", "atomic_write"): "kforcing_kernels.app.files:atomic_write",
    ("kforcing_kernels.app.training.checkpoint", "append_jsonl"): "kforcing_kernels.app.files:append_jsonl",
    ("kforcing_kernels.app.evaluation.evaluate", "format_table1"): "kforcing_kernels.app.evaluation.report:format_table1",
    ("kforcing_kernels.app.evaluation.evaluate", "format_tau_table"): "kforcing_kernels.app.evaluation.report:format_tau_table",
    ("kforcing_kernels.app.evaluation.evaluate", "format_nll_table"): "kforcing_kernels.app.evaluation.report:format_nll_table",
    ("kforcing_kernels.app.evaluation.evaluate", "plot_summary"): "kforcing_kernels.app.evaluation.report:plot_summary",
}
# 0.2 names with no equivalent to alias: the error says what replaced them (CHANGELOG, breaking changes of 0.3).
REMOVED = {
    ("kforcing_kernels.app.train", "DistInfo"): (
        "was removed in kforcing_kernels 0.3: where a rank sits is kforcing_kernels.app.training.parallel.ParallelDims"),
    ("kforcing_kernels.app.train", "setup_distributed"): (
        "was removed in kforcing_kernels 0.3: kforcing_kernels.app.training.parallel.setup_parallel(device, context_parallel, "
        "parallel) sets up the process group and the dp x cp device mesh"),
    ("kforcing_kernels.app.generation.paged_cache", "paged_trunk"): (
        "was removed in kforcing_kernels 0.3: the model reads the paged cache in place, "
        "model.trunk(x, positions, None, past=cache.views(rows))"),
}

_PREFIX = "kforcing_kernels."


def _notice(old: str, new: str) -> str:
    return f"{old} moved to {new} in kforcing_kernels 0.3; the old name will be removed in 0.4"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(_notice(self.old, self.new), DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system sets __spec__ to the alias's; exec_module puts it back
        return module

    def exec_module(self, module) -> None:  # the new module is already executed
        module.__spec__ = self._spec
        sys.modules[self.old] = module

    def get_code(self, fullname):
        # runpy (python -m old.name) asks for code to run as __main__: run the new module instead.
        source = (f"import runpy, sys\nprint({_notice(self.old, self.new)!r}, file=sys.stderr)\n"
                  f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n")
        return compile(source, f"<{self.old}>", "exec")

    def is_package(self, fullname) -> bool:
        return False


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        new = MOVED_MODULES.get(fullname[len(_PREFIX):])
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (called by ``kforcing_kernels/__init__.py``)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


def module_getattr(module_name: str):
    """The module ``__getattr__`` of a module whose 0.2 names moved or were renamed: ``__getattr__ = module_getattr(__name__)``.

    It answers :func:`moved_name` for every name the module lacks, and AttributeError for dunders (the import
    system probes ``__path__`` and others while aliasing the module)."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return moved_name(module_name, name)

    return __getattr__


def moved_name(module_name: str, name: str):
    """``module.<name>`` for a name that moved out of ``module_name`` or was renamed (:data:`MOVED_NAMES`,
    :data:`RENAMED`), with a DeprecationWarning; else AttributeError (naming the replacement, :data:`REMOVED`)."""
    renamed = RENAMED.get((module_name, name))
    if renamed is not None:
        home, new_name = renamed.split(":")
        old = f"{_PREFIX}{module_name.rsplit('.', 1)[1]}.{name}"
        warnings.warn(f"{old} is {home}.{new_name} since kforcing_kernels 0.3; the old name will be removed in 0.4",
                      DeprecationWarning, stacklevel=3)
        return getattr(importlib.import_module(home), new_name)
    if (module_name, name) in REMOVED:
        raise AttributeError(f"{module_name}.{name} {REMOVED[(module_name, name)]}")
    for target in MOVED_NAMES.get(module_name, ()):
        module = importlib.import_module(target)
        if hasattr(module, name):
            value = getattr(module, name)
            home = getattr(value, "__module__", None) or target
            warnings.warn(f"{module_name}.{name}: import it from {home} (moved in kforcing_kernels 0.3)", DeprecationWarning,
                          stacklevel=3)
            return value
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

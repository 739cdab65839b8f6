"""Modules that moved in 0.3, still importable (and runnable with ``python -m``) under their old names.

The application (trainer, pipeline, data, checkpoints, evaluation, demo, inference, serving,
paged cache) moved from the package root into :mod:`kforcing_kernels.app` so that the library
(layouts, ops, model, integrations, sdpa) stands apart. For one release, importing an old name
gives the new module itself (``kforcing_kernels.train is kforcing_kernels.app.train``) with a
DeprecationWarning, and ``python -m kforcing_kernels.train ...`` runs the new module after a
notice on stderr. Names that moved to another module (``train()`` now lives in ``app.trainer``)
are listed in :data:`MOVED_NAMES` and are found through the old module with the same warning.
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
    "train_config": "kforcing_kernels.app.train_config",
    "pipeline": "kforcing_kernels.app.pipeline",
    "objectives": "kforcing_kernels.app.objectives",
    "data": "kforcing_kernels.app.data",
    "checkpoint": "kforcing_kernels.app.checkpoint",
    "evaluate": "kforcing_kernels.app.evaluate",
    "demo": "kforcing_kernels.app.demo",
    "inference": "kforcing_kernels.app.inference",
    "serving": "kforcing_kernels.app.serving",
    "paged_cache": "kforcing_kernels.app.paged_cache",
    "cli_common": "kforcing_kernels.app.cli",
}
# Names the old kforcing_kernels.train offered that now live in the loop's module.
MOVED_NAMES = {"kforcing_kernels.app.train": "kforcing_kernels.app.trainer"}

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


def moved_name(module_name: str, name: str):
    """``module.<name>`` for a name that moved out of ``module_name`` (see :data:`MOVED_NAMES`), or AttributeError."""
    target = MOVED_NAMES.get(module_name)
    if target is not None:
        module = importlib.import_module(target)
        if hasattr(module, name):
            value = getattr(module, name)
            home = getattr(value, "__module__", None) or target
            warnings.warn(f"{module_name}.{name}: import it from {home} (moved in kforcing_kernels 0.3)", DeprecationWarning,
                          stacklevel=3)
            return value
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

"""One backend registry for every op: backends declared as data, loaded lazily, absent with a reason.

An op (``window_attention``, ``paged_attention``, ``sampling``) declares its backends as
:class:`BackendSpec` rows (name, module path, the device types it runs on) and which one it
prefers per device type; :class:`OpRegistry` is all the op needs to validate a ``backend=``
argument, load a backend, say which are usable here and why not, and pick the default. A backend
module provides ``available() -> Optional[str]`` (None when usable, else the reason) and may
provide ``supports(dtype, head_dim) -> bool`` (the default choice skips it otherwise; a backend
whose answer depends on the head dim lists the head dims it can take as ``HEAD_DIMS``, and
``supports`` is then asked about those only, else with ``head_dim=None``) and
``preferred() -> bool`` (present but slower than the next choice here, e.g. cpp's portable
build) and ``limits() -> Optional[str]`` (usable, but not for everything: flex has no backward on CPU
tensors; :meth:`OpRegistry.limits` collects these notes, ``available()`` stays None for it). A backend that is not built
or cannot import is reported absent with its reason; it is never faked, and ``reference`` is a backend like any other.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Optional

import torch


@dataclass(frozen=True)
class BackendSpec:
    """One backend of one op: what it is called, where it lives and where it runs."""

    name: str
    module: str  # import path of the module implementing the op's backend protocol
    devices: tuple[str, ...]  # device types it computes on ("cpu", "cuda"); ("*",) for any
    summary: str = ""

    def runs_on(self, device_type: str) -> bool:
        return "*" in self.devices or device_type in self.devices


class OpRegistry:
    """The backends of one op and its default choice per device type.

    Args:
        op: the op's name (used in messages).
        backends: its backends, in a fixed order (what ``names`` lists).
        preference: per device type, the backends to try in order for ``backend=None``;
            the first that is available, preferred here and supports the inputs wins.
        fallback: the backend used when none of the preferred ones qualifies (must run anywhere).
        override: optional callable returning a forced backend name (an environment switch), or None.
        override_name: what the forced name is called in errors (the environment variable).
    """

    def __init__(
        self,
        op: str,
        backends: tuple[BackendSpec, ...],
        preference: Mapping[str, tuple[str, ...]],
        fallback: str,
        override: Optional[Callable[[], Optional[str]]] = None,
        override_name: str = "backend override",
    ):
        self.op = op
        self.specs = {spec.name: spec for spec in backends}
        self.names = tuple(self.specs)
        unknown = {n for names in preference.values() for n in names} - set(self.specs)
        if unknown or fallback not in self.specs:
            raise ValueError(
                f"{op}: preference/fallback name unknown backends {sorted(unknown | ({fallback} - set(self.specs)))}"
            )
        self.preference = dict(preference)
        self.fallback = fallback
        self.override = override
        self.override_name = override_name

    def check_name(self, name: Optional[str], argument: str = "backend") -> None:
        """Raise ValueError naming ``argument`` unless ``name`` is None or one of :attr:`names`."""
        if name is not None and name not in self.specs:
            raise ValueError(f"{argument}: expected one of {self.names} or None, got {name!r}")

    def load(self, name: str) -> tuple[Optional[ModuleType], Optional[str]]:
        """(module, None) when usable here, else (module or None, why not)."""
        spec = self.specs[name]
        try:
            module = importlib.import_module(spec.module)
        except ImportError as exc:  # not built / dependency missing
            return None, f"cannot import {spec.module}: {exc}"
        return module, module.available()

    def available(self) -> dict[str, Optional[str]]:
        """``{backend: None if usable here, else the reason it is absent}``."""
        return {name: self.load(name)[1] for name in self.names}

    def limits(self) -> dict[str, str]:
        """``{backend: what it cannot do}`` for the usable backends that declare a limit (``limits()``)."""
        notes = {}
        for name in self.names:
            module, reason = self.load(name)
            note = module.limits() if module is not None and reason is None and hasattr(module, "limits") else None
            if note:
                notes[name] = note
        return notes

    def get(self, name: str) -> ModuleType:
        """The backend's module; ValueError for an unknown name, RuntimeError (with the reason) if absent."""
        self.check_name(name)
        module, reason = self.load(name)
        if module is None or reason is not None:  # module None comes with a reason
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
        return module

    def choices(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> tuple:
        """The default choice for inputs on ``device`` (of ``dtype`` when given) as data: ``((name, head_dims), ...)``
        in order, ``head_dims`` None (any head dim) or the tuple the backend takes; the fallback ends it.

        The first entry whose head dims hold the input's is the default. Plain constants: under
        torch.compile the op computes them once per device and dtype (``assume_constant_result``) and
        picks by a head dim that may be symbolic (``dynamic=True``).
        """
        forced = self.override() if self.override is not None else None
        if forced:
            self.check_name(forced, self.override_name)  # a typo in the switch names the switch
            return ((forced, None),)
        out = []
        for name in self.preference.get(torch.device(device).type, ()):
            module, reason = self.load(name)
            if reason is not None:
                continue
            if not getattr(module, "preferred", lambda: True)():
                continue
            supports = getattr(module, "supports", None)
            dims = getattr(module, "HEAD_DIMS", None)
            if supports is not None and dtype is not None:
                if dims is not None:
                    dims = tuple(d for d in dims if supports(dtype, d))
                    if not dims:
                        continue
                elif not supports(dtype, None):
                    continue
            out.append((name, None if dims is None else tuple(dims)))
        out.append((self.fallback, None))
        return tuple(out)

    def default(self, device: torch.device, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None) -> str:
        """The backend ``backend=None`` runs for inputs on ``device`` (of ``dtype`` / ``head_dim`` when given)."""
        table = self.choices(device, dtype if head_dim is not None else None)
        return pick(table, head_dim)


def pick(choices: tuple, head_dim) -> str:
    """The first backend of :meth:`OpRegistry.choices` that takes ``head_dim`` (None: any; a SymInt under compile)."""
    for name, dims in choices:
        if dims is None or head_dim is None or head_dim in dims:
            return name
    raise AssertionError("OpRegistry.choices ends with the fallback, which takes any head dim")

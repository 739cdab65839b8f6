"""Deterministic memory accounting on any device (CPU included): live tensor bytes and autograd's saved bytes.

* :class:`AllocationTracker` (a ``TorchDispatchMode``): the bytes of every storage an operator returns while it
  is on, counted from its allocation until its last reference dies (a ``weakref.finalize`` on the storage), and
  the peak of their sum. On CPU, where torch keeps no allocator statistics, this is the peak a step adds on
  top of what existed before it (weights, optimizer state, the batch). It does not see scratch memory a kernel
  allocates and frees inside itself (e.g. inside one C++ op), nor storages made outside the dispatcher.
* :class:`SavedTensors`: the bytes of the tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, with the storage's full size (a saved
  view pins its whole base), parameters excluded.

Both count bytes, not time, so they give the same numbers on a busy machine and on a quiet one.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker() as t: ...`` -> ``t.peak`` / ``t.current``: bytes of the storages made inside.

    A storage is counted once (views share it) from the operator that returned it until it is freed.
    ``device``: count only storages on this device type (None: all).
    """

    def __init__(self, device: Optional[str] = None):
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self._live: dict[int, weakref.finalize] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place op returns an input's storage: not an allocation (it may predate the tracker).
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or (self.device is not None and t.device.type != self.device):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._live or key in inputs:
                continue
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self._live[key] = weakref.finalize(storage, self._free, key, nbytes)
        return out

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.current


class SavedTensors:
    """Bytes autograd saves for backward while :meth:`context` is on: each storage once, at its full size.

    ``exclude``: tensors not to count (parameters: they exist anyway). ``by_size`` lists what was saved.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self.views: dict[int, int] = {}  # storage -> bytes of the largest saved view of it (what a copy would hold)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and storage.nbytes():
            self.storages[key] = storage.nbytes()
            self.views[key] = max(self.views.get(key, 0), t.numel() * t.element_size())
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        """Bytes of the saved storages (each once, whole)."""
        return sum(self.storages.values())

    @property
    def pinned_excess(self) -> int:
        """Bytes held only because a saved view pins a larger storage (whole storage minus the view's bytes)."""
        return sum(self.storages[key] - self.views[key] for key in self.storages)

    def by_size(self) -> list[int]:
        return sorted(self.storages.values(), reverse=True)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``getrusage``; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""What a layout derives from its numbers, computed once: one store per layout content.

A ``WindowLayout`` never changes, so everything derived from it (its row intervals and
slot-to-key table, the composite backend's window pieces, the Triton tile plans and
their device copies) is built at most once and kept in a plain dict that the layout
owns, through one method: ``layout.derived(name, build)``. ``name`` is any hashable
key (by convention ``"owner.what"`` plus whatever the artifact depends on, e.g. the
tile shapes, the device, the CUDA stream); ``build()`` makes the artifact on a miss.
Nothing is keyed by ``id()``: the store lives and dies with its layouts.

Equal layouts share one store. The first layout that derives anything registers itself
under its content key (``WindowLayout.cache_key``: ints, flags and the range tensors'
bytes) in one small table, ``canonical``; an equal layout made later (by a constructor
again, or rebuilt from the custom op's arguments by ``op.layout_from_args``, which looks
the table up before building anything) adopts that store. So a layout that round-trips
through the custom op reuses the plans its eager twin built, and vice versa.

Bounds: the table keeps the ``INTERN_MAX`` contents most recently looked up (a layout
that has adopted a store keeps it when its entry is dropped). A store keeps at most
``STORE_MAX`` artifacts and is emptied when full: device copies are keyed by CUDA stream,
the one key that can keep growing, and everything in a store can be rebuilt, so
emptying costs time only.

Threads: dict reads and writes are atomic under the GIL. Two threads deriving the same
missing artifact may both build it; ``setdefault`` makes them return the same object.
The table's LRU bookkeeping runs under a lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable, Optional, Sequence, TypeVar, cast

import torch

from .base import LayoutBase

INTERN_MAX = 64
STORE_MAX = 64

T = TypeVar("T")
L = TypeVar("L", bound=LayoutBase)
_MISSING = object()
_interned: "collections.OrderedDict[tuple, LayoutBase]" = collections.OrderedDict()
_lock = threading.Lock()


def clear_interned() -> None:
    """Empty the table of registered contents: equal layouts made afterwards build their derived data again
    (benchmarks timing a layout's construction from nothing; the layouts that exist keep their stores)."""
    with _lock:
        _interned.clear()


def content_key(
    n_ctx: int,
    num_windows: int,
    window_size: int,
    last_window_size: int,
    intra: str,
    queries: str,
    n_streams: int,
    ranges: Sequence[Optional[torch.Tensor]],
) -> tuple:
    """The hashable identity of a layout's content. ``ranges``: int64 CPU tensors (None: a default range)
    ``(prefix_lo, prefix_hi, context_lo, context_hi, live_slots, prefix_slide_lo, prefix_slide_hi)``, kept as
    ``(shape, bytes)``."""
    blobs = tuple(None if t is None else (tuple(t.shape), t.numpy().tobytes()) for t in ranges)
    return (n_ctx, num_windows, window_size, last_window_size, intra, queries, n_streams, *blobs)


def canonical(key: tuple, make: Callable[[], L]) -> L:
    """The registered layout whose content key is ``key``; registers ``make()`` when there is none."""
    with _lock:
        layout = _interned.get(key)
        if layout is not None:
            _interned.move_to_end(key)
            return cast(L, layout)  # registered by a make() of the same class (every caller makes WindowLayouts)
    layout = make()  # outside the lock: building a layout validates its ranges
    with _lock:
        registered = _interned.setdefault(key, layout)
        _interned.move_to_end(key)
        while len(_interned) > INTERN_MAX:
            _interned.popitem(last=False)
    return cast(L, registered)


def _store_of(layout: LayoutBase) -> dict:
    handle = layout.store
    if handle.artifacts is not None:
        return handle.artifacts
    owner = canonical(layout.cache_key, lambda: layout).store  # the first layout with this content
    shared = owner.artifacts if owner.artifacts is not None else owner.attach({})
    return handle.attach(shared)


def store_size(layout: LayoutBase) -> int:
    """How many artifacts ``layout``'s store holds now (0 before it derives anything): an inspection hook."""
    artifacts = layout.store.artifacts
    return 0 if artifacts is None else len(artifacts)


def derived(layout: LayoutBase, name: Hashable, build: Callable[[], T]) -> T:
    """The artifact ``name`` of ``layout`` (of every layout with its content), built by ``build()`` once."""
    store = _store_of(layout)
    value = store.get(name, _MISSING)
    if value is _MISSING:
        value = build()
        if len(store) >= STORE_MAX:
            store.clear()
        value = store.setdefault(name, value)
    return value

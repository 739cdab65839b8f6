"""``LayoutBase``: what a ``WindowLayout`` is to the modules its methods delegate to.

``window_layout.py`` defines the class and delegates to its helper modules (``constructors``, ``intervals``,
``derived``, ``flex``, ``query_rows``, ``sliding``); they read a layout through this interface and check
arguments with ``isinstance(x, LayoutBase)``, so they import this leaf module rather than ``window_layout``
(no import circle, ``python_tests/test_architecture.py`` counts ``TYPE_CHECKING`` imports too).
``WindowLayout`` is its one implementation; a ``QueryRowsLayout`` is not one (it is a view of one).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Hashable, Optional, TypeVar, Union

import torch

_T = TypeVar("_T")


class Store:
    """A layout's handle on its artifacts: ``artifacts`` is None until the layout first derives something,
    then the dict it shares with every equal layout. Set only by :meth:`attach` (through :func:`derived`)."""

    __slots__ = ("artifacts",)

    def __init__(self) -> None:
        self.artifacts: Optional[dict] = None

    def attach(self, artifacts: dict) -> dict:
        self.artifacts = artifacts
        return artifacts


class LayoutBase(abc.ABC):
    """The members of a ``WindowLayout`` its helper modules read (see ``window_layout.py`` for their meaning)."""

    n_ctx: int
    num_windows: int
    window_size: int
    last_window_size: int
    intra: str
    queries: str
    n_streams: int
    store: Store  # derived artifacts, shared by equal layouts (derived.py)

    @abc.abstractmethod
    def __init__(self, n_ctx: int, num_windows: int, window_size: int, prefix_lo, prefix_hi, **options: Any) -> None:
        """``WindowLayout``'s constructor (its keyword options: ``last_window_size``, ``intra``, ...)."""

    @property
    @abc.abstractmethod
    def prefix_lo(self) -> torch.Tensor: ...

    @property
    @abc.abstractmethod
    def prefix_hi(self) -> torch.Tensor: ...

    @property
    @abc.abstractmethod
    def context_lo(self) -> Optional[torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def context_hi(self) -> Optional[torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def prefix_slide_lo(self) -> Optional[torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def prefix_slide_hi(self) -> Optional[torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def live_slots(self) -> Optional[torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def has_sliding_context(self) -> bool: ...

    @property
    @abc.abstractmethod
    def range_batch(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def slots_per_stream(self) -> int: ...

    @property
    @abc.abstractmethod
    def n_keys(self) -> int: ...

    @property
    @abc.abstractmethod
    def n_queries(self) -> int: ...

    @property
    @abc.abstractmethod
    def query_offset(self) -> int: ...

    @property
    @abc.abstractmethod
    def cache_key(self) -> tuple: ...

    @property
    @abc.abstractmethod
    def row_intervals_int32(self) -> torch.Tensor: ...

    @property
    @abc.abstractmethod
    def cpu_query_tiles(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def window_lengths(self) -> torch.Tensor: ...

    @abc.abstractmethod
    def live_lengths(self) -> torch.Tensor: ...

    @abc.abstractmethod
    def row_intervals(self, copy: bool = True) -> torch.Tensor: ...

    @abc.abstractmethod
    def derived(self, name: Hashable, build: Callable[[], _T]) -> _T: ...

    @abc.abstractmethod
    def mask_mod(self, device: Union[str, torch.device] = "cpu"): ...

    @abc.abstractmethod
    def block_counts(self, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]: ...

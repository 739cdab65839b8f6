"""Fused GPU kernels (Triton) and the analytic tile plans they run.

``tile_plan`` is pure torch/python and always importable; the Triton module is
imported lazily by ``kforcing_kernels.backends.triton`` when the backend is used.
"""

from .tile_plan import DEFAULT_TILES, SLOT_WINDOW_MAX, Tiles, TilePlan, tile_plan

__all__ = ["DEFAULT_TILES", "SLOT_WINDOW_MAX", "Tiles", "TilePlan", "tile_plan"]

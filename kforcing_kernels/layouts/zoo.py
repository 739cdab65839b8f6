"""One shared set of layouts for tests and benchmarks.

``small()`` covers every family and every code path the backends have (short last
windows, long windows cut into row tiles, stream-major storage, per-batch ranges,
empty prefixes, packed documents, block-causal contexts, blank slots) at sizes an
fp64 dense oracle checks in milliseconds. ``bench(n, k)`` gives the benchmark
families at context length n and window k.
"""

from __future__ import annotations

from typing import Callable

import torch

from .window_layout import WindowLayout


def small() -> dict[str, WindowLayout]:
    """name -> layout, a few hundred tokens at most."""
    return {
        "causal": WindowLayout.causal(13),
        "causal_n1": WindowLayout.causal(1),
        "single_n1": WindowLayout.kforcing_single(1, 3),
        "single_k1": WindowLayout.kforcing_single(9, 1),
        "single_k3_odd": WindowLayout.kforcing_single(17, 3),
        "single_k16": WindowLayout.kforcing_single(7, 16),
        "single_large_window": WindowLayout.kforcing_single(5, 40),
        "single_multi_chunk": WindowLayout.kforcing_single(270, 1),  # > 1 key chunk, > 1 query tile
        "double_k2": WindowLayout.kforcing_double(11, 2),
        "double_k9": WindowLayout.kforcing_double(5, 9),  # window 18: tile products over 2 streams
        "sbd_short_last": WindowLayout.sbd(23, 4),
        "sbd_large_block": WindowLayout.sbd(70, 33),
        "ptp": WindowLayout.ptp(20, [5, 12, 20, 0], 6, [0, 4, 0, 0]),
        "ptp_empty_prefixes": WindowLayout.ptp(10, [0, 3, 10], 4, [0, 3, 2]),
        "ptp_per_batch": WindowLayout.ptp(16, [[3, 16], [9, 1]], 5, [[0, 2], [4, 0]]),
        "jacobi": WindowLayout.jacobi(6, 10),
        "jacobi_long_window": WindowLayout.jacobi(40, 150),  # one window cut into several row tiles
        "general_streams_full": WindowLayout(
            10, 4, 6, [0, 2, 5, 10], [3, 2, 9, 10], intra="full", queries="windows", n_streams=3
        ),
        # packed documents, block-causal contexts, BD3-LM, blank slots
        "causal_packed": WindowLayout.causal(19, cu_seqlens=[0, 5, 5, 12, 19]),
        "causal_block_packed": WindowLayout.causal(21, block=4, cu_seqlens=[0, 9, 21]),
        "single_packed": WindowLayout.kforcing_single(17, 3, cu_seqlens=[0, 1, 8, 17]),
        "single_packed_per_batch": WindowLayout.kforcing_single(12, 2, cu_seqlens=[[0, 12], [0, 4, 12]]),
        "double_packed": WindowLayout.kforcing_double(11, 2, cu_seqlens=[0, 6, 11]),
        "double_k9_packed": WindowLayout.kforcing_double(6, 9, cu_seqlens=[0, 2, 6]),
        "sbd_packed": WindowLayout.sbd(24, 4, cu_seqlens=[0, 8, 24]),
        "bd3lm": WindowLayout.bd3lm(16, 4),
        "bd3lm_packed_large_block": WindowLayout.bd3lm(72, 36, cu_seqlens=[0, 36, 72]),
        "ptp_doc_ends": WindowLayout.ptp(20, [5, 12, 20], 6, [0, 4, 12], doc_ends=[8, 12, 20]),
        "ptp_doc_ends_per_batch": WindowLayout.ptp(
            16, [[3, 16], [9, 1]], 5, [[0, 2], [4, 0]], doc_ends=[[5, 16], [9, 4]]
        ),
        "blank_full_windows": WindowLayout(8, 3, 40, [0, 2, 4], [3, 8, 8], intra="full", live_slots=[40, 7, 0]),
        # Block drafters: DFlash anchor blocks (per batch, dropped blocks), SpecForge's per-slot sliding
        # window over packed documents, speculators' block window with causal blocks.
        "anchor_blocks_per_batch": WindowLayout.anchor_blocks(
            20, [[0, 7, 19, 12], [20, 3, 3, 9]], 4, keep=[[True, True, False, True], [True, True, True, False]]
        ),
        "anchor_blocks_sliding_slot": WindowLayout.anchor_blocks(
            24, [5, 17, 23], 5, window=4, window_mode="slot", cu_seqlens=[0, 10, 24]
        ),
        "anchor_blocks_window_causal": WindowLayout.anchor_blocks(24, [[5, 17], [23, 2]], 3, intra="causal", window=6),
        "jacobi_batched": WindowLayout.jacobi([3, 6], num_blocks=[2, 1], block_size=[4, 3]),
    }


def bench(n: int, k: int) -> dict[str, WindowLayout]:
    """The benchmark families at context length ``n`` and window ``k``."""
    return {name: make(n, k) for name, make in BENCH_FAMILIES.items()}


def _doc_offsets(n: int, docs: int) -> list[int]:
    return [n * d // docs for d in range(docs + 1)]


BENCH_FAMILIES: dict[str, Callable[[int, int], WindowLayout]] = {
    "single": lambda n, k: WindowLayout.kforcing_single(n, k),
    "double": lambda n, k: WindowLayout.kforcing_double(n, k),
    "sbd": lambda n, k: WindowLayout.sbd(n, k),
    "ptp": lambda n, k: WindowLayout.ptp(n, torch.arange(n // 4, n + 1, max(1, n // 8)), 4 * k),
    "jacobi": lambda n, k: WindowLayout.jacobi(n // 2, n // 2),
    "single_packed8": lambda n, k: WindowLayout.kforcing_single(n, k, cu_seqlens=_doc_offsets(n, 8)),
    "bd3lm": lambda n, k: WindowLayout.bd3lm(n, k),
}

"""Layouts describe what attends to what; ops compute it.

    window_layout.py  WindowLayout: the mask family, its constructors and glossary
    intervals.py      the one derivation of its semantics: per-row key intervals
    documents.py      cu_seqlens (packed documents) and block helpers
    flex.py           FlexAttention interop (mask_mod, BlockMask) from the row intervals
    zoo.py            a shared set of layouts for tests and benchmarks
"""

from .window_layout import INTRA_MODES, QUERY_MODES, WindowLayout, ideal_causal_pairs

__all__ = ["WindowLayout", "ideal_causal_pairs", "INTRA_MODES", "QUERY_MODES"]

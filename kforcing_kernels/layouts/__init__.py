"""Layouts describe what attends to what; ops compute it.

window_layout.py  WindowLayout: the mask family, its glossary and what it derives
query_rows.py     QueryRowsLayout: a layout restricted to some query rows (context parallelism)
constructors.py   its named constructors (causal, kforcing_single, sbd, ptp, ...), as classmethods
intervals.py      the one derivation of its semantics: per-row key intervals
derived.py        the store of derived data per layout content (the caches keyed by a layout: DESIGN.md), interning
base.py           LayoutBase: what WindowLayout is to the modules above (they import it, not window_layout)
documents.py      cu_seqlens (packed documents), block helpers and int checks
positions.py      positions of every storage order and document offsets (model, HF integration, trainer)
flex.py           FlexAttention interop (mask_mod, BlockMask) from the row intervals
zoo.py            a shared set of layouts for tests and benchmarks
"""

from .query_rows import QueryRowsLayout
from .window_layout import INTRA_MODES, QUERY_MODES, WindowLayout, ideal_causal_pairs

__all__ = ["WindowLayout", "QueryRowsLayout", "ideal_causal_pairs", "INTRA_MODES", "QUERY_MODES"]

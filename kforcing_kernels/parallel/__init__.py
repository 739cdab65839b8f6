"""Training beyond one device on PyTorch's own distributed engine (library side; the trainer wires it).

balance.py           RowSplit / balanced_split: the query rows of one sequence over a CP group,
                     balanced by attended pairs (num_pairs) and rows
context_parallel.py  ContextParallel, context_parallel_attention: all-gathered K/V forward,
                     reduce-scattered dK/dV backward, each rank's rows via window_attention
cost.py              bytes a CP step communicates and keeps per rank (accounting for bench/)
rank_inputs.py       context_parallel_inputs: one rank's rows of the AR forward or SingleForward, embedded
                     (what both model kinds' context_parallel_forward run)
"""

from .balance import RowSplit, balanced_split
from .context_parallel import ContextParallel, RankRows, context_parallel_attention

__all__ = ["RowSplit", "balanced_split", "ContextParallel", "RankRows", "context_parallel_attention"]

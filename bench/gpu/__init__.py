"""GPU benchmarks and checks: Triton vs FlexAttention and SDPA, kernel profiles, the dispatch table, batch invariance,
host cost."""

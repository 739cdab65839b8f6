"""Training benchmarks: one step dense vs ours, memory, the teacher's placement, the Stage-1 curve, the demo's
budget."""

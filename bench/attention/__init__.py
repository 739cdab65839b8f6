"""Attention benchmarks on the CPU: the sweep, one shape against its peers, the C++ kernels, layouts, context
parallelism."""

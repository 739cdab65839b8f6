"""Benchmarks for kforcing_kernels (run as scripts or `python -m bench.<name>`)."""

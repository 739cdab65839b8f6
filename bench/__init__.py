"""Benchmarks for kforcing_kernels, a tool of the checkout (not installed with the package):
``python -m bench <command>`` from the repository root; ``python -m bench --help`` lists the commands.

Grouped by subject: ``attention/`` (CPU attention, layouts, context parallelism), ``training/``,
``inference/``, ``gpu/`` (Triton on CUDA, profiles, the GPU check, host cost). See BENCHMARKS.md.
"""

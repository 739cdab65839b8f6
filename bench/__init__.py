"""Benchmarks for kforcing_kernels: ``python -m bench <command>`` from the checkout (``kforcing-bench`` once
installed: the package installs this folder as ``kforcing_bench``, so modules here import each other relatively).

Commands: ``attention`` (the microbenchmark sweep, ``--quick`` for a short one),
``train`` (one self-forcing training step), ``infer`` (generation throughput),
``report`` / ``validate`` (reprint / check a sweep's JSON). ``python -m bench.attention``
times one shape. See README.md, section Benchmarks.
"""

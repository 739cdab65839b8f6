"""Benchmarks for kforcing_kernels: ``python -m bench <command>`` (or ``python bench/run.py``).

Commands: ``attention`` (the microbenchmark sweep, ``--quick`` for a short one),
``train`` (one self-forcing training step), ``infer`` (generation throughput),
``report`` / ``validate`` (reprint / check a sweep's JSON). ``python bench/attention.py``
times one shape. See README.md, section Benchmarks.
"""

"""The ``kforcing-bench`` console script: runs ``bench/`` of the source checkout this package was installed from.

The benchmarks are not part of the installed package (they compare against peers, write into the
repository's ``bench/results`` and need matplotlib): an editable install (``pip install -e .
--no-build-isolation``) or a source checkout finds them from any folder; a wheel install says where to get them.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def bench_root() -> Optional[str]:
    """The repository root holding ``bench/__main__.py`` next to this package, or None."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "bench", "__main__.py")) else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    root = bench_root()
    if root is None:
        print("kforcing-bench: the benchmarks live in the source repository (bench/), which this installation does not "
              "hold; clone the repository and install it with `pip install -e . --no-build-isolation`, or run "
              "`python path/to/repo/bench --help`", file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.__main__ import main as bench_main

    return bench_main(argv, prog="kforcing-bench")


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()

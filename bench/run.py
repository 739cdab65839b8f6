"""``python bench/run.py <command> [options]``: the same CLI as ``python -m bench``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="python bench/run.py"))

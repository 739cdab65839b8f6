"""``make demo``: until the trainer lands, the attention benchmark on the default shape."""

import os
import runpy
import sys


def main() -> None:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "attention.py")
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

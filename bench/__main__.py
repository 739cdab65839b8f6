"""``python -m bench <command> [options]`` (same as ``python bench/run.py``).

Commands:
    attention   the attention microbenchmark sweep (default; ``--quick`` for a short one)
    train       one self-forcing training step, dense-mask attention vs ours
    infer       inference throughput, AR vs K-Forcing
    validate    check an attention JSON report against its schema
    report      reprint an attention JSON report and redraw its plots
Run ``python -m bench <command> --help`` for a command's options.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMANDS = ("attention", "train", "infer", "validate", "report")


def main(argv=None, prog="python -m bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "attention"
    if argv and not argv[0].startswith("-") and command not in ("validate", "report"):
        print(f"unknown command {argv[0]!r}; expected one of {COMMANDS}", file=sys.stderr)
        return 2
    name = f"{prog} {command}"
    if command == "attention":
        from bench import sweep

        sweep.main(argv, prog=name)
    elif command == "train":
        from bench import train_step

        train_step.main(argv, prog=name)
    elif command == "infer":
        from bench import inference

        inference.main(argv, prog=name)
    elif command == "report":
        from bench import report

        return report.main(argv)
    else:
        return _validate(argv, prog=name)
    return 0


def _validate(argv, prog: str) -> int:
    """``validate REPORT.json [...]``: argparse front end (``--help``, and a clear error for a missing or bad file)."""
    import argparse
    import json

    from bench import schema

    p = argparse.ArgumentParser(prog=prog, description="Check attention JSON reports against bench/schema.py's schema.")
    p.add_argument("reports", nargs="+", metavar="REPORT.json", help="reports written by the attention sweep")
    args = p.parse_args(argv)
    for path in args.reports:
        if not os.path.isfile(path):
            p.error(f"REPORT.json: no such file: {path}")
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            p.error(f"REPORT.json: cannot read {path} as JSON: {exc}")
    return schema.main(args.reports)


if __name__ == "__main__":
    sys.exit(main())

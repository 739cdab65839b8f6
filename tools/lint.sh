#!/usr/bin/env bash
# The lint, the format check and the type check, before the tests (.ci/run): ruff over the tree and mypy, all
# configured in pyproject.toml ([tool.ruff], [tool.mypy]). Fails on the first tool that reports a finding.
#   tools/lint.sh                 # with .venv/bin/python when there is one, else python3
#   PYTHON=/path/to/python tools/lint.sh
# The tools come with the test extra (pip install -e ".[test]").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
echo "lint: ruff check ."
"$PYTHON" -m ruff check .
echo "lint: ruff format --check ."
"$PYTHON" -m ruff format --check .
echo "lint: mypy (the whole package, pyproject.toml [tool.mypy])"
"$PYTHON" -m mypy

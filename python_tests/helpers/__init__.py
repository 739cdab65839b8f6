"""What the tests share: the checkout's paths, model and data builders, the paper masks (no code shared with
the package), and the attention comparison helpers. Torchrun workers live in ``python_tests/workers/``."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root."""
TESTS = REPO / "python_tests"
WORKERS = TESTS / "workers"

"""`make mutate`'s list stays applicable: every mutation's target text is in its file exactly once.

A refactor that rewrites a mutated line silently retires the mutation (tools/mutate.py then
stops on it); this catches that in the ordinary suite, without running the mutations.
"""

import os

import pytest

from helpers import REPO
from tools import mutations

ROOT = str(REPO)


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m["id"])
def test_each_mutation_applies_exactly_once(mutation):
    with open(os.path.join(ROOT, mutation["file"])) as f:
        text = f.read()
    assert text.count(mutation["old"]) == 1, f"{mutation['id']}: {mutation['old']!r} in {mutation['file']}"
    assert mutation["new"] != mutation["old"]

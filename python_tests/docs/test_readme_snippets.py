"""Every ```python block of README.md and BENCHMARKS.md runs as written.

Each block runs alone in a fresh interpreter (so it must carry its own imports and
inputs), from a scratch directory, importing this checkout. A block may be preceded
by one marker line, an HTML comment that does not show when the Markdown is rendered:

    <!-- snippet: needs cuda -->     run only where torch sees a CUDA device
    <!-- snippet: skip REASON -->    never run here, for REASON (keep these few)

Any other ``<!-- snippet: ... -->`` is an error, so a typo cannot skip a block silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import REPO

ROOT = str(REPO)
DOCS = ("README.md", "BENCHMARKS.md")
MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->$")


def python_blocks(doc):
    """[(line of the opening fence, marker or None, code)] of the ```python blocks of ``doc``."""
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            previous = lines[start - 1].strip() if start > 0 else ""
            match = MARKER.match(previous)
            blocks.append((start + 1, match[1] if match else None, "\n".join(lines[start + 1 : j]) + "\n"))
            i = j
        i += 1
    return blocks


SNIPPETS = [(doc, line, marker, code) for doc in DOCS for line, marker, code in python_blocks(doc)]


def test_the_readme_has_runnable_snippets():
    readme = [s for s in SNIPPETS if s[0] == "README.md"]
    assert len(readme) >= 4, "README.md lost its examples"
    assert sum(marker is None for _, _, marker, _ in readme) >= 4, "most README snippets must run on CPU"


def test_every_marker_is_known_and_sits_on_a_python_block():
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
        for number, line in enumerate(lines, 1):
            if "<!-- snippet" not in line:
                continue
            match = MARKER.match(line.strip())
            assert match, f"{doc}:{number}: malformed marker {line.strip()!r}"
            assert match[1] == "needs cuda" or re.fullmatch(r"skip \S.*", match[1]), (
                f"{doc}:{number}: unknown marker {match[1]!r}"
            )
            assert number < len(lines) and lines[number].strip() == "```python", (
                f"{doc}:{number}: marker not right above a ```python block"
            )


@pytest.mark.parametrize("doc, line, marker, code", SNIPPETS, ids=[f"{d}:{n}" for d, n, _, _ in SNIPPETS])
def test_snippet_runs(doc, line, marker, code, tmp_path):
    if marker == "needs cuda" and not torch.cuda.is_available():
        pytest.skip(f"{doc}:{line} needs a CUDA device")
    if marker is not None and marker.startswith("skip "):
        pytest.skip(f"{doc}:{line}: {marker[5:]}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{doc}:{line} failed\n--- code\n{code}--- stderr\n{proc.stderr[-4000:]}"


def _slug(heading):
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_and_inside_the_docs_resolve():
    anchors = {
        doc: {
            _slug(line.lstrip("#")) for line in open(os.path.join(ROOT, doc), encoding="utf-8") if line.startswith("#")
        }
        for doc in DOCS
    }
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = path or doc
            assert os.path.exists(os.path.join(ROOT, linked)), f"{doc}: link to missing {linked}"
            if anchor:
                assert linked in anchors, f"{doc}: anchor into {linked}, which is not checked"
                assert anchor in anchors[linked], f"{doc}: no heading for #{anchor} in {linked}"

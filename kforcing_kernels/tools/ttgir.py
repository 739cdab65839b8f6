"""What a compiled Triton kernel's TTGIR says about Hopper features: wgmma use and loop pipelining.

Read from the TTGIR text (``CompiledKernel.asm["ttgir"]``, the last IR where Triton's own ops are
visible), with the same meaning under Triton 3.6 .. 3.9:

* ``dot_counts``: ``(wgmma, dots)``. ``wgmma`` counts ``ttng.warp_group_dot`` ops (Hopper warpgroup
  MMA; each lowers to several PTX ``wgmma.mma_async`` instructions, one per K step), ``dots`` counts
  every matrix product (``ttng.warp_group_dot`` + ``tt.dot``, the latter lowered to mma_v2/FMA).
  These are static op counts in the kernel text, not executed counts.
* ``main_loop_depth``: the software-pipelining depth of the kernel's main loop. Triton pipelines only
  innermost ``scf.for`` loops: it issues a load ``S - 1`` iterations ahead into a multi-buffered
  shared allocation (``ttg.async_copy_global_to_local``, or ``ttng.async_tma_copy_global_to_local``
  for TMA), ``S - 1`` such copies sit in the prologue before the loop and one in the loop body. So a
  loop's depth is ``1 + (most prologue copies into one of the buffers its body copies into)``: 3 for
  a loop whose loads run two iterations ahead (``num_stages=3``), 2 for one iteration ahead, and 0
  when the loop body issues no such copy (its loads are synchronous: nothing overlaps the math).
  Not used: the largest ``ttg.async_wait {num = N}``, which is 0 in a real two-stage pipeline
  (every outstanding copy is waited for one iteration after it was issued), nor the number of
  buffers (Triton keeps ``S - 1`` buffers when the operand goes through registers).

  The main loop is the innermost loop that (transitively) holds a matrix product, not counting a
  loop whose trip count is the GQA group size (``GROUP_ARGS``: 1 for multi-head attention, so
  pipelining across it overlaps nothing); when several loops qualify (e.g. separate loops over full
  and partial tiles) the smallest depth is reported. A kernel without a dot-bearing loop has depth
  ``None``.
* ``main_loops``: every such main loop, each with ``top_wait`` and ``buffers``. Depth alone does not
  show a loop that stalls: a loop can have ``S - 1`` copies in its prologue and still open every
  iteration by draining them all. ``top_wait`` is the ``num`` of the first ``ttg.async_wait`` in the
  loop's own body (how many copy groups may stay in flight while the iteration starts): with
  ``num_stages >= 3`` it must be >= 1, else the next iteration's tiles are requested only after this
  one's math and waited for at once (``stalls``; e.g. a load whose address depends on another load
  of the same iteration, such as a step-table entry, keeps the pipeliner from issuing it ahead).
  ``buffers`` is the fewest buffers of a 2-D operand tile (``ttg.local_alloc`` of ``N x rows x cols``)
  the loop's body copies into: ``S`` buffers for an ``S``-stage pipeline whose copies stay in flight,
  fewer when the pipeliner could not run them ahead. ``None`` where the loop has no async_wait / copies.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

# Kernel arguments that count query heads sharing one KV head: a loop over them runs once for
# ordinary multi-head attention.
GROUP_ARGS = ("kv_group",)
COPY_OPS = ("ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local")

_WGMMA = re.compile(r"\bttng\.warp_group_dot\s")
_DOT = re.compile(r"\btt\.dot\s")
_FOR = re.compile(r"\bscf\.for\s+%[\w.]+\s*=\s*%?[\w.\-]+\s+to\s+%?([\w.\-]+)\s+step\b")
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)?\s*=\s*(.*)$")
_VALUE = re.compile(r"%([\w.]+)")
_ALLOC_DEPTH = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x")
# A multi-buffered 2-D tile: buffers x rows x cols (1-D row vectors and table scalars have one dim fewer).
_TILE_ALLOC = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x")
_ASYNC_WAIT = re.compile(r"\bttg\.async_wait\b.*\{num = (\d+) : i32\}")
_VIEW_OPS = ("ttg.memdesc_index", "ttg.memdesc_subview", "ttg.memdesc_subslice", "ttg.memdesc_reinterpret")


def dot_counts(ttgir: str) -> tuple[int, int]:
    """(wgmma ops, all matrix-product ops) in the TTGIR text."""
    wgmma = len(_WGMMA.findall(ttgir))
    return wgmma, wgmma + len(_DOT.findall(ttgir))


@dataclasses.dataclass
class Loop:
    start: int  # line index of the scf.for
    end: int  # line index of its closing brace
    bound: str  # the upper bound's SSA name (without %), or a literal
    parent: Optional[int]  # index into the loop list
    dots: int = 0  # matrix products in its body, nested loops included
    depth: int = 0  # software-pipelining depth (module docstring)
    top_wait: Optional[int] = None  # num of the first ttg.async_wait of its own body
    buffers: Optional[int] = None  # fewest buffers of a 2-D operand tile its own body copies into

    @property
    def over_group(self) -> bool:
        return self.bound in GROUP_ARGS


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def loops(ttgir: str) -> list[Loop]:
    """Every ``scf.for`` of the TTGIR with its span, parent, dot count and pipelining depth."""
    lines = ttgir.splitlines()
    found: list[Loop] = []
    stack: list[int] = []
    for i, line in enumerate(lines):
        match = _FOR.search(line)
        if match and line.rstrip().endswith("{"):
            found.append(Loop(i, len(lines) - 1, match.group(1), stack[-1] if stack else None))
            stack.append(len(found) - 1)
            continue
        stripped = line.strip()
        if stack and stripped.startswith("}") and _indent(line) == _indent(lines[found[stack[-1]].start]):
            found[stack.pop()].end = i
    # MLIR reuses SSA names in sibling regions (three sibling loops may all define %k_279), so a use
    # resolves to the name's last definition printed before it.
    defs: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        match = _DEF.match(line)
        if match:
            defs.setdefault(match.group(1)[1:], []).append(i)
    for loop in found:
        body = range(loop.start + 1, loop.end)
        loop.dots = sum(1 for i in body if _WGMMA.search(lines[i]) or _DOT.search(lines[i]))
        nested = [
            (other.start, other.end) for other in found if other.parent is not None and found[other.parent] is loop
        ]
        direct = [i for i in body if not any(s <= i <= e for s, e in nested)]
        waits = [int(m.group(1)) for m in (_ASYNC_WAIT.search(lines[i]) for i in direct) if m]
        loop.top_wait = waits[0] if waits else None
        allocs = {a for i in direct if _is_copy(lines[i]) for a in _copy_allocs(i, lines, defs)}
        if not allocs:
            continue
        tiles = [int(m.group(1)) for m in (_TILE_ALLOC.search(lines[at]) for _, at in allocs) if m]
        loop.buffers = min(tiles) if tiles else None
        prologue = {a: 0 for a in allocs}
        for i in range(min(a[1] for a in allocs), loop.start):
            if _is_copy(lines[i]) and not _inside(i, found, exclude=loop):
                for a in _copy_allocs(i, lines, defs):
                    if a in prologue:
                        prologue[a] += 1
        ahead = max(prologue.values())
        loop.depth = ahead + 1 if ahead else 0
    return found


def _is_copy(line: str) -> bool:
    return any(op in line for op in COPY_OPS)


def _inside(i: int, found: list[Loop], exclude: Loop) -> bool:
    """Whether line i is inside a loop that does not also enclose ``exclude`` (a sibling's body)."""
    return any(loop.start <= i <= loop.end and not (loop.start <= exclude.start <= loop.end) for loop in found)


def _def_line(name: str, use: int, defs: dict) -> Optional[int]:
    """Line of the definition of ``name`` that a use on line ``use`` sees (the last one printed before it)."""
    before = [i for i in defs.get(name, ()) if i < use]
    return before[-1] if before else None


def _copy_allocs(index: int, lines: list[str], defs: dict) -> set[tuple[str, int]]:
    """The multi-buffered allocations (name, line) the copy op on line ``index`` writes (its operands
    traced through memdesc views)."""
    line = lines[index]
    rhs = line.split("=", 1)[1] if _DEF.match(line) else line
    out = set()
    for name in _VALUE.findall(rhs.split(":", 1)[0]):
        name, at = name.split("#")[0], index
        for _ in range(8):  # follow view chains
            found = _def_line(name, at, defs)
            if found is None:
                break
            at = found
            text = lines[at]
            if _ALLOC_DEPTH.search(text):
                out.add((name, at))
                break
            view = next((op for op in _VIEW_OPS if op in text), None)
            if view is None:
                break
            name = _VALUE.findall(text.split(view, 1)[1])[0].split("#")[0]
    return out


def main_loops(ttgir: str) -> list[Loop]:
    """The kernel's main loops in text order (module docstring): the innermost dot-bearing loops, not
    counting loops over the GQA group."""
    found = loops(ttgir)
    candidates = [i for i, loop in enumerate(found) if loop.dots and not loop.over_group]

    def ancestors(i):
        while found[i].parent is not None:
            i = found[i].parent
            yield i

    return [found[i] for i in candidates if not any(i in set(ancestors(j)) for j in candidates if j != i)]


def main_loop_depth(ttgir: str) -> Optional[int]:
    """Pipelining depth of the kernel's main loop (module docstring), None without a dot-bearing loop."""
    main = main_loops(ttgir)
    return min(loop.depth for loop in main) if main else None


def stalls(top_wait: Optional[int], num_stages: int) -> bool:
    """Whether a main loop whose ``top_wait`` is this, compiled with ``num_stages``, opens each iteration by
    draining every copy in flight (0 at 3 or more stages: nothing it issued ahead overlaps its math)."""
    return num_stages >= 3 and top_wait == 0

"""Random-layout fuzzer: every backend, forward, LSE and all gradients, against an fp64 dense oracle.

Layouts are drawn at random over the constructor's whole space: context length,
window count and size, a short last window, shared or per-batch prefix ranges of
several shapes, context ranges (``context_lo/hi``: packed documents, block-causal,
sliding, arbitrary, empty rows), ``live_slots`` (blank slots), causal/full intra,
all/windows queries, streams; shared and per-batch ranges mixed. A share of the
layouts comes from the named constructors instead (packed documents for causal,
K-Forcing Single/Double, SBD, BD3-LM; block-causal; PTP with doc_starts/doc_ends;
Jacobi), shared or per-batch ``cu_seqlens``. Heads (MHA and GQA), head dim, batch
and dtype (fp64, fp32, fp16, bf16) are drawn with them.

The oracle is written here from the layout's documented semantics, reading only
its numbers (prefix/context ranges, live slots; it does not call ``dense_mask()``,
the row intervals or any backend): an fp64 masked softmax on the same (already
rounded) inputs, differentiated by autograd; a row that sees nothing has output 0,
LSE -inf and zero gradient. ``dense_mask()`` is also checked against the oracle's
mask.

* quick form (default suite): a few dozen layouts in-process, plus a few through
  the Triton interpreter in a ``TRITON_INTERPRET=1`` subprocess;
* long form: ``pytest -m fuzz_long python_tests/ops/window_attention/test_fuzz.py`` with
  ``KFORCING_FUZZ_COUNT`` layouts (default 10000) in-process and
  ``KFORCING_FUZZ_TRITON_COUNT`` (default 10000) through the interpreter.

To extend the family, add a draw to :func:`random_case` and the matching rule
to :func:`oracle_mask`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from helpers import REPO
from kforcing_kernels import WindowLayout, backends_available, window_attention

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = str(REPO)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

# max |got - oracle| / max(1, max |oracle|) per dtype (inputs are rounded to the dtype before the oracle sees them).
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}


@dataclass
class Case:
    seed: int
    layout: WindowLayout
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    desc: str


def _ranges(rng: random.Random, c: int, m: int, kind: str):
    """(lo, hi) lists for m windows over c context tokens."""
    lo, hi = [], []
    for t in range(m):
        if kind == "staircase":
            a, b = 0, min(c, t + 1)
        elif kind == "empty":
            a = b = rng.randint(0, c)
        elif kind == "full":
            a, b = 0, c
        elif kind == "sliding":
            b = min(c, t + 1 + rng.randint(0, 1))
            a = max(0, b - rng.randint(0, 3))
        else:
            a = rng.randint(0, c)
            b = rng.randint(a, c)
        lo.append(a)
        hi.append(b)
    return lo, hi


def _cu(rng: random.Random, n: int, align: int = 1) -> list[int]:
    """Random ``cu_seqlens`` over n tokens (boundaries at multiples of ``align``; empty documents allowed)."""
    cuts = sorted(rng.randint(0, n // align) * align for _ in range(rng.randint(0, 3)))
    return [0, *cuts, n]


def _context_ranges(rng: random.Random, c: int, kind: str):
    """(lo, hi) lists for the c context rows."""
    if kind == "docs":
        cu = _cu(rng, c)
        start = [max(x for x in cu if x <= t) for t in range(c)]
        return start, [t + 1 for t in range(c)]
    if kind == "block":
        blk = rng.randint(1, 4)
        return [0] * c, [min(c, (t // blk + 1) * blk) for t in range(c)]
    if kind == "sliding":
        width = rng.randint(1, 4)
        return [max(0, t + 1 - width) for t in range(c)], [t + 1 for t in range(c)]
    if kind == "empty":
        a = [rng.randint(0, c) for _ in range(c)]
        return a, a
    lo = [rng.randint(0, c) for _ in range(c)]
    return lo, [rng.randint(a, c) for a in lo]


def _constructor_case(rng: random.Random):
    """(layout, batch, description) from a named constructor, with shared or per-batch documents."""
    batch = rng.randint(1, 3)
    per_batch = rng.random() < 0.5

    def cus(n, align=1):
        return (
            [_cu(rng, n, align) for _ in range(batch)]
            if per_batch
            else (_cu(rng, n, align) if rng.random() < 0.8 else None)
        )

    family = rng.choice(("causal", "causal_block", "single", "double", "sbd", "bd3lm", "ptp", "jacobi"))
    n = rng.randint(1, 13)
    if family == "causal":
        cu = cus(n)
        layout = WindowLayout.causal(n, cu_seqlens=cu)
    elif family == "causal_block":
        blk = rng.randint(1, 5)
        cu = cus(n)
        layout = WindowLayout.causal(n, cu_seqlens=cu, block=blk)
    elif family in ("single", "double"):
        k = rng.randint(1, 3)
        cu = cus(n)
        make = WindowLayout.kforcing_single if family == "single" else WindowLayout.kforcing_double
        layout = make(n, k, cu_seqlens=cu)
    elif family in ("sbd", "bd3lm"):
        blk = rng.randint(1, 4)
        cu = None
        if rng.random() < 0.6:  # documents: every boundary (the packed length too) a multiple of the block
            n = blk * rng.randint(1, 4)
            cu = cus(n, blk)
        layout = getattr(WindowLayout, family)(n, blk, cu_seqlens=cu)
    elif family == "ptp":
        m, length = rng.randint(1, 4), rng.randint(1, 4)
        shape = (batch, m) if per_batch else (m,)
        starts = torch.randint(0, n + 1, shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        doc_starts = (starts * torch.rand(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))).long()
        doc_ends = starts + torch.randint(
            0, length + 2, shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))
        )
        cu = None
        layout = WindowLayout.ptp(
            n,
            starts,
            length,
            doc_starts=doc_starts if rng.random() < 0.7 else None,
            doc_ends=doc_ends if rng.random() < 0.7 else None,
        )
    else:
        p, t = rng.randint(1, 6), rng.randint(1, 5)
        cu = None
        layout = WindowLayout.jacobi(p, t)
    batch = layout.range_batch or batch
    return layout, batch, f"{family} n={n} cu_seqlens={cu}"


def random_case(seed: int, *, triton: bool = False) -> Case:
    """One random layout and problem size (deterministic in ``seed``)."""
    rng = random.Random(seed)
    if rng.random() < 0.3:
        layout, batch, what = _constructor_case(rng)
        return _sizes(rng, seed, layout, batch, triton, what)
    streams = rng.choice((1, 1, 1, 2, 3))
    w = streams * rng.randint(1, 3 if streams > 1 else 5)
    m = rng.choice((0, 1, 1, 2, 3, 4, 5, 7))
    c = rng.choice((0, 1, 2, 3, 5, 8, 13))
    if c + m == 0:
        c = rng.randint(1, 6)
    last = w if streams > 1 or m == 0 or rng.random() < 0.5 else rng.randint(1, w)
    intra = rng.choice(("causal", "full"))
    queries = "windows" if m and rng.random() < 0.35 else "all"
    batch = rng.randint(1, 3)
    per_batch = rng.random() < 0.3
    kinds = ("random", "random", "staircase", "staircase", "staircase", "empty", "full", "sliding")
    if per_batch:
        rows = [_ranges(rng, c, m, rng.choice(kinds)) for _ in range(batch)]
        lo, hi = [r[0] for r in rows], [r[1] for r in rows]
    else:
        lo, hi = _ranges(rng, c, m, rng.choice(kinds))
    # Lists and tensors both go through the constructor (empty lists read as float: issue 12 item 18, not ours).
    if m == 0 or rng.random() < 0.5:
        lo = (
            torch.tensor(lo, dtype=torch.int64).reshape(batch if per_batch else -1, m)
            if per_batch
            else torch.tensor(lo, dtype=torch.int64)
        )
        hi = (
            torch.tensor(hi, dtype=torch.int64).reshape(batch if per_batch else -1, m)
            if per_batch
            else torch.tensor(hi, dtype=torch.int64)
        )
    extra, what = {}, ""
    if c and rng.random() < 0.4:  # context ranges, shared or per batch element
        kind = rng.choice(("docs", "docs", "block", "sliding", "random", "empty"))
        if rng.random() < 0.35:
            rows = [_context_ranges(rng, c, kind) for _ in range(batch)]
            extra.update(context_lo=[r[0] for r in rows], context_hi=[r[1] for r in rows])
        else:
            extra["context_lo"], extra["context_hi"] = _context_ranges(rng, c, kind)
        what += f" context={kind}"
    if m and rng.random() < 0.4:  # blank slots (live_slots may exceed w: capped), shared or per batch element
        draw = lambda: [rng.choice((0, rng.randint(0, w), w, w + 1)) for _ in range(m)]  # noqa: E731
        extra["live_slots"] = [draw() for _ in range(batch)] if rng.random() < 0.35 else draw()
        what += " live_slots"
    layout = WindowLayout(
        c, m, w, lo, hi, last_window_size=last, intra=intra, queries=queries, n_streams=streams, **extra
    )
    batch = layout.range_batch or batch
    desc = f"C={c} M={m} w={w} last={last} S={streams} intra={intra} queries={queries} per_batch={per_batch}{what}"
    return _sizes(rng, seed, layout, batch, triton, desc)


def _sizes(rng: random.Random, seed: int, layout: WindowLayout, batch: int, triton: bool, what: str) -> Case:
    kv_heads = rng.choice((1, 2))
    heads = kv_heads * rng.choice((1, 2, 3))
    if triton:
        head_dim, dtype = rng.choice((32, 64)), rng.choice((torch.float32, torch.float16))
    else:
        head_dim = rng.choice((1, 4, 8, 16, 24))
        dtype = rng.choice((torch.float64, torch.float32, torch.float32, torch.float16, torch.bfloat16))
    desc = f"seed={seed} {what} | {layout!r} B={batch} H={heads}/{kv_heads} D={head_dim} {dtype}"
    return Case(seed, layout, batch, heads, kv_heads, head_dim, dtype, desc)


# ---------------------------------------------------------------------- oracle


def _window_roles(layout: WindowLayout):
    """Per window-region token (storage order): (window index, slot within the window), from the documented storage."""
    m, w, s_count = layout.num_windows, layout.window_size, layout.n_streams
    n = layout.n_window_tokens
    roles = []
    for r in range(n):
        if s_count == 1:
            roles.append((r // w, r % w))
        else:
            s = w // s_count
            j, rem = divmod(r, m * s)
            roles.append((rem // s, j * s + rem % s))
    return roles


def oracle_mask(layout: WindowLayout, batch: int) -> torch.Tensor:
    """bool [B, Lq, Lk] from the semantics: context row t sees [context_lo[t], context_hi[t]) (default [0, t+1));
    window m sees [lo, hi) and its own slots (causal: slot <= own); a slot >= live_slots[m] is blank: its row
    sees nothing and no row sees it."""
    c, m = layout.n_ctx, layout.num_windows

    def per_b(t, n):
        return None if t is None else t.reshape(-1, n).expand(batch, n)

    lo, hi = per_b(layout.prefix_lo, m) if m else None, per_b(layout.prefix_hi, m) if m else None
    clo, chi = per_b(layout.context_lo, c), per_b(layout.context_hi, c)
    live = per_b(layout.live_slots, m) if layout.live_slots is not None else None
    roles = _window_roles(layout)
    lk = c + len(roles)
    mask = torch.zeros(batch, lk, lk, dtype=torch.bool)
    for b in range(batch):
        for t in range(c):
            a, e = (0, t + 1) if clo is None else (int(clo[b, t]), int(chi[b, t]))
            mask[b, t, a:e] = True
        for r, (win, slot) in enumerate(roles):

            def alive(s, b=b, win=win):
                return live is None or s < int(live[b, win])

            if not alive(slot):
                continue
            row = c + r
            mask[b, row, int(lo[b, win]) : int(hi[b, win])] = True
            for r2, (win2, slot2) in enumerate(roles):
                if win2 == win and alive(slot2) and (layout.intra == "full" or slot2 <= slot):
                    mask[b, row, c + r2] = True
    return mask[:, layout.query_offset :]


def oracle(q, k, v, mask, scale):
    """fp64 masked softmax attention with GQA: (out, lse)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    seen = mask[:, None].any(-1, keepdim=True)  # rows that see nothing: output 0, LSE -inf, no gradient
    s = torch.where(seen, s, 0.0)
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1), float("-inf"))
    return torch.where(seen, torch.softmax(s, -1), 0.0) @ vv, lse


def _in_process_backends():
    from kforcing_kernels.ops.window_attention import backend_limits

    # Gradients are checked here: a backend with a limit (flex: no CPU backward) is left to its own tests.
    names = [n for n, reason in backends_available().items() if reason is None and n not in backend_limits()]
    return [n for n in names if n != "triton" or INTERPRETING]


def check_case(case: Case, backends) -> list[str]:
    """Mismatch descriptions (empty when every backend agrees with the oracle)."""
    layout, dtype = case.layout, case.dtype
    gen = torch.Generator().manual_seed(case.seed)
    shape_q = (case.batch, case.heads, layout.n_queries, case.head_dim)
    shape_k = (case.batch, case.kv_heads, layout.n_keys, case.head_dim)
    q, k, v, dout = (
        torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in (shape_q, shape_k, shape_k, shape_q)
    )
    scale = 1.0 / case.head_dim**0.5
    mask = oracle_mask(layout, case.batch)
    problems = []
    dense = layout.dense_mask()
    if not torch.equal(dense.expand(case.batch, *dense.shape[-2:]), mask):
        problems.append(f"dense_mask() differs from the oracle's mask: {case.desc}")
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want_out, want_lse = oracle(q64, k64, v64, mask, scale)
    want = (want_out, *torch.autograd.grad(want_out, (q64, k64, v64), dout.double()))
    tol = TOL[dtype]
    for backend in backends:
        if backend == "triton" and (dtype not in (torch.float32, torch.float16) or case.head_dim not in (32, 64, 128)):
            continue
        qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
        try:
            out, lse = window_attention(qb, kb, vb, layout, backend=backend, return_lse=True)
            got = (out, *torch.autograd.grad(out, (qb, kb, vb), dout))
        except Exception as exc:  # a crash is a mismatch too
            problems.append(f"{backend}: raised {type(exc).__name__}: {exc} | {case.desc}")
            continue
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            if a.dtype != dtype or a.shape != b.shape:
                problems.append(f"{backend} {name}: dtype/shape {a.dtype} {tuple(a.shape)} | {case.desc}")
                continue
            err = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item()) if b.numel() else 0.0
            if not err <= tol:
                problems.append(f"{backend} {name}: rel err {err:.3g} > {tol} | {case.desc}")
        if lse.numel():
            finite = torch.isfinite(want_lse)
            if not torch.equal(torch.isfinite(lse), finite) or bool((lse[~finite] != float("-inf")).any()):
                problems.append(f"{backend} lse: not -inf exactly on the rows that see nothing | {case.desc}")
                continue
            if bool(finite.any()):
                lerr = (lse.double()[finite] - want_lse[finite]).abs().max().item() / max(
                    1.0, want_lse[finite].abs().max().item()
                )
                if not lerr <= max(tol, 1e-6 if dtype != torch.float64 else tol):
                    problems.append(f"{backend} lse: rel err {lerr:.3g} | {case.desc}")
    return problems


def run_fuzz(
    first_seed: int, count: int, *, triton_only: bool = False, progress: bool = False
) -> tuple[int, list[str]]:
    backends = ["triton"] if triton_only else _in_process_backends()
    problems: list[str] = []
    for i in range(count):
        case = random_case(first_seed + i, triton=triton_only)
        found = check_case(case, backends)
        if found and progress:
            print("\n".join(found), file=sys.stderr, flush=True)
        problems += found
        if progress and (i + 1) % int(os.environ.get("KFORCING_FUZZ_PROGRESS", "25" if triton_only else "500")) == 0:
            print(f"fuzz: {i + 1}/{count} layouts, {len(problems)} mismatches", file=sys.stderr, flush=True)
    return count, problems


def _report(problems: list[str]) -> str:
    return f"{len(problems)} mismatches:\n" + "\n".join(problems[:20])


# ---------------------------------------------------------------------- quick form


def test_oracle_mask_matches_known_families():
    """The test's own mask rules, checked on layouts whose masks are known by construction."""
    single = WindowLayout.kforcing_single(3, 2)  # [ctx 0..2 | w0 w0 w1 w1 w2 w2]; window t sees ctx [0, t+1)
    m = oracle_mask(single, 1)[0]
    assert m[3].tolist() == [True, False, False, True, False, False, False, False, False]
    assert m[4].tolist() == [True, False, False, True, True, False, False, False, False]
    assert m[8].tolist() == [True, True, True, False, False, False, False, True, True]
    double = WindowLayout.kforcing_double(2, 2)  # stream-major [F1 of w0, w1 | F2 of w0, w1], queries = windows
    d = oracle_mask(double, 1)[0]
    # Keys [ctx 0, 1 | F1 w0: 2, 3 | F1 w1: 4, 5 | F2 w0: 6, 7 | F2 w1: 8, 9]; query r is key 2 + r.
    # F2 slot 0 of window 0 sees ctx [0, 1), F1 of its window and itself; of window 1, ctx [0, 2).
    assert d[4].nonzero().flatten().tolist() == [0, 2, 3, 6]
    assert d[6].nonzero().flatten().tolist() == [0, 1, 4, 5, 8]
    assert d[7].nonzero().flatten().tolist() == [0, 1, 4, 5, 8, 9]


QUICK_COUNT = 300  # about 5 s in-process on 2 cores


def test_fuzz_quick():
    count, problems = run_fuzz(0, QUICK_COUNT)
    assert count == QUICK_COUNT and not problems, _report(problems)


def test_fuzz_quick_draws_the_whole_space():
    """The quick seeds reach every part of the space the fuzzer claims (a draw that silently stopped happening
    would let its bugs through: issue #29 item 15, the composite staircase fast path with blank slots)."""
    cases = [random_case(seed) for seed in range(QUICK_COUNT)]
    descs = [c.desc for c in cases]

    want = {
        "context docs": lambda d: "context=docs" in d,
        "context block": lambda d: "context=block" in d,
        "context sliding": lambda d: "context=sliding" in d,
        "context random": lambda d: "context=random" in d,
        "context empty rows": lambda d: "context=empty" in d,
        "live_slots": lambda d: "live_slots" in d,
        "per-batch live_slots": lambda d: (
            "live_slots=(" in d and "live_slots=(" in d and ", " in d.split("live_slots=(")[1].split(")")[0]
        ),
        "per-batch context": lambda d: "context_ranges=(" in d and ", " in d.split("context_ranges=(")[1].split(")")[0],
        **{
            f"constructor {f}": lambda d, f=f: d.startswith("seed=") and f" {f} n=" in d
            for f in ("causal", "causal_block", "single", "double", "sbd", "bd3lm", "ptp", "jacobi")
        },
        "per-batch cu_seqlens": lambda d: "cu_seqlens=[[" in d,
        "shared cu_seqlens": lambda d: "cu_seqlens=[0" in d,
    }
    missing = [name for name, hit in want.items() if not any(hit(d) for d in descs)]
    assert not missing, missing

    def staircase_with_blanks(layout):  # the composite staircase's own condition, less its blank-slot exclusion
        m = layout.num_windows
        return (
            layout.batch_size is None
            and 0 < m <= layout.n_ctx
            and layout.last_window_size == layout.window_size
            and layout.has_blank_slots
            and not bool(layout.prefix_lo.any())
            and torch.equal(layout.prefix_hi, torch.arange(1, m + 1))
        )

    staircase_blank = [c for c in cases if staircase_with_blanks(c.layout)]
    assert len(staircase_blank) >= 3, "the staircase fast path with blank slots is drawn too rarely"


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter process")
def test_fuzz_quick_triton_interpreter():
    pytest.importorskip("triton")
    _run_interpreter_subprocess(count=4, first_seed=0)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the TRITON_INTERPRET=1 subprocess")
def test_fuzz_triton_interpreter_cases():
    first = int(os.environ.get("KFORCING_FUZZ_TRITON_FIRST", "0"))
    count = int(os.environ.get("KFORCING_FUZZ_TRITON_COUNT", "4"))
    done, problems = run_fuzz(first, count, triton_only=True, progress=True)
    print(f"fuzz triton interpreter: {done} layouts, {len(problems)} mismatches")
    assert not problems, _report(problems)


def _run_interpreter_subprocess(count: int, first_seed: int, timeout: float = 900) -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        KFORCING_FUZZ_TRITON_COUNT=str(count),
        KFORCING_FUZZ_TRITON_FIRST=str(first_seed),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        os.path.join(HERE, "test_fuzz.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-s",
        "-k",
        "test_fuzz_triton_interpreter_cases",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0 and " passed" in result.stdout, (
        f"interpreter fuzz failed (rc={result.returncode}):\n{tail}"
    )
    print(next((line for line in result.stdout.splitlines() if line.startswith("fuzz triton")), tail))


# ---------------------------------------------------------------------- long form


@pytest.mark.fuzz_long
def test_fuzz_long():
    count = int(os.environ.get("KFORCING_FUZZ_COUNT", "10000"))
    first = int(os.environ.get("KFORCING_FUZZ_FIRST", "1000000"))  # shard a long run over processes by seed range
    done, problems = run_fuzz(first, count, progress=True)
    print(f"fuzz in-process ({', '.join(_in_process_backends())}): {done} layouts, {len(problems)} mismatches")
    assert not problems, _report(problems)


@pytest.mark.fuzz_long
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter process")
def test_fuzz_long_triton_interpreter():
    pytest.importorskip("triton")
    count = int(os.environ.get("KFORCING_FUZZ_TRITON_COUNT", "10000"))
    first = int(os.environ.get("KFORCING_FUZZ_TRITON_FIRST", "2000000"))
    _run_interpreter_subprocess(
        count=count, first_seed=first, timeout=float(os.environ.get("KFORCING_FUZZ_TIMEOUT", "86400"))
    )


def test_fuzz_detects_a_wrong_backend(monkeypatch):
    """The comparison itself can fail: a backend whose last output row is off by 1e-2 is reported."""
    real = window_attention

    def off(q, k, v, layout, backend=None, return_lse=False):
        out, lse = real(q, k, v, layout, backend=backend, return_lse=True)
        return out + torch.nn.functional.pad(torch.full_like(out[..., -1:, :], 1e-2), (0, 0, out.shape[-2] - 1, 0)), lse

    monkeypatch.setattr(sys.modules[__name__], "window_attention", off)
    _, problems = run_fuzz(0, 2)
    assert problems and all(" out: rel err" in p for p in problems)

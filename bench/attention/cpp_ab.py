"""A/B of the cpp backend between git commits, at the README headline shape.

    python -m bench cpp-ab                                   # 2e66b3e vs HEAD, 2 threads
    python -m bench cpp-ab --commits 2e66b3e 68394f4 HEAD --rounds 7 --json /tmp/cpp_ab.json

Each commit gets a ``git worktree`` (detached) under ``--workdir`` (default
/tmp/kforcing_cpp_ab) and its C++ extension built in place there (skipped when that
worktree already has one). Every measurement runs in a fresh subprocess whose
PYTHONPATH (and working directory) is that worktree, so each side imports its own
``kforcing_kernels`` and ``_C``; the child checks that it did. Rounds alternate the
commits (A B C A B C ...): a busy machine slows all alike. Per round and case the child
reports the median of ``--iters`` timed calls after warm-up; the table gives the
median over rounds. Forward: ``window_attention(..., backend="cpp")`` without grad;
forward+backward: the same with ``out.backward(dout)``. fp32, B=1, H=12, D=64,
N=1024, k=4 by default, SingleForward and DoubleForward layouts.

The default base, 2e66b3e, is the last commit before the row-interval/hardening
changes: its op.py has no non-finite scan (``masked_keys``) and its C++ kernels derive
what a row sees from the prefix ranges themselves (af7f088, next, made them read the
row intervals; 0794c87 added the scan).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kforcing_kernels.app.cli import add_batch_size, add_threads, checked, non_negative_int, positive_int

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BASE = "2e66b3e"

# Runs in the child with the commit's worktree first on sys.path; works with every
# commit that has WindowLayout.kforcing_single/double and window_attention(backend=).
CHILD = r"""
import json, os, statistics, sys, time
import torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
import kforcing_kernels
from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels import _extension
root = os.path.realpath(cfg["root"])
ext = _extension.load()
assert ext is not None, "cpp extension not loaded"
for name, path in (("kforcing_kernels", kforcing_kernels.__file__), ("_C", ext.__file__)):
    assert os.path.realpath(path).startswith(root + os.sep), f"{name} imported from {path}, not {root}"
make = {"single": WindowLayout.kforcing_single, "double": WindowLayout.kforcing_double}
res = {}
for lname in cfg["layouts"]:
    layout = make[lname](cfg["n"], cfg["k"])
    g = torch.Generator().manual_seed(0)
    B, H, D = cfg["batch"], cfg["heads"], cfg["dim"]
    q = torch.randn(B, H, layout.n_queries, D, generator=g)
    k = torch.randn(B, H, layout.n_keys, D, generator=g)
    v = torch.randn(B, H, layout.n_keys, D, generator=g)
    dout = torch.randn(B, H, layout.n_queries, D, generator=g)

    def fwd():
        with torch.no_grad():
            window_attention(q, k, v, layout, backend="cpp")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        window_attention(*leaves, layout, backend="cpp").backward(dout)

    for mode, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        for _ in range(cfg["warmup"]):
            fn()
        times = []
        for _ in range(cfg["iters"]):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        res[f"{lname}/{mode}"] = statistics.median(times) * 1e3
print("RESULT " + json.dumps({"isa": ext.isa(), "ms": res}))
"""


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def worktree(commit: str, workdir: Path) -> Path:
    """A detached worktree of ``commit`` under ``workdir`` (reused when it is there)."""
    path = workdir / commit[:12]
    if not (path / ".git").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", str(path), commit)
    head = git("rev-parse", "HEAD", cwd=path)
    if head != commit:
        raise SystemExit(f"{path}: expected a worktree at {commit}, found {head}")
    return path


def build(path: Path, jobs: int) -> None:
    """``setup.py build_ext --inplace`` unless that worktree already has its extension."""
    if list((path / "kforcing_kernels").glob("_C*.so")):
        print(f"[cpp_ab] {path}: extension already built", file=sys.stderr)
        return
    print(f"[cpp_ab] {path}: building the extension (MAX_JOBS={jobs}) ...", file=sys.stderr)
    env = dict(os.environ, MAX_JOBS=str(jobs))
    log = path / "build_ext.log"
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=path,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        raise SystemExit(f"{path}: build failed (see {log})")


def measure(path: Path, cfg: dict) -> dict:
    """One child process timing every case with ``path``'s package first on sys.path."""
    env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS=str(cfg["threads"]))
    env.pop("KFORCING_BACKEND", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(dict(cfg, root=str(path)))],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"child for {path} failed:\n{done.stderr}")
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


DEFAULT_THREADS = 2  # as BENCHMARKS.md's A/B ran
CHILD_LAYOUTS = ("single", "double")  # CHILD's ``make``
layout_list = checked(
    lambda text: [item.strip() for item in str(text).split(",")],
    lambda names: bool(names) and set(names) <= set(CHILD_LAYOUTS),
    "comma-separated layouts of " + ", ".join(CHILD_LAYOUTS),
)


def add_arguments(p) -> None:
    p.add_argument(
        "--commits",
        nargs="+",
        default=[DEFAULT_BASE, "HEAD"],
        help="the commits to compare, the first is the baseline (see the module docstring for the default base)",
    )
    p.add_argument("--workdir", default="/tmp/kforcing_cpp_ab", help="where the worktrees go")
    add_threads(p, none=f"{DEFAULT_THREADS} (in each measuring child)")
    p.add_argument("--rounds", type=positive_int, default=5, help="alternating A/B rounds")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per case and round")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed calls per case first")
    p.add_argument(
        "--layouts",
        type=layout_list,
        default="single,double",
        help="the layouts timed, comma-separated: single, double",
    )
    p.add_argument("--n", type=positive_int, default=1024, help="context length N")
    p.add_argument("--k", type=positive_int, default=4, help="window k")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=12, help="attention heads H")
    p.add_argument("--dim", type=positive_int, default=64, help="head dim D")
    p.add_argument("--jobs", type=positive_int, default=2, help="MAX_JOBS for the builds")
    p.add_argument("--json", default="cpp_ab.json", help="where the results go")


def finish_args(p, args, argv, prog):
    if args.threads is None:
        args.threads = DEFAULT_THREADS
    return args


def execute(args) -> None:

    sides = [chr(ord("A") + i) for i in range(len(args.commits))]
    commits = {side: git("rev-parse", c + "^{commit}") for side, c in zip(sides, args.commits)}
    paths = {side: worktree(c, Path(args.workdir)) for side, c in commits.items()}
    for path in paths.values():
        build(path, args.jobs)
    cfg = dict(
        threads=args.threads,
        iters=args.iters,
        warmup=args.warmup,
        layouts=args.layouts,
        n=args.n,
        k=args.k,
        batch=args.batch_size,
        heads=args.heads,
        dim=args.dim,
    )
    rounds = {side: [] for side in sides}
    isa = {}
    for r in range(args.rounds):
        for side in sides:
            got = measure(paths[side], cfg)
            isa[side] = got["isa"]
            rounds[side].append(got["ms"])
            print(
                f"[cpp_ab] round {r + 1}/{args.rounds} {side}: "
                + ", ".join(f"{c} {ms:.2f}" for c, ms in got["ms"].items()),
                file=sys.stderr,
            )
    cases = list(rounds["A"][0])
    med = {side: {c: statistics.median(x[c] for x in rounds[side]) for c in cases} for side in rounds}

    print(
        f"cpp backend, B={args.batch_size} H={args.heads} D={args.dim} N={args.n} k={args.k} fp32, "
        f"{args.threads} threads, ISA {'/'.join(isa[s] for s in sides)}; median of {args.rounds} alternating rounds "
        f"(each the median of {args.iters} calls)\n"
    )
    print(
        "| layout | pass | "
        + " | ".join(f"{s} {commits[s][:10]} (ms)" for s in sides)
        + " | "
        + " | ".join(f"{s} / A" for s in sides[1:])
        + " |"
    )
    print("|---|---|" + "---:|" * (2 * len(sides) - 1))
    for c in cases:
        layout, mode = c.split("/")
        print(
            f"| {layout} | {mode} | "
            + " | ".join(f"{med[s][c]:.2f}" for s in sides)
            + " | "
            + " | ".join(f"{med[s][c] / med['A'][c]:.3f}" for s in sides[1:])
            + " |"
        )
    out = dict(commits=commits, config=cfg, rounds=args.rounds, isa=isa, median_ms=med, per_round_ms=rounds)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n[cpp_ab] wrote {args.json}", file=sys.stderr)

"""Compile the Triton kernels for real GPU targets without a GPU and report their resources.

    python -m kforcing_kernels.tools.aot_report              # every config the dispatcher can choose
    python -m kforcing_kernels.tools.aot_report --defaults   # only each kernel's default config
    python -m kforcing_kernels.tools.aot_report --all        # every candidate (to re-prune KERNEL_CONFIGS)
    python -m kforcing_kernels.tools.aot_report --defaults --no-require-hopper   # resources only

For each (target, kernel, tile set, head dim, dtype, num_warps, num_stages) this runs
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80|90, 32))`` (Triton builds
capability 90 for sm_90a) and reads
the cubin's registers, stack (spill frame), local and shared memory with the
``cuobjdump --dump-resource-usage`` that ships with Triton. Dynamic shared memory
comes from the compiled kernel's metadata. From the TTGIR (tools/ttgir.py, which defines both):
``wgmma``, the number of ``ttng.warp_group_dot`` ops (Hopper warpgroup MMA; ``dots`` counts every
matrix product, so wgmma < dots means some fell back to mma_v2), ``depth``, the software-
pipelining depth of the main loop (S when its loads are issued S - 1 iterations ahead, 0 when they
are synchronous, "-" without a dot-bearing loop), and per main loop in kernel order (``/``-separated)
``top wait``, the ``num`` of the ``ttg.async_wait`` that opens each iteration, and ``bufs``, the
buffers of its operand tiles (q/dO in the dK/dV step loops, k/v in the key loops; "-": none). A
loop of ``num_stages >= 3`` whose top wait is 0 drains every copy before its math: it stalls
(``ttgir.stalls``); ``stalls`` lists such loops by their 1-based place in ``top wait`` ("-": none).

It prints one table and exits 1 if a config the dispatcher can choose spills (STACK or LOCAL > 0)
or needs more shared memory than the target has, or, with ``--require-hopper`` (on by default with
``--defaults``), if a default config (the first of its list, what runs without autotuning) of a
main kernel (``main_kernels()``: fwd, bwd and any new kernel not in AUXILIARY_KERNELS) has
no wgmma, a main loop of depth 0 or a main loop that stalls on sm_90a; 2 if Triton's ptxas/cuobjdump
are missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Optional

from . import ttgir

TARGETS = (80, 90)
# Kernels that only feed the main ones (the backward's delta) and the paged decode kernel: not held to
# the Hopper check. Every other name in launch.KERNELS is a main kernel.
AUXILIARY_KERNELS = ("delta", "paged")
# Max dynamic shared memory per block (bytes): A100 / H100.
SHARED_LIMIT = {80: 166912, 90: 232448}
DTYPES = ("fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class Job:
    arch: int
    kernel: str
    tile_set: str
    head_dim: int
    dtype: str
    num_warps: int
    num_stages: int
    chosen: bool  # in KERNEL_CONFIGS, i.e. the dispatcher can pick it
    default: bool = False  # the first entry of its KERNEL_CONFIGS list: what runs without autotuning


@dataclasses.dataclass(frozen=True)
class Row:
    job: Job
    registers: int
    stack: int
    local: int
    shared: int  # dynamic, from Triton's metadata
    static_shared: int
    error: Optional[str] = None
    wgmma: int = 0  # ttng.warp_group_dot ops in the TTGIR (tools/ttgir.py)
    dots: int = 0  # every matrix-product op in the TTGIR (wgmma + tt.dot)
    depth: Optional[int] = None  # the main loop's software-pipelining depth; None: no dot-bearing loop
    top_waits: tuple = ()  # per main loop (ttgir.main_loops order): the loop-top async_wait num, None: no wait
    buffers: tuple = ()  # per main loop: buffers of its operand tiles, None: it copies none

    @property
    def stalled_loops(self) -> list[int]:
        """Indices of the main loops that stall (``ttgir.stalls`` at this config's num_stages)."""
        return [i for i, wait in enumerate(self.top_waits) if ttgir.stalls(wait, self.job.num_stages)]

    @property
    def spills(self) -> int:
        return self.stack + self.local

    @property
    def ok(self) -> bool:
        return (
            self.error is None and self.spills == 0 and self.shared + self.static_shared <= SHARED_LIMIT[self.job.arch]
        )

    def hopper_problems(self) -> list[str]:
        """Why this config is not Hopper-grade (wgmma and a pipelined main loop), empty if it is."""
        if self.error is not None:
            return [f"does not compile ({self.error})"]
        problems = []
        if self.wgmma == 0:
            problems.append(f"no wgmma (0 of {self.dots} dots)")
        if not self.depth:
            problems.append("main loop not pipelined (depth 0)" if self.depth == 0 else "no main loop with a dot")
        stalled = self.stalled_loops
        if stalled:
            problems.append(
                f"main loop{'s' if len(stalled) > 1 else ''} {', '.join(str(i + 1) for i in stalled)} of "
                f"{len(self.top_waits)} stall{'' if len(stalled) > 1 else 's'} "
                f"(async_wait num = 0 at the top, {self.job.num_stages} stages)"
            )
        return problems


def tools_missing() -> Optional[str]:
    """Why Triton's NVIDIA tools cannot run here, or None."""
    try:
        import triton
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    for tool in ("ptxas", "cuobjdump"):
        path = getattr(triton.knobs.nvidia, tool).path
        if not path or not os.access(path, os.X_OK):
            return f"Triton's {tool} is missing ({path!r})"
    return None


# The paged decode kernel (ops/paged_attention): launched with Triton's default config, its window
# padded to 16 rows (K-Forcing k <= 8), 4 KV heads (a constexpr: the report's representative).
PAGED = "paged"
PAGED_CONFIG = (4, 3)
PAGED_HEAD_DIMS = (64, 128)
PAGED_IO = ("Q", "KNew", "VNew", "KPages", "VPages", "Out")
PAGED_INT_POINTERS = ("Table", "Lens")


def _kernel_fn(name: str):
    if name == PAGED:
        from ..ops.paged_attention import triton_kernels as paged

        return paged._paged_fwd_kernel
    from ..ops.window_attention.triton import launch as kernels

    return kernels.KERNELS[name]


def _paged_signature(fn, dtype: str, constexprs: dict):
    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in PAGED_IO:
            signature[name] = "*" + dtype
        elif name in PAGED_INT_POINTERS:
            signature[name] = "*i32"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if signature[name].startswith("*"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _signature(fn, dtype: str, constexprs: dict):
    from ..ops.window_attention.triton import jit_common as roles

    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in roles.IO_POINTERS:
            signature[name] = "*" + dtype
        elif name in roles.FP32_POINTERS:
            signature[name] = "*fp32"
        elif name[0].isupper():
            signature[name] = "*i32"
        elif name in roles.FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        # What the launcher specialises: torch allocations are aligned, and so are q/k strides.
        if signature[name].startswith("*") or name in roles.ALIGNED_STRIDES:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _constexprs(kernel: str, head_dim: int, tile_set: str = "base") -> dict:
    from ..ops.window_attention.triton import configs

    if kernel == PAGED:
        from ..ops.paged_attention import triton_kernels as paged

        return dict(HKV=4, D=head_dim, BLOCK_M=16, BLOCK_N=paged.BLOCK_N, BLOCK_D=head_dim)
    tiles = configs.TILE_SETS[tile_set][head_dim]
    if kernel == "delta":
        return dict(BLOCK_M=configs.DELTA_BLOCK, HEAD_DIM=head_dim)
    if kernel == "bwd":
        return dict(
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_M_STEP=tiles.dkdv_step_rows,
            BLOCK_N_DKDV=tiles.block_n_dkdv,
            BLOCK_T=tiles.block_t,
            HEAD_DIM=head_dim,
            INSTRUMENT=False,
        )
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HEAD_DIM=head_dim, INSTRUMENT=False)


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_one(job: Job, fn=None) -> Row:
    """Compile one job and read its resource usage. ``fn``: another ``@triton.jit`` kernel with ``job.kernel``'s
    arguments and constexprs, compiled in its place (bench/gpu/bwd_registers.py: one program kind of ``bwd``)."""
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = fn or _kernel_fn(job.kernel)
    constexprs = _constexprs(job.kernel, job.head_dim, job.tile_set)
    signature, attrs = (_paged_signature if job.kernel == PAGED else _signature)(fn, job.dtype, constexprs)
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", job.arch, 32),
            options=dict(num_warps=job.num_warps, num_stages=job.num_stages),
        )
    except Exception as exc:  # a config that does not compile is reported, not hidden
        return Row(job, 0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        dump = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    match = _RESOURCES.search(dump)
    if match is None:
        return Row(job, 0, 0, 0, 0, 0, error=f"cannot parse cuobjdump output: {dump[:200]!r}")
    reg, stack, static_shared, local = (int(x) for x in match.groups())
    text = compiled.asm["ttgir"]
    wgmma, dots = ttgir.dot_counts(text)
    main = ttgir.main_loops(text)
    return Row(
        job,
        reg,
        stack,
        local,
        int(compiled.metadata.shared),
        static_shared,
        wgmma=wgmma,
        dots=dots,
        depth=ttgir.main_loop_depth(text),
        top_waits=tuple(loop.top_wait for loop in main),
        buffers=tuple(loop.buffers for loop in main),
    )


def jobs(scope: str, head_dims=None, kernels_subset=None, dtypes=DTYPES, archs=TARGETS) -> list[Job]:
    """``scope``: 'defaults' (first config each), 'chosen' (KERNEL_CONFIGS) or 'all' (every candidate).
    A (kernel, tile set) whose constexprs equal another set's (the delta kernel does not read
    block_m/block_n) is compiled once."""
    from ..ops.window_attention.triton import configs, launch

    out, seen = [], set()
    for arch in archs:
        for name in [n for n in kernels_subset or launch.KERNELS if n != PAGED]:
            for (tile_set, d), chosen in configs.KERNEL_CONFIGS[name].items():
                if (head_dims and d not in head_dims) or arch // 10 < configs.TILE_SET_MIN_CAPABILITY[tile_set]:
                    continue  # a set is only dispatched on targets at or above its minimum capability
                if scope == "defaults":
                    picked = chosen[:1]
                elif scope == "chosen":
                    picked = chosen
                else:
                    picked = sorted(set(configs.CANDIDATE_CONFIGS) | set(chosen))
                for dtype in dtypes:
                    for w, s in picked:
                        what = (arch, name, tuple(sorted(_constexprs(name, d, tile_set).items())), dtype, w, s)
                        if what not in seen:
                            seen.add(what)
                            out.append(Job(arch, name, tile_set, d, dtype, w, s, (w, s) in chosen, (w, s) == chosen[0]))
        if kernels_subset is None or PAGED in kernels_subset:
            for d in PAGED_HEAD_DIMS:
                if not head_dims or d in head_dims:
                    out += [Job(arch, PAGED, "-", d, dtype, *PAGED_CONFIG, True, True) for dtype in dtypes]
    return out


def run(job_list: list[Job], workers: int = 1) -> list[Row]:
    if workers <= 1:
        return [compile_one(j) for j in job_list]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, job_list))


def main_kernels() -> tuple[str, ...]:
    """The kernels that carry the attention math (fwd, bwd and any kernel added since): every kernel in
    KERNELS but the auxiliary ones. These must be Hopper-grade."""
    from ..ops.window_attention.triton import launch

    return tuple(name for name in launch.KERNELS if name not in AUXILIARY_KERNELS)


# The head dims the Hopper standard covers: the paper backbone's 64 and 128 (D = 32 is reported, not held to it).
HOPPER_HEAD_DIMS = (64, 128)


def hopper_failures(rows: list[Row], count: bool = False):
    """Default sm_90a configs of the main kernels without wgmma or without a pipelined main loop, for the tile
    sets the dispatcher picks there unforced (``configs.dispatched_by_default``) at D in HOPPER_HEAD_DIMS
    (``count``: also how many configs were checked)."""
    from ..ops.window_attention.triton import configs

    main = set(main_kernels())
    checked = [
        r
        for r in rows
        if r.job.arch >= 90
        and r.job.default
        and r.job.kernel in main
        and r.job.head_dim in HOPPER_HEAD_DIMS
        and configs.dispatched_by_default(r.job.tile_set, r.job.head_dim, r.job.arch // 10)
    ]
    failures = [(r, r.hopper_problems()) for r in checked if r.hopper_problems()]
    return (failures, len(checked)) if count else failures


def format_table(rows: list[Row]) -> str:
    header = (
        "target",
        "kernel",
        "tiles",
        "D",
        "dtype",
        "warps",
        "stages",
        "regs",
        "spill B",
        "smem B",
        "smem limit",
        "wgmma",
        "dots",
        "depth",
        "top wait",
        "bufs",
        "stalls",
        "chosen",
        "status",
    )
    lines = [header]

    def per_loop(values) -> str:
        return "/".join("-" if v is None else str(v) for v in values) or "-"

    for r in rows:
        j = r.job
        status = r.error or ("ok" if r.ok else ("SPILLS" if r.spills else "SMEM OVERFLOW"))
        stalled = ",".join(str(i + 1) for i in r.stalled_loops) or "-"
        lines.append(
            (
                f"sm_{j.arch}{'a' if j.arch >= 90 else ''}",
                j.kernel,
                j.tile_set,
                str(j.head_dim),
                j.dtype,
                str(j.num_warps),
                str(j.num_stages),
                str(r.registers),
                str(r.spills),
                str(r.shared + r.static_shared),
                str(SHARED_LIMIT[j.arch]),
                str(r.wgmma),
                str(r.dots),
                "-" if r.depth is None else str(r.depth),
                per_loop(r.top_waits),
                per_loop(r.buffers),
                stalled,
                "default" if j.default else ("yes" if j.chosen else "no"),
                status,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--defaults", action="store_const", const="defaults", dest="scope", help="only default configs")
    scope.add_argument("--all", action="store_const", const="all", dest="scope", help="every candidate config")
    parser.add_argument("--head-dims", type=int, nargs="*", help="subset of head dims")
    parser.add_argument("--kernels", nargs="*", help="subset of kernels")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument(
        "--require-hopper",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fail when a default sm_90a config of a main kernel has no wgmma, no pipelined main "
        "loop or a main loop that stalls (default: on with --defaults)",
    )
    args = parser.parse_args(argv)
    missing = tools_missing()
    if missing:
        print(f"aot_report: cannot compile: {missing}", file=sys.stderr)
        return 2
    import triton

    rows = run(jobs(args.scope or "chosen", args.head_dims, args.kernels, tuple(args.dtypes)), args.workers)
    print(f"triton {triton.__version__}, scope {args.scope or 'chosen'}")
    print(format_table(rows))
    bad = [r for r in rows if r.job.chosen and not r.ok]
    print(f"\n{len(rows)} compiles; {len(bad)} chosen configs spill, overflow shared memory or fail to compile")
    require_hopper = args.require_hopper if args.require_hopper is not None else args.scope == "defaults"
    failures, checked = hopper_failures(rows, count=True) if require_hopper else ([], 0)
    if require_hopper:
        print(
            f"Hopper check (main kernels {', '.join(main_kernels())}; default configs of the sets sm_90a dispatches, "
            f"D in {HOPPER_HEAD_DIMS}): {checked - len(failures)} of {checked} have wgmma and pipelined main loops "
            f"that do not stall"
        )
        for r, problems in failures:
            j = r.job
            print(
                f"  NOT HOPPER-GRADE: {j.kernel} {j.tile_set} D={j.head_dim} {j.dtype} "
                f"({j.num_warps} warps, {j.num_stages} stages): {'; '.join(problems)}"
            )
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())

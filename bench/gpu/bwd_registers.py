"""Which program kind sets the fused backward's register count (AOT, no GPU).

    python -m bench bwd-registers                          # sm_90a, bf16, the default config of each set
    python -m bench bwd-registers --arch 80 --tiles base --head-dims 128

The fused ``bwd`` kernel (``jit_backward._bwd_kernel``) runs three program kinds, split by program id:
dK/dV (``_dkdv_program``), dQ with the window rows' slot part inline (``_dq_program``) and
the window keys' dK/dV (``_slot_dkdv_program``). One kernel gets one register allocation, the largest
kind's (plus whatever the branches cost together). This compiles ``bwd`` and, with ``bwd``'s arguments,
constexprs and config, three kernels that each run one kind alone, and prints registers and spill bytes
of each (``aot_report.compile_one``: ``triton.compile`` for the target, ``cuobjdump`` for resources).
"""

from __future__ import annotations

import concurrent.futures
import sys

import triton.language as tl

from kforcing_kernels.ops.window_attention.triton.jit_backward import _dkdv_program, _dq_program, _slot_dkdv_program
from kforcing_kernels.ops.window_attention.triton.jit_common import jit_kernel
from kforcing_kernels.tools import aot_report

# Each kernel below takes exactly _bwd_kernel's arguments (the AOT signature is built from their names)
# and runs one of its program kinds for every program id.


@jit_kernel
def _bwd_dkdv_only(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DK,
    DV,
    QueryTiles,
    Bounds,
    Order,
    KeyTiles,
    StepPtr,
    StepEntries,
    StepOrder,
    RowIv,
    WindowKeys,
    RowSlot0,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    bounds_bstride,
    stepptr_bstride,
    iv_bstride,
    n_heads,
    n_kv_heads,
    kv_group,
    n_keys,
    n_ctx,
    query_offset,
    n_intervals,
    n_iv,
    num_windows,
    window_size,
    windows_per_block,
    n_bh,
    n_bkv,
    n_dkdv_programs,
    n_dq_programs,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M_STEP: tl.constexpr,
    BLOCK_N_DKDV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    pid = tl.program_id(0)
    _dkdv_program(
        pid % n_bkv,
        pid // n_bkv,
        Q,
        K,
        V,
        DOut,
        Lse,
        Delta,
        DK,
        DV,
        KeyTiles,
        StepPtr,
        StepEntries,
        StepOrder,
        RowIv,
        Counters,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_lb,
        stride_lh,
        stepptr_bstride,
        iv_bstride,
        n_kv_heads,
        kv_group,
        n_iv,
        qk_scale,
        sm_scale,
        BLOCK_M_STEP,
        BLOCK_N_DKDV,
        HEAD_DIM,
        INSTRUMENT,
    )


@jit_kernel
def _bwd_dq_only(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DK,
    DV,
    QueryTiles,
    Bounds,
    Order,
    KeyTiles,
    StepPtr,
    StepEntries,
    StepOrder,
    RowIv,
    WindowKeys,
    RowSlot0,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    bounds_bstride,
    stepptr_bstride,
    iv_bstride,
    n_heads,
    n_kv_heads,
    kv_group,
    n_keys,
    n_ctx,
    query_offset,
    n_intervals,
    n_iv,
    num_windows,
    window_size,
    windows_per_block,
    n_bh,
    n_bkv,
    n_dkdv_programs,
    n_dq_programs,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M_STEP: tl.constexpr,
    BLOCK_N_DKDV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    pid = tl.program_id(0)
    _dq_program(
        pid % n_bh,
        pid // n_bh,
        Q,
        K,
        V,
        DOut,
        Lse,
        Delta,
        DQ,
        QueryTiles,
        Bounds,
        Order,
        RowIv,
        WindowKeys,
        RowSlot0,
        Counters,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_lb,
        stride_lh,
        bounds_bstride,
        iv_bstride,
        n_heads,
        kv_group,
        n_keys,
        n_ctx,
        query_offset,
        n_intervals,
        n_iv,
        window_size,
        qk_scale,
        sm_scale,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        INSTRUMENT,
    )


@jit_kernel
def _bwd_window_keys_only(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DK,
    DV,
    QueryTiles,
    Bounds,
    Order,
    KeyTiles,
    StepPtr,
    StepEntries,
    StepOrder,
    RowIv,
    WindowKeys,
    RowSlot0,
    Counters,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_lb,
    stride_lh,
    bounds_bstride,
    stepptr_bstride,
    iv_bstride,
    n_heads,
    n_kv_heads,
    kv_group,
    n_keys,
    n_ctx,
    query_offset,
    n_intervals,
    n_iv,
    num_windows,
    window_size,
    windows_per_block,
    n_bh,
    n_bkv,
    n_dkdv_programs,
    n_dq_programs,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M_STEP: tl.constexpr,
    BLOCK_N_DKDV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INSTRUMENT: tl.constexpr,
):
    pid = tl.program_id(0)
    _slot_dkdv_program(
        pid % n_bkv,
        pid // n_bkv,
        Q,
        K,
        V,
        DOut,
        Lse,
        Delta,
        DK,
        DV,
        RowIv,
        WindowKeys,
        Counters,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_lb,
        stride_lh,
        n_kv_heads,
        kv_group,
        num_windows,
        window_size,
        query_offset,
        windows_per_block,
        iv_bstride,
        n_iv,
        qk_scale,
        sm_scale,
        BLOCK_T,
        HEAD_DIM,
        INSTRUMENT,
    )


KINDS = {
    "bwd (all kinds)": None,
    "dK/dV only": _bwd_dkdv_only,
    "dQ only": _bwd_dq_only,
    "window keys only": _bwd_window_keys_only,
}


def _compile(item):
    label, job = item
    return label, aot_report.compile_one(job, KINDS[label])


def add_arguments(p) -> None:
    from kforcing_kernels.app.cli import positive_int
    from kforcing_kernels.ops.window_attention.triton import configs

    p.add_argument(
        "--arch", type=int, default=90, choices=aot_report.TARGETS, help="compute capability compiled for (90: sm_90a)"
    )
    p.add_argument(
        "--tiles",
        nargs="*",
        default=["base", "wide", "hopper"],
        choices=sorted(configs.TILE_SETS),
        help="tile sets, each at its default bwd config (one below --arch's capability is skipped)",
    )
    p.add_argument(
        "--head-dims",
        type=positive_int,
        nargs="*",
        default=[64, 128],
        help="head dims D (one a tile set has no tiles for is skipped)",
    )
    p.add_argument("--dtype", default="bf16", choices=aot_report.DTYPES, help="q/k/v dtype compiled for")
    p.add_argument("--workers", type=positive_int, default=2, help="compiles run at once (processes)")


def execute(args) -> int:
    from kforcing_kernels.ops.window_attention.triton import configs

    missing = aot_report.tools_missing()
    if missing:
        print(f"bwd_registers: cannot compile: {missing}", file=sys.stderr)
        return 2
    items = []
    for tile_set in args.tiles:
        for d in args.head_dims:
            if d not in configs.TILE_SETS[tile_set] or args.arch // 10 < configs.TILE_SET_MIN_CAPABILITY[tile_set]:
                continue
            w, s = configs.KERNEL_CONFIGS["bwd"][(tile_set, d)][0]
            for label in KINDS:
                items.append((label, aot_report.Job(args.arch, "bwd", tile_set, d, args.dtype, w, s, True, True)))
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_compile, items))
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}{'a' if args.arch >= 90 else ''}, {args.dtype}")
    print("| tiles | D | program | warps/stages | regs | spill B | top wait | bufs |")
    print("|---|---|---|---|---|---|---|---|")
    for label, row in results:
        j = row.job
        waits = "/".join("-" if w is None else str(w) for w in row.top_waits) or "-"
        bufs = "/".join("-" if b is None else str(b) for b in row.buffers) or "-"
        print(
            f"| {j.tile_set} | {j.head_dim} | {label} | {j.num_warps}/{j.num_stages} | "
            f"{row.error or row.registers} | {row.spills} | {waits} | {bufs} |"
        )
    return 0

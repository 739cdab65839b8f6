"""Tile sets and kernel config tables of the Triton backend, and the choice between them.

Tile shapes are part of the plan (``plan.py``), so a tile set is chosen per call by
``tile_set_for`` (head dim, query rows, device); the autotuner (``launch.py``) then only
picks ``(num_warps, num_stages)`` from ``KERNEL_CONFIGS`` for the key it is given. Nothing
here imports triton: the tables are read by tools/aot_report.py and tools/slot_cost.py too.
"""

from __future__ import annotations

from typing import Optional

import torch

from .... import env
from .plan import DEFAULT_TILES, Tiles

SUPPORTED_HEAD_DIMS = (32, 64, 128)

# Tile sets (tile shapes are part of the plan, so they are chosen by `tile_set_for`, not by the autotuner):
# "base" runs everywhere; "wide" is the H100-class D=128 set: FlexAttention's H100 forward tiles (128 query
# rows x 64 keys) for the forward and dQ; each dK/dV program owns 128 keys and steps through the query
# tiles 16 rows at a time (q and dO are re-read once per key tile: 4x less traffic than the earlier 32-key
# programs; on an H100, single N=8192 k=4 fwd+bwd 141 -> 202 TFLOP/s, bench/gpu/triton_gpu.py --wide-dkdv).
# It is used on sm_90+ once a head has >= WIDE_MIN_ROWS query rows (below that, 128-row tiles leave SMs
# idle at B*H = 16: Lq = 1024 gives 128 programs for 132 SMs). Its windows of 5..16 slots take tile
# products instead of slot steps: at w = 8 and 16 (single / double k=8, N=8192) in-tile beat slot steps
# on an H100, fwd 424 vs 356 and 414 vs 311 TFLOP/s, fwd+bwd 150 vs 138 and 146 vs 127 (--slot-window-max 0).
# "hopper" is the sm_90+ D=64 set (the paper backbone's head dim): 64-key dK/dV programs, so every product
# is a 64-row wgmma (32-key programs fall back to mma_v2); under Triton 3.6 they spill on sm_80, where
# "base" keeps 32-key programs. The wide set now steps 32 rows (the pipelined dK/dV kernel compiles clean).
# Base D=128 dK/dV programs step 32 rows too: with the prefetching step loop (issue 34; q/dO of two steps
# in flight) 64-row steps spill 32-56 bytes under Triton 3.6 (sm_80 bwd, sm_90a bwd and dkdv); 32-row steps
# compile clean (sm_90a: 229 registers).
TILE_SETS: dict[str, dict[int, Tiles]] = {
    "base": {32: DEFAULT_TILES, 64: DEFAULT_TILES, 128: Tiles(64, 64, 64, 32, block_m_dkdv=32)},
    "hopper": {64: Tiles(64, 64, 64, 64)},
    "wide": {128: Tiles(128, 64, 128, 32, block_m_dkdv=32, slot_window_max=4)},
    # A/B candidate, never dispatched unless forced (KFORCING_TRITON_TILES=hopper128; the GPU run decides):
    # the hopper D=64 set with 128-key dK/dV programs at 8 warps, as FlexAttention's sm_90 backward (128-key
    # tiles, 3 stages, 8 warps): half the q/dO re-reads per key of 64-key programs. sm_90a: 0 spill bytes under
    # Triton 3.6.0 and 3.9.0 (bwd 255 / 220 registers, dkdv 255 / 222; bench/results/aot/). Not a candidate:
    # the wide D=128 set with 64-row steps, which spills 64-144 bytes (bwd, dkdv) on sm_90a.
    "hopper128": {64: Tiles(64, 64, 128, 64)},
    # D=128 backward candidate for the GPU A/B (issue 47: at N=8192 the wide set's forward + backward is 0.82x
    # FlexAttention's, 294 vs 357 TFLOP/s on an H200, forward at parity). FlexAttention's sm_90 D=128 backward
    # (torch/_inductor/template_heuristics/triton.py: FlexBwDConfig(64, 128, 128, 64, 3, 8); one launch, dK/dV
    # programs first, then dQ) steps 64 query rows per 128-key dK/dV program and 64 keys per 128-row dQ program,
    # 3 stages, 8 warps. The wide set matches it but for 32-row steps. "wide_n64" takes FlexAttention's step
    # shape on 64-key programs (twice the q/dO re-reads of 128-key programs, twice the math per step of the wide
    # set's), at 2 stages: AOT-clean on sm_90a under Triton 3.6.0 and 3.9.0. Not candidates (they spill on sm_90a
    # under 3.6.0): 64-row steps on 128-key programs (FlexAttention's exact shape: 72-136 B), the wide set at 4
    # stages (16 B) or with only its dK/dV loop at 4 (8 B), "wide_n64" at 3 stages (56 B); BENCHMARKS.md, "D=128
    # backward candidates". Forced only (KFORCING_TRITON_TILES=wide_n64).
    "wide_n64": {128: Tiles(128, 64, 64, 32, block_m_dkdv=64, slot_window_max=4)},
}
# Tile sets tile_set_for picks only when KFORCING_TRITON_TILES names them (A/B candidates).
FORCED_ONLY_TILE_SETS = ("hopper128", "wide_n64")
TILES_BY_HEAD_DIM = TILE_SETS["base"]
WIDE_MIN_ROWS = 2048
# Lowest compute capability (major) each set runs on, forced or not: the AOT report checks a set only
# for targets at or above it (the wide dQ kernel spills on sm_80 under Triton 3.6).
TILE_SET_MIN_CAPABILITY = {"base": 0, "hopper": 9, "wide": 9, "hopper128": 9, "wide_n64": 9}
# (num_warps, num_stages) per kernel and (tile set, head dim): every entry compiles with 0 spill bytes
# and within shared memory on sm_80 and sm_90a ("hopper", "wide": sm_90a only) in fp16 and bf16 under both
# ends of the supported Triton range, 3.6.0 and 3.9.0 (`make aot-check`; README "Triton AOT resources").
# The first entry of each list is the default (`aot_report --defaults`, the CI test) and what runs
# without timing (KFORCING_TRITON_AUTOTUNE=0, or by default under torch.distributed); on sm_90a the
# defaults of fwd and bwd are software-pipelined (3 stages) with wgmma. Pruned by that measurement
# (pipelined kernels): the bwd D=64 base set spills at 4 warps on sm_80 (so 8 warps lead); with the
# window slot steps inline, the D=32 bwd spills on sm_80 at 4 warps under 3.9 (8 warps lead) and the
# D=64 one at 8/1 (8/2 replaces it). Until 0.4 (commit 6f25b35) the table also held the split kernels
# (slot_fwd, slot_bwd, dq, dkdv) and the legacy ones (dq_legacy, dkdv_legacy), removed after the H200 run.
_DELTA = {32: [(4, 1), (8, 1)], 64: [(4, 1), (8, 1)], 128: [(4, 1), (8, 1)]}
KERNEL_CONFIGS: dict[str, dict[tuple[str, int], list[tuple[int, int]]]] = {
    "fwd": {
        ("base", 32): [(4, 3), (8, 2), (8, 3)],
        ("base", 64): [(4, 2), (4, 3), (8, 2), (8, 3)],
        ("hopper", 64): [(4, 3), (4, 2), (8, 3)],
        ("base", 128): [(8, 3), (8, 2), (8, 1)],
        ("wide", 128): [(8, 3), (8, 2), (8, 1)],
    },
    "bwd": {
        ("base", 32): [(8, 3), (8, 2)],
        ("base", 64): [(8, 3), (8, 2)],
        ("hopper", 64): [(4, 3), (8, 3)],
        ("base", 128): [(8, 3)],
        ("wide", 128): [(8, 3), (8, 2)],
        ("hopper128", 64): [(8, 3)],
        ("wide_n64", 128): [(8, 2)],
    },
    # The delta kernel does not read block_m/block_n: the same lists under every tile set.
    "delta": {(s, d): _DELTA[d] for s, by_d in TILE_SETS.items() for d in by_d},
}
# The candidate sets' forwards are the hopper / wide sets' (the same forward tiles there).
KERNEL_CONFIGS["fwd"][("hopper128", 64)] = KERNEL_CONFIGS["fwd"][("hopper", 64)]
KERNEL_CONFIGS["fwd"][("wide_n64", 128)] = KERNEL_CONFIGS["fwd"][("wide", 128)]
# Candidates the AOT report compiles to prune the table above (`aot_report --all`).
CANDIDATE_CONFIGS = [(4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3)]
DELTA_BLOCK = 64
GPU_DTYPES = (torch.float16, torch.bfloat16)
# Length buckets of the autotune key: next power of two of the query rows, clamped to this range.
BUCKET_MIN, BUCKET_MAX = 1024, 16384


def length_bucket(rows: int) -> int:
    """Autotune bucket of ``rows`` query rows per head: the next power of two in [BUCKET_MIN, BUCKET_MAX]."""
    return min(BUCKET_MAX, max(BUCKET_MIN, 1 << max(0, int(rows) - 1).bit_length()))


def autotune_enabled() -> bool:
    """Whether launches benchmark their config list (else the first entry runs: deterministic).

    KFORCING_TRITON_AUTOTUNE=1 / 0 forces it. Unset: on, except under an initialised torch.distributed
    group of more than one rank, where per-rank timing noise could pick different configs (and so
    different rounding) on different ranks; there the first entry runs everywhere.
    """
    forced = env.triton_autotune()
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"KFORCING_TRITON_AUTOTUNE: expected '0' or '1', got {forced!r}")
        return forced == "1"
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: the triton backend supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")


_capabilities: dict[int, tuple[int, int]] = {}  # per CUDA device index (a device fact, not a layout's)


def _capability(device: Optional[torch.device]) -> tuple[int, int]:
    """Compute capability of a CUDA ``device`` ((0, 0) for anything else)."""
    if device is None or device.type != "cuda":
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


def tile_set_for(head_dim: int, rows: int = 0, device: Optional[torch.device] = None) -> str:
    """Name of the tile set for ``rows`` query rows per head of ``head_dim`` on ``device``.

    KFORCING_TRITON_TILES=base|hopper|wide|hopper128|wide_n64 forces a set where it applies (head dims it has
    no tiles for, and CUDA devices below its TILE_SET_MIN_CAPABILITY, keep "base"). Unforced, CUDA sm_90+ takes "wide"
    for long D=128 heads and "hopper" where it has tiles; everything else (and the interpreter) "base".
    """
    check_head_dim(head_dim)
    forced = env.triton_tiles()
    if forced and forced not in TILE_SETS:
        raise ValueError(f"KFORCING_TRITON_TILES: expected one of {sorted(TILE_SETS)}, got {forced!r}")
    cuda = device is not None and device.type == "cuda"

    def fits(name: str) -> bool:  # the interpreter (CPU) runs any set
        return head_dim in TILE_SETS[name] and (not cuda or _capability(device)[0] >= TILE_SET_MIN_CAPABILITY[name])

    if forced:
        return forced if fits(forced) else "base"
    if cuda and rows >= WIDE_MIN_ROWS and fits("wide"):
        return "wide"
    return "hopper" if cuda and fits("hopper") else "base"


def dispatched_by_default(tile_set: str, head_dim: int, capability_major: int) -> bool:
    """Whether ``tile_set_for`` (nothing forced) picks ``tile_set`` for ``head_dim`` on some shape of a device
    of this capability: the sets whose defaults the AOT report holds to that target's standard."""
    if (
        head_dim not in TILE_SETS[tile_set]
        or capability_major < TILE_SET_MIN_CAPABILITY[tile_set]
        or tile_set in FORCED_ONLY_TILE_SETS
    ):
        return False
    if tile_set == "base" and capability_major >= TILE_SET_MIN_CAPABILITY["hopper"]:
        return head_dim not in TILE_SETS["hopper"]
    return True


def tiles_for(head_dim: int, rows: int = 0, device: Optional[torch.device] = None) -> Tiles:
    """The tiles the dispatcher uses for ``rows`` query rows per head of ``head_dim`` on ``device``."""
    return TILE_SETS[tile_set_for(head_dim, rows, device)][head_dim]

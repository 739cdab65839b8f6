#!/usr/bin/env bash
# bench/gpu/gpu_check.sh: the project's one-call GPU check (fits one 10-minute command).
#
#   bash bench/gpu/gpu_check.sh            # from the project root; logs and JSON under $OUT (else ./gpu-out)
#   bash bench/gpu/gpu_check.sh --dry-run  # on any machine: every step's Python on CPU (python_tests/bench/test_gpu_check.py)
#
# Nothing is installed (GPU machines here have no network): missing packages are reported and
# the steps that need them skipped. Each step has its own cap, and a global deadline
# (GPU_CHECK_BUDGET_S, default 540 s) keeps the whole run under 9 minutes (GPU_CHECK_ONLY="2_smoke 9e_sampler"
# runs only the steps named; their reserves still apply); a failing or
# timed-out step does not stop the ones after it; the last lines give every step's exit code.
#
# --dry-run runs the same step commands on CPU, rewritten by dry_rewrite below: the Python scripts and
# bench/gpu/triton_gpu.py / triton_profile.py get --dry-run (tiny shapes, fp32, one call per method instead of
# do_bench), the Triton steps run in the interpreter (TRITON_INTERPRET=1), `--device cuda` becomes cpu, the
# serving and batch-invariance steps get tiny sizes, pytest only collects. No reserves, no budget cut;
# every step, the opt-in ones included, must exit 0. No step of the real run imports or calls code the
# dry run does not (the same modules and functions; only the compile backend of FlexAttention, inductor
# vs dynamo's eager on CPU, and the device differ).
#
# Steps, in the order of their value (the real run stops wherever its budget ends; kept in step with
# python_tests/ops/window_attention/triton/test_triton_gpu.py, test_gpu_check.py and bench/gpu/triton_gpu.py):
#   0 versions: packages, the triton tile sets and autotune switch, composite_cuda's kernels, FlexAttention's
#     FLASH route (flash_attn.cute), the dispatch table in use
#   1 warm: every kernel that steps 5-7 time, compiled and autotuned once (bench/gpu/triton_gpu.py --warm: the
#     fused default, FlexAttention called directly and as backend="flex", every variant of bench/gpu/gpu_variants.txt,
#     at N 1024/8192, k 4, D 64/128), so later steps reuse Triton's and inductor's disk caches; prints each
#     first call's seconds (the compile estimate in BENCHMARKS.md checks against them)
#   2 smoke: window_attention(backend="triton") fwd+bwd in bf16 vs the float64 reference (ours <= 2x torch's own
#     bf16 error + 8e-3), D 128/64, slot and tile modes, both D=128 tile sets, 3 more runs that must match bit
#     for bit (no atomics: a difference is a race); backend="flex" on one case; the composite CUDA path
#   3 pytest: python_tests/ops/window_attention/triton/test_triton_gpu.py (the CUDA tests)
#   4 int64 offsets: B*H*L*D > 2^31 elements per tensor, first/last batch element vs the reference
#   5 A/B (decides the defaults): per shape the fused default, compiled FlexAttention and backend="flex" first,
#     then every variant of bench/gpu/gpu_variants.txt (prefetch off, tile candidates, split, legacy),
#     single layout, N 1024/8192, k 4, D 64/128 (do_bench medians, TFLOP/s per useful FLOP)
#   6 profile: per-kernel GPU time of one fwd+bwd for the default, every variant and backend="flex", summed
#     per part (fwd, delta, dQ, dK/dV, fused bwd, flex fwd/bwd): where a loss is
#   7 dispatch table: the step-5 winners (triton vs backend="flex", fwd+bwd) written to
#     $OUT/dispatch_table.json with their provenance (copy it to kforcing_kernels/ops/window_attention/)
#   8 train step: paper backbone (12 layers, width 768), N 1024, B 4, teacher k 2 -> student 4: triton, the
#     same step with attention replaced by a zero-cost op (the limit; target: within 10%), then dense-mask SDPA
#   8b the same at N 4096, teacher k 4 -> student 8 (target: >= 7x dense; dense last: seconds per step)
#   9 batch invariance (bench/gpu/batch_invariance.py): triton fwd+bwd bitwise alone vs inside batches of 2-16, under
#     the autotuned choice and every config forced in turn; teacher targets batched vs per sample
#  9b grid: triton (auto and the base tile set) vs SDPA flash causal (same useful work), flash-attn, single layout,
#     N 1024/4096/8192, k 2/4/8, D 128, B 1, H 16
#  9c triton rows (N 1024/8192, k 2/4, single + double) with every window's intra part in-tile
#     (--slot-window-max 0): the slot-step threshold for w <= 4 (BENCHMARKS.md, tools/slot_cost)
#  9d + composite (CUDA path) and dense-mask SDPA, N 1024/2048, k 4, D 64/128
#  9e sampler: the Triton inverse-CDF sampler vs torch float64, noise-inversion round trip
#  10 serving (only when named: GPU_CHECK_ONLY="10_serving_b4 10_serving_b16 10_serving_b128", a call of its own):
#     K-Forcing's Table 1 protocol through `bench infer`: the paper backbone (12 x 768, random weights, no EOS
#     stop), bf16, 64-token prompts completed to 1,024 tokens, AR vs K-Forcing k = 2 / 4, paged and contiguous
#     KV cache, 5 timed runs after a warm-up; one batch size per step, each writing its own JSON
#  11 the README table (only when named: GPU_CHECK_ONLY="11_table_d64 11_table_d128", a call of its own): triton vs
#     compiled FlexAttention, SDPA-flash causal and dense-mask SDPA, single layout, N 1024/4096/8192, k 2/4/8,
#     B 1, H 16; `python3 -m bench gpu --render $OUT/table_d*.json` prints the markdown table
#
# Time (BENCHMARKS.md "GPU check: compile estimate", assumed costs, not yet measured): with a fresh Triton
# cache step 1 compiles for ~270 s and steps 0-7 end at ~480 s of the 540 s budget on an H200; steps 8-9e
# take what is left (a second call with GPU_CHECK_ONLY runs them); the summary shows the real times.
set -uo pipefail

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

ROOT=${KF_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if [ ! -d "$ROOT/kforcing_kernels" ] || [ ! -f "$ROOT/bench/gpu/triton_gpu.py" ] || [ ! -d "$ROOT/python_tests" ]; then
    echo "gpu_check: run this from the kforcing_kernels project root (or set KF_ROOT); $ROOT has no kforcing_kernels/, bench/gpu/triton_gpu.py or python_tests/" >&2
    exit 2
fi
cd "$ROOT" || exit 2
OUT_DIR=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log
BUDGET=${GPU_CHECK_BUDGET_S:-540}
START=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || { echo "gpu_check: mktemp failed" >&2; exit 2; }
trap 'rm -rf "$WORK"' EXIT

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif command -v python >/dev/null 2>&1; then PY=python
else PY=python3
fi

# Compiled kernels (the dry run: Triton's interpreter), the package from this source tree (no install
# needed), no forced backend or kernel switch (the variants set their own).
for var in TRITON_INTERPRET KFORCING_BACKEND KFORCING_TRITON_TILES KFORCING_TRITON_KERNELS KFORCING_TRITON_PREFETCH \
        KFORCING_FLEX_BACKEND KFORCING_DISPATCH_TABLE; do
    if [ -n "${!var:-}" ]; then echo "gpu_check: unsetting $var=${!var}"; fi
    unset "$var"
done
if [ "$DRY_RUN" -eq 1 ]; then export TRITON_INTERPRET=1; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_PRINT_AUTOTUNING=1   # the config each autotuned kernel picks, and how long tuning took

# ---------------------------------------------------------------- the Python parts
cat > "$WORK/info.py" <<'PYEOF'
import importlib
import platform
import sys

print("python", sys.version.split()[0], "on", platform.platform())
required = {
    "torch": "everything",
    "triton": "the triton backend",
    "numpy": "torch and Triton",
    "pytest": "step 2 (python_tests/ops/window_attention/triton/test_triton_gpu.py)",
}
optional = {
    "flash_attn": "the bench's fa2_causal column (empty without it; sdpa_causal is always measured)",
    "flash_attn.cute": "FlexAttention's FLASH route (KFORCING_FLEX_BACKEND=FLASH, the flash-attn-4 package)",
    "safetensors": "kforcing_kernels.app.train / inference checkpoints; not used by this script",
    "tokenizers": "kforcing_kernels.app.data; not used by this script",
    "hypothesis": "property tests elsewhere in python_tests; not run here",
    "pytest_benchmark": "bench/attention/pytest_attention.py; not run here",
    "transformers": "python_tests/integrations/test_hf.py; not run here",
}
missing = []
for name, why in {**required, **optional}.items():
    try:
        module = importlib.import_module(name)
        print(f"  {name:17s} {getattr(module, '__version__', '(no __version__)')}")
    except Exception as exc:  # noqa: BLE001 - report, never fail here
        kind = "MISSING, REQUIRED for" if name in required else "missing (optional):"
        print(f"  {name:17s} {kind} {why} [{type(exc).__name__}: {exc}]")
        if name in required:
            missing.append(name)
if missing:
    print(f"REQUIRED PACKAGES MISSING: {', '.join(missing)}. This script installs nothing (no network); "
          "the steps that need them are skipped or fail.")
try:
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "cuda available:", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free), {torch.cuda.device_count()} device(s)")
except Exception as exc:  # noqa: BLE001
    print("torch check failed:", type(exc).__name__, exc)
try:
    import triton

    print("triton", triton.__version__, "ptxas", getattr(triton.knobs.nvidia.ptxas, "path", "?"))
except Exception as exc:  # noqa: BLE001
    print("triton check failed:", type(exc).__name__, exc)
try:
    import kforcing_kernels

    print("kforcing_kernels imported from", kforcing_kernels.__file__)
    print("backends:", kforcing_kernels.backends_available())
    print("backend limits:", kforcing_kernels.ops.window_attention.backend_limits())
    from kforcing_kernels.ops.window_attention import dispatch
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda
    from kforcing_kernels.ops.window_attention.triton import configs

    print("composite_cuda kernels:", composite_cuda.status())
    print("triton autotune:", "on" if configs.autotune_enabled() else "off (first config)",
          "| tile sets:", {n: {d: tuple(t.__dict__.values()) for d, t in s.items()} for n, s in configs.TILE_SETS.items()})
    print("dispatch table:", dispatch.TABLE_PATH, f"{len(dispatch.load()['rows'])} measured row(s)")
except Exception as exc:  # noqa: BLE001
    print("kforcing_kernels import FAILED:", type(exc).__name__, exc)
    sys.exit(1)
sys.exit(1 if missing else 0)
PYEOF

cat > "$WORK/smoke.py" <<'PYEOF'
import os
import sys
import time

import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda

DRY = "--dry-run" in sys.argv  # CPU, fp32 (the interpreter's bf16 dot is wrong), tiny layouts
dev = torch.device("cpu" if DRY else "cuda")
DTYPE = torch.float32 if DRY else torch.bfloat16
failures = 0


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(q, k, v, layout, dout, backend, grads=True):
    out, lse = window_attention(q, k, v, layout, backend=backend, return_lse=True)
    if not grads:
        return out, lse
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def case(name, layout, dtype, d, batch=2, heads=4, kv_heads=2, backend="triton"):
    global failures
    g = torch.Generator(device=dev).manual_seed(0)
    # FlexAttention has no CPU backward: the dry run checks backend="flex" forward only
    grads = not (backend == "flex" and dev.type == "cpu")

    def rand(h, length):
        return torch.randn(batch, h, length, d, device=dev, dtype=dtype, generator=g)

    q, k, v = rand(heads, layout.n_queries), rand(kv_heads, layout.n_keys), rand(kv_heads, layout.n_keys)
    dout = rand(heads, layout.n_queries)
    q, k, v = (t.requires_grad_(grads) for t in (q, k, v))
    label = f"{backend:9s} {name:26s} {str(dtype)[6:]:8s} D={d:3d} tiles={os.environ.get('KFORCING_TRITON_TILES', 'auto')}"
    try:
        t0 = time.perf_counter()
        ours = run(q, k, v, layout, dout, backend, grads)
        sync()
        first_s = time.perf_counter() - t0
        ref64 = run(*(t.detach().double().requires_grad_(grads) for t in (q, k, v)), layout, dout.double(), "reference", grads)
        ref_lp = run(*(t.detach().clone().requires_grad_(grads) for t in (q, k, v)), layout, dout, "reference", grads)
        repeat_ok = True
        for _ in range(1 if DRY else 3):
            again = run(q, k, v, layout, dout, backend, grads)
            repeat_ok &= all(torch.equal(a, b) for a, b in zip(again, ours))
    except Exception as exc:  # noqa: BLE001 - report and go on
        failures += 1
        print(f"{label}: EXCEPTION {type(exc).__name__}: {exc}", flush=True)
        return
    floor = 8e-3 if dtype == torch.bfloat16 else 1e-3
    parts, ok = [], repeat_ok
    for what, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, ref_lp):
        finite = bool(torch.isfinite(a).all())
        err = (a.double() - b).abs().max().item()
        torch_err = (c.double() - b).abs().max().item()
        good = finite and err <= 2 * torch_err + floor
        ok &= good
        parts.append(f"{what} {err:.1e}/{torch_err:.1e}{'' if finite else ' NONFINITE'}{'' if good else ' BAD'}")
    failures += not ok
    print(f"{label}: first call {first_s:5.1f}s | max err ours/torch-same-dtype vs fp64: {', '.join(parts)} | "
          f"bitwise repeatable: {repeat_ok} | {'OK' if ok else 'FAIL'}", flush=True)


if DRY:  # the same calls on fewer, smaller cases: each interpreted fwd + bwd takes seconds
    cases = [
        ("single N=4 k=4", WindowLayout.kforcing_single(4, 4)),
        ("double N=2 k=12 (tiles)", WindowLayout.kforcing_double(2, 12)),
    ]
    big, big_name, dims, tile_cases = WindowLayout.kforcing_single(8, 4), "single N=8 k=4 H=2", (64,), cases[:1]
else:
    cases = [
        ("single N=256 k=4", WindowLayout.kforcing_single(256, 4)),         # slot mode (w <= 16)
        ("double N=128 k=4", WindowLayout.kforcing_double(128, 4)),         # slot mode, two streams
        ("double N=64 k=12 (tiles)", WindowLayout.kforcing_double(64, 12)),  # w = 24: tile mode with streams
        ("sbd N=300 b=7", WindowLayout.sbd(300, 7)),                        # full intra, short last window
    ]
    big, big_name, dims, tile_cases = WindowLayout.kforcing_single(1024, 4), "single N=1024 k=4 H=16", (128, 64), cases[:3]
big_heads = 2 if DRY else 16
for d in dims:
    for name, layout in cases:
        case(name, layout, DTYPE, d)
for tiles in ("base", "wide"):  # both D=128 tile sets, whatever this GPU would pick
    os.environ["KFORCING_TRITON_TILES"] = tiles
    for name, layout in tile_cases:
        case(name, layout, DTYPE, 128)
    if not DRY:
        case(big_name, big, DTYPE, 128, batch=1, heads=big_heads, kv_heads=big_heads)
os.environ.pop("KFORCING_TRITON_TILES")
case(big_name, big, DTYPE, 128 if not DRY else 64, batch=1, heads=big_heads, kv_heads=big_heads, backend="flex")
for name, layout in cases:
    case(name, layout, DTYPE, 128 if not DRY else 64, backend="composite")
print("composite_cuda kernels:", composite_cuda.status())
failures += bool(composite_cuda.status()["disabled"])
print(f"smoke: {failures} failing case(s)")
sys.exit(1 if failures else 0)
PYEOF

cat > "$WORK/int64.py" <<'PYEOF'
import sys

import torch

from kforcing_kernels import WindowLayout, window_attention

DRY = "--dry-run" in sys.argv  # CPU, fp32, 3 batch elements: the code path, not the 2^31 offsets
layout = WindowLayout.kforcing_single(8 if DRY else 64, 4)  # Lq = Lk = 320, 256 window rows
heads, d, dtype = (2, 32, torch.float32) if DRY else (16, 128, torch.bfloat16)
per_batch = heads * layout.n_queries * d
batch = 3 if DRY else 2**31 // per_batch + 2
elems = batch * per_batch
window_rows = layout.n_queries - layout.n_ctx
# Peak: q, k, v, out, dout, dq, dk, dv (bf16), the fp32 slot partial, lse/delta.
need = 8 * elems * 2 + batch * heads * window_rows * d * 4 + 2 * batch * heads * layout.n_queries * 4
free, total = (need * 2 + 2**32, 0) if DRY else torch.cuda.mem_get_info()
print(f"B={batch} H={heads} L={layout.n_queries} D={d}: {elems} elements per tensor (2^31 = {2**31}); "
      f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
if free < need * 1.1 + 2 * 2**30:
    print("int64 offsets: SKIPPED (not enough free GPU memory)")
    sys.exit(0)
dev = torch.device("cpu" if DRY else "cuda")
g = torch.Generator(device=dev).manual_seed(0)


def rand():
    return torch.randn(batch, heads, layout.n_queries, d, device=dev, dtype=dtype, generator=g)


q, k, v = (rand().requires_grad_(True) for _ in range(3))
dout = rand()
out, lse = window_attention(q, k, v, layout, backend="triton", return_lse=True)
dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
if not DRY:
    torch.cuda.synchronize()


def reference(b, precision):
    qr, kr, vr = (t[b:b + 1].detach().to(precision).requires_grad_(True) for t in (q, k, v))
    ro, rl = window_attention(qr, kr, vr, layout, backend="reference", return_lse=True)
    return (ro, rl, *torch.autograd.grad(ro, (qr, kr, vr), dout[b:b + 1].to(precision)))


bad = 0
for b in (0, batch - 1):
    ref64, ref_lp = reference(b, torch.float64), reference(b, dtype)
    parts = []
    for what, a, r, c in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref64, ref_lp):
        a = a[b:b + 1]
        err = (a.double() - r).abs().max().item()
        torch_err = (c.double() - r).abs().max().item()
        good = bool(torch.isfinite(a).all()) and err <= 2 * torch_err + (1e-3 if DRY else 8e-3)
        bad += not good
        parts.append(f"{what} {err:.1e}/{torch_err:.1e}{'' if good else ' BAD'}")
    print(f"batch element {b}: max err ours/torch-bf16 vs fp64: {', '.join(parts)}")
print("int64 offsets:", "FAIL" if bad else "OK")
sys.exit(1 if bad else 0)
PYEOF

cat > "$WORK/sampler.py" <<'PYEOF'
import sys

import torch

from kforcing_kernels.ops import sampling

DRY = "--dry-run" in sys.argv  # CPU, small vocabularies, 16 rows
dev = torch.device("cpu" if DRY else "cuda")
rows = 16 if DRY else 256
print(f"sampler backend on {dev.type}:", sampling.sampler_backend(dev))
g = torch.Generator(device=dev).manual_seed(0)
fails = 0
for V in ((7, 300) if DRY else (7, 2500, 152064)):
    for dtype in (torch.float32, torch.bfloat16):
        for tau in (0.3, 1.0):
            logits = (torch.randn(rows, V, device=dev, generator=g) * 3).to(dtype)
            if V > 3:
                logits[:, 2::5] = float("-inf")
            z = torch.rand(rows, device=dev, generator=g)
            got = sampling.inverse_cdf_sample(logits, z, tau)
            want = sampling.inverse_cdf_sample_reference(logits, z, tau)
            mismatch = int((got != want).sum())
            z_back = sampling.noise_inversion(logits, got, tau, generator=g)
            round_trip = int((sampling.inverse_cdf_sample(logits, z_back, tau) != got).sum())
            # A lone mismatch can be a 1-ulp float64 difference at a bin edge; more than 2 of 256 is a bug.
            fails += mismatch > 2 or round_trip > 2
            print(f"V={V:6d} {str(dtype)[6:]:8s} tau={tau}: {mismatch}/{rows} differ from the torch float64 reference, "
                  f"{round_trip}/{rows} noise-inversion round trips fail")
if not DRY:
    torch.cuda.synchronize()
print("sampler:", "FAIL" if fails else "OK")
sys.exit(1 if fails else 0)
PYEOF

# ---------------------------------------------------------------- steps
elapsed() { echo $(( $(date +%s) - START )); }

# The dry run's changes to a step's command (see the header): FLAG -> VALUE replaces the flag's value(s),
# per kind of command; the Python scripts and benches get --dry-run, pytest --collect-only.
declare -A DRY_INFER=([--device]=cpu [--preset]=micro [--dtype]=float32 [--batch-sizes]=2 [--prompt-len]=4
                      [--new-tokens]=4 [--warmup]=0 [--reps]=1)
declare -A DRY_INVARIANCE=([--n]=4 [--k]=2 [--dims]=32 [--batch-sizes]=2)
DRY_CAP=300  # seconds per dry-run step (the Triton interpreter on 2 busy cores)

# dry_rewrite CMD...: sets DRY_CMD to CMD as the dry run runs it.
dry_rewrite() {
    DRY_CMD=()
    local kind=script extra=(--dry-run)
    if [ "${2:-}" = "-m" ]; then
        case "${3:-} ${4:-}" in
            "bench gpu"|"bench profile") kind=bench ;;
            "pytest "*) kind=pytest; extra=(--collect-only) ;;
            "bench batch-invariance") kind=invariance; extra=(--device cpu --backend triton --layouts single --heads 1 --teacher-n 8) ;;
            "bench infer") kind=infer; extra=() ;;
            *) kind=other; extra=() ;;
        esac
    fi
    local a skipping=0 value
    for a in "$@"; do
        if [ "$skipping" -eq 1 ]; then
            if [[ "$a" != --* ]]; then continue; fi
            skipping=0
        fi
        DRY_CMD+=("$a")
        value=""
        case "$kind" in
            infer) value=${DRY_INFER[$a]:-} ;;
            invariance) value=${DRY_INVARIANCE[$a]:-} ;;
        esac
        if [ -n "$value" ]; then DRY_CMD+=("$value"); skipping=1; fi
    done
    DRY_CMD+=("${extra[@]}")
}

# run_step NAME CAP RESERVE CMD...: run CMD with min(CAP, time left - RESERVE) seconds; skip if < 20 s.
# The dry run runs dry_rewrite's CMD with DRY_CAP seconds, whatever the budget.
run_step() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        return 0  # not among the steps asked for
    fi
    local left=$(( BUDGET - $(elapsed) - reserve ))
    local t=$(( cap < left ? cap : left ))
    local cmd=("$@")
    if [ "$DRY_RUN" -eq 1 ]; then
        t=$DRY_CAP
        dry_rewrite "$@"
        cmd=("${DRY_CMD[@]}")
    fi
    echo
    echo "==================== [$name] $(date -u +%H:%M:%S)Z, elapsed $(elapsed)s, cap ${t}s"
    echo "\$ ${cmd[*]}"
    if [ "$t" -lt 20 ]; then
        echo "[$name] SKIPPED: only ${t}s left in the ${BUDGET}s budget"
        SUMMARY+=("$name: skipped (no time left)")
        return 0
    fi
    local t0 rc dt what
    t0=$(date +%s)
    timeout --kill-after=10 "$t" "${cmd[@]}" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    dt=$(( $(date +%s) - t0 ))
    what="rc=$rc"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then what="rc=$rc (TIMED OUT at ${t}s)"; fi
    echo "[$name] exit: $what, ${dt}s"
    SUMMARY+=("$name: $what, ${dt}s")
    return 0
}

skip_step() {
    echo
    echo "==================== [$1] SKIPPED: $2"
    SUMMARY+=("$1: skipped ($2)")
}

gpu_state() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 20 nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used,utilization.gpu --format=csv
    fi
}

main() {
    SUMMARY=()
    echo "gpu_check: root $ROOT, out $OUT_DIR, python $(command -v "$PY" || echo "$PY (not found)"), budget ${BUDGET}s$(
        [ "$DRY_RUN" -eq 1 ] && echo ", DRY RUN (CPU, Triton interpreter, tiny shapes: no numbers)")"
    date -u
    uname -a
    if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
        echo "git: $(git -C "$ROOT" rev-parse HEAD), $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed paths"
    else
        echo "git: not a git checkout"
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 30 nvidia-smi
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
    else
        echo "nvidia-smi: NOT FOUND"
    fi
    run_step 0_versions 45 0 "$PY" "$WORK/info.py"

    local have_cuda=0 have_pytest=0
    if "$PY" -c "import pytest" >/dev/null 2>&1; then have_pytest=1; fi
    if [ "$DRY_RUN" -eq 0 ]; then
        if "$PY" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then have_cuda=1; fi
    else
        have_cuda=1  # the dry run runs every step on CPU
        export GPU_CHECK_ONLY=${GPU_CHECK_ONLY:-"0_versions 1_warm 2_smoke 3_pytest_gpu 4_int64_offsets 5_ab 6_profile 7_dispatch_table 8_train_step 8b_train_step_n4096 9_batch_invariance 9b_grid_d128 9c_in_tile 9d_composite_dense 9e_sampler 10_serving_b4 10_serving_b16 10_serving_b128 11_table_d64 11_table_d128"}
    fi
    if [ "$have_cuda" -eq 0 ]; then
        echo "gpu_check: torch/triton not importable or no CUDA device; every GPU step is skipped"
        local s
        for s in 1_warm 2_smoke 3_pytest_gpu 4_int64_offsets 5_ab 6_profile 7_dispatch_table 8_train_step 8b_train_step_n4096 9_batch_invariance 9b_grid_d128 9c_in_tile 9d_composite_dense 9e_sampler; do
            skip_step "$s" "no CUDA device or torch/triton not importable"
        done
    else
        # By value: compile first (so no later cap pays for it), correctness, then the A/B that decides the
        # defaults and the dispatch table, the training step, batch invariance; the rest as time allows.
        # Each reserve keeps that many seconds for the steps up to the dispatch table after it (BENCHMARKS.md
        # "GPU check: compile estimate": ~270 s of compiles in step 1, ~210 s for steps 2-7); 8-9e run if time is left.
        run_step 1_warm 290 230 "$PY" -m bench gpu --warm --layout single --n 1024 8192 --k 4 --dim 64 128 --batch-size 1 --heads 16 \
            --methods triton flex flex_backend --variants bench/gpu/gpu_variants.txt --json "$OUT_DIR/warm.json"
        run_step 2_smoke 50 180 "$PY" "$WORK/smoke.py"
        if [ "$have_pytest" -eq 1 ]; then
            run_step 3_pytest_gpu 80 130 "$PY" -m pytest python_tests/ops/window_attention/triton/test_triton_gpu.py -q -p no:cacheprovider \
                -rfEs --durations=10 --maxfail=4 --junitxml="$OUT_DIR/pytest_gpu.xml"
        else
            skip_step 3_pytest_gpu "pytest is not installed, and this script installs nothing"
        fi
        run_step 4_int64_offsets 25 110 "$PY" "$WORK/int64.py"
        gpu_state
        run_step 5_ab 60 50 "$PY" -m bench gpu --layout single --n 1024 8192 --k 4 --dim 64 128 --batch-size 1 --heads 16 \
            --methods triton flex flex_backend --variants bench/gpu/gpu_variants.txt --json "$OUT_DIR/bench_ab.json"
        run_step 6_profile 45 10 "$PY" -m bench profile --layout single --n 1024 8192 --k 4 --dim 64 128 \
            --methods triton flex_backend --variants bench/gpu/gpu_variants.txt --reps 5 --json "$OUT_DIR/profile.json"
        run_step 7_dispatch_table 20 0 "$PY" -m bench dispatch-table "$OUT_DIR/bench_ab.json" \
            --out "$OUT_DIR/dispatch_table.json" --command "bash bench/gpu/gpu_check.sh"
        run_step 8_train_step 60 0 "$PY" -m bench gpu --train-step --n 1024 --k 2 --batch-size 4 \
            --train-variants ours zero dense --json "$OUT_DIR/train_step.json"
        run_step 8b_train_step_n4096 60 0 "$PY" -m bench gpu --train-step --n 4096 --k 4 --batch-size 4 \
            --train-variants ours zero dense --json "$OUT_DIR/train_step_n4096.json"
        run_step 9_batch_invariance 60 0 "$PY" -m bench batch-invariance --n 1024 --k 4 --dims 64 128 \
            --batch-sizes 2,4,8,16 --json "$OUT_DIR/batch_invariance.json"
        run_step 9b_grid_d128 70 0 "$PY" -m bench gpu --layout single --n 1024 4096 8192 --k 2 4 8 \
            --dim 128 --batch-size 1 --heads 16 --methods triton sdpa_flash_causal fa2_causal --triton-tiles auto base \
            --json "$OUT_DIR/bench_single_d128.json"
        run_step 9c_in_tile 35 0 "$PY" -m bench gpu --layout single double --n 1024 8192 --k 2 4 --dim 128 \
            --batch-size 1 --heads 16 --methods triton --slot-window-max 0 --json "$OUT_DIR/bench_in_tile_d128.json"
        run_step 9d_composite_dense 45 0 "$PY" -m bench gpu --layout single --n 1024 2048 --k 4 --dim 64 128 \
            --batch-size 1 --heads 16 --methods triton sdpa_flash_causal composite dense_sdpa --json "$OUT_DIR/bench_composite_dense.json"
        run_step 9e_sampler 30 0 "$PY" "$WORK/sampler.py"
        if [ -n "${GPU_CHECK_ONLY:-}" ]; then  # opt-in: the default run's budget goes to steps 1-9
            local b
            for b in 4 16 128; do
                run_step "10_serving_b$b" 190 0 "$PY" -m bench infer --device cuda --preset paper --dtype bfloat16 \
                    --k 2,4 --batch-sizes "$b" --prompt-len 64 --new-tokens 960 --warmup 1 --reps 5 --max-seconds 60 \
                    --no-progress --out "$OUT_DIR/serving_b$b"
            done
            local d
            for d in 64 128; do
                run_step "11_table_d$d" 280 0 "$PY" -m bench gpu --layout single --n 1024 4096 8192 \
                    --k 2 4 8 --dim "$d" --batch-size 1 --heads 16 \
                    --methods triton flex sdpa_flash_causal dense_sdpa --json "$OUT_DIR/table_d$d.json"
            done
        fi
        gpu_state
    fi

    echo
    echo "==================== summary (elapsed $(elapsed)s of ${BUDGET}s; outputs in $OUT_DIR)"
    local s failed=0
    for s in "${SUMMARY[@]}"; do
        echo "  $s"
        case "$s" in
            *"rc=0,"*) ;;
            *skipped*) if [ "$DRY_RUN" -eq 1 ]; then failed=1; fi ;;  # the dry run skips nothing
            *) failed=1 ;;
        esac
    done
    ls -la "$OUT_DIR"
    return "$failed"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

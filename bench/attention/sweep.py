"""Attention microbenchmark sweep: every layout x N x k x D, ours vs the peers vs the ideal.

    python -m bench attention --quick          # all layouts at N=256, under 2 minutes on 2 cores
    python -m bench attention                  # the full sweep: N 256..2048, k 1..8, D 64 and 128
    python -m bench attention --layouts single,double --n 1024 --dims 64

Methods, timed forward and forward+backward in one process, each against the
ideal measured right next to it:

* ``ideal``: ``|M| / causal(N)`` x causal SDPA over the N context tokens, the cost of
  the mask's non-zero pairs at causal-attention speed (``~(1 + k) x`` for K-Forcing
  SingleForward, ``~2k x`` for DoubleForward);
* ``dense_sdpa``: SDPA with the layout's dense bool mask, which is what the paper's
  code does and what the ``reference`` backend computes (O(k^2));
* ``flex_blockmask`` / ``flex_create_block_mask``: ``torch.compile``d FlexAttention
  with our analytic ``layout.to_block_mask()`` / with ``create_block_mask(layout.mask_mod())``
  (same tiles; the second shows the cost of building them by sweeping the mask).
  Forward only on CPU, where Flex has no backward;
* ``flash_attn_ideal``: the ideal at FlashAttention speed (CUDA with flash-attn only;
  flash-attn has no way to express these masks itself);
* ours: ``window_attention(backend=...)`` for ``composite``, ``cpp``, ``triton`` when
  ``backends_available()`` says they are built (triton is timed on CUDA only).

Mask/plan build times (dense mask, analytic BlockMask, create_block_mask) are
reported as phase ``build``. A method that is not present here is listed with
the reason and never timed. Ratios are only meaningful inside one run.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kforcing_kernels import backends_available, window_attention
from kforcing_kernels.app.cli import add_batch_size, add_device, add_threads, positive_int
from kforcing_kernels.layouts import ideal_causal_pairs

from .._cli import add_progress_args, add_timing_args, apply_profile, command_line, default_out, progress_bar
from .._timing import (
    busy_cores,
    failure_reason,
    machine_info,
    measure,
    measure_many,
    paired_ratio,
    phase_step,
    pin_threads,
    row_stamp,
)
from .methods import METHOD_DESCRIPTION, METHOD_KIND, METHODS, OURS, PHASES
from .peers import LAYOUTS, mean_pairs

SCHEMA_ID = "kforcing-bench/attention/v1"
FLEX_BLOCK = 128
# create_block_mask evaluates mask_mod over the full Lq x Lk grid; peak memory measured
# at ~15 bytes per element (torch 2.13, CPU), so cap it to keep a shared machine alive.
CBM_MAX_ELEMENTS = 3 * 10**8

FULL = {
    "layouts": list(LAYOUTS),
    "n": [256, 512, 1024, 2048],
    "k": [1, 2, 4, 8],
    "dims": [64, 128],
    "warmup": 1,
    "reps": 5,
    "max_seconds": 10.0,
    "k_by_layout": {},
}
# Quick: the k sweep where the work grows with k (the O(k) vs O(k^2) story), one k elsewhere.
QUICK = {
    "layouts": list(LAYOUTS),
    "n": [256],
    "k": [1, 2, 4, 8],
    "dims": [64],
    "warmup": 1,
    "reps": 5,
    "max_seconds": 0.5,
    "k_by_layout": {"sbd": [4], "ptp": [4], "bd3lm": [4], "single_packed8": [4]},
}


# ---------------------------------------------------------------------- availability


def method_availability(args, device: torch.device, dtype: torch.dtype) -> dict[str, Optional[str]]:
    """``{method: None if it will be timed here, else why not}`` for every method in METHODS."""
    reasons: dict[str, Optional[str]] = {
        "ideal": None,
        "dense_sdpa": "skipped (--skip-dense)" if args.skip_dense else None,
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401

        flex = "skipped (--no-flex)" if args.no_flex else None
    except ImportError as exc:
        flex = f"FlexAttention not in this torch: {exc}"
    reasons["flex_blockmask"] = reasons["flex_create_block_mask"] = flex
    reasons["flash_attn_ideal"] = _flash_attn_reason(device, dtype)
    built = backends_available()
    wanted = set(args.backends)
    for name in OURS:
        if name not in wanted:
            reasons[name] = "not selected (--backends)"
        elif built.get(name) is not None:
            reasons[name] = built[name]
        elif name == "triton" and device.type != "cuda":
            reasons[name] = f"GPU kernel: not timed on device {device.type} (the interpreter measures nothing useful)"
        elif name == "cpp" and device.type != "cpu":
            reasons[name] = f"CPU kernel: not timed on device {device.type}"
        else:
            reasons[name] = None
    return reasons


def _flash_attn_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device (device is {device.type})"
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        return f"flash-attn not installed: {exc}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16/bfloat16, got {dtype}"
    return None


# ---------------------------------------------------------------------- one configuration


def _useful_tflops(pairs: float, batch: int, heads: int, dim: int, phase: str, ms: float) -> float:
    # 2 matmuls x 2 flops per attended pair and head dim; backward ~2.5x forward.
    flops = 4.0 * pairs * dim * batch * heads * (1.0 if phase == "fwd" else 3.5)
    return flops / (ms * 1e-3) / 1e12


def bench_config(layout_name: str, n: int, k: Optional[int], d: int, layout, args, avail, device, dtype) -> list[dict]:
    """All rows (ideal, peers, ours; fwd, fwd_bwd, build) for one (layout, N, k, D).

    Every timed callable of the configuration runs round-robin (``measure_many``), so
    the ideal and each method see the same background load.
    """
    b, h = args.batch_size, args.heads
    gen = torch.Generator().manual_seed(0)

    def rand(length, grad=True):
        return torch.randn(b, h, length, d, generator=gen).to(device, dtype).requires_grad_(grad)

    pairs = mean_pairs(layout)
    mult = pairs / ideal_causal_pairs(layout.n_ctx)
    base = {
        "layout": layout_name,
        "n": n,
        "k": k,
        "d": d,
        "lq": layout.n_queries,
        "lk": layout.n_keys,
        "num_pairs": pairs,
        "ideal_multiplier": mult,
    }
    rows: list[dict] = []

    def add(method, phase, status, timing=None, reason=None, scale=1.0):
        row = {
            **base,
            "method": method,
            "kind": METHOD_KIND[method],
            "phase": phase,
            "status": status,
            "reason": reason,
            "median_ms": None,
            "min_ms": None,
            "first_ms": None,
            "reps": 0,
            "ratio_to_ideal": None,
            "ratio_to_ideal_min": None,
            "causal_units": None,
            "tflops": None,
        }
        if timing is not None:
            row.update(
                median_ms=timing["median_ms"] * scale,
                min_ms=timing["min_ms"] * scale,
                first_ms=timing["first_ms"],
                reps=timing["reps"],
            )
            rounds[(method, phase)] = [t * scale for t in timing.get("times_ms", [])]
            if phase in PHASES:
                row["tflops"] = _useful_tflops(pairs, b, h, d, phase, row["median_ms"])
        rows.append(row)

    jobs: dict[tuple[str, str], Callable[[], None]] = {}
    scales: dict[str, float] = {}
    rounds: dict[tuple[str, str], list[float]] = {}  # per-round times, for ratios taken inside one round

    def add_jobs(method, fn, grad_inputs, dout, *, bwd_reason=None, scale=1.0):
        scales[method] = scale
        jobs[(method, "fwd")] = phase_step(fn)
        if bwd_reason is None:
            jobs[(method, "fwd_bwd")] = phase_step(fn, grad_inputs, dout)
        else:
            add(method, "fwd_bwd", "unsupported", reason=bwd_reason)

    def time_build(method, fn):
        try:
            add(method, "build", "ok", measure(fn, warmup=1, reps=args.reps, max_seconds=args.max_seconds))
        except Exception as exc:  # an honest failure row beats a crashed sweep
            add(method, "build", "error", reason=failure_reason(exc))

    # The ideal: causal attention over the N context tokens, scaled to |M| pairs.
    c = layout.n_ctx
    qc, kc, vc = rand(c), rand(c), rand(c)
    dc = rand(c, grad=False)
    add_jobs("ideal", lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True), (qc, kc, vc), dc, scale=mult)
    if avail["flash_attn_ideal"] is None:
        from flash_attn import flash_attn_func

        fq, fk, fv = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (qc, kc, vc))
        add_jobs(
            "flash_attn_ideal",
            lambda: flash_attn_func(fq, fk, fv, causal=True),
            (fq, fk, fv),
            dc.transpose(1, 2).contiguous(),
            scale=mult,
        )

    q, kk, v = rand(layout.n_queries), rand(layout.n_keys), rand(layout.n_keys)
    dout = rand(layout.n_queries, grad=False)
    grads = (q, kk, v)
    on_gpu = device.type == "cuda"

    if avail["dense_sdpa"] is None:
        time_build("dense_sdpa", lambda: layout.dense_mask().to(device))
        mask = layout.dense_mask().to(device)
        mask = mask[:, None] if mask.dim() == 3 else mask
        add_jobs("dense_sdpa", lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=mask), grads, dout)

    if avail["flex_blockmask"] is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()  # one compile per shape; never hit dynamo's recompile limit mid-sweep
        compiled = torch.compile(flex_attention, dynamic=False)
        # Flex refuses CPU inputs that require grad (no CPU backward): hand it detached ones there.
        fq, fk, fv = grads if on_gpu else (q.detach(), kk.detach(), v.detach())
        no_bwd = None if on_gpu else "FlexAttention has no CPU backward (it refuses CPU inputs that require grad)"
        time_build("flex_blockmask", lambda: layout.to_block_mask(FLEX_BLOCK, device=device))
        analytic = layout.to_block_mask(FLEX_BLOCK, device=device)
        add_jobs("flex_blockmask", lambda: compiled(fq, fk, fv, block_mask=analytic), grads, dout, bwd_reason=no_bwd)
        elements = layout.n_queries * layout.n_keys * (layout.batch_size or 1)
        if elements > args.cbm_max_elements:
            why = (
                f"create_block_mask would evaluate mask_mod over {layout.n_queries}x{layout.n_keys} elements "
                f"(> --cbm-max-elements {args.cbm_max_elements:.0e}, ~15 B each on CPU)"
            )
            for phase in ("build",) + PHASES:
                add("flex_create_block_mask", phase, "skipped", reason=why)
        else:
            mask_mod = layout.mask_mod(device)

            def build():
                return create_block_mask(
                    mask_mod,
                    layout.batch_size,
                    None,
                    layout.n_queries,
                    layout.n_keys,
                    device=device,
                    BLOCK_SIZE=FLEX_BLOCK,
                )

            time_build("flex_create_block_mask", build)
            swept = build()
            add_jobs(
                "flex_create_block_mask", lambda: compiled(fq, fk, fv, block_mask=swept), grads, dout, bwd_reason=no_bwd
            )

    for name in OURS:
        if avail[name] is None:
            add_jobs(name, lambda name=name: window_attention(q, kk, v, layout, backend=name), grads, dout)

    timings = measure_many(jobs, warmup=args.warmup, reps=args.reps, max_seconds=args.max_seconds)
    for (method, phase), timing in timings.items():
        if isinstance(timing, BaseException):
            add(method, phase, "error", reason=failure_reason(timing))
        else:
            add(method, phase, "ok", timing, scale=scales[method])

    order = {m: i for i, m in enumerate(METHODS)}
    phase_order = {"build": 0, "fwd": 1, "fwd_bwd": 2}
    rows.sort(key=lambda r: (order[r["method"]], phase_order[r["phase"]]))
    ideal = {row["phase"]: row for row in rows if row["method"] == "ideal" and row["status"] == "ok"}
    for row in rows:
        if row["status"] == "ok" and row["phase"] in ideal:
            row["ratio_to_ideal"] = paired_ratio(rounds[(row["method"], row["phase"])], rounds[("ideal", row["phase"])])
            row["ratio_to_ideal_min"] = row["min_ms"] / ideal[row["phase"]]["min_ms"]
            # Time in units of causal attention over N timed in the same round: comparable across
            # configurations even when the machine's load drifts between them.
            row["causal_units"] = row["ratio_to_ideal"] * mult
    # Release this configuration's tensors before the next one. The closures above read these names, so they are
    # rebound (which empties the closures' cells, as del would) rather than deleted.
    jobs.clear()
    q = kk = v = dout = grads = None
    gc.collect()
    return rows


# ---------------------------------------------------------------------- the sweep


def configurations(layouts: list[str], ns: list[int], ks: list[int], k_by_layout: Optional[dict] = None):
    """(layout name, N, k or None, layout) in sweep order; a layout whose mask does not
    depend on k (Jacobi here) is measured once, with k None. ``k_by_layout`` overrides
    the k list per layout."""
    for name in layouts:
        for n in ns:
            if LAYOUTS[name](n, 1).cache_key == LAYOUTS[name](n, 2).cache_key:
                yield name, n, None, LAYOUTS[name](n, 1)
                continue
            for k in (k_by_layout or {}).get(name, ks):
                yield name, n, k, LAYOUTS[name](n, k)


def fit_n(ns: list[int]) -> int:
    """The N at which exponents are fitted: 1024 when swept, else the largest N."""
    return 1024 if 1024 in ns else max(ns)


def run_sweep(args) -> dict:
    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    avail = method_availability(args, device, dtype)
    meta = {
        **machine_info(),
        "schema": SCHEMA_ID,
        "command": args.command,
        "quick": args.quick,
        "device": str(device),
        "dtype": args.dtype,
        "batch": args.batch_size,
        "heads": args.heads,
        "threads": threads,
        "warmup": args.warmup,
        "reps": args.reps,
        "max_seconds": args.max_seconds,
        "layouts": args.layouts,
        "n": args.n,
        "k": args.k,
        "dims": args.dims,
        "k_by_layout": args.k_by_layout,
        "fit_n": fit_n(args.n),
        "loadavg_start": busy_cores(),
    }
    stamp = row_stamp(meta)
    rows = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Flex/inductor chatter on CPU
        configs = [(d, *c) for d in args.dims for c in configurations(args.layouts, args.n, args.k, args.k_by_layout)]
        with progress_bar(len(configs), "attention", args.progress) as bar:
            for d, name, n, k, layout in configs:
                t0 = time.perf_counter()
                bar.set_postfix_str(f"{name} N={n} k={k if k is not None else '-'} D={d}")
                for row in bench_config(name, n, k, d, layout, args, avail, device, dtype):
                    rows.append({**stamp, **row})
                if args.verbose:
                    bar.write(
                        f"  {name:<7} N={n:<5} k={k if k is not None else '-':<2} D={d:<4} "
                        f"{time.perf_counter() - t0:6.1f} s",
                        file=sys.stderr,
                    )
                bar.update()
    meta["wall_s"] = time.perf_counter() - start
    meta["loadavg_end"] = busy_cores()
    methods = {
        m: {
            "kind": METHOD_KIND[m],
            "status": "measured" if avail[m] is None else "unavailable",
            "reason": avail[m],
            "description": METHOD_DESCRIPTION[m],
        }
        for m in METHODS
    }
    from .report import fit_exponents

    report = {"schema": SCHEMA_ID, "meta": meta, "methods": methods, "rows": rows}
    report["fits"] = fit_exponents(report)
    return report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"small sweep, under 2 minutes on 2 cores: {QUICK}")
    p.add_argument(
        "--layouts", default=None, help=f"comma-separated subset of {','.join(LAYOUTS)} (None: the profile's)"
    )
    p.add_argument("--n", default=None, help="comma-separated context lengths N (None: the profile's)")
    p.add_argument("--k", default=None, help="comma-separated window sizes k, block size for sbd (None: the profile's)")
    p.add_argument("--dims", default=None, help="comma-separated head dims D (None: the profile's)")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads H")
    add_device(p)
    p.add_argument("--dtype", default=None, help="None: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--backends", default=",".join(OURS), help="comma-separated backends of ours to time")
    add_threads(p)
    add_timing_args(p)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves its compile time)")
    p.add_argument("--skip-dense", action="store_true", help="skip dense-mask SDPA")
    p.add_argument(
        "--cbm-max-elements",
        type=float,
        default=CBM_MAX_ELEMENTS,
        help="skip create_block_mask above this many mask elements",
    )
    p.add_argument("--out", default=None, help="output folder (None: runs/bench-<UTC time>)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    add_progress_args(p)


def finish_args(p, args, argv, prog):
    """The profile (quick or full) fills what the command line left unset; lists parsed and checked."""
    profile = QUICK if args.quick else FULL
    args.layouts = args.layouts.split(",") if args.layouts else list(profile["layouts"])
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: expected names from {list(LAYOUTS)}, got {unknown}")
    args.n = _ints(args.n) if args.n else list(profile["n"])
    args.k_by_layout = {} if args.k else dict(profile["k_by_layout"])
    args.k = _ints(args.k) if args.k else list(profile["k"])
    args.dims = _ints(args.dims) if args.dims else list(profile["dims"])
    apply_profile(args, profile, ("warmup", "reps", "max_seconds"))
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.backends = [name for name in args.backends.split(",") if name]
    args.out = args.out or default_out("bench-")
    args.command = command_line(prog, argv)
    return args


def execute(args) -> dict:
    from .report import print_report, write_outputs

    report = run_sweep(args)
    print_report(report)
    paths = write_outputs(report, args.out, plots=not args.no_plots)
    print("\nwrote " + ", ".join(paths))
    return report

"""GPU benchmark: TFLOP/s per *useful* FLOP of prefix-window attention, and the self-forcing training step.

    python -m bench gpu                              # the full sweep (needs a CUDA device)
    python -m bench gpu --n 1024 --k 4 --dim 128 --methods triton sdpa_flash_causal --json out.json
    python -m bench gpu --train-step --n 1024 --k 2  # paper backbone step: dense vs ours vs zero-cost attention
    python -m bench gpu --list                       # planned shapes and useful FLOPs; runs anywhere

Timing: ``triton.testing.do_bench`` (CUDA events, warm-up, the L2 cache flushed before every
rep, no host sync inside the timed region; the median is reported). Each method runs once
before timing, so compilation and autotuning are not timed. Useful FLOPs count only the
attended pairs |M| (``layout.num_pairs()``): forward 4 |M| D per (batch, head), forward +
backward 3.5x that (FlashAttention-2's convention). Methods, bf16, same q/k/v:

* ``triton``: ``window_attention(backend="triton")`` (``--triton-tiles`` adds runs with the tile set
  forced: ``triton[wide]``; ``--variants FILE`` adds one run per line of FILE, ``NAME VAR=VALUE ...``,
  e.g. ``triton[wide_m64]`` from ``wide_m64 KFORCING_TRITON_TILES=wide_m64``: bench/gpu/gpu_variants.txt);
* ``flex``: ``torch.compile``d FlexAttention with the layout's analytic BlockMask (128x128), called as the
  flex backend calls it (``flex.attention``: its LSE returned too, so both share one compiled graph per shape)
  and differentiated by FlexAttention's own autograd;
* ``flex_backend``: ``window_attention(backend="flex")``, the same FlexAttention as users get it (eager calls
  differentiated by FlexAttention's own autograd, as ``flex``): what the CUDA dispatch table weighs against
  ``triton``;
* ``sdpa_flash_causal``: torch SDPA, flash kernel forced, causal over L' tokens with
  L'(L'+1)/2 ~ |M|: the same useful work at autoregressive-attention efficiency (the FA2 anchor);
* ``fa2_causal``: flash-attn's own kernel on the same L' (when flash-attn is installed);
* ``composite``: ``window_attention(backend="composite")``, its pieces in fused SDPA / flash-attn kernels;
* ``dense_sdpa``: SDPA with the layout's dense boolean mask (what a dense-mask implementation does;
  skipped when the mask would exceed ``--dense-max-elems``).

``--dry-run`` (bench/gpu/gpu_check.sh --dry-run): the same code on CPU at a tiny shape per layout and
head dim, fp32 (the Triton interpreter's bf16 dot is wrong; TRITON_INTERPRET=1 is the caller's),
every method called once and timed by the wall clock (meaningless numbers); exit status 1 if any
method failed, except FlexAttention's backward, which CPU tensors do not have.

Targets (issues #24/#25, H100, bf16): triton fwd+bwd >= 1.0x flex at every (N, k, D) and >= 1.3x at
N=1024; >= 1.0x sdpa_flash_causal at N=8192, D=128; D=64 N=1024 fwd+bwd >= 100 TFLOP/s; the
training step (paper backbone, N=1024, B=4, k 2 -> 4) within 10% of the same step with zero-cost
attention (``ours_vs_zero`` <= 1.10) and >= 7x dense at N=4096, k 4 -> 8. Without CUDA this prints
why and measures nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch
import torch.nn.functional as F

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.app.cli import add_batch_size, add_device, non_negative_int, positive_int
from kforcing_kernels.ops.window_attention.triton.configs import TILE_SETS

from .._cli import command_line, write_json
from .._timing import machine_info
from ..attention import peers as attention
from ..training.train_step_gpu import TRAIN_VARIANTS
from . import sampler_gpu
from .gpu_table import render_markdown
from .gpu_variants import read_variants, repeats_the_default, triton_switches, variant_backend, variant_problem

LAYOUTS = {name: attention.LAYOUTS[name] for name in ("single", "double")}
FWD_BWD_FACTOR = 3.5
METHODS = ("triton", "flex", "flex_backend", "sdpa_flash_causal", "fa2_causal", "composite", "dense_sdpa")
DRY_RUN_N = 16  # --dry-run's context length: every code path at interpreter speed
NO_CPU_BACKWARD = ("flex", "flex_backend")  # FlexAttention has no CPU backward: --dry-run times their forward only


def useful_flops(layout: WindowLayout, batch: int, heads: int, dim: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of the attended pairs."""
    fwd = 4.0 * int(layout.num_pairs()) * dim * batch * heads
    return fwd, FWD_BWD_FACTOR * fwd


def equivalent_causal_length(pairs: int) -> int:
    """L' with L'(L'+1)/2 closest to ``pairs``: causal attention doing the same useful work."""
    return max(1, round((math.sqrt(8 * pairs + 1) - 1) / 2))


def shapes(args):
    for layout_name in args.layout:
        for n in args.n:
            for k in args.k:
                for d in args.dim:
                    yield layout_name, n, k, d


def once_ms(fn) -> float:
    """--dry-run's timer: one call, wall clock (CPU; the number only says the path ran)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def once_ms_synced(fn) -> float:
    """--warm's timer: one call, wall clock after a CUDA sync (the compile and autotune cost of a first call)."""
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _timer(args):
    if getattr(args, "dry_run", False):
        return once_ms
    return once_ms_synced if getattr(args, "warm", False) else time_ms  # looked up per call: tests replace time_ms


def time_ms(fn) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench (one untimed call first: compile / autotune)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


_WIDE_DKDV_DEFAULT: list = []  # [(tiles, configs)] of the shipped wide D=128 set, saved on first use


def use_wide_dkdv(spec: str | None) -> None:
    """Make the "wide" D=128 set's dK/dV tiles and configs ``spec`` (KEYS:STEP:W.S[,W.S...]: keys per program,
    rows per step, autotuned (warps, stages)), or the shipped ones for None, until the next other spec."""
    import dataclasses

    from kforcing_kernels.ops.window_attention.triton import launch as tk  # its tables are configs.py's

    if not _WIDE_DKDV_DEFAULT:
        _WIDE_DKDV_DEFAULT.append((tk.TILE_SETS["wide"][128], list(tk.KERNEL_CONFIGS["bwd"][("wide", 128)])))
    want = _WIDE_DKDV_DEFAULT[0]
    if spec is not None:
        keys, step, configs = spec.split(":")
        want = (
            dataclasses.replace(want[0], block_n_dkdv=int(keys), block_m_dkdv=int(step)),
            [tuple(int(x) for x in c.split(".")) for c in configs.split(",")],
        )
    if (tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["bwd"][("wide", 128)]) != want:
        tk.TILE_SETS["wide"][128], tk.KERNEL_CONFIGS["bwd"][("wide", 128)] = want[0], list(want[1])
        tk._tuned.clear()  # autotuners are keyed by the tile set's name, not its tiles
        tk.clear_host_states()  # so are the launchers' cached host states (their tiles)


@contextlib.contextmanager
def _setting(tiles: str = "auto", extra: dict | None = None, wide_dkdv=False):
    """A method's switches (``triton_switches``) and wide dK/dV tiles (``use_wide_dkdv``: a spec, None for the
    shipped ones, False to leave them), set once around all of its calls: never inside a timed call."""
    if wide_dkdv is not False:
        use_wide_dkdv(wide_dkdv)
    with triton_switches(tiles, extra):
        yield


def _methods(layout, q, kk, v, args, extras):
    """{name: (forward fn, inputs, useful pairs, setting)}; forward fns return the output to differentiate;
    ``setting()`` is the context (environment switches, tile tables) every call of the method runs in."""
    pairs = int(layout.num_pairs())
    out = {}
    for spec in args.wide_dkdv if "triton" in args.methods else ():
        out[f"triton[dkdv {spec}]"] = (
            lambda: window_attention(q, kk, v, layout, backend="triton"),
            (q, kk, v),
            pairs,
            functools.partial(_setting, "wide", wide_dkdv=spec),
        )
    for tiles in args.triton_tiles if "triton" in args.methods else ():
        name = "triton" if tiles == "auto" else f"triton[{tiles}]"
        out[name] = (
            lambda: window_attention(q, kk, v, layout, backend="triton"),
            (q, kk, v),
            pairs,
            functools.partial(_setting, tiles, wide_dkdv=None if args.wide_dkdv else False),
        )
    for vname, assignments in getattr(args, "variant_list", ()):
        backend = variant_backend(assignments)
        if backend not in args.methods and not (backend == "flex" and "flex_backend" in args.methods):
            continue
        if repeats_the_default(assignments, q.shape[-1], layout.n_queries, q.device):
            continue  # the dispatcher picks that tile set here anyway: the default's run measures it

        out[f"{backend}[{vname}]"] = (
            lambda backend=backend: window_attention(q, kk, v, layout, backend=backend),
            (q, kk, v),
            pairs,
            functools.partial(_setting, extra=assignments),
        )
    if "flex" in args.methods:
        from kforcing_kernels.ops.window_attention import flex as flex_backend

        # CPU (a dry run): forward only, on inputs that need no grad, as FlexAttention requires there
        flex_in = (q, kk, v) if q.device.type == "cuda" else tuple(t.detach() for t in (q, kk, v))
        out["flex"] = (lambda: flex_backend.attention(*flex_in, layout)[0], (q, kk, v), pairs)
    if "flex_backend" in args.methods:
        out["flex_backend"] = (lambda: window_attention(q, kk, v, layout, backend="flex"), (q, kk, v), pairs)
    lc = equivalent_causal_length(pairs)
    qc, kc, vc = (
        torch.randn(q.shape[0], q.shape[1], lc, q.shape[3], device=q.device, dtype=q.dtype).requires_grad_(True)
        for _ in range(3)
    )
    causal_pairs = lc * (lc + 1) // 2
    if "sdpa_flash_causal" in args.methods:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash_causal():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

        out["sdpa_flash_causal"] = (flash_causal, (qc, kc, vc), causal_pairs)
    if "fa2_causal" in args.methods and extras.get("fa2") is not None:
        qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (qc, kc, vc))
        out["fa2_causal"] = (lambda: extras["fa2"](qf, kf, vf, causal=True), (qf, kf, vf), causal_pairs)
    if "composite" in args.methods:
        out["composite"] = (lambda: window_attention(q, kk, v, layout, backend="composite"), (q, kk, v), pairs)
    if "dense_sdpa" in args.methods and layout.n_queries * layout.n_keys <= args.dense_max_elems:
        mask = layout.dense_mask().to(q.device)
        out["dense_sdpa"] = (lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=mask), (q, kk, v), pairs)
    # By value: the default and FlexAttention first (a run cut short still compares them), then the alternatives.
    first = [name for name in ("triton", "flex", "flex_backend") if name in out]
    return {**{name: out[name] for name in first}, **out}, lc


def bench_one(layout_name, n, k, d, args, extras) -> dict:
    layout = LAYOUTS[layout_name](n, k)
    b, h = args.batch_size, args.heads
    dev, dt = torch.device(args.device), (torch.float32 if getattr(args, "dry_run", False) else torch.bfloat16)
    timer = _timer(args)
    torch.manual_seed(0)
    q = torch.randn(b, h, layout.n_queries, d, device=dev, dtype=dt).requires_grad_(True)
    kk, v = (torch.randn(b, h, layout.n_keys, d, device=dev, dtype=dt).requires_grad_(True) for _ in range(2))
    methods, lc = _methods(layout, q, kk, v, args, extras)
    rows, errors = {}, {}
    stack = contextlib.ExitStack()
    for name, (fwd, inputs, pairs, *setting) in methods.items():
        flops = 4.0 * pairs * d * b * h
        started = time.perf_counter()
        try:
            stack.close()  # the previous method's switches undone
            if setting:
                stack.enter_context(setting[0]())
            if dev.type == "cpu" and name in NO_CPU_BACKWARD:  # forward only: FlexAttention has no CPU backward
                with torch.no_grad():
                    fwd_ms = timer(fwd)
                rows[name] = {
                    "fwd_ms": fwd_ms,
                    "fwd_tflops": flops / fwd_ms / 1e9,
                    "fwd_bwd_ms": None,
                    "fwd_bwd_tflops": None,
                    "note": "forward only: FlexAttention has no CPU backward",
                }
                continue
            dout = torch.randn_like(fwd())

            def step(fwd=fwd, inputs=inputs, dout=dout):
                torch.autograd.grad(fwd(), inputs, dout)

            with torch.no_grad():
                fwd_ms = timer(fwd)
            fb_ms = timer(step)
        except Exception as exc:  # noqa: BLE001 - one method failing (OOM, missing kernel) must not end the sweep
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            torch.cuda.empty_cache()
            continue
        rows[name] = {
            "fwd_ms": fwd_ms,
            "fwd_bwd_ms": fb_ms,
            "fwd_tflops": flops / fwd_ms / 1e9,
            "fwd_bwd_tflops": FWD_BWD_FACTOR * flops / fb_ms / 1e9,
        }
        if getattr(args, "warm", False):  # first calls: compile + autotune; no timings worth keeping
            rows[name] = {"first_calls_s": time.perf_counter() - started}
            print(
                f"warm: {name} {layout_name} N={n} k={k} D={d}: first calls {rows[name]['first_calls_s']:.1f} s",
                flush=True,
            )
    stack.close()
    ratios = {}
    if "triton" in rows:
        for other in rows:
            if other != "triton":
                for phase in ("fwd", "fwd_bwd"):
                    if rows[other].get(f"{phase}_tflops") and rows["triton"].get(f"{phase}_tflops"):
                        ratios[f"{phase}_vs_{other}"] = (
                            rows["triton"][f"{phase}_tflops"] / rows[other][f"{phase}_tflops"]
                        )
    return {
        "layout": layout_name,
        "n": n,
        "k": k,
        "dim": d,
        "batch": b,
        "heads": h,
        "pairs": int(layout.num_pairs()),
        "causal_equivalent_len": lc,
        "results": rows,
        "errors": errors,
        "ratios": ratios,
    }


def format_row(r: dict) -> str:
    cells = [f"{r['layout']:<7}{r['n']:>6}{r['k']:>3}{r['dim']:>5} |"]
    for name, res in r["results"].items():
        if "first_calls_s" in res:  # --warm
            cells.append(f" {name} {res['first_calls_s']:.1f}s")
            continue
        fb = "-" if res["fwd_bwd_tflops"] is None else f"{res['fwd_bwd_tflops']:.0f}"
        cells.append(f" {name} {res['fwd_tflops']:.0f}/{fb}")
    for name in ("sdpa_flash_causal", "flex", "flex_backend"):
        if f"fwd_vs_{name}" in r["ratios"]:
            fb = r["ratios"].get(f"fwd_bwd_vs_{name}")  # absent where one side has no backward (CPU flex)
            cells.append(f" | x{name} {r['ratios'][f'fwd_vs_{name}']:.2f}/{'-' if fb is None else f'{fb:.2f}'}")
    for name, err in r["errors"].items():
        cells.append(f" | {name} FAILED {err}")
    return "".join(cells)


HEADER = "layout      N  k    D | method fwd/fwd+bwd TFLOP/s per useful FLOP ... | x method: triton's ratio fwd/fwd+bwd"


# ---------------------------------------------------------------------- training step


def train_step(args) -> list[dict]:
    """The training-step rows (``train_step_gpu.rows``), timed with this module's ``time_ms``."""
    from ..training.train_step_gpu import rows

    return rows(args, _timer(args))


def add_arguments(p) -> None:
    p.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=["single"], help="attention layouts")
    p.add_argument("--n", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192], help="context lengths N")
    p.add_argument("--k", type=positive_int, nargs="+", default=[1, 2, 4, 8], help="windows k")
    p.add_argument("--dim", type=positive_int, nargs="+", default=[64, 128], help="head dims D")
    add_batch_size(p, 1)
    p.add_argument("--heads", type=positive_int, default=16, help="attention heads H")
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help="the methods timed, each on the same q/k/v (the module docstring says what each is)",
    )
    p.add_argument(
        "--triton-tiles",
        nargs="+",
        choices=("auto", *TILE_SETS),
        default=["auto"],
        help="tile sets to run triton with (auto: the dispatcher's choice)",
    )
    p.add_argument(
        "--wide-dkdv",
        nargs="*",
        default=[],
        metavar="KEYS:STEP:W.S,...",
        help="extra triton runs with the wide D=128 set's dK/dV tiles replaced (keys per program, "
        "query rows per step, autotuned warps.stages), e.g. 64:32:8.1,8.2",
    )
    p.add_argument(
        "--variants",
        default=None,
        metavar="FILE",
        help="extra triton runs, one per line of FILE: NAME KFORCING_VAR=VALUE ... "
        "(bench/gpu/gpu_variants.txt); "
        "a variant this checkout cannot run (unknown variable or tile set) is skipped with the reason",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="call every method once (forward, forward + backward) to compile and autotune; time nothing "
        "(bench/gpu/gpu_check.sh's first step: later steps reuse the disk caches)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, fp32, each method called once (bench/gpu/gpu_check.sh --dry-run; no numbers)",
    )
    p.add_argument(
        "--slot-window-max",
        type=non_negative_int,
        default=None,
        help="override triton/plan.py's SLOT_WINDOW_MAX for this run (0: every window's intra part in-tile; "
        "python -m kforcing_kernels.tools.slot_cost predicts the trade-off)",
    )
    p.add_argument(
        "--dense-max-elems", type=positive_int, default=2**30, help="skip dense_sdpa above Lq*Lk mask elements"
    )
    p.add_argument("--train-step", action="store_true", help="time the self-forcing training step instead")
    p.add_argument("--train-preset", default="paper", help="model preset for --train-step (paper: 12 layers, 768)")
    p.add_argument("--train-ours", default="triton", help="our backend for --train-step")
    p.add_argument(
        "--train-variants",
        nargs="+",
        choices=TRAIN_VARIANTS,
        default=list(TRAIN_VARIANTS),
        help="--train-step variants: dense-mask SDPA, ours, attention replaced by a zero-cost op (the limit)",
    )
    p.add_argument("--sampler", action="store_true", help="time the Triton sampler instead")
    p.add_argument(
        "--sampler-vocab", type=positive_int, nargs="+", default=[32000, 152064], help="--sampler: vocabulary sizes V"
    )
    p.add_argument(
        "--sampler-rows",
        type=positive_int,
        nargs="+",
        default=[256, 4096],
        help="--sampler: rows of bf16 logits sampled at once",
    )
    p.add_argument(
        "--render",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print a markdown table of the rows in these --json reports, measure nothing",
    )
    p.add_argument("--list", action="store_true", help="print the shapes and useful FLOPs, measure nothing")
    add_device(
        p,
        help_extra="; the timing needs CUDA: without a CUDA device nothing is measured, and cpu where there is one "
        "is an error (cpu runs the rows' logic in tests; --dry-run runs on cpu whatever is given)",
    )
    p.add_argument("--json", default=None, help="write the report as JSON here (rewritten after every row)")


def finish_args(p, args, argv, prog):
    """The command as typed, for the report."""
    args.command_line = command_line(prog, argv)
    return args


def execute(args) -> int:
    if args.render:
        print(render_markdown(args.render))
        return 0
    if args.list:
        for layout_name, n, k, d in shapes(args):
            layout = LAYOUTS[layout_name](n, k)
            fwd, fb = useful_flops(layout, args.batch_size, args.heads, d)
            print(
                f"{layout_name} N={n} k={k} D={d}: |M|={int(layout.num_pairs())} "
                f"L'={equivalent_causal_length(int(layout.num_pairs()))} fwd {fwd / 1e9:.2f} GFLOP, "
                f"fwd+bwd {fb / 1e9:.2f} GFLOP"
            )
        return 0
    args.variant_list = []
    if args.variants:
        for name, assignments in read_variants(args.variants):
            problem = variant_problem(assignments)
            if problem:
                print(f"variant {name}: SKIPPED, {problem}")
            else:
                args.variant_list.append((name, assignments))
    if args.dry_run:
        dry_run_shapes(args)
    elif not torch.cuda.is_available():
        print("bench/gpu/triton_gpu.py: skipped, no CUDA device here; nothing was measured (GPU-only benchmark).")
        return 0
    elif torch.device(args.device).type != "cuda":
        raise SystemExit(
            f"--device {args.device}: bench gpu times on CUDA only (--dry-run runs the same code on cpu; --list and "
            "--render need no device)"
        )
    from kforcing_kernels import backends_available

    reason = backends_available().get("triton")
    if reason is not None:
        print(f"bench/gpu/triton_gpu.py: skipped, the triton backend is unavailable: {reason}")
        return 0
    if args.slot_window_max is not None:
        from kforcing_kernels.ops.window_attention.triton import plan as tile_plan

        tile_plan.SLOT_WINDOW_MAX = args.slot_window_max  # read when a plan is built; set before the first
    report = {
        "machine": machine_info(),
        "config": vars(args),
        "rows": [],
        "started": time.time(),
        "capability": capability(args.device),
        "command": args.command_line,
    }
    if args.sampler:
        report["sampler"] = sampler_gpu.rows(args, time_ms)
        if args.json:
            write_json(report, args.json, indent=2)
        return 0
    if args.train_step:
        report["train_step"] = train_step(args)
        if args.json:
            write_json(report, args.json, indent=2)
        failed = [
            (r["teacher_k"], key)
            for r in report["train_step"]
            for key, value in r.items()
            if key.endswith("_ms") and isinstance(value, str)
        ]
        if args.dry_run and failed:
            print(f"dry run: train-step variants failed: {failed}")
            return 1
        return 0
    extras = {}
    if args.dry_run and {"flex", "flex_backend"} & set(args.methods):
        from kforcing_kernels.ops.window_attention import flex as flex_backend

        # Walk the compiled (CUDA) path on CPU with dynamo's eager backend: inductor takes a minute per CPU shape.
        flex_backend.CPU_COMPILE_BACKEND = "eager"
    try:
        from flash_attn import flash_attn_func

        extras["fa2"] = flash_attn_func
    except ImportError:
        print("flash-attn is not installed: no fa2_causal (sdpa_flash_causal is torch's own flash kernel)")
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda

    report["composite_cuda"] = composite_cuda.status()
    print(HEADER)
    for layout_name, n, k, d in shapes(args):
        row = bench_one(layout_name, n, k, d, args, extras)
        report["rows"].append(row)
        print(format_row(row), flush=True)
        if args.json:
            report["composite_cuda"] = composite_cuda.status()
            write_json(report, args.json, indent=2)
    print("composite_cuda:", composite_cuda.status())
    if args.dry_run:
        failed = [(r["layout"], r["dim"], name, err) for r in report["rows"] for name, err in r["errors"].items()]
        for failure in failed:
            print("dry run: method failed:", *failure)
        return 1 if failed else 0
    return 0


def capability(device: str) -> str:
    """The CUDA compute capability of ``device`` ("9.0"), or its type when it is not CUDA ("cpu": a dry run)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev)
    return f"{major}.{minor}"


def dry_run_shapes(args) -> None:
    """--dry-run: CPU, one tiny shape per layout (the smallest k and head dim: on CPU the interpreter takes the
    base tile set at every head dim, so a second one reruns the same Python), batch 1, 2 heads; the training
    step on the micro preset in fp16 autocast (the Triton interpreter runs fp16 and fp32, not bf16)."""
    args.device = "cpu"
    args.n = [min(DRY_RUN_N // 2 if args.train_step else DRY_RUN_N, n) for n in args.n[:1]]
    args.k = [min(args.k + ([2] if args.train_step else []))]  # the step's students run k = 4 at most
    args.dim = [min(args.dim)]
    args.batch_size, args.heads = (2, args.heads) if args.train_step else (1, 2)
    args.train_preset = "micro" if args.train_step else args.train_preset
    args.train_overrides = {"n_embd": 64, "n_head": 2}  # head dim 32: the smallest the triton backend takes
    args.train_dtype = "float16"
    args.dense_max_elems = max(args.dense_max_elems, 1)

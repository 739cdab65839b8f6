"""Inference throughput: AR decoding vs K-Forcing (k tokens per forward pass), contiguous vs paged KV cache.

    python -m bench infer --quick                 # CPU, seconds: micro model, batch 2/4, 8 new tokens
    python -m bench infer                         # k = 1, 2, 4 at batch 4, 16; prompt 64; 64 new tokens (short on CPU)
    python -m bench infer --full                  # the issue's grid: batch 4, 16, 128; prompt 64 and 512; 256 new
    tokens
    python -m bench infer --paper --device cuda --compile cudagraph --hf eager --hf-reps 1   # Table 1 protocol:
        # paper backbone (12 x 768, vocab 50258, random weights), bf16, 64-token prompts to 1,024 tokens (960 new),
        # AR and k = 2, 4 on both caches at batch 4, 16, 128, 1 warm-up + 3 timed runs; + the HF baseline row
    python -m bench infer --host-cost             # host time per forward pass (CPU, eager, 12 layers of width 16)

Each method's row is written to ``<out>/inference.json`` as soon as it is measured (a run cut short keeps
its rows). ``--compile`` runs the decode step eager (default), ``compile`` (``torch.compile(fullgraph=True)``,
``reduce-overhead`` on CUDA) or ``cudagraph`` (captured once per generation, replayed; CUDA only); the
first (warm-up) run's extra time over the median is reported apart as ``compile_s`` (compiling / capturing).
``--hf eager|compile`` adds the user's own baseline: Hugging Face ``generate`` with a static cache on a GPT-2
of the same sizes (layers, width, heads, MLP 4x, vocabulary; built from its config, random weights), greedy,
EOS disabled; ``compile`` lets ``generate`` compile its forward (CUDA graphs) as it does for a static cache.

Both use ``kforcing_kernels.app.generation.inference`` (``generate_ar`` one token per forward,
``generate_kforcing`` k per forward, paper Algorithm 1) on the same random-weight
model and prompts, each with ``cache="contiguous"`` (one buffer per layer; every
decode step concatenates the cache with the new keys) and ``cache="paged"`` (pages
read in place by ``paged_attention``); throughput is generated tokens per second
(batch x new tokens / time), all timed round-robin in one process. Weights are
random: the work per step does not depend on training, only the text does. Generation never stops
early (no EOS check): every request generates exactly ``--new-tokens``.

Memory: ``kv_bytes_per_step`` is the analytic K/V traffic of one decode step at the
mean context length (reads + writes of cached K/V, all layers); ``cache_bytes`` the
K/V storage allocated (contiguous: B x capacity; paged: the pages the requests fill).
On CUDA ``peak_bytes`` is measured during the first timed run (``torch.cuda.max_memory_allocated``,
no extra run); on CPU PyTorch keeps no allocator statistics, so it is left out rather than guessed.

``--host-cost``: the host's share of a forward pass, where the compute is ~0 (12 layers of width 16,
2 heads, vocabulary 64, batch 4, cpp backend, fp32, eager): wall and CPU ms per pass (a generation's
time over its passes, best of the timed runs), and two counts that no background load changes: Python
function calls and aten operator calls per pass. It calls only ``generate_ar`` / ``generate_kforcing``
with arguments every version takes, so the same command measures an older checkout's package too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from kforcing_kernels import default_backend
from kforcing_kernels.app.cli import add_batch_sizes, add_new_tokens, int_list, positive_int

from .._cli import (
    add_model_args,
    add_run_args,
    apply_profile,
    command_line,
    default_out,
    parse_overrides,
    progress_bar,
    write_json,
    write_report_files,
)
from .._timing import busy_cores, commit_label, failure_reason, machine_info, pin_threads, row_stamp

SCHEMA_ID = "kforcing-bench/inference/v1"
FULL = {
    "k": [1, 2, 4],
    "batch": [4, 16, 128],
    "prompt_len": [64, 512],
    "new_tokens": 256,
    "reps": 3,
    "warmup": 1,
    "max_seconds": 60.0,
}
DEFAULT = {
    "k": [1, 2, 4],
    "batch": [4, 16],
    "prompt_len": [64],
    "new_tokens": 64,
    "reps": 3,
    "warmup": 1,
    "max_seconds": 10.0,
}
QUICK = {
    "k": [2, 4],
    "batch": [2, 4],
    "prompt_len": [8],
    "new_tokens": 8,
    "reps": 2,
    "warmup": 1,
    "max_seconds": 1.0,
    "preset": "micro",
}
# K-Forcing's Table 1: 64-token prompts completed to 1,024 tokens, batch 4 / 16 / 128, paper backbone, bf16.
PAPER = {
    "k": [2, 4],
    "batch": [4, 16, 128],
    "prompt_len": [64],
    "new_tokens": 960,
    "reps": 3,
    "warmup": 1,
    "max_seconds": None,
    "preset": "paper",
    "dtype": "bfloat16",
}
HOST_COST = {"k": [4], "batch": [4], "prompt_len": [16], "new_tokens": 64, "reps": 5, "warmup": 1, "max_seconds": None}
COMPILE = {"eager": False, "compile": True, "cudagraph": "cudagraph"}
CACHES = ("contiguous", "paged")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE_SIZE = 16


def kv_traffic(cfg, batch: int, prompt_len: int, new_tokens: int, k, cache: str, paged_backend: str, elt: int) -> dict:
    """Analytic K/V bytes of one decode step at the mean context length L, and of the cache storage.

    Per layer, K and V each, per request (row = n_head * head_dim * elt bytes). Both caches are read in
    place by the static decode step (the contiguous cache is one page of its capacity per request), c = k
    context tokens (1 for AR) are written: cpp / triton backends: attention reads L + W, L + W + c rows;
    composite backend: each chunk of pages is gathered (read L, write L) and read again: 3L + W + c rows.
    """
    w = 1 if k is None else 2 * k
    c = 1 if k is None else k
    steps = new_tokens if k is None else -(-new_tokens // k)
    mean_len = prompt_len + (steps - 1) * c / 2
    rows = (3 * mean_len if paged_backend == "composite" else mean_len) + w + c
    if cache == "contiguous":
        stored = prompt_len + steps * c  # KVCache capacity
    else:
        stored = -(-(prompt_len + (steps - 1) * c) // PAGE_SIZE) * PAGE_SIZE
    per_row = 2 * cfg.n_layer * batch * cfg.n_head * cfg.head_dim * elt  # K and V, all layers, all requests
    return {"kv_bytes_per_step": int(rows * per_row), "cache_bytes": int(stored * per_row)}


def _timed(fn, warmup: int, reps: int, max_seconds, device: torch.device) -> dict:
    """Warm-up runs, then timed runs; CUDA peak memory is read during the first timed run (no extra run)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = None
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        sync()
        if i == 0:
            first = (time.perf_counter() - t0) * 1e3
    times, peak, start = [], None, time.perf_counter()
    for r in range(reps):
        if r == 0 and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if r == 0 and cuda:
            peak = torch.cuda.max_memory_allocated(device)
        if max_seconds is not None and r + 1 >= min(3, reps) and time.perf_counter() - start > max_seconds:
            break
    median = statistics.median(times)
    return {
        "median_ms": median,
        "min_ms": min(times),
        "reps": len(times),
        "times_ms": times,
        "first_ms": first,
        "compile_s": None if first is None else max(0.0, first - median) * 1e-3,
        "peak_bytes": peak,
    }


def hf_baseline(cfg, dtype: torch.dtype, device: torch.device):
    """A GPT-2 of the backbone's sizes (layers, width, heads, MLP ratio, vocabulary) from its config, random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=max(1024, cfg.seq_len),
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.mlp_ratio * cfg.n_embd,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(hf_cfg).to(device=device, dtype=dtype).eval()


def hf_generate(model, prompts: torch.Tensor, new_tokens: int, compile_: bool):
    """``generate`` with a static cache, greedy, exactly ``new_tokens`` (EOS disabled); compiled by generate
    itself (on CUDA, with a static cache) unless ``compile_`` is False."""
    with torch.no_grad():
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            eos_token_id=None,
            pad_token_id=0,
            disable_compile=not compile_,
        )


def run(args) -> dict:
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.model import PRESETS, KForcingLM
    from kforcing_kernels.ops.paged_attention.op import default_paged_backend

    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    backend = args.backend or default_backend(device)
    paged_backend = backend if backend in ("reference", "composite", "cpp") else default_paged_backend(device)
    cfg = PRESETS[args.preset](
        seq_len=max(args.prompt_len) + args.new_tokens, attention_backend=backend, **args.overrides
    )
    torch.manual_seed(0)
    model = KForcingLM(cfg).to(device=device, dtype=DTYPES[args.dtype]).eval()  # weights and KV cache
    elt = model.wte.weight.element_size()
    compile_step = COMPILE[args.compile]
    meta = {
        **machine_info(),
        "schema": SCHEMA_ID,
        "command": args.command,
        "quick": args.quick,
        "device": str(device),
        "threads": threads,
        "backend": backend,
        "paged_backend": paged_backend,
        "page_size": PAGE_SIZE,
        "preset": args.preset,
        "dtype": args.dtype,
        "model": cfg.to_dict(),
        "k": args.k,
        "batch": args.batch_sizes,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "warmup": args.warmup,
        "reps": args.reps,
        "max_seconds": args.max_seconds,
        "caches": args.cache,
        "compile": args.compile,
        "hf": args.hf,
        "loadavg_start": busy_cores(),
    }
    stamp = row_stamp(meta)
    report = {"schema": SCHEMA_ID, "meta": meta, "rows": []}
    rows = report["rows"]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "inference.json")
    hf_model = hf_baseline(cfg, DTYPES[args.dtype], device) if args.hf is not None else None
    start = time.perf_counter()
    t = args.new_tokens
    grid = [(p_len, b) for p_len in args.prompt_len for b in args.batch_sizes]
    bar = progress_bar(len(grid), "infer", args.progress)
    for p_len, b in grid:
        bar.set_postfix_str(f"prompt {p_len} batch {b}")
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, cfg.vocab_size, (b, p_len), generator=gen).to(device)
        runs = {}
        for cache in args.cache:
            runs[("ar", None, cache)] = lambda cache=cache, prompts=prompts: generate_ar(
                model,
                prompts,
                t,
                temperature=1.0,
                generator=torch.Generator().manual_seed(1),
                cache=cache,
                page_size=PAGE_SIZE,
                compile_step=compile_step,
            )
            for k in args.k:
                runs[("kforcing", k, cache)] = lambda k=k, cache=cache, prompts=prompts: generate_kforcing(
                    model,
                    prompts,
                    k,
                    t,
                    generator=torch.Generator().manual_seed(1),
                    cache=cache,
                    page_size=PAGE_SIZE,
                    compile_step=compile_step,
                )
        if hf_model is not None:
            runs[("hf_generate", None, "static")] = lambda prompts=prompts: hf_generate(
                hf_model, prompts, t, args.hf == "compile"
            )
        for (method, k, cache), fn in runs.items():
            row = {
                **stamp,
                "batch": b,
                "prompt_len": p_len,
                "method": method,
                "k": k,
                "cache": cache,
                "compile": args.compile,
                "forward_passes": t if k is None else -(-t // k),
                "new_tokens": t,
                **(
                    kv_traffic(cfg, b, p_len, t, k, cache, paged_backend, elt)
                    if method != "hf_generate"
                    else {"kv_bytes_per_step": None, "cache_bytes": None}
                ),
            }
            reps = args.hf_reps if method == "hf_generate" and args.hf_reps else args.reps
            try:
                timing = _timed(fn, args.warmup, reps, args.max_seconds, device)
            except Exception as exc:  # noqa: BLE001 - an error row, the run goes on
                row.update(
                    status="error",
                    reason=failure_reason(exc),
                    median_ms=None,
                    min_ms=None,
                    reps=0,
                    tokens_per_s=None,
                    peak_bytes=None,
                    compile_s=None,
                    speedup_vs_ar=None,
                    paged_speedup=None,
                )
            else:
                row.update(status="ok", reason=None, tokens_per_s=b * t / (timing["median_ms"] * 1e-3), **timing)
                _ratios(row, rows)
            rows.append(row)
            write_json(report, path)  # every row as soon as it is measured
        if args.verbose:
            bar.write(f"  prompt {p_len}, batch {b}: {time.perf_counter() - start:6.1f} s", file=sys.stderr)
        bar.update()
    bar.close()
    meta["wall_s"] = time.perf_counter() - start
    meta["loadavg_end"] = busy_cores()
    return report


def _ratios(row: dict, rows: list) -> None:
    """speedup_vs_ar: the AR row of the same cache (for HF: the paged one) over this row's median time; paged_speedup:
    the contiguous twin's over the paged row's (medians; the rows are timed one after the other)."""

    def same(o):
        return o["batch"] == row["batch"] and o["prompt_len"] == row["prompt_len"] and o["status"] == "ok"

    ar_cache = "paged" if row["method"] == "hf_generate" else row["cache"]
    ar = (
        row
        if row["method"] == "ar"
        else next((o for o in rows if same(o) and o["method"] == "ar" and o["cache"] == ar_cache), None)
    )
    twin = next(
        (
            o
            for o in rows
            if same(o) and o["method"] == row["method"] and o["k"] == row["k"] and o["cache"] == "contiguous"
        ),
        None,
    )
    row["speedup_vs_ar"] = ar["median_ms"] / row["median_ms"] if ar else None
    row["paged_speedup"] = twin["median_ms"] / row["median_ms"] if twin and row["cache"] == "paged" else None


# ---------------------------------------------------------------------- host cost


class _OpCounter:
    """Counts aten operator calls (a TorchDispatchMode, made lazily so that importing this module stays cheap)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            count = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.count += 1
                return func(*args, **(kwargs or {}))

        return Mode()


def host_cost(args) -> dict:
    """Host ms, Python calls and aten ops per forward pass of a 12-layer model of width 16 (compute ~0), eager, CPU."""
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.model import KForcingLM, ModelConfig

    threads = pin_threads(args.threads or 1)
    b, p_len, t, k = args.batch_sizes[0], args.prompt_len[0], args.new_tokens, args.k[0]
    cfg = ModelConfig(
        vocab_size=64,
        n_layer=12,
        n_head=2,
        n_embd=16,
        seq_len=p_len + t,
        noise_features=8,
        tau_features=4,
        attention_backend="cpp",
    )
    torch.manual_seed(0)
    model = KForcingLM(cfg).eval()
    prompts = torch.randint(0, cfg.vocab_size, (b, p_len), generator=torch.Generator().manual_seed(0))
    meta = {
        **machine_info(),
        "schema": SCHEMA_ID + "/host-cost",
        "command": args.command,
        "threads": threads,
        "model": cfg.to_dict(),
        "batch": b,
        "prompt_len": p_len,
        "new_tokens": t,
        "k": k,
        "reps": args.reps,
        "package": os.path.dirname(__import__("kforcing_kernels").__file__),
        "loadavg_start": busy_cores(),
    }
    rows = []
    for cache in args.cache:
        for method, kk in (("ar", None), ("kforcing", k)):
            passes = t if kk is None else -(-t // kk)
            if kk is None:

                def fn(cache=cache):
                    return generate_ar(
                        model,
                        prompts,
                        t,
                        temperature=1.0,
                        generator=torch.Generator().manual_seed(1),
                        cache=cache,
                        page_size=PAGE_SIZE,
                    )
            else:

                def fn(cache=cache):
                    return generate_kforcing(
                        model,
                        prompts,
                        k,
                        t,
                        generator=torch.Generator().manual_seed(1),
                        cache=cache,
                        page_size=PAGE_SIZE,
                    )

            for _ in range(args.warmup):
                fn()
            wall, cpu = [], []
            for _ in range(args.reps):
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall.append((time.perf_counter() - w0) * 1e3 / passes)
                cpu.append((time.process_time() - c0) * 1e3 / passes)
            calls = [0]

            def count(frame, event, arg, calls=calls):
                if event in ("call", "c_call"):
                    calls[0] += 1

            sys.setprofile(count)
            try:
                fn()
            finally:
                sys.setprofile(None)
            with _OpCounter() as ops:
                fn()
            rows.append(
                {
                    "method": method,
                    "k": kk,
                    "cache": cache,
                    "forward_passes": passes,
                    "host_ms_per_pass": min(wall),
                    "cpu_ms_per_pass": min(cpu),
                    "python_calls_per_pass": round(calls[0] / passes),
                    "aten_ops_per_pass": round(ops.count / passes),
                    "wall_ms_per_pass_all": wall,
                }
            )
    meta["loadavg_end"] = busy_cores()
    return {"schema": SCHEMA_ID + "/host-cost", "meta": meta, "rows": rows}


def format_host_cost(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"host cost per forward pass: {meta['command']}",
        f"  package {meta['package']}, commit {commit_label(meta)}; 12 layers, width 16, "
        f"batch {meta['batch']}, prompt "
        f"{meta['prompt_len']}, {meta['new_tokens']} new tokens, cpp, fp32, eager, {meta['threads']} thread(s); "
        f"load average {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} on {meta['cpus']} cores",
        "",
        f"{'method':<15}{'cache':<11}{'passes':>7}{'host ms':>9}{'cpu ms':>8}{'py calls':>10}{'aten ops':>10}",
    ]
    for r in report["rows"]:
        label = "AR" if r["method"] == "ar" else f"K-Forcing k={r['k']}"
        lines.append(
            f"{label:<15}{r['cache']:<11}{r['forward_passes']:>7}{r['host_ms_per_pass']:>9.2f}"
            f"{r['cpu_ms_per_pass']:>8.2f}{r['python_calls_per_pass']:>10}{r['aten_ops_per_pass']:>10}"
        )
    return "\n".join(lines)


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def format_report(report: dict) -> str:
    meta = report["meta"]
    m = meta["model"]
    lines = [
        f"inference throughput: {meta['command']}",
        f"  model {meta['preset']} ({meta.get('dtype', 'float32')}): {m['n_layer']} layers, width {m['n_embd']}, "
        f"{m['n_head']} heads, vocab {m['vocab_size']}; "
        f"{meta['new_tokens']} new tokens; attention backend {meta['backend']!r}, paged backend "
        f"{meta['paged_backend']!r}, "
        f"page size {meta['page_size']}",
        f"  {meta['device']}, threads={meta['threads']} (pinned), decode step {meta.get('compile', 'eager')}, "
        f"warm-up {meta['warmup']}, up to {meta['reps']} reps; torch {meta['torch']}, "
        f"commit {commit_label(meta)}, {meta['timestamp']}, {meta['wall_s']:.0f} s, "
        f"load average {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} on {meta['cpus']} cores",
        "  KV MiB/step: analytic K/V bytes read+written per decode step (mean context); cache MiB: K/V storage; "
        "paged vs contig: time ratio, round by round",
        "",
        f"{'prompt':>6}{'batch':>6}  {'method':<14}{'cache':<11}{'passes':>7}{'ms':>9}{'tokens/s':>10}{'vs AR':>7}"
        f"{'paged vs contig':>16}{'KV MiB/step':>12}{'cache MiB':>10}{'peak MiB':>9}{'compile s':>10}",
    ]
    for r in report["rows"]:
        label = {"ar": "AR", "hf_generate": "HF generate"}.get(r["method"], f"K-Forcing k={r['k']}")
        head = f"{r['prompt_len']:>6}{r['batch']:>6}  {label:<14}{r['cache']:<11}{r['forward_passes']:>7}"
        if r["status"] != "ok":
            lines.append(f"{head}  {r['status']}: {r['reason']}")
            continue
        paged = "" if r["paged_speedup"] is None else f"{r['paged_speedup']:.2f}x"
        vs_ar = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        compile_s = "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"
        lines.append(
            f"{head}{r['median_ms']:>9.0f}{r['tokens_per_s']:>10.0f}{vs_ar:>7}{paged:>16}"
            f"{_mib(r['kv_bytes_per_step']):>12}{_mib(r['cache_bytes']):>10}{_mib(r['peak_bytes']):>9}"
            f"{compile_s:>10}"
        )
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--quick", "--small", dest="quick", action="store_true", help=f"a run of seconds on CPU: {QUICK}")
    p.add_argument("--full", action="store_true", help=f"the issue's grid (long on CPU): {FULL}")
    p.add_argument("--paper", action="store_true", help=f"K-Forcing's Table 1 protocol (a GPU run): {PAPER}")
    p.add_argument(
        "--compile",
        choices=tuple(COMPILE),
        default="eager",
        help="the decode step: eager, torch.compile(fullgraph) ('reduce-overhead' on CUDA), or a CUDA graph",
    )
    p.add_argument(
        "--hf",
        choices=("eager", "compile"),
        default=None,
        help="add the Hugging Face generate baseline (static cache) as a row: eager, or compiled by "
        "generate itself (CUDA; minutes of compiling per batch size)",
    )
    p.add_argument(
        "--hf-reps",
        type=positive_int,
        default=None,
        help="timed runs of the HF row (None: --reps); its eager generate is far slower per token",
    )
    p.add_argument(
        "--host-cost",
        action="store_true",
        help=f"host ms, Python calls and aten ops per forward pass instead (CPU, eager, compute ~0): {HOST_COST}",
    )
    p.add_argument("--cache", default=None, help=f"comma-separated caches to time (None: {','.join(CACHES)})")
    p.add_argument("--k", type=int_list, default=None, help="comma-separated K-Forcing k values (None: the profile's)")
    add_batch_sizes(p, None, help="batch sizes to time (None: the profile's)")
    p.add_argument(
        "--prompt-len", type=int_list, default=None, help="comma-separated prompt lengths (None: the profile's)"
    )
    add_new_tokens(p, None, help_extra=" (None: the profile's)")
    add_model_args(p)
    p.add_argument("--backend", default=None, help="attention backend (None: default_backend for the device)")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="model weights and KV cache (the paper's serving table: bfloat16 on a GPU)",
    )
    add_run_args(p, "bench-infer-")


def finish_args(p, args, argv, prog):
    if sum((args.quick, args.full, args.paper)) > 1:
        p.error("argument --full: --quick, --full and --paper are exclusive")
    if args.compile == "cudagraph" and torch.device(args.device).type != "cuda":
        p.error(f"argument --compile: cudagraph needs --device cuda, got {args.device}")
    if args.host_cost and (args.full or args.paper):
        p.error("argument --host-cost: not allowed with --full or --paper (it times its own small model)")
    profile = (
        HOST_COST
        if args.host_cost
        else QUICK
        if args.quick
        else FULL
        if args.full
        else PAPER
        if args.paper
        else DEFAULT
    )
    for key in ("preset", "dtype"):  # a profile's model unless given on the command line
        given = argv if argv is not None else sys.argv[1:]
        if key in profile and not any(a == f"--{key}" or a.startswith(f"--{key}=") for a in given):
            setattr(args, key, profile[key])
    args.k = args.k or list(profile["k"])
    args.batch_sizes = args.batch_sizes or list(profile["batch"])
    args.prompt_len = args.prompt_len or list(profile["prompt_len"])
    args.cache = args.cache.split(",") if args.cache else list(CACHES)
    if any(c not in CACHES for c in args.cache):
        p.error(f"argument --cache: expected a comma-separated subset of {CACHES}, got {','.join(args.cache)!r}")
    apply_profile(args, profile, ("new_tokens", "warmup", "reps", "max_seconds"))
    args.overrides = parse_overrides(p, args.override)
    args.out = args.out or default_out("bench-infer-")
    args.command = command_line(prog, argv)
    return args


def execute(args) -> dict:
    if args.host_cost:
        report = host_cost(args)
        print(format_host_cost(report))
        write_report_files(report, args.out, "host_cost")
        return report
    report = run(args)
    print(format_report(report))
    write_report_files(report, args.out, "inference")
    return report

"""Inference throughput: AR decoding vs K-Forcing (k tokens per forward pass), contiguous vs paged KV cache.

    python -m bench infer --quick
    python -m bench infer                         # k = 1, 2, 4 at batch 4, 16; prompt 64; 64 new tokens (short on CPU)
    python -m bench infer --full                  # the issue's grid: batch 4, 16, 128; prompt 64 and 512; 256 new tokens
    python -m bench infer --device cuda --preset paper --dtype bfloat16 --k 2,4 --batch-sizes 4,16,128 \
        --prompt-len 64 --new-tokens 960 --warmup 1 --reps 5    # K-Forcing's Table 1 protocol (64 -> 1024 tokens)

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
On CUDA ``peak_bytes`` is measured (``torch.cuda.max_memory_allocated``); on CPU
PyTorch keeps no allocator statistics, so it is left out rather than guessed.
"""

from __future__ import annotations

import sys
import time

import torch

from kforcing_kernels import default_backend
from kforcing_kernels.app.cli import add_batch_sizes, add_new_tokens, int_list, make_parser

from .._cli import (
    add_model_args,
    add_run_args,
    apply_profile,
    command_line,
    default_out,
    parse_overrides,
    progress_bar,
    write_report_files,
)
from .._timing import (
    busy_cores,
    commit_label,
    machine_info,
    measure_many,
    paired_ratio,
    pin_threads,
    row_stamp,
    timing_fields,
)

SCHEMA_ID = "kforcing-bench/inference/v1"
FULL = {"k": [1, 2, 4], "batch": [4, 16, 128], "prompt_len": [64, 512], "new_tokens": 256, "reps": 3, "warmup": 1, "max_seconds": 60.0}
DEFAULT = {"k": [1, 2, 4], "batch": [4, 16], "prompt_len": [64], "new_tokens": 64, "reps": 3, "warmup": 1, "max_seconds": 10.0}
QUICK = {"k": [1, 2, 4], "batch": [4, 16], "prompt_len": [32], "new_tokens": 16, "reps": 3, "warmup": 1, "max_seconds": 1.0}
CACHES = ("contiguous", "paged")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE_SIZE = 16


def kv_traffic(cfg, batch: int, prompt_len: int, new_tokens: int, k, cache: str, paged_backend: str, elt: int) -> dict:
    """Analytic K/V bytes of one decode step at the mean context length L, and of the cache storage.

    Per layer, K and V each, per request (row = n_head * head_dim * elt bytes):
    contiguous: ``torch.cat([cache[:L], new])`` reads L and writes L + W rows, attention reads L + W, the
    append writes c (c = k context tokens, 1 for AR): 3L + 2W + c rows. Paged, cpp backend: attention reads L
    + W in place, the append writes c: L + W + c rows. Paged, composite backend: each chunk of pages is
    gathered (read L, write L) and read again: 3L + W + c rows.
    """
    w = 1 if k is None else 2 * k
    c = 1 if k is None else k
    steps = new_tokens if k is None else -(-new_tokens // k)
    mean_len = prompt_len + (steps - 1) * c / 2
    if cache == "contiguous":
        rows = 3 * mean_len + 2 * w + c
        stored = prompt_len + steps * c  # KVCache capacity
    else:
        rows = (mean_len if paged_backend == "cpp" else 3 * mean_len) + w + c
        stored = -(-(prompt_len + (steps - 1) * c) // PAGE_SIZE) * PAGE_SIZE
    per_row = 2 * cfg.n_layer * batch * cfg.n_head * cfg.head_dim * elt  # K and V, all layers, all requests
    return {"kv_bytes_per_step": int(rows * per_row), "cache_bytes": int(stored * per_row)}


def run(args) -> dict:
    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.model import PRESETS, KForcingLM
    from kforcing_kernels.ops.paged_attention.op import default_paged_backend

    threads = pin_threads(args.threads)
    device = torch.device(args.device)
    backend = args.backend or default_backend(device)
    paged_backend = backend if backend in ("reference", "composite", "cpp") else default_paged_backend(device)
    cfg = PRESETS[args.preset](seq_len=max(args.prompt_len) + args.new_tokens, attention_backend=backend, **args.overrides)
    torch.manual_seed(0)
    model = KForcingLM(cfg).to(device=device, dtype=DTYPES[args.dtype]).eval()  # weights and KV cache
    elt = model.wte.weight.element_size()
    meta = {
        **machine_info(), "schema": SCHEMA_ID, "command": args.command, "quick": args.quick, "device": str(device),
        "threads": threads, "backend": backend, "paged_backend": paged_backend, "page_size": PAGE_SIZE,
        "preset": args.preset, "dtype": args.dtype, "model": cfg.to_dict(), "k": args.k, "batch": args.batch_sizes, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "warmup": args.warmup, "reps": args.reps, "max_seconds": args.max_seconds,
        "caches": args.cache, "loadavg_start": busy_cores(),
    }
    stamp = row_stamp(meta)
    rows = []
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
                model, prompts, t, temperature=1.0, generator=torch.Generator().manual_seed(1), cache=cache, page_size=PAGE_SIZE)
            for k in args.k:
                runs[("kforcing", k, cache)] = lambda k=k, cache=cache, prompts=prompts: generate_kforcing(
                    model, prompts, k, t, generator=torch.Generator().manual_seed(1), cache=cache, page_size=PAGE_SIZE)
        timings = measure_many(runs, warmup=args.warmup, reps=args.reps, max_seconds=args.max_seconds)
        for (method, k, cache), timing in timings.items():
            row = {**stamp, "batch": b, "prompt_len": p_len, "method": method, "k": k, "cache": cache,
                   "forward_passes": t if k is None else -(-t // k), "new_tokens": t,
                   **kv_traffic(cfg, b, p_len, t, k, cache, paged_backend, elt), "peak_bytes": None}
            row.update(timing_fields(timing, "tokens_per_s", b * t))
            if device.type == "cuda" and row["status"] == "ok":
                torch.cuda.reset_peak_memory_stats(device)
                runs[(method, k, cache)]()
                row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            rows.append(row)
        if args.verbose:
            bar.write(f"  prompt {p_len}, batch {b}: {time.perf_counter() - start:6.1f} s", file=sys.stderr)
        bar.update()
    bar.close()
    for r in rows:
        def same(o, r=r):
            return o["batch"] == r["batch"] and o["prompt_len"] == r["prompt_len"] and o["status"] == "ok"

        ar = next((o for o in rows if same(o) and o["method"] == "ar" and o["cache"] == r["cache"]), None)
        contiguous = next((o for o in rows if same(o) and o["method"] == r["method"] and o["k"] == r["k"] and o["cache"] == "contiguous"), None)
        ok = r["status"] == "ok"
        r["speedup_vs_ar"] = paired_ratio(ar["times_ms"], r["times_ms"]) if ar and ok else None
        r["paged_speedup"] = paired_ratio(contiguous["times_ms"], r["times_ms"]) if contiguous and ok and r["cache"] == "paged" else None
    meta["wall_s"] = time.perf_counter() - start
    meta["loadavg_end"] = busy_cores()
    return {"schema": SCHEMA_ID, "meta": meta, "rows": rows}


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def format_report(report: dict) -> str:
    meta = report["meta"]
    m = meta["model"]
    lines = [
        f"inference throughput: {meta['command']}",
        f"  model {meta['preset']} ({meta.get('dtype', 'float32')}): {m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocab {m['vocab_size']}; "
        f"{meta['new_tokens']} new tokens; attention backend {meta['backend']!r}, paged backend {meta['paged_backend']!r}, "
        f"page size {meta['page_size']}",
        f"  {meta['device']}, threads={meta['threads']} (pinned), warm-up {meta['warmup']}, up to {meta['reps']} reps; torch {meta['torch']}, "
        f"commit {commit_label(meta)}, {meta['timestamp']}, {meta['wall_s']:.0f} s, "
        f"load average {meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f} on {meta['cpus']} cores",
        "  KV MiB/step: analytic K/V bytes read+written per decode step (mean context); cache MiB: K/V storage; "
        "paged vs contig: time ratio, round by round",
        "",
        f"{'prompt':>6}{'batch':>6}  {'method':<14}{'cache':<11}{'passes':>7}{'ms':>9}{'tokens/s':>10}{'vs AR':>7}"
        f"{'paged vs contig':>16}{'KV MiB/step':>12}{'cache MiB':>10}{'peak MiB':>9}",
    ]
    for r in report["rows"]:
        label = "AR" if r["method"] == "ar" else f"K-Forcing k={r['k']}"
        head = f"{r['prompt_len']:>6}{r['batch']:>6}  {label:<14}{r['cache']:<11}{r['forward_passes']:>7}"
        if r["status"] != "ok":
            lines.append(f"{head}  {r['status']}: {r['reason']}")
            continue
        paged = "" if r["paged_speedup"] is None else f"{r['paged_speedup']:.2f}x"
        lines.append(f"{head}{r['median_ms']:>9.0f}{r['tokens_per_s']:>10.0f}{r['speedup_vs_ar']:>6.2f}x{paged:>16}"
                     f"{_mib(r['kv_bytes_per_step']):>12}{_mib(r['cache_bytes']):>10}{_mib(r['peak_bytes']):>9}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    p.add_argument("--full", action="store_true", help=f"the issue's grid (long on CPU): {FULL}")
    p.add_argument("--cache", default=None, help=f"comma-separated caches to time (None: {','.join(CACHES)})")
    p.add_argument("--k", type=int_list, default=None, help="comma-separated K-Forcing k values (None: the profile's)")
    add_batch_sizes(p, None, help="batch sizes to time (None: the profile's)")
    p.add_argument("--prompt-len", type=int_list, default=None, help="comma-separated prompt lengths (None: the profile's)")
    add_new_tokens(p, None, help_extra=" (None: the profile's)")
    add_model_args(p)
    p.add_argument("--backend", default=None, help="attention backend (None: default_backend for the device)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="model weights and KV cache (the paper's serving table: bfloat16 on a GPU)")
    add_run_args(p, "bench-infer-")


def finish_args(p, args, argv, prog):
    if args.quick and args.full:
        p.error("argument --full: not allowed with --quick")
    profile = QUICK if args.quick else FULL if args.full else DEFAULT
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


def parse_args(argv=None, prog="python -m bench infer"):
    p = make_parser(prog, __doc__)
    add_arguments(p)
    return finish_args(p, p.parse_args(argv), argv, prog)


def execute(args) -> dict:
    report = run(args)
    print(format_report(report))
    write_report_files(report, args.out, "inference")
    return report


def main(argv=None, prog="python -m bench infer") -> dict:
    return execute(parse_args(argv, prog))

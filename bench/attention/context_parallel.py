"""Context parallelism by accounting: per-rank memory of a K-Forcing SingleForward training step, the longest
N(1+k) sequence a memory budget admits with CP 1 and 2, and the bytes CP communicates per step vs the ideal.

    python -m bench context-parallel                          # paper backbone (12 x 768, D=64), k=4, 80 GiB
    python -m bench context-parallel --k 8 --budget-gib 40 --json out.json

1. Saved activations per row, *measured* on CPU (fp32): the model's forward + loss under
   ``torch.autograd.graph.saved_tensors_hooks``, summing the distinct storages kept for backward
   (parameters excluded), at three small (N, k) to fit bytes per context row, per window row (which
   also holds its logits: the vocabulary dominates) and a constant; once through the plain model,
   once through its context-parallel path with one rank (the same tensors must be saved).
2. Per-rank memory at size N by accounting: parameters + gradients + AdamW moments (16 B/param,
   replicated: CP does not shard the model), the rank's rows (``balanced_split``) x bytes per row,
   and the attention's transient peak: without CP the backward's dq/dk/dv; with CP the gathered K/V,
   full-length dK/dV and their scatter buffers and one row chunk's scores
   (``parallel/cost.attention_transient_bytes``). The longest N under the budget is searched.
3. Bytes through a rank per training step over all layers (``parallel/cost.layer_traffic``): what the
   implementation sends (padded all-gather forward, again in backward, reduce-scatter of dK/dV), the
   same without the backward's re-gather, and the mask-aware ideal.

``--time-attention`` instead times one attention layer, forward + backward, of rank 0 of 2 and of 4
(``balanced_split``, its rows on its sub-layout: ``restrict_rows``) against the whole layout in one
process, for SingleForward, DoubleForward and SingleForward over 8 packed documents, all in one
interleaved run (``measure_many``: ratios are per round), with each rank's attended pairs and bytes
communicated per layer (``layer_traffic``: padded all-gather forward and backward, reduce-scatter):

    OMP_NUM_THREADS=2 python -m bench context-parallel --time-attention --n 1024 --k 4 --backend cpp
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kforcing_kernels.app.cli import positive_int
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.window_attention.composite.query_rows import GROUP_ROWS
from kforcing_kernels.parallel import ContextParallel, balanced_split
from kforcing_kernels.parallel.cost import attention_transient_bytes, layer_traffic

FIT_SIZES = ((8, 4), (16, 4), (16, 8))  # (N, k) of the measured runs
GIB = 2**30


def saved_bytes(model: KForcingLM, n: int, k: int, context_parallel: bool) -> int:
    """Bytes of the distinct non-parameter storages a forward + loss saves for backward (B = 1)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
    noise, tau = torch.rand(1, n, k, generator=g), torch.tensor([1.0])
    targets = torch.randint(0, model.config.vocab_size, (1, n * k), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if context_parallel:
            logits, rows = model(tokens, noise, tau, context_parallel=ContextParallel(0, 1))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[:, rows].flatten())
        else:
            logits = model(tokens, noise, tau).flatten(1, 2)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    del loss
    return sum(seen.values())


def fit_row_bytes(model: KForcingLM, context_parallel: bool) -> tuple[float, float, float]:
    """(bytes per context row, per window row, constant) from the three measured sizes (exact solve)."""
    rows = torch.tensor([[n, n * k, 1.0] for n, k in FIT_SIZES], dtype=torch.float64)
    measured = torch.tensor([saved_bytes(model, n, k, context_parallel) for n, k in FIT_SIZES], dtype=torch.float64)
    a, w, c = torch.linalg.solve(rows, measured).tolist()
    return a, w, c


def rank_memory(
    cfg: ModelConfig, n: int, k: int, world: int, per_row: tuple[float, float, float], n_params: int
) -> dict:
    """Per-rank bytes (the largest rank) of one SingleForward training step at context N, window k."""
    a, w, c = per_row
    static = 16 * n_params
    d, h = cfg.head_dim, cfg.n_head
    length = n * (1 + k)
    if world == 1:
        rows_ctx, rows_win, transient = n, n * k, 3 * length * h * d * 4
        split = None
    else:
        split = balanced_split(WindowLayout.kforcing_single(n, k), world)
        per_rank = [(int((r < n).sum()), int((r >= n).sum())) for r in split.query_rows]
        rows_ctx, rows_win = max(per_rank, key=lambda cw: a * cw[0] + w * cw[1])
        transient = attention_transient_bytes(
            split, batch=1, heads=h, kv_heads=h, head_dim=d, elem_bytes=4, chunk_rows=GROUP_ROWS
        )
    act = a * rows_ctx + w * rows_win + c
    return {
        "n": n,
        "k": k,
        "length": length,
        "world": world,
        "rows": rows_ctx + rows_win,
        "static": static,
        "activations": act,
        "attention_transient": transient,
        "total": static + act + transient,
        "split": split,
    }


def longest(cfg, k, world, per_row, n_params, budget: float, step: int = 256) -> dict:
    """The largest N (a multiple of ``step``) whose per-rank total fits ``budget`` bytes (bisection)."""
    lo, hi = 0, step
    while rank_memory(cfg, hi, k, world, per_row, n_params)["total"] <= budget:
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if rank_memory(cfg, mid, k, world, per_row, n_params)["total"] <= budget else (lo, mid)
    return rank_memory(cfg, lo, k, world, per_row, n_params) if lo else {"n": 0, "length": 0, "total": 0}


def traffic(cfg: ModelConfig, split, world: int) -> dict:
    """Bytes through the busiest rank per training step (all layers, fp32 K/V), for each measure its own busiest
    rank."""
    per = [
        layer_traffic(split, r, batch=1, kv_heads=cfg.n_head, head_dim=cfg.head_dim, elem_bytes=4) for r in range(world)
    ]
    return {name: cfg.n_layer * max(getattr(t, name) for t in per) for name in ("actual", "all_gather_once", "ideal")}


TIMED_FAMILIES = {
    "single": lambda n, k: WindowLayout.kforcing_single(n, k),
    "double": lambda n, k: WindowLayout.kforcing_double(n, k),
    "single_packed8": lambda n, k: WindowLayout.kforcing_single(n, k, cu_seqlens=[n * d // 8 for d in range(9)]),
}


def time_attention(args: argparse.Namespace) -> dict:
    """Rank 0 of 2 and of 4 vs the whole layout, one attention layer forward + backward (ms), interleaved."""
    from kforcing_kernels.ops.window_attention import window_attention

    from .._timing import measure_many, paired_ratio, pin_threads

    threads = pin_threads(args.threads)
    heads, head_dim = 8, 64
    report = {"threads": threads, "heads": heads, "head_dim": head_dim, "backend": args.backend, "rows": []}
    print(
        f"attention fwd+bwd, B=1 H={heads} D={head_dim} fp32, {threads} threads, backend={args.backend}; "
        f"min / median ms over {args.reps} interleaved rounds, ratio = median over rounds of rank / whole"
    )
    print(
        "| layout | N | k | world | rank rows / all | rank pairs / all | ms (whole -> rank 0) | rank / whole "
        "| comm per layer MiB (actual / ideal) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        for family, make in TIMED_FAMILIES.items():
            layout = make(n, args.k)
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, heads, layout.n_queries, head_dim, generator=g)
            k = torch.randn(1, heads, layout.n_keys, head_dim, generator=g)
            v = torch.randn(1, heads, layout.n_keys, head_dim, generator=g)

            def step(lay, rows, q=q, k=k, v=v):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q if rows is None else q[:, :, rows], k, v))
                out = window_attention(qq, kk, vv, lay, backend=args.backend)
                torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))

            splits = {w: balanced_split(layout, w) for w in (2, 4)}
            fns = {"whole": lambda layout=layout: step(layout, None)}
            for w, split in splits.items():
                fns[w] = (lambda s: lambda: step(s.sub_layout(0), s.query_rows[0]))(split)
            timing = measure_many(fns, warmup=1, reps=args.reps)
            whole = timing["whole"]
            for w, split in splits.items():
                t = timing[w]
                ratio = paired_ratio(t["times_ms"], whole["times_ms"])
                traffic = layer_traffic(split, 0, batch=1, kv_heads=heads, head_dim=head_dim, elem_bytes=4)
                rows = split.query_rows[0].numel()
                pairs = int(split.sub_layout(0).num_pairs())
                print(
                    f"| {family} | {n} | {args.k} | {w} | {rows} / {layout.n_queries} "
                    f"| {pairs / layout.num_pairs():.3f} "
                    f"| {whole['min_ms']:.1f} / {whole['median_ms']:.1f} -> {t['min_ms']:.1f} / {t['median_ms']:.1f} "
                    f"| {ratio:.2f} | {traffic.actual / 2**20:.2f} / {traffic.ideal / 2**20:.2f} |"
                )
                report["rows"].append(
                    {
                        "layout": family,
                        "n": n,
                        "k": args.k,
                        "world": w,
                        "rank_rows": rows,
                        "all_rows": layout.n_queries,
                        "rank_pairs": pairs,
                        "all_pairs": layout.num_pairs(),
                        "whole_ms": whole,
                        "rank_ms": t,
                        "rank_over_whole": ratio,
                        "comm_bytes_actual": traffic.actual,
                        "comm_bytes_ideal": traffic.ideal,
                    }
                )
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=positive_int, default=4, help="student window k (SingleForward over N(1+k) rows)")
    p.add_argument("--budget-gib", type=float, default=80.0, help="per-rank memory budget (GiB), e.g. one H100")
    p.add_argument("--n", type=positive_int, nargs="+", default=[2048, 8192], help="context lengths of the table")
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument(
        "--time-attention",
        action="store_true",
        help="time rank 0 of 2 and 4 against the whole layout (one attention layer, fwd+bwd) instead",
    )
    p.add_argument("--backend", default="cpp", help="backend of --time-attention (a row-subset backend)")
    p.add_argument("--reps", type=positive_int, default=5, help="interleaved rounds of --time-attention")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (None: all cores)")


def execute(args: argparse.Namespace) -> int:
    if args.time_attention:
        report = time_attention(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return 0
    cfg = ModelConfig.paper_backbone()
    torch.manual_seed(0)
    model = KForcingLM(cfg)
    n_params = model.num_parameters()
    plain, cp1 = fit_row_bytes(model, False), fit_row_bytes(model, True)
    print(
        f"paper backbone: {cfg.n_layer} x {cfg.n_embd}, H={cfg.n_head}, D={cfg.head_dim}, V={cfg.vocab_size}, "
        f"{n_params / 1e6:.1f}M parameters; fp32; k={args.k}; B=1"
    )
    print("saved activations (measured, bytes): per context row / per window row / constant")
    print(f"  plain model:          {plain[0]:,.0f} / {plain[1]:,.0f} / {plain[2]:,.0f}")
    print(f"  CP path with 1 rank:  {cp1[0]:,.0f} / {cp1[1]:,.0f} / {cp1[2]:,.0f}")
    report = {
        "config": cfg.to_dict(),
        "k": args.k,
        "budget_gib": args.budget_gib,
        "per_row_plain": plain,
        "per_row_cp": cp1,
        "table": [],
        "longest": {},
    }
    print(
        "\n| N | N(1+k) | CP | rows/rank | params+grads+Adam GiB | activations GiB | attention transient GiB | total "
        "GiB "
        "| comm/step GiB | no re-gather GiB | ideal GiB | comm / ideal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        for world in (1, 2):
            m = rank_memory(cfg, n, args.k, world, plain if world == 1 else cp1, n_params)
            t = traffic(cfg, m["split"], world) if world > 1 else {"actual": 0, "all_gather_once": 0, "ideal": 0}
            ratio = f"{t['actual'] / t['ideal']:.2f}" if t["ideal"] else "-"
            print(
                f"| {n} | {m['length']} | {world} | {m['rows']} | {m['static'] / GIB:.2f} "
                f"| {m['activations'] / GIB:.2f} "
                f"| {m['attention_transient'] / GIB:.2f} | {m['total'] / GIB:.2f} | {t['actual'] / GIB:.2f} "
                f"| {t['all_gather_once'] / GIB:.2f} | {t['ideal'] / GIB:.2f} | {ratio} |"
            )
            report["table"].append({key: v for key, v in m.items() if key != "split"} | {"traffic": t})
    print(f"\nlongest sequence under {args.budget_gib:g} GiB per rank (N a multiple of 256):")
    for world in (1, 2):
        best = longest(cfg, args.k, world, plain if world == 1 else cp1, n_params, args.budget_gib * GIB)
        report["longest"][world] = {key: v for key, v in best.items() if key != "split"}
        print(f"  CP {world}: N = {best['n']}, N(1+k) = {best['length']} ({best['total'] / GIB:.1f} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0

"""Context parallelism by accounting: per-rank memory of a K-Forcing SingleForward training step, the longest
N(1+k) sequence a memory budget admits with CP 1 and 2, and the bytes CP communicates per step vs the ideal.

    python -m bench.context_parallel                          # paper backbone (12 x 768, D=64), k=4, 80 GiB
    python -m bench.context_parallel --k 8 --budget-gib 40 --json out.json

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
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kforcing_kernels.app.cli import make_parser, positive_int
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.window_attention.query_rows import GROUP_ROWS
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


def rank_memory(cfg: ModelConfig, n: int, k: int, world: int, per_row: tuple[float, float, float], n_params: int) -> dict:
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
        transient = attention_transient_bytes(split, batch=1, heads=h, kv_heads=h, head_dim=d, elem_bytes=4,
                                              chunk_rows=GROUP_ROWS)
    act = a * rows_ctx + w * rows_win + c
    return {"n": n, "k": k, "length": length, "world": world, "rows": rows_ctx + rows_win, "static": static,
            "activations": act, "attention_transient": transient, "total": static + act + transient, "split": split}


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
    """Bytes through the busiest rank per training step (all layers, fp32 K/V), for each measure its own busiest rank."""
    per = [layer_traffic(split, r, batch=1, kv_heads=cfg.n_head, head_dim=cfg.head_dim, elem_bytes=4) for r in range(world)]
    return {name: cfg.n_layer * max(getattr(t, name) for t in per) for name in ("actual", "all_gather_once", "ideal")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=positive_int, default=4, help="student window k (SingleForward over N(1+k) rows)")
    p.add_argument("--budget-gib", type=float, default=80.0, help="per-rank memory budget (GiB), e.g. one H100")
    p.add_argument("--n", type=positive_int, nargs="+", default=[2048, 8192], help="context lengths of the table")
    p.add_argument("--json", help="also write the numbers here")


def execute(args: argparse.Namespace) -> int:
    cfg = ModelConfig.paper_backbone()
    torch.manual_seed(0)
    model = KForcingLM(cfg)
    n_params = model.num_parameters()
    plain, cp1 = fit_row_bytes(model, False), fit_row_bytes(model, True)
    print(f"paper backbone: {cfg.n_layer} x {cfg.n_embd}, H={cfg.n_head}, D={cfg.head_dim}, V={cfg.vocab_size}, "
          f"{n_params / 1e6:.1f}M parameters; fp32; k={args.k}; B=1")
    print("saved activations (measured, bytes): per context row / per window row / constant")
    print(f"  plain model:          {plain[0]:,.0f} / {plain[1]:,.0f} / {plain[2]:,.0f}")
    print(f"  CP path with 1 rank:  {cp1[0]:,.0f} / {cp1[1]:,.0f} / {cp1[2]:,.0f}")
    report = {"config": cfg.to_dict(), "k": args.k, "budget_gib": args.budget_gib, "per_row_plain": plain,
              "per_row_cp": cp1, "table": [], "longest": {}}
    print("\n| N | N(1+k) | CP | rows/rank | params+grads+Adam GiB | activations GiB | attention transient GiB | total GiB "
          "| comm/step GiB | no re-gather GiB | ideal GiB | comm / ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        for world in (1, 2):
            m = rank_memory(cfg, n, args.k, world, plain if world == 1 else cp1, n_params)
            t = traffic(cfg, m["split"], world) if world > 1 else {"actual": 0, "all_gather_once": 0, "ideal": 0}
            ratio = f"{t['actual'] / t['ideal']:.2f}" if t["ideal"] else "-"
            print(f"| {n} | {m['length']} | {world} | {m['rows']} | {m['static'] / GIB:.2f} | {m['activations'] / GIB:.2f} "
                  f"| {m['attention_transient'] / GIB:.2f} | {m['total'] / GIB:.2f} | {t['actual'] / GIB:.2f} "
                  f"| {t['all_gather_once'] / GIB:.2f} | {t['ideal'] / GIB:.2f} | {ratio} |")
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


def main(argv=None) -> int:
    p = make_parser("python -m bench.context_parallel", __doc__.split("\n\n")[0])
    add_arguments(p)
    return execute(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

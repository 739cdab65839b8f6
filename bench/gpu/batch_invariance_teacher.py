"""Teacher targets alone vs inside a batch: the "teacher" check of bench/gpu/batch_invariance.py.

The reference model (``kforcing_kernels.model.KForcingLM``) with random weights stands in for a
trained teacher (the bits are under test, not the quality), run as the trainer runs it: fp32 weights,
bf16 autocast on CUDA, fp32 on CPU. For one sequence alone (batch 1) and the same sequence inside
batches of other random sequences, four targets are compared:

  single_logits        SingleForward logits ``[N, k, V]`` (paper eq. 18)
  single_inverse_cdf   tokens drawn from them by inverse CDF at fixed noise (``ops.sampling.inverse_cdf_sample``)
  self_forcing         the stage-2 targets (``app.training.objectives.self_forcing_targets``: SingleForward, then
                       DoubleForward on its tokens)
  ar_inverse_cdf       the stage-1 targets: AR logits -> inverse CDF
                       (``app.training.objectives.forward_distillation_targets``)

in three modes:

  batched     one model call over the batch, as training runs it: every matmul sees B x rows rows, and
              the noise encoder's temperature MLP sees one row per sequence (M = B; M = 1 alone).
  batched_tau_per_row
              the same, with the temperature MLP run one row at a time (M = 1, as alone): what is left
              are the large matmuls (M = B x rows), the ones cuBLAS may choose other kernels for by size.
  per_sample  the batch-invariant mode: one call per sequence (batch 1), outputs concatenated, so every
              matmul, norm and attention call sees exactly the shapes of the sequence alone. Invariant
              by construction, checked all the same (hidden state or a nondeterministic kernel would
              show); it gives up batching, and the throughput it costs is measured (meta
              ``teacher_throughput``).

A batched record that differs names the first leaf module whose output for the sequence changes with the
batch while its input does not (a kernel chosen by matrix size), or says that its input already differed
(then an op outside the leaf modules, such as attention, RoPE or a residual add, changed first).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

from kforcing_kernels.app.training.objectives import forward_distillation_targets, self_forcing_targets
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling import inverse_cdf_sample

MODES = ("batched", "batched_tau_per_row", "per_sample")
TOKEN_TARGETS = ("single_inverse_cdf", "self_forcing", "ar_inverse_cdf")
# Logits of the batch-1 run vs a float64 copy of the model with reference attention: at most 2x the
# error of the same-precision model with reference attention, plus this floor.
LOGIT_FLOOR = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def positions(batch: int) -> list[int]:
    """Where the sequence under test sits in a batch: first, middle, last."""
    return sorted({0, batch // 2, batch - 1})


def teacher_model(device: torch.device, n: int, seed: int) -> KForcingLM:
    """Random-weight teacher: 4 x 512, head dim 64 on CUDA (the triton backend's D); the tiny preset on CPU."""
    if device.type == "cuda":
        cfg = ModelConfig(
            vocab_size=8192, n_layer=4, n_head=8, n_embd=512, seq_len=n, noise_features=64, tau_features=8
        )
    else:
        cfg = ModelConfig(seq_len=n)
    model = KForcingLM(cfg)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    model.reset_noise_encoder(torch.Generator().manual_seed(seed + 1))
    return model.to(device).eval()


def autocast_for(device: torch.device, dtype: torch.dtype) -> Callable[[], contextlib.AbstractContextManager]:
    """The trainer's precision: autocast to ``dtype`` unless it is fp32 (then plain fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def targets(model: KForcingLM, tokens, z, u, tau, autocast) -> dict[str, torch.Tensor]:
    """tokens [B, N], z [B, N, 2k], u [B, N, k] uniform, tau [B] -> every target, batch first."""
    k = u.shape[-1]
    with autocast():
        logits, _ = model.single_forward(tokens, z[..., :k], tau)
        ar_logits = model(tokens)
        second_stage = self_forcing_targets(model, tokens, z, tau)
    return {
        "single_logits": logits,
        "single_inverse_cdf": inverse_cdf_sample(logits, u, tau[:, None, None].expand(u.shape)),
        "self_forcing": second_stage,
        "ar_inverse_cdf": forward_distillation_targets(ar_logits, u[..., 0], tau),
    }


@contextlib.contextmanager
def tau_mlp_per_row(model: KForcingLM):
    """Inside the block the noise encoder's temperature MLP multiplies one row at a time (M = 1 whatever B)."""
    mlp = model.noise_encoder.tau_mlp

    def per_row(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([torch.nn.Sequential.forward(mlp, rows[i : i + 1]) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    mlp.forward = per_row
    try:
        yield
    finally:
        del mlp.forward


def run_mode(mode: str, model: KForcingLM, inputs: list, autocast) -> dict[str, torch.Tensor]:
    """Every target of the batch ``inputs`` in ``mode`` (one of MODES)."""
    if mode == "per_sample":
        return per_sample_targets(model, *inputs, autocast)
    with tau_mlp_per_row(model) if mode == "batched_tau_per_row" else contextlib.nullcontext():
        return targets(model, *inputs, autocast)


def per_sample_targets(model: KForcingLM, tokens, z, u, tau, autocast) -> dict[str, torch.Tensor]:
    """The batch-invariant mode: :func:`targets` of each sequence alone, concatenated."""
    parts = [
        targets(model, tokens[i : i + 1], z[i : i + 1], u[i : i + 1], tau[i : i + 1], autocast)
        for i in range(tokens.shape[0])
    ]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def random_inputs(
    cfg: ModelConfig, batch: int, n: int, k: int, gen: torch.Generator, device: torch.device
) -> list[torch.Tensor]:
    """[tokens [B, N], z [B, N, 2k], u [B, N, k], tau [B]] drawn on ``device``."""
    return [
        torch.randint(0, cfg.vocab_size, (batch, n), generator=gen, device=device),
        torch.rand(batch, n, 2 * k, generator=gen, device=device),
        torch.rand(batch, n, k, generator=gen, device=device),
        0.7 + 0.6 * torch.rand(batch, generator=gen, device=device),
    ]


def compare(alone: dict, got: dict, pos: int) -> tuple[bool, dict, dict]:
    """(all equal, per-target detail, max abs logit diff) of the sequence at ``pos`` of ``got`` vs ``alone``."""
    detail, ok = {}, True
    for name, want in alone.items():
        have = got[name][pos : pos + 1]
        equal = torch.equal(have, want)
        ok &= equal
        if name in TOKEN_TARGETS:
            detail[name] = {"equal": equal, "tokens_differing": int((have != want).sum()), "tokens": want.numel()}
        else:
            detail[name] = {"equal": equal, "max_abs_diff": (have.double() - want.double()).abs().max().item()}
    return ok, detail, {"single_logits": detail["single_logits"]["max_abs_diff"]}


def leaf_calls(model: torch.nn.Module, run: Callable[[], object]) -> list[tuple]:
    """[(module name, type, first input, output)] of every leaf-module call made by ``run()``, in order."""
    calls = []

    def hook(name):
        def record(module, inputs, output):
            first = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
            calls.append(
                (
                    name,
                    type(module).__name__,
                    None if first is None else first.detach().clone(),
                    output.detach().clone() if torch.is_tensor(output) else None,
                )
            )

        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if not any(m.children())]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def first_divergent_module(model, one: list, batched: list, pos: int, autocast) -> Optional[dict]:
    """The first leaf module (SingleForward, call order) whose output for the sequence differs alone vs batched.
    Calls are matched by module name and occurrence; a module whose batched output is not batch-first is skipped."""
    k = one[2].shape[-1]

    def single(inputs):
        def run():
            with autocast():
                model.single_forward(inputs[0], inputs[1][..., :k], inputs[3])

        return run

    alone, in_batch = leaf_calls(model, single(one)), leaf_calls(model, single(batched))
    batch = batched[0].shape[0]
    by_occurrence, seen = {}, {}
    for name, _, in_b, out_b in in_batch:  # a module may run more often batched (tau_mlp_per_row): match by count
        by_occurrence[(name, seen.setdefault(name, 0))] = (in_b, out_b)
        seen[name] += 1
    seen.clear()
    for name, kind, in_a, out_a in alone:
        in_b, out_b = by_occurrence.get((name, seen.setdefault(name, 0)), (None, None))
        seen[name] += 1
        if out_a is None or out_b is None or out_b.shape[0] != batch or out_a.shape[0] != 1:
            continue
        mine = out_b[pos : pos + 1]
        if mine.shape != out_a.shape or torch.equal(mine, out_a):
            continue
        input_equal = (
            in_a is not None and in_b is not None and in_b.shape[0] == batch and torch.equal(in_b[pos : pos + 1], in_a)
        )
        found = {
            "module": name,
            "type": kind,
            "input_equal": input_equal,
            "max_abs_diff": (mine.double() - out_a.double()).abs().max().item(),
        }
        if in_a is not None and in_b is not None:
            found["rows_alone"], found["rows_batched"] = in_a.numel() // in_a.shape[-1], in_b.numel() // in_b.shape[-1]
        found["cause"] = (
            f"{kind} gives other bits for the same input when it computes {found.get('rows_batched')} "
            "rows "
            f"instead of {found.get('rows_alone')} (a kernel chosen by matrix size)"
            if input_equal
            else "its input already differed: an op outside the leaf modules before it changed first"
        )
        return found
    return None


def oracle_check(model: KForcingLM, one: list, alone: dict, autocast, dtype: torch.dtype) -> dict:
    """The batch-1 SingleForward logits against a float64 copy of the model with reference attention."""
    import copy

    def with_reference_attention(m: KForcingLM) -> KForcingLM:
        for block in m.blocks:
            block.attn.backend = "reference"
        return m

    exact = with_reference_attention(copy.deepcopy(model).double())
    same = with_reference_attention(copy.deepcopy(model))
    k = one[2].shape[-1]
    with torch.no_grad():
        want = exact.single_forward(one[0], one[1][..., :k].double(), one[3].double())[0]
        with autocast():
            ref_same = same.single_forward(one[0], one[1][..., :k], one[3])[0]
    err = (alone["single_logits"].double() - want).abs().max().item()
    bound = 2 * (ref_same.double() - want).abs().max().item() + LOGIT_FLOOR[dtype]
    return {
        "pass": bool(torch.isfinite(alone["single_logits"]).all()) and err <= bound,
        "err": {"single_logits": err},
        "bound": {"single_logits": bound},
    }


def _seconds(run: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(model, inputs: list, autocast, device: torch.device) -> dict:
    """Seconds for all targets of one batch in each mode (best of 3), and the per-sample mode's slowdown."""
    seconds = {mode: _seconds(lambda mode=mode: run_mode(mode, model, inputs, autocast), device) for mode in MODES}
    return {
        "batch": inputs[0].shape[0],
        **{f"{mode}_s": s for mode, s in seconds.items()},
        "per_sample_slowdown": seconds["per_sample"] / seconds["batched"],
    }


def teacher_checks(
    report, *, device: torch.device, dtype: torch.dtype, n: Optional[int], k: int, batch_sizes: list[int], seed: int
) -> None:
    """Records ``teacher_vs_reference`` (the batch-1 logits), then ``teacher`` per (mode, batch, position)."""

    n = n or (256 if device.type == "cuda" else 32)
    model = teacher_model(device, n, seed)
    autocast = autocast_for(device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    one = random_inputs(model.config, 1, n, k, gen, device)
    alone = targets(model, *one, autocast)
    precision = "fp32" if dtype == torch.float32 else f"{str(dtype).replace('torch.', '')} autocast"
    base = {
        "n": n,
        "k": k,
        "precision": precision,
        "device": str(device),
        "model": {f: getattr(model.config, f) for f in ("vocab_size", "n_layer", "n_head", "n_embd")},
        "attention_backend": model.config.attention_backend or "dispatcher default",
    }
    report.add({"check": "teacher_vs_reference", **base, **oracle_check(model, one, alone, autocast, dtype)})
    for batch in batch_sizes:
        others = random_inputs(model.config, batch - 1, n, k, gen, device)
        for pos in positions(batch):
            batched = [torch.cat([o[:pos], t, o[pos:]]) for o, t in zip(others, one)]
            for mode in MODES:
                ok, detail, logit_diff = compare(alone, run_mode(mode, model, batched, autocast), pos)
                record = {
                    "check": "teacher",
                    **base,
                    "mode": mode,
                    "batch": batch,
                    "position": pos,
                    "pass": ok,
                    "observation": mode != "per_sample",
                    "targets": detail,
                    "max_abs_diff": logit_diff,
                }
                if mode != "per_sample" and not ok:
                    with tau_mlp_per_row(model) if mode == "batched_tau_per_row" else contextlib.nullcontext():
                        record["first_divergent_module"] = first_divergent_module(model, one, batched, pos, autocast)
                report.add(record)
    report.data["meta"]["teacher_summary"] = summarize(report.data["checks"])
    print("teacher summary:", report.data["meta"]["teacher_summary"], flush=True)
    largest = random_inputs(model.config, max(batch_sizes), n, k, gen, device)
    report.data["meta"]["teacher_throughput"] = throughput(model, largest, autocast, device)
    report.write()


def summarize(checks: list[dict]) -> dict:
    """Per mode: bitwise invariant in every record?, the largest logit difference, tokens that changed, and
    the modules named as the first to differ (with how many records named each)."""
    found = {}
    for mode in MODES:
        records = [c for c in checks if c["check"] == "teacher" and c["mode"] == mode]
        modules: dict[str, int] = {}
        for c in records:
            named = (c.get("first_divergent_module") or {}).get("module")
            if named:
                modules[named] = modules.get(named, 0) + 1
        found[mode] = {
            "invariant": all(c["pass"] for c in records),
            "records": len(records),
            "max_logit_diff": max((c["max_abs_diff"]["single_logits"] for c in records), default=0.0),
            "tokens_differing": sum(t.get("tokens_differing", 0) for c in records for t in c["targets"].values()),
            "first_divergent_modules": modules,
        }
    return found

"""The self-forcing training step on a GPU (``python -m bench gpu --train-step``): the paper
backbone's step with dense-mask SDPA (the public code's attention), with ours, and with attention
replaced by a zero-cost op (the limit no attention kernel can beat). Rows per teacher k; timing is the
caller's (``triton_gpu.time_ms``: ``triton.testing.do_bench``). The GPU check's training step is
``python -m bench train-gpu`` (train_gpu.py: the trainer's autocast, every candidate backend, peak memory, error rows,
rows written as they finish); it shares this module's attention replacements.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

# The step's variants: dense-mask SDPA, ours (``--train-ours``), attention replaced by a zero-cost op.
TRAIN_VARIANTS = ("dense", "ours", "zero")


@contextlib.contextmanager
def zero_cost_attention():
    """While on, the model's attention costs nothing: it returns q itself (same shape, dtype and graph,
    no kernel, gradients flow to q only). The rest of the step is unchanged, so its time is the limit
    that no attention kernel can beat: the step's time minus the attention's."""
    from kforcing_kernels.model import gpt

    saved = gpt.window_attention
    gpt.window_attention = lambda q, k, v, layout, backend=None: q
    try:
        yield
    finally:
        gpt.window_attention = saved


@contextlib.contextmanager
def dense_sdpa_model(on: bool):
    """While on, the model's attention is SDPA with the layout's dense boolean mask: what the K-Forcing
    public code does (torch picks its kernel; on a GPU, memory-efficient attention with a bias)."""
    if not on:
        yield
        return
    from kforcing_kernels.model import gpt

    masks: dict = {}

    def dense(q, k, v, layout, backend=None):
        key = (layout.cache_key, str(q.device))
        if key not in masks:
            mask = layout.dense_mask().to(q.device)
            masks[key] = mask[:, None] if mask.dim() == 3 else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[key])

    saved = gpt.window_attention
    gpt.window_attention = dense
    try:
        yield
    finally:
        gpt.window_attention = saved


def rows(args, time_ms) -> list[dict]:
    """Self-forcing step (teacher k -> student 2k) of the paper backbone, bf16 autocast: dense-mask SDPA
    (``dense``, the public code's attention), ours (``--train-ours``) and the same step with attention
    replaced by a zero-cost op (``zero``: the limit; ``ours_vs_zero`` = ours / zero time, 1.0 is ideal)."""
    from kforcing_kernels.app.training.objectives import Batch

    from .train_step import build_models, make_step

    device = torch.device(args.device)
    # bf16; a dry run (bench/gpu/triton_gpu.py --dry-run) sets fp16: the Triton interpreter's bf16 dot is wrong
    amp_dtype = getattr(torch, getattr(args, "train_dtype", "bfloat16"))
    rows = []
    for k in args.k:
        ns = argparse.Namespace(
            preset=args.train_preset, seq_len=args.n[0], overrides=getattr(args, "train_overrides", {}), device=device
        )
        gen = torch.Generator().manual_seed(k)
        teacher, _, _ = build_models(ns, None, None)
        cfg = teacher.config
        state = {"teacher": teacher.state_dict(), "student": teacher.state_dict()}
        del teacher
        batch = Batch(
            tokens=torch.randint(0, cfg.vocab_size, (args.batch_size, args.n[0]), generator=gen),
            noise=torch.rand(args.batch_size, args.n[0], 2 * k, generator=gen),
            tau=0.5 + 0.5 * torch.rand(args.batch_size, generator=gen),
        ).to(device)
        times = {}
        for label in args.train_variants:
            backend = {"dense": "reference", "ours": args.train_ours, "zero": "reference"}[label]
            teacher, student, optimizer = build_models(ns, backend, state)
            step = make_step(teacher, student, optimizer, batch, k)

            def amp_step(step=step, label=label):
                with (
                    torch.autocast(device.type, dtype=amp_dtype),
                    dense_sdpa_model(label == "dense"),
                    zero_cost_attention() if label == "zero" else contextlib.nullcontext(),
                ):
                    step()

            try:
                times[label] = time_ms(amp_step)
            except Exception as exc:  # noqa: BLE001
                times[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            del teacher, student, optimizer, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row = {
            "preset": args.train_preset,
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "n": args.n[0],
            "batch": args.batch_size,
            "teacher_k": k,
            "student_k": 2 * k,
            "ours": args.train_ours,
            **{f"{label}_ms": times[label] for label in args.train_variants},
        }

        def timed(*labels, times=times):
            return all(isinstance(times.get(x), float) for x in labels)

        row["speedup"] = times["dense"] / times["ours"] if timed("dense", "ours") else None
        row["ours_vs_zero"] = times["ours"] / times["zero"] if timed("ours", "zero") else None
        rows.append(row)
        cells = ", ".join(
            f"{label} {times[label]:.1f} ms" if timed(label) else f"{label} {times[label]}"
            for label in args.train_variants
        )
        ratios = "".join(
            f", {name} {row[key]:.2f}x"
            for name, key in (("ours vs dense: speed-up", "speedup"), ("ours / zero-cost attention", "ours_vs_zero"))
            if row[key] is not None
        )
        print(
            f"train step {args.train_preset} ({cfg.n_layer} layers, width {cfg.n_embd}) N={args.n[0]} "
            f"B={args.batch_size} k {k}->{2 * k}: {cells}{ratios}",
            flush=True,
        )
    return rows

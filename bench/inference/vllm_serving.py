"""The paper's Table 1 protocol through vLLM: vLLM AR (the k = 1 teacher's backbone, stock vLLM) against K-Forcing
k = 2, 4 (``kforcing_kernels.integrations.vllm``) on the same backbone, weights and prompts.

    python -m bench vllm                                  # CPU: paper backbone with 2 layers, batch 16, fp32, eager
    python -m bench vllm --compile                        # the same, both engines' backbones torch.compile'd
    python -m bench vllm --batches 4 16 128 --layers 12 --device cuda --dtype bfloat16   # the GPU check
    python -m bench vllm --backbone native                # the package's own model, through its vLLM exports

Per row: tokens/s (batch x new tokens / wall time of one ``LLM.generate``, after a warm-up run), engine steps per
generated token (model forwards with requests, counted by a forward hook on the engine's model, per token), wall
and forward ms per step and the host ms per step (wall - forward: scheduling, sampling, the proposer). Beside vLLM's
rows, the package's own ``generate_ar`` / ``generate_kforcing`` (its kind, KV-cached) on the same model and batch,
and each method's speed-up over its own AR. Rows are appended to ``--out`` (JSON Lines) as each finishes.

Backbone (``--backbone hf``): the paper's width (768, 12 heads, MLP 2x width, vocabulary 50257) as a Hugging Face
Llama, ``--layers`` deep, random weights (the work per step does not depend on training); its AR is the same weights
as a plain HF folder on stock vLLM. ``--backbone native``: the package's own model (``KForcingLM``: 768 wide, 12 heads,
GELU MLP 4x width, vocabulary 50257), a K-Forced stage and an AR stage (k = 0) of the same weights, each served
through its vLLM export (``app/vllm_export.py``: ``KForcingNativeForCausalLM`` / ``KForcingNativeARForCausalLM``).

Prompts of ``--prompt`` tokens, ``--new-tokens`` generated, EOS ignored. vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model is reachable for the step count). On the CPU both engines run
eager, or with ``--compile`` both compiled (vLLM's torch.compile of the backbone; the CPU has no CUDA graphs);
``--device cuda`` runs the AR baseline compiled with CUDA graphs and K-Forcing compiled without them (it refuses
captured graphs: its per-step work is built on the host, see the README's "Serve with vLLM").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backbone", default="hf", choices=["hf", "native"], help="an HF Llama, or the package's model")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true", help="CPU: torch.compile both engines' backbones (default eager)")
    p.add_argument("--no-package", action="store_true", help="skip the package's own generate_* rows")
    p.add_argument("--out", default="bench/results/vllm.jsonl")
    p.add_argument("--workdir", default=None, help="where the model folders are built (default: a temp folder)")
    return p


def _folders(work: Path, layers: int, backbone: str = "hf", positions: int = 256):
    """``(K-Forced stage folder k_train=4, AR folder of the same weights)`` for the package's rows, and the two folders
    vLLM serves in their place: the same for ``hf`` (the AR one a plain HF folder for stock vLLM); for ``native``
    (stage and AR stage of the package's own model, ``positions`` long) their vLLM exports."""
    from .vllm_models import build_native_stage, build_stage, tokenizer

    if backbone == "native":
        from kforcing_kernels.app.vllm_export import export_for_vllm

        folders = []
        for name, k in (("native_k4", 4), ("native_ar", 0)):
            folder = work / name
            if not (folder / "model.json").exists():  # the same seed: the same weights (the AR one's noise unused)
                shape = dict(n_layer=layers, n_head=12, n_embd=768, seq_len=positions)
                build_native_stage(folder, k=k, seed=0, vocab=50257, **shape)
            if not (work / f"{name}_vllm" / "model.json").exists():
                export_for_vllm(folder, work / f"{name}_vllm")
            folders += [folder, work / f"{name}_vllm"]
        return folders[0], folders[2], folders[1], folders[3]

    stage = work / "stage_k4"
    if not (stage / "model.json").exists():
        build_stage(stage, "llama", k=4, vocab=50257, hidden=768, layers=layers, heads=12)
    ar = work / "ar"
    if not (ar / "config.json").exists():
        from kforcing_kernels.app.hf_recipe.trainer import load_pflm

        model = load_pflm(stage)
        model.hf.save_pretrained(ar)
        tokenizer(50257).save_pretrained(ar)
    return stage, ar, stage, ar


def _counted(llm):
    """A forward hook counting the engine model's forwards with requests and their time."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    stats = {"steps": 0, "forward_s": 0.0}

    def pre(module, args, kwargs):
        stats["t0"] = time.perf_counter()

    def post(module, args, kwargs, out):
        stats["steps"] += 1
        stats["forward_s"] += time.perf_counter() - stats["t0"]

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    return stats


def _vllm_row(llm, method, k, prompts, args, extra):
    import vllm

    stats = _counted(llm)
    params = vllm.SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, seed=0, **extra)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, params, use_tqdm=False)  # warm-up
    stats.update(steps=0, forward_s=0.0)
    t0 = time.perf_counter()
    llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = len(prompts) * args.new_tokens
    steps = stats["steps"]
    return {
        "engine": "vllm",
        "backbone": args.backbone,
        "method": method,
        "k": k,
        "batch": len(prompts),
        "compiled": not llm.llm_engine.vllm_config.model_config.enforce_eager,
        "tokens_per_s": tokens / wall,
        "steps_per_token": steps / args.new_tokens,  # engine steps per generated token of one request
        "wall_ms_per_step": 1e3 * wall / steps,
        "forward_ms_per_step": 1e3 * stats["forward_s"] / steps,
        "host_ms_per_step": 1e3 * (wall - stats["forward_s"]) / steps,
    }


def _package_rows(stage, ar, batch, prompts, args):
    import torch

    from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing
    from kforcing_kernels.app.student import load_student

    rows = []
    p = torch.tensor(prompts)
    teacher = load_student(ar)[0]
    student = load_student(stage)[0]
    runs = [("ar", 1, lambda: generate_ar(teacher, p, args.new_tokens, temperature=0.0))]
    runs += [(f"kforcing_k{k}", k, lambda k=k: generate_kforcing(student, p, k, args.new_tokens)) for k in args.ks]
    for method, k, run in runs:
        run()  # warm-up
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
        rows.append(
            {
                "engine": "package",
                "backbone": args.backbone,
                "method": method,
                "k": k,
                "batch": batch,
                "tokens_per_s": batch * args.new_tokens / wall,
            }
        )
    return rows


def _emit(row, out: Path, rows: list) -> None:
    same = [r for r in rows if r["engine"] == row["engine"] and r["batch"] == row["batch"] and r["method"] == "ar"]
    if same and row["method"] != "ar":
        row["speedup_over_own_ar"] = row["tokens_per_s"] / same[0]["tokens_per_s"]
    rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm

    from kforcing_kernels.integrations.vllm import engine_kwargs

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kf-vllm-bench-"))
    positions = args.prompt + args.new_tokens + 16
    stage, ar, served_stage, served_ar = _folders(work, args.layers, args.backbone, max(256, positions))
    g = torch.Generator().manual_seed(0)
    out, rows = Path(args.out), []
    common = dict(dtype=args.dtype, max_model_len=positions, seed=0)
    if args.device == "cpu":
        common.update(gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30)
    for batch in args.batches:
        prompts = torch.randint(0, 50000, (batch, args.prompt), generator=g).tolist()
        num = dict(max_num_seqs=batch, max_num_batched_tokens=max(batch * args.prompt, 8192))
        eager = args.device == "cpu" and not args.compile
        if args.backbone == "native":  # the AR stage's export: its registered architecture, stock decoding
            llm = vllm.LLM(**engine_kwargs(served_ar, enforce_eager=eager, **common, **num))
        else:
            llm = vllm.LLM(model=str(served_ar), enforce_eager=eager, **common, **num)
        _emit(_vllm_row(llm, "ar", 1, prompts, args, {}), out, rows)
        del llm
        gc.collect()
        for k in args.ks:
            llm = vllm.LLM(**engine_kwargs(served_stage, k, enforce_eager=eager, **common, **num))
            _emit(_vllm_row(llm, f"kforcing_k{k}", k, prompts, args, {"extra_args": {"kforcing_tau": 1.0}}), out, rows)
            del llm
            gc.collect()
        if not args.no_package:
            for row in _package_rows(stage, ar, batch, prompts, args):
                _emit(row, out, rows)

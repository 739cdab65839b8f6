"""A memory model of one self-forcing (Stage-2) training step on one device, per part, calibrated on CPU.

    python -m bench memory-model                                  # the paper backbone, N 1024/4096/8192, B=4, k 4 -> 8
    python -m bench memory-model --seq-len 4096 --batch-size 4 --gpu-gb 80

What the step holds at its peak, in bytes, for the native model as ``bench train`` and the trainer run it
(AdamW, fp32 weights; ``--dtype bfloat16``: bf16 autocast as on a GPU; the chunked loss and teacher of
``app/training/objectives.py``), in parts:

* ``weights+optimizer``: the student's parameters, gradients and AdamW's two moments (16 bytes a parameter),
  under autocast the weights' low-precision copies its products save (2), and the frozen teacher's parameters (4);
* ``activations``: what autograd saves in the student's forward except inside attention, per row (the
  student's SingleForward runs ``B * N * (1 + 2k)`` rows) and layer, *measured* on a 1- and a 2-layer model of the
  backbone's width on CPU at two row counts (``torch.autograd.graph.saved_tensors_hooks``, under bf16 autocast
  for bf16: the calibration; the slopes over rows and layers), scaled by rows and layers. With activation
  checkpointing (``--ac``): each layer's input
  (fp32 residual stream) plus one layer's full set during its recompute;
* ``attention``: what ``window_attention`` saves (q, k, v, out, lse per row and layer: the calibration's
  saved bytes minus those of the same model with a zero-cost attention);
* ``loss``: the chunked loss's gradient of the hidden states ``[B N 2k, C]`` fp32 and of the head ``[V, C]``
  fp32, plus one chunk's logits (``[chunk, V]`` fp32 and its autocast copy). The unchunked loss's
  ``~16 B N 2k V`` bytes are printed beside it for comparison;
* ``teacher``: its two rounds run without autograd before the student's forward: the context K/V kept
  for DoubleForward (``2 n_layer B N C``) plus one layer's working set over DoubleForward's ``2 B N k``
  query rows (taken as one layer's calibrated activations) and one chunk of logits; the student's parts are
  not alive then, so the peak is ``weights+optimizer + max(teacher, activations + attention + loss + backward)``;
* ``backward``: the gradients in flight, taken as one layer's saved bytes.

It is a model: the parts are what the step saves and allocates by construction, the calibration is one
measurement, and allocator fragmentation, workspace and the CUDA context (~0.5-1 GB) are not counted. The
calibration is tested against saved bytes measured at other small shapes (python_tests/bench/test_memory_model.py).
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext
from typing import Optional

import torch

from kforcing_kernels.app.cli import add_batch_size, int_list, positive_int

GIB = 2**30
PARTS = ("weights+optimizer", "activations", "attention", "loss", "teacher", "backward")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Saved bytes per student row: per layer outside attention, per layer inside it, and once outside the layers."""

    layer_row: float
    attention_row: float
    base_row: float


def _saved_bytes(cfg, n: int, k: int, b: int, zero_attention: bool, dtype: torch.dtype) -> int:
    """Bytes autograd saves in the student's SingleForward (hidden states, no loss) of a fresh model."""
    from kforcing_kernels.model import KForcingLM, gpt
    from kforcing_kernels.tools.memory import SavedTensors

    torch.manual_seed(0)
    model = KForcingLM(cfg)
    gen = torch.Generator().manual_seed(0)
    tokens, noise = torch.randint(0, cfg.vocab_size, (b, n), generator=gen), torch.rand(b, n, k, generator=gen)
    saved = SavedTensors(exclude=model.parameters())
    original = gpt.window_attention
    if zero_attention:
        gpt.window_attention = lambda q, kk, v, layout, backend=None: q
    amp = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else nullcontext()
    try:
        with saved.context(), amp:
            model(tokens, noise, 0.8, return_hidden=True)
    finally:
        gpt.window_attention = original
    return saved.total


def calibrate(
    n_embd: int, n_head: int, dtype: torch.dtype = torch.bfloat16, n: int = 16, k: int = 8, mlp_ratio: int = 4
) -> Calibration:
    """Per-row saved bytes of the backbone's layers, measured on CPU at width ``n_embd`` (a small vocabulary)."""
    from kforcing_kernels.model import ModelConfig

    def cfg(layers):
        return ModelConfig(
            vocab_size=256,
            n_layer=layers,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            seq_len=n,
            noise_features=128,
            tau_features=16,
        )

    # Two row counts and two depths: the slopes are per row and per layer; what does not grow with the rows
    # (autocast's low-precision weight copies, saved by the products) is left out and counted with the weights.
    short, long = n * (1 + k), 2 * n * (1 + k)

    def slopes(zero: bool) -> tuple[float, float]:
        s = {(layers, m): _saved_bytes(cfg(layers), m, k, 1, zero, dtype) for layers in (1, 2) for m in (n, 2 * n)}
        per_layer = ((s[2, 2 * n] - s[1, 2 * n]) - (s[2, n] - s[1, n])) / (long - short)
        outside = ((s[1, 2 * n] - s[1, n]) / (long - short)) - per_layer
        return per_layer, outside

    layer, outside = slopes(True)
    with_attention, _ = slopes(False)
    return Calibration(layer_row=layer, attention_row=with_attention - layer, base_row=outside)


def parameter_count(*, n_layer: int, n_embd: int, n_head: int, vocab: int, mlp_ratio: int = 4) -> int:
    """Parameters of the native model (tied head, the paper's noise features), counted on the meta device."""
    from kforcing_kernels.model import KForcingLM, ModelConfig

    cfg = ModelConfig(
        vocab_size=vocab,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        mlp_ratio=mlp_ratio,
        noise_features=128,
        tau_features=16,
    )
    with torch.device("meta"):
        return KForcingLM(cfg).num_parameters()


def predict(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    vocab: int,
    n: int,
    batch: int,
    teacher_k: int,
    ac: bool,
    calibration: Calibration,
    dtype: torch.dtype = torch.bfloat16,
    mlp_ratio: int = 4,
    chunk_rows: Optional[int] = None,
) -> dict:
    """Bytes per part (:data:`PARTS`) and ``peak`` of one Stage-2 step; see the module docstring."""
    from kforcing_kernels.app.training.linear_ce import chunk_rows_for

    k = 2 * teacher_k
    c, e = n_embd, torch.empty((), dtype=dtype).element_size()
    params = parameter_count(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, mlp_ratio=mlp_ratio)
    rows = batch * n * (1 + k)
    window_rows = batch * n * k
    chunk = chunk_rows or chunk_rows_for(vocab)
    layer_saved = calibration.layer_row * rows
    attention_saved = calibration.attention_row * rows
    if ac:
        activations = n_layer * rows * c * 4 + layer_saved + calibration.base_row * rows
        attention = attention_saved
    else:
        activations = n_layer * layer_saved + calibration.base_row * rows
        attention = n_layer * attention_saved
    parts = {
        # student: fp32 weights, gradients, AdamW moments, and under autocast the low-precision copies; teacher: fp32
        "weights+optimizer": params * (4 + 4 + 8 + (e if e < 4 else 0)) + params * 4,
        "activations": activations,
        "attention": attention,
        "loss": window_rows * c * 4 + vocab * c * 4 + chunk * vocab * (4 + e),
        "teacher": (
            2 * n_layer * batch * n * c * e
            + calibration.layer_row * 2 * batch * n * teacher_k
            + chunk * vocab * (4 + e)
        ),
        "backward": layer_saved + attention_saved,
    }
    student = parts["activations"] + parts["attention"] + parts["loss"] + parts["backward"]
    parts["peak"] = parts["weights+optimizer"] + max(parts["teacher"], student)
    parts["unchunked_loss"] = 16 * window_rows * vocab
    parts["params"] = params
    return parts


def predicted_saved_bytes(
    *, n_layer: int, n_embd: int, vocab: int, n: int, batch: int, teacher_k: int, calibration: Calibration
) -> float:
    """What autograd saves in one Stage-2 ``compute_loss`` (no AC, fp32): the student's layers, attention, and the
    chunked loss's two gradients; the model's prediction that the tests compare with a measurement."""
    k = 2 * teacher_k
    rows = batch * n * (1 + k)
    return (
        rows * (n_layer * (calibration.layer_row + calibration.attention_row) + calibration.base_row)
        + batch * n * k * n_embd * 4
        + vocab * n_embd * 4
    )


def add_arguments(p) -> None:
    p.add_argument("--seq-len", type=int_list, default="1024,4096,8192", help="context lengths N (comma-separated)")
    add_batch_size(p, 4, help="sequences per step B")
    p.add_argument("--k", type=positive_int, default=4, help="teacher window k (the student gets 2k)")
    p.add_argument("--n-layer", type=positive_int, default=12, help="decoder layers")
    p.add_argument("--n-embd", type=positive_int, default=768, help="model width")
    p.add_argument("--n-head", type=positive_int, default=12, help="attention heads")
    p.add_argument("--vocab", type=positive_int, default=50258, help="vocabulary size")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="bfloat16: bf16 autocast (the GPU step); float32: the CPU step",
    )
    p.add_argument("--gpu-gb", type=float, default=80.0, help="the device memory to check the peak against (GB)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")


def execute(args) -> int:
    dtype = getattr(torch, args.dtype)
    cal = calibrate(args.n_embd, args.n_head, dtype)
    print(
        f"calibration ({args.dtype}, width {args.n_embd}, {args.n_head} heads, measured on CPU): saved bytes per row "
        f"per layer {cal.layer_row:.0f} + attention {cal.attention_row:.0f}; outside the layers {cal.base_row:.0f}"
    )
    print(
        f"Stage-2 step, {args.n_layer} x {args.n_embd}, vocab {args.vocab}, B={args.batch_size}, "
        f"k {args.k}->{2 * args.k}; GiB\n"
    )
    print("| N | AC | " + " | ".join(PARTS) + f" | peak | fits {args.gpu_gb:g} GB | unchunked loss would add |")
    print("|---|---|" + "---|" * (len(PARTS) + 3))
    rows = []
    for n in args.seq_len:
        for ac in (False, True):
            parts = predict(
                n_layer=args.n_layer,
                n_embd=args.n_embd,
                n_head=args.n_head,
                vocab=args.vocab,
                n=n,
                batch=args.batch_size,
                teacher_k=args.k,
                ac=ac,
                calibration=cal,
                dtype=dtype,
            )
            fits = parts["peak"] <= args.gpu_gb * 1e9
            rows.append({"n": n, "ac": ac, "fits": fits, **parts})
            print(
                f"| {n} | {'on' if ac else 'off'} | "
                + " | ".join(f"{parts[p] / GIB:.1f}" for p in PARTS)
                + f" | {parts['peak'] / GIB:.1f} | {'yes' if fits else 'no'} | {parts['unchunked_loss'] / GIB:.1f} |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calibration": dataclasses.asdict(cal), "rows": rows}, f, indent=1)
    return 0

"""The student loss over row chunks (issue 45): equal to the unchunked path, and never [rows, V] at once.

Oracles: ``F.cross_entropy(F.linear(hidden, W, b).float(), targets)`` (the loss as it was), and
``compute_loss(..., chunked=False)``, which runs the model's logits through exactly that. Memory: the
deterministic allocation tracker and autograd's saved tensors (``kforcing_kernels/tools/memory.py``).
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kforcing_kernels.app.training.linear_ce import IGNORE_INDEX, chunk_rows_for, linear_cross_entropy
from kforcing_kernels.app.training.objectives import Batch, Objective, compute_loss, make_batch, student_inputs
from kforcing_kernels.app.training.targets import chunk_bounds, output_head, teacher_head
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.tools.memory import AllocationTracker, SavedTensors

F32 = dict(atol=2e-6, rtol=2e-5)


def _oracle(hidden, weight, bias, targets, row_weights):
    per_row = F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")
    return (per_row * row_weights).sum(), per_row


class _OpLog(TorchDispatchMode):
    """Every aten op run under it, with its outputs' shapes and data pointers."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, [(tuple(t.shape), t.data_ptr()) for t in outs]))
        return out


_PRODUCTS = {"mm", "addmm", "addmm_", "matmul", "bmm", "linear"}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_no_gradient_work_without_grad_mode(mode, with_bias):
    """Issue 56 item 2: under no_grad / inference_mode (evaluate_loss) only the losses are computed, even though
    hidden and W require grad: one product per chunk (the logits), no [V, C] gradient buffer, no [R, C] one.
    With grad mode on, the same call does the gradient products (the counter can fail)."""
    rows, width, vocab, chunk = 10, 6, 13, 4
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True) if with_bias else None
    targets, row_weights = torch.randint(0, vocab, (rows,)), torch.full((rows,), 1.0 / rows)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]
    log = _OpLog()
    with context(), log:
        loss, _ = linear_cross_entropy(hidden, weight, bias, targets, row_weights, chunk)
    chunks = -(-rows // chunk)
    products = [name for name, _ in log.ops if name in _PRODUCTS]
    # Shapes of the tensors the call allocated (not the inputs themselves, e.g. weight.to(its own dtype)).
    inputs = {t.data_ptr() for t in (hidden, weight, bias) if t is not None}
    shapes = {shape for _, outs in log.ops for shape, ptr in outs if ptr not in inputs}
    if mode == "grad":
        assert loss.requires_grad and len(products) == 3 * chunks  # logits, grad_hidden, grad_weight
        assert (vocab, width) in shapes
        return
    assert not loss.requires_grad
    assert len(products) == chunks, products  # the logits' product of each chunk, nothing more
    assert (vocab, width) not in shapes and (rows, width) not in shapes and (vocab,) not in shapes, log.ops
    torch.testing.assert_close(loss, _oracle(hidden, weight, bias, targets, row_weights)[0].detach(), **F32)


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 36, 37, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_equals_unchunked(chunk_rows, with_bias):
    gen = torch.Generator().manual_seed(1)
    rows, width, vocab = 37, 16, 101
    hidden = torch.randn(rows, width, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, width, generator=gen, requires_grad=True)
    bias = torch.randn(vocab, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[[3, 20]] = IGNORE_INDEX
    row_weights = torch.rand(rows, generator=gen)
    row_weights[5] = 0.0
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    loss, per_row = linear_cross_entropy(hidden, weight, bias, targets, row_weights, chunk_rows)
    grads = torch.autograd.grad(loss * 2.5, inputs)
    ref_loss, ref_rows = _oracle(hidden, weight, bias, targets, row_weights)
    ref_grads = torch.autograd.grad(ref_loss * 2.5, inputs)
    torch.testing.assert_close(loss, ref_loss, **F32)
    torch.testing.assert_close(per_row, ref_rows.detach(), **F32)
    assert not per_row.requires_grad
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **F32)


def test_linear_cross_entropy_without_grad_and_errors():
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    targets, row_weights = torch.tensor([0, 1, 2, 3, 8]), torch.full((5,), 0.2)
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden, weight, None, targets, row_weights, 2)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _oracle(hidden, weight, None, targets, row_weights)[0].detach(), **F32)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, None, targets, row_weights, 0)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, None, targets[:4], row_weights, 2)
    with pytest.raises(ValueError, match="row_weights"):
        linear_cross_entropy(hidden, weight, None, targets, row_weights[:4], 2)
    assert chunk_rows_for(50258) == 333


def test_linear_cross_entropy_bf16_autocast_matches_unchunked():
    """Under autocast the logits are computed in bf16 then converted to fp32, as ``head(h).float()`` does."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(24, 32, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(80, 32, generator=gen)).requires_grad_()
    targets = torch.randint(0, 80, (24,), generator=gen)
    row_weights = torch.full((24,), 1 / 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, per_row = linear_cross_entropy(hidden, weight, None, targets, row_weights, 5)
        ref_loss, ref_rows = _oracle(hidden, weight, None, targets, row_weights)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    torch.testing.assert_close(per_row, ref_rows.detach(), atol=1e-5, rtol=1e-5)  # the same bf16 logits, row by row
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)  # bf16 products, summed in another order


# ---------------------------------------------------------------------- compute_loss, native and HF students


def _micro(tie: bool = True, vocab: int = 64) -> ModelConfig:
    return ModelConfig.micro(vocab_size=vocab, tie_embeddings=tie)


def _batch(objective, vocab, packed, k=4, n=12, b=2, seed=3):
    stream = torch.randint(0, vocab, (400,), generator=torch.Generator().manual_seed(seed))
    stream[::7] = 5  # separators often enough that windows cross documents
    generator = torch.Generator().manual_seed(seed + 1)
    return make_batch(objective, stream, b, n, k, (0.5, 1.5), generator, 5 if packed else None)


def _loss_and_grads(model, objective, batch, teacher, k, **kw):
    model.zero_grad(set_to_none=True)
    loss, per_pos = compute_loss(objective, model, batch, teacher, k=k, **kw)
    loss.backward()
    return loss.detach(), per_pos, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(chunked, reference):
    torch.testing.assert_close(chunked[0], reference[0], **F32)
    torch.testing.assert_close(chunked[1], reference[1], **F32)
    assert chunked[2].keys() == reference[2].keys()
    for name in reference[2]:
        torch.testing.assert_close(chunked[2][name], reference[2][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("objective", list(Objective))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tie", [True, False])
def test_compute_loss_chunked_equals_unchunked(objective, packed, tie):
    cfg = _micro(tie)
    torch.manual_seed(0)
    student = KForcingLM(cfg)
    teacher = None if objective is Objective.AR else KForcingLM(cfg).eval()
    k = {Objective.AR: 1, Objective.FORWARD: 1, Objective.NOISE_INVERSION: 3, Objective.SELF_FORCING: 4}[objective]
    batch = _batch(objective, cfg.vocab_size, packed, k=k)
    reference = _loss_and_grads(student, objective, batch, teacher, k, chunked=False)
    for chunk_rows in (1, 5, 17, None):  # 17 divides no row count here; None: one chunk at this size
        _assert_same(_loss_and_grads(student, objective, batch, teacher, k, chunk_rows=chunk_rows), reference)


def test_compute_loss_uses_hidden_states_and_no_logits():
    """The chunked path asks the model for hidden states; a model without ``output_head`` keeps the logits path."""
    cfg = _micro()
    student, teacher = KForcingLM(cfg), KForcingLM(cfg).eval()
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((kwargs.get("return_hidden"), out.shape[-1]))

    student.register_forward_hook(hook, with_kwargs=True)
    batch = _batch(Objective.SELF_FORCING, cfg.vocab_size, False)
    compute_loss(Objective.SELF_FORCING, student, batch, teacher)
    compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=False)
    assert calls == [(True, cfg.n_embd), (None, cfg.vocab_size)]
    assert output_head(student) is student.head
    assert output_head(torch.nn.Linear(2, 2)) is None


def test_hf_student_chunked_equals_unchunked():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kforcing_kernels.app.hf_recipe.student import HFStudent

    config = transformers.LlamaConfig(
        vocab_size=90,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    student = HFStudent(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing"))
    torch.manual_seed(1)
    teacher = HFStudent(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing")).eval()
    assert output_head(student) is student.hf.lm_head
    for objective, k, packed in ((Objective.SELF_FORCING, 4, True), (Objective.AR, 1, False)):
        batch = _batch(objective, 90, packed, k=k)
        distil = None if objective is Objective.AR else teacher
        reference = _loss_and_grads(student, objective, batch, distil, k, chunked=False)
        got = _loss_and_grads(student, objective, batch, distil, k, chunk_rows=7)
        _assert_same(got, reference)
    # A final soft-capping makes the logits more than lm_head(hidden): the loss keeps the logits path.
    student.hf.config.final_logit_softcapping = 30.0
    assert output_head(student) is None


# ---------------------------------------------------------------------- the teacher's targets, chunk by chunk


@pytest.mark.parametrize("objective", [Objective.FORWARD, Objective.NOISE_INVERSION, Objective.SELF_FORCING])
@pytest.mark.parametrize("decode", ["argmax", "residual"])
@pytest.mark.parametrize("packed", [False, True])
def test_teacher_targets_chunked_are_bit_identical(objective, decode, packed):
    """Same noise, same tokens (and for noise inversion the same z, bit for bit) for every chunk size."""
    cfg = dataclasses.replace(_micro(vocab=96), decode=decode)
    torch.manual_seed(0)
    teacher = KForcingLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than at init, so that the inverse CDF has work to do
        teacher.head.weight.mul_(20.0)
    k = {Objective.FORWARD: 1, Objective.NOISE_INVERSION: 3, Objective.SELF_FORCING: 4}[objective]
    batch = _batch(objective, cfg.vocab_size, packed, k=k, n=20, b=3)
    reference = student_inputs(objective, batch, teacher, k, chunked=False)
    assert teacher_head(teacher) is teacher.head
    # 1: raised to MIN_TEACHER_CHUNK; 17: a tail of 9 or 13 rows joins the chunk before it
    for chunk_rows in (1, 17, 64, None):
        got = student_inputs(objective, batch, teacher, k, chunk_rows=chunk_rows)
        for a, b in zip(got, reference):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), chunk_rows
    assert reference[2].unique().numel() > 10  # the targets are not all one token


def test_chunk_bounds():
    assert chunk_bounds(100, 30) == [(0, 30), (30, 60), (60, 100)]
    assert chunk_bounds(10, 4) == [(0, 10)]
    assert chunk_bounds(40, 20) == [(0, 20), (20, 40)]
    assert chunk_bounds(0, 20) == []


# ---------------------------------------------------------------------- memory: no [rows, V] fp32 held


def _one_layer_step(chunked: bool):
    """Peak tracked bytes of one Stage-2 step (loss + backward) of a 1-layer model with a large vocabulary, in units
    of one fp32 [rows, V], and autograd's saved bytes in the same unit."""
    cfg = dataclasses.replace(_micro(vocab=4096), n_layer=1, n_embd=16, n_head=2)
    torch.manual_seed(0)
    student, teacher = KForcingLM(cfg), KForcingLM(cfg).eval()
    n, k, b = 32, 8, 1
    gen = torch.Generator().manual_seed(0)
    batch = Batch(
        torch.randint(0, cfg.vocab_size, (b, n), generator=gen),
        torch.rand(b, n, k, generator=gen),
        torch.full((b,), 0.8),
    )
    unit = b * n * k * cfg.vocab_size * 4
    saved = SavedTensors(exclude=student.parameters())
    with AllocationTracker() as tracker, saved.context():
        loss, _ = compute_loss(Objective.SELF_FORCING, student, batch, teacher, chunked=chunked, chunk_rows=16)
        loss.backward()
    grads = sum(p.grad.numel() * 4 for p in student.parameters())
    return (tracker.peak - grads) / unit, saved.total / unit, max(saved.by_size()) / unit


def test_stage2_step_holds_no_rows_by_vocab_tensor():
    peak, saved, largest = _one_layer_step(chunked=True)
    old_peak, old_saved, old_largest = _one_layer_step(chunked=False)
    assert old_peak > 2.0 and old_largest >= 1.0  # the measure sees the unchunked path's [rows, V] tensors
    assert peak <= 0.5, peak  # the student's loss and the teacher's targets, both chunked
    assert largest < 0.25 and saved < 0.5, (largest, saved)


def test_tied_gradient_accumulates_in_place():
    """Untracked, autograd sums a tied weight's two gradients into the loss's own buffer (no second [V, C]);
    under a dispatch mode (the allocation tracker) it does not: why BENCHMARKS.md discounts that sum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kforcing_kernels.app.training import linear_ce

    class NoOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(mode):
        returned = {}
        original = linear_ce.LinearCrossEntropy.backward

        def backward(ctx, *grads):
            out = original(ctx, *grads)
            returned["weight"] = out[1].data_ptr()
            return out

        weight = torch.randn(500, 16, requires_grad=True)
        tokens = torch.randint(0, 500, (64,))
        hidden = F.embedding(tokens, weight) * 2.0
        loss, _ = linear_cross_entropy(hidden, weight, None, tokens, torch.full((64,), 1 / 64), 16)
        linear_ce.LinearCrossEntropy.backward = staticmethod(backward)
        try:
            with mode:
                loss.backward()
        finally:
            linear_ce.LinearCrossEntropy.backward = original
        return weight.grad.data_ptr() == returned["weight"]

    from contextlib import nullcontext

    assert run(nullcontext())
    assert not run(NoOp())

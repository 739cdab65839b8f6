"""ops/common/saved.py (issue 56 items 6b and 7): what the ops save never pins a larger buffer, and nothing is copied
when autograd will not save.

Retention is checked over every kind of view, contiguous ones included (a batch slice or a ``select`` of a
contiguous tensor is contiguous yet pins its whole base): on ``own_storage`` itself, and through
``window_attention`` on its eager path and on its custom-op path (under a TorchFunctionMode) with autograd's
saved-tensor hooks (``SavedTensors.pinned_excess``: bytes held only because a saved view pins a larger storage).
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.common.saved import autograd_records, own_storage
from kforcing_kernels.tools.memory import SavedTensors

LAYOUT = WindowLayout.kforcing_single(n_ctx=6, k=2)  # 6 + 3 * 2 = 12 query and key rows
B, H, L, D = 2, 2, LAYOUT.n_queries, 8


def _views() -> dict:
    """name -> (a function of a fresh base tensor that returns a [B, H, L, D] view of it, the base's shape)."""
    return {
        "batch-slice": (lambda t: t[:B], (4, H, L, D)),  # contiguous: the case the fused-qkv tests never reached
        "narrow-keys": (lambda t: t.narrow(2, 1, L), (B, H, L + 5, D)),  # a K/V cache's first rows
        "select-layer": (lambda t: t.select(0, 1), (3, B, H, L, D)),  # one layer of a stacked cache: contiguous
        "expand": (lambda t: t.expand(B, H, L, D), (1, H, L, D)),  # smaller storage than the view: nothing pinned
        "as_strided-gaps": (lambda t: t.as_strided((B, H, L, D), (H * L * D * 2, L * D, D, 1)), (2 * B * H * L * D,)),
        "transposed": (lambda t: t.transpose(1, 2), (B, L, H, D)),
        "fused-qkv": (lambda t: t.permute(2, 0, 3, 1, 4)[2], (B, L, 3, H, D)),
    }


VIEWS = _views()


def _compact(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() <= t.numel() * t.element_size()


@pytest.mark.parametrize("view", list(VIEWS))
def test_own_storage_is_compact_and_equal_for_every_view(view):
    make, shape = VIEWS[view]
    base = torch.randn(shape)
    t = make(base)
    kept = own_storage(t)
    assert _compact(kept), (view, kept.untyped_storage().nbytes(), t.numel() * t.element_size())
    assert torch.equal(kept, t)
    if _compact(t):  # already its own storage (or smaller): no copy
        assert kept is t


class _NoEagerPath(TorchFunctionMode):
    """Any torch-function mode sends window_attention through its custom op (op._plain_eager)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["eager", "custom-op"])
@pytest.mark.parametrize("backend", ["reference", "composite"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_window_attention_saves_no_pinned_buffer_for_every_view(view, backend, path):
    """q, k and v all the same kind of view of their own base; with grad on, what the op saves holds no more
    bytes than the views themselves, and the gradients equal those of contiguous copies."""
    make, shape = VIEWS[view]
    bases = [torch.randn(shape, requires_grad=True) for _ in range(3)]
    saved = SavedTensors(exclude=bases if view == "expand" else ())  # an expanded base is smaller than the view
    with saved.context(), _NoEagerPath() if path == "custom-op" else torch.enable_grad():
        out = window_attention(*(make(b) for b in bases), LAYOUT, backend=backend)
    assert saved.pinned_excess == 0, (view, saved.pinned_excess)
    grads = torch.autograd.grad(out.sum(), bases)
    fresh = [b.detach().clone().requires_grad_() for b in bases]
    want = torch.autograd.grad(
        window_attention(*(make(b).contiguous() for b in fresh), LAYOUT, backend=backend).sum(), fresh
    )
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def _clone_bytes(fn) -> tuple[object, int]:
    """(fn(), bytes aten::clone copied from [B, H, L, D] inputs (q, k, v's shape) while it ran), from the profiler
    (unlike a dispatch mode it leaves the eager path alone). The backend's own small clones are not counted."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    copied = 0
    for event in prof.events():
        if event.name == "aten::clone" and event.input_shapes and list(event.input_shapes[0]) == [B, H, L, D]:
            copied += B * H * L * D * 4  # fp32
    return result, copied


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no-input-requires-grad"])
def test_no_copy_of_a_cache_view_when_autograd_will_not_save(mode):
    """A decode call with K/V views of a stacked cache (contiguous views, one layer of [layers, B, H, L, D]):
    without a recorded backward, no compact copy is made (issue 56 item 7); with one, it is (the retention test)."""
    cache_k, cache_v = torch.randn(3, B, H, L, D), torch.randn(3, B, H, L, D)
    q = torch.randn(B, H, L, D, requires_grad=mode != "no-input-requires-grad")
    if mode != "no-input-requires-grad":
        cache_k.requires_grad_()
    k, v = cache_k[1], cache_v[1]
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode if mode == "inference_mode" else None
    want = window_attention(q.detach(), k.detach().clone(), v.clone(), LAYOUT, backend="composite")
    with context() if context else torch.enable_grad():
        assert not autograd_records(q, k, v)
        window_attention(q, k, v, LAYOUT, backend="composite")  # the eager cache's first, validating call
        out, copied = _clone_bytes(lambda: window_attention(q, k, v, LAYOUT, backend="composite"))
    assert copied == 0, copied
    assert not out.requires_grad
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    # The same call recorded copies the views it saves: the profiler count can see a copy.
    q.requires_grad_(True)
    out, copied = _clone_bytes(lambda: window_attention(q, k, v, LAYOUT, backend="composite"))
    assert out.requires_grad and copied == 2 * k.numel() * 4, copied  # k and v, not q (its own storage)

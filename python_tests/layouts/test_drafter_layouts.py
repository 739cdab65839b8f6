"""Block-drafter layouts (issue #26): anchor blocks (DFlash, speculators, SpecForge's sliding
layers), batched Jacobi Forcing and its interleaved storage, sliding context bounds.

The masks are checked against element-wise definitions written from the public code's
description (paper_masks.py), never against the package's own intervals; every backend, forward
and all gradients, is checked against fp64 in test_backends_vs_paper_masks.py."""

import itertools

import numpy as np
import pytest
import torch

from helpers.paper_masks import dflash_elementwise, jacobi_batched_elementwise, jacobi_elementwise
from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.layouts.jacobi import from_streams, stream_order, to_streams


def _dense(layout):
    m = layout.dense_mask()
    return m[:, None] if m.dim() == 3 else m[None, None]


@pytest.mark.parametrize(
    "intra, window, mode",
    [
        ("full", None, "block"),
        ("causal", None, "block"),
        ("full", 3, "block"),
        ("causal", 4, "slot"),
        ("full", 1, "slot"),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_anchor_blocks_equal_the_dflash_definition(intra, window, mode, packed):
    anchors = [[0, 11, 6, 12], [3, 3, 9, 1]]  # 0, the last context token, S itself, repeats
    keep = [[True, True, False, True], [True, False, True, True]]
    cu = [[0, 5, 12], [0, 2, 9, 12]] if packed else None
    layout = WindowLayout.anchor_blocks(
        12, anchors, 3, keep=keep, intra=intra, window=window, window_mode=mode, cu_seqlens=cu
    )
    want = dflash_elementwise(12, anchors, 3, keep, intra, window, mode, cu)
    assert torch.equal(_dense(layout), want)
    assert layout.queries == "windows" and layout.n_keys == 12 + 12


def test_slot_mode_defaults_to_causal_blocks_as_specforge_does():
    assert WindowLayout.anchor_blocks(8, [4], 3, window=2, window_mode="slot").intra == "causal"
    assert WindowLayout.anchor_blocks(8, [4], 3, window=2, window_mode="slot", intra="full").intra == "full"
    assert WindowLayout.anchor_blocks(8, [4], 3, window=2).intra == "full"


def test_dropped_blocks_give_zero_output_and_gradient():
    layout = WindowLayout.anchor_blocks(10, [[4, 7]], 3, keep=[[True, False]])
    q = torch.randn(1, 2, layout.n_queries, 8, requires_grad=True)
    kv = torch.randn(1, 2, layout.n_keys, 8, requires_grad=True)
    for backend in ("reference", "composite", "cpp"):
        out = window_attention(q, kv, kv, layout, backend=backend)
        assert torch.equal(out[:, :, 3:], torch.zeros_like(out[:, :, 3:]))
        (gq, gk) = torch.autograd.grad(out.sum(), (q, kv))
        assert torch.equal(gq[:, :, 3:], torch.zeros_like(gq[:, :, 3:]))
        assert torch.equal(gk[:, :, 13:], torch.zeros_like(gk[:, :, 13:]))  # nobody sees the dropped block


def test_anchor_blocks_refuse_bad_arguments():
    with pytest.raises(ValueError, match="anchors: expected positions in"):
        WindowLayout.anchor_blocks(8, [9], 2)
    with pytest.raises(ValueError, match="anchors: expected at least one block"):
        WindowLayout.anchor_blocks(8, [], 2)
    with pytest.raises(ValueError, match="keep: expected bool"):
        WindowLayout.anchor_blocks(8, [3, 4], 2, keep=[1, 0])
    with pytest.raises(ValueError, match="keep: expected bool"):
        WindowLayout.anchor_blocks(8, [3, 4], 2, keep=[True])
    with pytest.raises(ValueError, match="window_mode"):
        WindowLayout.anchor_blocks(8, [3], 2, window=2, window_mode="sliding")
    with pytest.raises(ValueError, match="window"):
        WindowLayout.anchor_blocks(8, [3], 2, window=0)
    with pytest.raises(ValueError, match="block"):
        WindowLayout.anchor_blocks(8, [3], 0)


@pytest.mark.parametrize("lo_slide, hi_slide", [([-3, 0, 2], None), (None, [1, -1, 4]), ([0, 2, -9], [2, 9, 3])])
def test_sliding_bounds_follow_their_definition(lo_slide, hi_slide):
    """Slot o of window m sees [max(lo, slide_lo + o), min(hi, slide_hi + o)) of the context."""
    lo, hi, w = [0, 2, 1], [5, 6, 6], 4
    layout = WindowLayout(6, 3, w, lo, hi, intra="full", prefix_slide_lo=lo_slide, prefix_slide_hi=hi_slide)
    mask = layout.dense_mask()
    for m, o, key in itertools.product(range(3), range(w), range(6)):
        a = max(lo[m], lo_slide[m] + o) if lo_slide else lo[m]
        b = min(hi[m], hi_slide[m] + o) if hi_slide else hi[m]
        assert bool(mask[6 + m * w + o, key]) == (a <= key < b), (m, o, key)


def test_sliding_layouts_round_trip_through_the_custom_op_and_compile():
    layout = WindowLayout.anchor_blocks(12, [[3, 11], [7, 5]], 4, window=3, window_mode="slot")
    q = torch.randn(2, 2, layout.n_queries, 8, requires_grad=True)
    kv = torch.randn(2, 2, layout.n_keys, 8, requires_grad=True)
    eager = window_attention(q, kv, kv, layout, backend="composite")
    compiled = torch.compile(
        lambda a, b: window_attention(a, b, b, layout, backend="composite"), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(q, kv), eager)
    unslid = WindowLayout.anchor_blocks(12, [[3, 11], [7, 5]], 4, intra="causal")
    assert layout.cache_key != unslid.cache_key  # the slide is part of the layout's identity
    assert layout.batch_element(1).prefix_slide_lo.tolist() == [5, 3]


@pytest.mark.parametrize(
    "prompts, counts, sizes", [([3, 6], [2, 1], [4, 3]), ([2], [3], [2]), ([1, 4, 2], [1, 2, 3], [3, 1, 2])]
)
def test_batched_jacobi_equals_per_sample_jacobi(prompts, counts, sizes):
    layout = WindowLayout.jacobi(prompts, num_blocks=counts, block_size=sizes)
    noisy = [n * t for n, t in zip(counts, sizes)]
    assert torch.equal(_dense(layout).expand(len(prompts), -1, -1, -1), jacobi_batched_elementwise(prompts, noisy))
    if len(prompts) == 1:  # one sample: the unbatched layout exactly
        assert torch.equal(layout.dense_mask()[0], WindowLayout.jacobi(prompts[0], noisy[0]).dense_mask())


def _jacobi_interleaved_mask(p, n, t):
    """Jacobi Forcing's noise-conditioned mask in its own storage [prompt | noisy_0 | clean_0 | ...]:
    prompt and clean tokens are one causal sequence; noisy token r of block j sees the prompt and
    the noisy tokens up to itself (jacobi(P, N*T)), written on interleaved indices."""
    size = p + 2 * n * t
    kind, rank = [], []  # ("p" | "c" | "n", index in its own stream)
    for i in range(size):
        if i < p:
            kind.append("p"), rank.append(i)
        else:
            j, r = divmod(i - p, 2 * t)
            kind.append("n" if r < t else "c"), rank.append(j * t + r % t)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for qi, ki in itertools.product(range(size), range(size)):
        if kind[qi] == "n":
            mask[qi, ki] = kind[ki] == "p" or (kind[ki] == "n" and rank[ki] <= rank[qi])
        else:  # prompt + clean: causal in AR order (prompt first, then clean stream)
            order = lambda k, r: r if k == "p" else p + r  # noqa: E731
            mask[qi, ki] = kind[ki] != "n" and order(kind[ki], rank[ki]) <= order(kind[qi], rank[qi])
    return mask


def test_interleaved_storage_maps_to_the_stream_order_and_back():
    prompts, counts, sizes = [3, 2], [2, 3], [2, 1]
    order = stream_order(prompts, counts, sizes)
    layout = WindowLayout.jacobi(prompts, num_blocks=counts, block_size=sizes)
    assert order.shape == (2, layout.n_keys)
    length = max(p + 2 * n * t for p, n, t in zip(prompts, counts, sizes))
    for b, (p, n, t) in enumerate(zip(prompts, counts, sizes)):
        inter = _jacobi_interleaved_mask(p, n, t)
        live = order[b] >= 0
        idx = order[b][live]
        # the layout's mask on the live positions is Jacobi Forcing's own mask, reordered
        assert torch.equal(layout.dense_mask()[b][live][:, live], inter[idx][:, idx])
        assert not layout.dense_mask()[b][~live].any() and not layout.dense_mask()[b][:, ~live].any()
    ids = torch.randint(0, 100, (2, length))
    hidden = torch.randn(2, length, 5)
    for x in (ids, hidden):
        back = from_streams(to_streams(x, order), order, length)
        for b, (p, n, t) in enumerate(zip(prompts, counts, sizes)):
            used = p + 2 * n * t
            assert torch.equal(back[b, :used], x[b, :used])
    with pytest.raises(ValueError, match="interleaved positions"):
        to_streams(ids[:, :4], order)


def test_unbatched_jacobi_is_unchanged():
    assert torch.equal(WindowLayout.jacobi(4, 6).dense_mask(), jacobi_elementwise(4, 6))
    with pytest.raises(ValueError, match="n_noisy"):
        WindowLayout.jacobi(4)
    with pytest.raises(ValueError, match="num_blocks"):
        WindowLayout.jacobi(4, 6, num_blocks=2, block_size=3)


# ---------------------------------------------------------------------- issue 40, item 3


@pytest.mark.parametrize(
    "length, message",
    [
        (6, "length: expected at least 7"),
        (-1, "length: expected at least 7"),
        (7.0, "length: expected an int"),
        (True, "length: expected an int"),
    ],
)
def test_from_streams_refuses_a_length_that_cannot_hold_the_order(length, message):
    """These raised IndexError / RuntimeError / TypeError from inside the scatter."""
    order = stream_order(3, 2, 1)  # [prompt 3 | noisy, clean | noisy, clean]: interleaved positions 0..6
    need = 7
    y = torch.randn(1, order.shape[1], 2)
    with pytest.raises(ValueError, match=f"^{message}"):
        from_streams(y, order, length)
    assert from_streams(y, order, need).shape == (1, need, 2)


@pytest.mark.parametrize("scalar", [lambda v: np.int64(v), lambda v: torch.tensor(v), lambda v: np.array(v)])
def test_jacobi_and_stream_order_take_numpy_ints_and_0_dim_tensors(scalar):
    """As every other constructor does: the same layout and order as from Python ints."""
    assert torch.equal(stream_order(scalar(3), scalar(2), scalar(2)), stream_order(3, 2, 2))
    assert torch.equal(stream_order([3, 2], scalar(2), scalar(1)), stream_order([3, 2], 2, 1))
    order = stream_order(3, 2, 1)
    y = torch.randn(1, order.shape[1])
    assert torch.equal(from_streams(y, order, scalar(12)), from_streams(y, order, 12))
    assert torch.equal(WindowLayout.jacobi(scalar(4), scalar(6)).dense_mask(), jacobi_elementwise(4, 6))
    batched = WindowLayout.jacobi(np.array([3, 2]), num_blocks=scalar(2), block_size=torch.tensor([2, 1]))
    assert torch.equal(batched.dense_mask(), WindowLayout.jacobi([3, 2], num_blocks=2, block_size=[2, 1]).dense_mask())
    with pytest.raises(ValueError, match="^n_prompt: expected an int"):
        WindowLayout.jacobi(torch.tensor(4.0), 6)
    with pytest.raises(ValueError, match="^prompt_lens: expected an int"):
        stream_order(np.float64(3), 2, 2)

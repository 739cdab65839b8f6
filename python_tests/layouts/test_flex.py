"""FlexAttention interop: flex_attention with our BlockMask / mask_mod equals the dense-mask reference.

FlexAttention has no backward on CPU, so these are forward checks. Eager
flex_attention evaluates only the BlockMask's mask_mod (densely); the block
indices that ``to_block_mask()`` builds analytically are honoured by the
compiled kernel, so one compiled case checks them, including that a corrupted
index changes the result (the test can fail).
"""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from helpers.attention import make_qkv
from kforcing_kernels import WindowLayout, window_attention

LAYOUTS = {
    "single": WindowLayout.kforcing_single(9, 3),
    "double": WindowLayout.kforcing_double(7, 2),
    "sbd_short_last": WindowLayout.sbd(21, 4),
    "ptp_per_batch": WindowLayout.ptp(20, [[3, 16, 20], [9, 1, 12]], 5, [[0, 2, 10], [4, 0, 0]]),
}


def _inputs(layout):
    batch = layout.batch_size or 2
    return make_qkv(layout, batch=batch, heads=4, kv_heads=2, requires_grad=False)


@pytest.mark.parametrize("name", LAYOUTS)
def test_eager_flex_with_our_block_mask_equals_reference(name):
    layout = LAYOUTS[name]
    q, k, v = _inputs(layout)
    got = flex_attention(q, k, v, block_mask=layout.to_block_mask(block_size=16), enable_gqa=True, scale=0.25)
    torch.testing.assert_close(
        got, window_attention(q, k, v, layout, backend="reference", scale=0.25), atol=2e-6, rtol=2e-6
    )


def test_mask_mod_builds_an_equivalent_block_mask():
    layout = LAYOUTS["ptp_per_batch"]
    built = create_block_mask(
        layout.mask_mod(), B=2, H=None, Q_LEN=layout.n_queries, KV_LEN=layout.n_keys, device="cpu", BLOCK_SIZE=16
    )
    ours = layout.to_block_mask(block_size=16)
    assert torch.equal(built.to_dense(), ours.to_dense())
    q, k, v = _inputs(layout)
    got = flex_attention(q, k, v, block_mask=built, enable_gqa=True)
    torch.testing.assert_close(got, window_attention(q, k, v, layout, backend="reference"), atol=2e-6, rtol=2e-6)


def test_compiled_flex_honours_the_analytic_block_indices():
    torch._dynamo.reset()
    layout = WindowLayout.kforcing_single(24, 3)  # 96 tokens: 6 x 6 tiles of 16, some skipped, some full
    q, k, v = _inputs(layout)
    block_mask = layout.to_block_mask(block_size=16)
    compiled = torch.compile(flex_attention)
    want = window_attention(q, k, v, layout, backend="reference")
    torch.testing.assert_close(compiled(q, k, v, block_mask=block_mask, enable_gqa=True), want, atol=2e-6, rtol=2e-6)
    dropped = block_mask.kv_num_blocks.clone()
    dropped[..., -1] -= 1  # forget the last visited tile of the last query row block
    corrupted = BlockMask.from_kv_blocks(
        dropped,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=16,
        mask_mod=block_mask.mask_mod,
        seq_lengths=block_mask.seq_lengths,
    )
    assert not torch.allclose(compiled(q, k, v, block_mask=corrupted, enable_gqa=True), want, atol=1e-3)

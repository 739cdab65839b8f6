"""The cpp kernels keep NaN/inf at masked keys out of every row that does not see them.

No Python scan guards the cpp backend (op.py calls it as is): the kernels themselves never
combine a row with a key outside its intervals. The poisoned keys here sit inside key
chunks that the same query tile also reads for rows that do see them (a context key in the
middle of a window tile's prefix span, a key of a second 256-key chunk, a window slot
seen by later slots only), so the tile products hold masked keys for some rows. Rows
that see no poisoned key must get the same bits as with clean inputs, forward and every
gradient, and so must the dK/dV of keys no poisoned row sees, even with a non-zero
upstream gradient at the poisoned rows (their NaN delta/LSE must not spread either).
"""

import pytest
import torch

from kforcing_kernels import WindowLayout, backends_available, window_attention

pytestmark = pytest.mark.skipif(
    backends_available()["cpp"] is not None, reason=f"cpp backend: {backends_available()['cpp']}"
)

LAYOUTS = {
    "single": lambda: WindowLayout.kforcing_single(300, 4),  # 16 windows a tile, context > one 256-key chunk
    "single_large_window": lambda: WindowLayout.kforcing_single(60, 20),  # w > 16: intra-window tile products
    "double": lambda: WindowLayout.kforcing_double(200, 4),  # stream-major, queries="windows"
    "sbd": lambda: WindowLayout.sbd(150, 4),
    "packed": lambda: WindowLayout.kforcing_single(200, 4, cu_seqlens=[0, 70, 130, 200]),
    "packed_per_batch": lambda: WindowLayout.kforcing_single(120, 2, cu_seqlens=[[0, 120], [0, 50, 120]]),
}
POISON = {
    "k_nan": (float("nan"), None),
    "v_inf": (None, float("inf")),
    "k_inf_v_nan": (float("inf"), float("nan")),
    "k_neg_inf_v_neg_inf": (float("-inf"), float("-inf")),
}


def _bad_keys(layout: WindowLayout) -> list[int]:
    """A context key mid-prefix, one in a second key chunk (when there is one), and a window slot."""
    keys = [int(layout.n_ctx * 0.45)]
    if layout.n_ctx > 260:
        keys.append(layout.n_ctx - 20)
    slots = layout.window_token_keys[layout.num_windows // 2]
    keys.append(int(slots[1]))
    return keys


def _masks(layout: WindowLayout, batch: int) -> torch.Tensor:
    mask = layout.dense_mask()
    return mask if mask.dim() == 3 else mask[None].expand(batch, -1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cpp_poisoned_keys_inside_shared_tiles_do_not_reach_other_rows(name, poison, heads, kv_heads, dtype):
    layout = LAYOUTS[name]()
    batch = layout.batch_size or 2
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, layout.n_queries, 24, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, layout.n_keys, 24, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, layout.n_keys, 24, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, layout.n_queries, 24, generator=g, dtype=dtype)  # poisoned rows too
    bad = _bad_keys(layout)
    k_val, v_val = POISON[poison]
    pk, pv = k.clone(), v.clone()
    if k_val is not None:
        pk[:, :, bad, 3] = k_val
    if v_val is not None:
        pv[:, :, bad, 5] = v_val

    mask = _masks(layout, batch)  # [B, Lq, Lk]
    sees = mask[:, :, bad].any(-1)  # [B, Lq]: rows that see a poisoned key
    touched = (mask & sees[:, :, None]).any(1)  # [B, Lk]: keys some poisoned row sees
    assert sees.any() and (~sees).any()

    def run(k_, v_):
        leaves = [t.clone().requires_grad_() for t in (q, k_, v_)]
        out = window_attention(*leaves, layout, backend="cpp")
        return (out, *torch.autograd.grad(out, leaves, dout))

    clean, dirty = run(k, v), run(pk, pv)
    for b in range(batch):
        rows, keys = ~sees[b], ~touched[b]
        assert not torch.isfinite(dirty[0][b][:, sees[b]]).all(), "the poison never reached a row that sees it"
        for label, i, sel in (("out", 0, rows), ("dq", 1, rows), ("dk", 2, keys), ("dv", 3, keys)):
            a, c = dirty[i][b][:, sel], clean[i][b][:, sel]
            assert torch.isfinite(a).all(), f"{label}: batch {b} has non-finite values where no poisoned key is seen"
            assert torch.equal(a, c), f"{label}: batch {b}: max diff {(a - c).abs().max().item()}"

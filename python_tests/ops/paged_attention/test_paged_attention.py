"""paged_attention against window_attention over the gathered contiguous cache (the queries="windows" layout)."""

import math
import os

import pytest
import torch

from kforcing_kernels import WindowLayout, window_attention
from kforcing_kernels.ops.paged_attention import PAGED_BACKENDS, paged_attention, paged_backends_available

AVAILABLE = [name for name, why in paged_backends_available().items() if why is None]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_case(
    lens, *, page_size=4, window=3, heads=4, kv_heads=2, head_dim=8, spare_pages=3, dtype=torch.float64, seed=0
):
    """A pool whose pages are handed out in a shuffled order, block tables padded with -1 past each request's pages."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    need = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    max_pages = max(need + [1]) + 1
    table = torch.full((b, max_pages), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at : at + n].to(torch.int32)
        at += n

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = rnd(b, heads, window, head_dim)
    k_new, v_new = rnd(b, kv_heads, window, head_dim), rnd(b, kv_heads, window, head_dim)
    k_pages, v_pages = rnd(num_pages, page_size, kv_heads, head_dim), rnd(num_pages, page_size, kv_heads, head_dim)
    return q, k_new, v_new, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int64)


def oracle(q, k_new, v_new, k_pages, v_pages, table, lens):
    """window_attention (reference backend, fp64) over [gathered cache | window] with per-request prefix ranges."""
    b, hkv, w, d = k_new.shape
    page = k_pages.shape[1]
    l_max = int(lens.max())
    k_ctx = torch.zeros(b, hkv, l_max, d, dtype=torch.float64)
    v_ctx = torch.zeros_like(k_ctx)
    for i, n in enumerate(lens.tolist()):
        for t in range(n):  # token by token: independent of any page arithmetic in the code under test
            p = int(table[i, t // page])
            k_ctx[i, :, t] = k_pages[p, t % page].double()
            v_ctx[i, :, t] = v_pages[p, t % page].double()
    layout = WindowLayout(
        l_max, 1, w, torch.zeros(b, 1, dtype=torch.int64), lens[:, None], intra="causal", queries="windows"
    )
    keys = torch.cat([k_ctx, k_new.double()], 2)
    vals = torch.cat([v_ctx, v_new.double()], 2)
    return window_attention(q.double(), keys, vals, layout, backend="reference")


CASES = {
    "ragged": dict(lens=[5, 13, 1, 8]),
    # full pages, and windows that straddle a boundary
    "page_boundaries": dict(lens=[4, 8, 3, 9], page_size=4, window=6),
    "empty_context": dict(lens=[0, 7, 0]),
    "all_empty": dict(lens=[0, 0]),
    "one_page_per_token": dict(lens=[3, 6], page_size=1),
    "large_pages": dict(lens=[2, 40, 17], page_size=16, window=8),
    "many_chunks": dict(lens=[1500, 37], page_size=16, window=2),  # > composite.CHUNK_TOKENS: several chunks merged
    "ar_window": dict(lens=[11, 2, 6], window=1),
    "mha": dict(lens=[5, 9], heads=3, kv_heads=3),
    "mqa": dict(lens=[5, 9], heads=4, kv_heads=1),
}


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_window_attention_on_gathered_cache(backend, case):
    if backend not in AVAILABLE:
        pytest.skip(paged_backends_available()[backend])
    dtype = torch.float32 if backend == "triton" else torch.float64  # triton computes in fp32 (tl.dot)
    args = make_case(**CASES[case], dtype=dtype)
    out = paged_attention(*args, backend=backend)
    torch.testing.assert_close(out.double(), oracle(*args), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", [b for b in PAGED_BACKENDS if b != "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision(backend, dtype):
    if backend not in AVAILABLE:
        pytest.skip(paged_backends_available()[backend])
    if backend == "triton" and dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip("the Triton interpreter's tl.dot is wrong for bfloat16 (refused by the backend)")
    args = make_case([6, 21, 0, 12], page_size=8, window=4, dtype=dtype)
    out = paged_attention(*args, backend=backend)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), oracle(*args), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_request_result_does_not_depend_on_the_batch(backend):
    """Request 1 alone (its own pages only) gives the same bits as inside a ragged batch."""
    q, kn, vn, kp, vp, table, lens = make_case([9, 30, 2], page_size=4, window=4, dtype=torch.float32)
    batched = paged_attention(q, kn, vn, kp, vp, table, lens, backend=backend)
    alone = paged_attention(q[1:2], kn[1:2], vn[1:2], kp, vp, table[1:2], lens[1:2], backend=backend)
    assert torch.equal(batched[1:2], alone)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_pages_past_the_length_are_never_read(backend):
    """Junk (inf/NaN) in the unused tail of the last page and in unused pool pages does not reach any row."""
    q, kn, vn, kp, vp, table, lens = make_case(
        [5, 2], page_size=4, window=2, dtype=torch.float32 if backend == "triton" else torch.float64
    )
    ref = paged_attention(q, kn, vn, kp, vp, table, lens, backend=backend)
    kp, vp = kp.clone(), vp.clone()
    used = {(int(table[i, t // 4]), t % 4) for i, n in enumerate(lens.tolist()) for t in range(n)}
    for p in range(kp.shape[0]):
        for s in range(kp.shape[1]):
            if (p, s) not in used:
                kp[p, s] = float("nan")
                vp[p, s] = float("inf")
    out = paged_attention(q, kn, vn, kp, vp, table, lens, backend=backend)
    assert torch.equal(out, ref)


def test_reads_the_cache_in_place():
    """Writing a page after the call changes the next result: the op reads the pool, not a cached copy."""
    q, kn, vn, kp, vp, table, lens = make_case([6], page_size=4, window=1)
    before = paged_attention(q, kn, vn, kp, vp, table, lens)
    vp[int(table[0, 1]), 1] += 1.0  # token 5
    after = paged_attention(q, kn, vn, kp, vp, table, lens)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, oracle(q, kn, vn, kp, vp, table, lens), atol=1e-10, rtol=0)


def test_lengths_as_a_list_and_int64_block_table():
    q, kn, vn, kp, vp, table, lens = make_case([3, 7])
    out = paged_attention(q, kn, vn, kp, vp, table.long(), lens.tolist(), backend="composite")
    torch.testing.assert_close(out, oracle(q, kn, vn, kp, vp, table, lens), atol=1e-10, rtol=0)


def test_empty_batch():
    q, kn, vn, kp, vp, table, lens = make_case([3])
    out = paged_attention(q[:0], kn[:0], vn[:0], kp, vp, table[:0], lens[:0])
    assert out.shape == (0, *q.shape[1:])


# ---------------------------------------------------------------------- bad input


def bad(match, **changes):
    q, kn, vn, kp, vp, table, lens = make_case([5, 9], page_size=4)
    args = dict(q=q, k_new=kn, v_new=vn, k_pages=kp, v_pages=vp, block_table=table, context_lens=lens)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)


def test_block_table_outside_the_pool():
    q, kn, vn, kp, vp, table, lens = make_case([5, 9], page_size=4)
    t = table.clone()
    t[1, 2] = kp.shape[0]
    bad(r"block_table: request 1 page 2 is \d+, outside the pool", block_table=t)
    t = table.clone()
    t[0, 0] = -1
    bad("block_table: request 0 page 0 is -1", block_table=t)


def test_padding_past_used_pages_is_ignored():
    q, kn, vn, kp, vp, table, lens = make_case([5, 9], page_size=4)
    t = table.clone()
    t[0, 2:] = 10_000  # request 0 reads only 2 pages
    torch.testing.assert_close(
        paged_attention(q, kn, vn, kp, vp, t, lens), paged_attention(q, kn, vn, kp, vp, table, lens)
    )


def test_lengths_beyond_the_requests_pages():
    q, kn, vn, kp, vp, table, lens = make_case([5, 9], page_size=4)
    bad(
        r"context_lens: request 1 has length 30, which needs 8 pages of 4, but block_table has 4",
        context_lens=torch.tensor([5, 30]),
    )
    bad("context_lens: expected lengths >= 0", context_lens=torch.tensor([-1, 3]))
    bad(r"context_lens: expected shape \[B=2\]", context_lens=torch.tensor([5]))
    bad("context_lens: expected an integer tensor", context_lens=torch.tensor([5.0, 9.0]))
    bad("context_lens: expected integers", context_lens=[5, True])


def test_mismatched_dtypes_devices_shapes():
    q, kn, vn, kp, vp, table, lens = make_case([5, 9], page_size=4)
    bad("k_pages: expected dtype torch.float64", k_pages=kp.float())
    bad("v_new: expected dtype torch.float64", v_new=vn.float())
    bad("k_pages: expected device", k_pages=kp.to("meta"))
    bad("block_table: expected an int32", block_table=table.float())
    bad(r"block_table: expected shape \[B=2", block_table=table[:1])
    bad(r"k_pages: expected \[num_pages, page_size, Hkv=2, D=8\]", k_pages=kp[:, :, :1], v_pages=vp[:, :, :1])
    bad("v_pages: expected the shape of k_pages", v_pages=vp[:-1])
    bad("q: expected a head count that is a multiple", q=q[:, :3])
    bad("k_new: expected", k_new=kn[:, :, :2], v_new=vn[:, :, :2])
    bad("q: expected rank 4", q=q[0])
    bad("scale: expected a positive finite number", scale=float("nan"))
    bad("backend: expected one of", backend="flash")


@pytest.mark.parametrize("backend", AVAILABLE)
def test_bitwise_independent_of_the_thread_count(backend):
    args = make_case([40, 3, 17, 0, 25], page_size=4, window=4, heads=4, kv_heads=2, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*args, backend=backend)
        torch.set_num_threads(2)
        two = paged_attention(*args, backend=backend)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_registry_reports_why_a_backend_is_absent():
    avail = paged_backends_available()
    assert set(avail) == set(PAGED_BACKENDS) and avail["reference"] is None and avail["composite"] is None
    assert avail["cpp"] is None or "kforcing_kernels._C" in avail["cpp"] or "disabled" in avail["cpp"]
    if avail["cpp"] is not None:
        with pytest.raises(RuntimeError, match="backend 'cpp' is not available"):
            paged_attention(*make_case([3]), backend="cpp")

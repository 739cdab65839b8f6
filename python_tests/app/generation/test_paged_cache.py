"""PagedKVCache: pages on demand from a pool, in-place appends, freeing, and a full pool that changes nothing."""

import pytest
import torch

from kforcing_kernels.app.generation.paged_cache import PagedKVCache, PagePoolFull


def kv(b, n, hkv=2, d=4, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)) for _ in range(layers)]


def read_back(cache, row, layer=0):
    """[Hkv, len, D] of a row, token by token through its pages."""
    pages, n, s = cache.pages_of(row), cache.length(row), cache.page_size
    return torch.stack([cache.k[layer][pages[t // s], t % s] for t in range(n)], 1)


def test_append_writes_each_row_at_its_length_and_allocates_on_demand():
    cache = PagedKVCache(2, 2, 4, num_pages=8, page_size=3)
    a, b = cache.add_row(), cache.add_row()
    assert cache.pages_of(a) == [] and cache.free_pages == 8
    first = kv(2, 5)
    cache.append([a, b], first, [5, 2])
    assert cache.lengths([a, b]).tolist() == [5, 2]
    assert len(cache.pages_of(a)) == 2 and len(cache.pages_of(b)) == 1 and cache.free_pages == 5
    second = kv(2, 4, seed=1)
    cache.append([b, a], second, [4, 1])  # b grows across a page boundary
    assert cache.lengths([a, b]).tolist() == [6, 6]
    torch.testing.assert_close(
        read_back(cache, a), torch.cat([first[0][0][0, :, :5], second[0][0][1, :, :1]], 1), rtol=0, atol=0
    )
    torch.testing.assert_close(
        read_back(cache, b), torch.cat([first[0][0][1, :, :2], second[0][0][0, :, :4]], 1), rtol=0, atol=0
    )
    table = cache.block_table([a, b])
    assert table.dtype == torch.int32 and table.shape == (2, 2)
    assert table[0].tolist() == cache.pages_of(a) and table[1].tolist() == cache.pages_of(b)


def test_free_returns_pages_and_they_are_reused():
    cache = PagedKVCache(1, 1, 2, num_pages=4, page_size=2)
    a = cache.add_row()
    cache.append([a], kv(1, 7, hkv=1, d=2, layers=1), [7])
    assert cache.free_pages == 0
    pages = cache.pages_of(a)
    cache.free(a)
    assert cache.free_pages == 4
    with pytest.raises(ValueError, match="rows: 0 is not a live row"):
        cache.length(a)
    b = cache.add_row()
    cache.append([b], kv(1, 3, hkv=1, d=2, layers=1, seed=2), [3])
    assert set(cache.pages_of(b)) <= set(pages)


def test_full_pool_raises_and_changes_nothing():
    cache = PagedKVCache(2, 2, 4, num_pages=3, page_size=2)
    a, b = cache.add_row(), cache.add_row()
    cache.append([a, b], kv(2, 2), [2, 2])
    k_before = [t.clone() for t in cache.k]
    state = (cache.free_pages, cache.pages_of(a), cache.pages_of(b), cache.lengths([a, b]).tolist())
    with pytest.raises(PagePoolFull, match=r"page pool full: 2 more pages .* 1 of 3 free"):
        cache.append([a, b], kv(2, 2, seed=3), [1, 2])
    assert (cache.free_pages, cache.pages_of(a), cache.pages_of(b), cache.lengths([a, b]).tolist()) == state
    assert all(torch.equal(x, y) for x, y in zip(cache.k, k_before))
    cache.append([a], kv(1, 2, seed=4), [2])  # what does fit still works
    assert cache.length(a) == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size: expected a divisor of capacity=100, got 16"):
        PagedKVCache(1, 1, 2, capacity=100, page_size=16)
    assert PagedKVCache(1, 1, 2, capacity=96, page_size=16).num_pages == 6
    with pytest.raises(ValueError, match="num_pages: give exactly one"):
        PagedKVCache(1, 1, 2, page_size=16)
    with pytest.raises(ValueError, match="page_size: expected a positive int"):
        PagedKVCache(1, 1, 2, num_pages=4, page_size=0)
    cache = PagedKVCache(2, 2, 4, num_pages=4, page_size=2)
    a = cache.add_row()
    with pytest.raises(ValueError, match="counts: expected 1 non-negative"):
        cache.append([a], kv(1, 2), [-1])
    with pytest.raises(ValueError, match="kvs: expected 2 layers"):
        cache.append([a], kv(1, 2, layers=1), [1])
    with pytest.raises(ValueError, match="kvs: expected"):
        cache.append([a], kv(1, 2, hkv=3), [1])
    with pytest.raises(ValueError, match="rows: 7 is not a live row"):
        cache.block_table([7])

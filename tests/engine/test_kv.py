"""Page pool and KV cache behaviour."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.kv import KVCache, OutOfPages, PagePool


def test_allocate_distinct_pages_until_exhausted():
    pool = PagePool(10)
    assert pool.num_free == 10 and pool.num_used == 0
    a = pool.allocate(4)
    b = pool.allocate(6)
    assert sorted(a + b) == list(range(10))
    assert a == [0, 1, 2, 3]  # deterministic order from a fresh pool
    assert pool.num_free == 0 and pool.num_used == 10
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_out_of_pages_allocates_nothing():
    pool = PagePool(5)
    held = pool.allocate(3)
    with pytest.raises(OutOfPages) as e:
        pool.allocate(3)
    assert e.value.requested == 3 and e.value.free == 2
    assert pool.num_free == 2
    assert sorted(pool.allocate(2) + held) == list(range(5))
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_free_returns_pages_for_reuse():
    pool = PagePool(4)
    a = pool.allocate(4)
    pool.free(a[1:3])
    assert pool.num_free == 2
    again = pool.allocate(2)
    assert sorted(again) == sorted(a[1:3])
    pool.check_integrity()


@pytest.mark.parametrize("bad", [[2], [7], [-1], [0, 0]])
def test_free_rejects_double_unknown_and_repeated_pages(bad):
    pool = PagePool(5)
    held = pool.allocate(2)  # pages 0, 1; page 2 is free
    with pytest.raises(ValueError):
        pool.free(bad)
    # nothing was freed by the failed call, even the valid part of it
    assert pool.num_free == 3
    pool.free(held)
    with pytest.raises(ValueError, match="double free"):
        pool.free([held[0]])
    pool.check_integrity()


def test_free_validates_whole_list_before_freeing():
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([0, 2])  # 0 allocated, 2 not
    assert pool.num_free == 1
    pool.free([0, 1])
    assert pool.num_free == 3


def test_random_alloc_free_against_a_set_model():
    rng = np.random.default_rng(7)
    pool = PagePool(64)
    owned: list[list[int]] = []
    used: set[int] = set()
    for _ in range(500):
        if owned and rng.random() < 0.45:
            pages = owned.pop(int(rng.integers(len(owned))))
            pool.free(pages)
            used -= set(pages)
        else:
            n = int(rng.integers(0, 9))
            if n > 64 - len(used):
                with pytest.raises(OutOfPages):
                    pool.allocate(n)
                continue
            pages = pool.allocate(n)
            assert not used & set(pages) and len(set(pages)) == n
            assert all(0 <= p < 64 for p in pages)
            used |= set(pages)
            owned.append(pages)
        assert pool.num_free == 64 - len(used)
        pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool = PagePool(6)
    pool.allocate(2)
    pool._free.append(pool._free[-1])  # a page listed twice
    with pytest.raises(RuntimeError, match="twice"):
        pool.check_integrity()
    pool = PagePool(6)
    pages = pool.allocate(2)
    pool._free.append(pages[0])  # free and allocated at once
    with pytest.raises(RuntimeError, match="both free and allocated"):
        pool.check_integrity()
    pool = PagePool(6)
    pool._free.pop()  # a page lost: neither free nor allocated
    with pytest.raises(RuntimeError, match="neither"):
        pool.check_integrity()


def test_kv_cache_layout_and_size():
    kv = KVCache(num_layers=3, num_pages=5, page_size=16, nkv=2, hd=8)
    assert len(kv.k) == len(kv.v) == 3
    for arr in kv.k + kv.v:
        assert arr.shape == (5, 16, 2, 8) and arr.dtype == np.float32
        assert not arr.any()
    # layers are independent buffers
    kv.k[0][1, 2] = 1.0
    assert not kv.k[1].any() and not kv.v[0].any()
    assert kv.nbytes == sum(a.nbytes for a in kv.k + kv.v) == 3 * 2 * 5 * 16 * 2 * 8 * 4
    assert kv.bytes_per_token == 3 * 2 * 2 * 8 * 4


def test_kv_cache_uses_given_allocator():
    calls = []

    def zeros(shape, dtype):
        calls.append((shape, dtype))
        return np.zeros(shape, dtype)

    KVCache(2, 3, 4, 1, 8, zeros=zeros)
    assert calls == [((3, 4, 1, 8), np.float32)] * 4


@pytest.mark.parametrize("args", [(0, 1, 1, 1, 1), (1, 0, 1, 1, 1), (1, 1, 0, 1, 1)])
def test_kv_cache_rejects_empty_dimensions(args):
    with pytest.raises(ValueError):
        KVCache(*args)

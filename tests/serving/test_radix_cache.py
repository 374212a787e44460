"""RadixCache: prefix matching, splitting, locking, LRU eviction and slot accounting."""

import random

import torch

from shardline_runtime.mem_cache.memory_pool import TokenToKVPoolAllocator
from shardline_runtime.mem_cache.radix_cache import RadixCache


def _cache(size=100):
    alloc = TokenToKVPoolAllocator(size)
    return alloc, RadixCache(alloc.free)


def test_match_insert_split():
    alloc, cache = _cache()
    a = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], a) == 0
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == a[:3].tolist() and node.key == [1, 2, 3]
    b = alloc.alloc(4)
    assert cache.insert([1, 2, 7, 8], b) == 2  # caller frees b[:2]
    alloc.free(b[:2])
    assert cache.match_prefix([1, 2, 7, 8, 9])[0].tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.evictable_size() == 7
    assert alloc.available_size() + cache.total_size() == 100


def test_locked_nodes_survive_eviction_and_lru_order():
    alloc, cache = _cache()
    old, new = alloc.alloc(3), alloc.alloc(3)
    cache.insert([1, 2, 3], old)
    cache.insert([4, 5, 6], new)
    cache.match_prefix([4, 5, 6])  # touch: [1,2,3] is now least recently used
    assert cache.evict(1) == 3
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    _, node = cache.match_prefix([4, 5, 6])
    cache.inc_lock_ref(node)
    assert cache.evict(10) == 0 and cache.protected_size() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 3 and alloc.available_size() == 100


def test_reset_frees_everything():
    alloc, cache = _cache()
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.reset()
    assert alloc.available_size() == 100 and cache.total_size() == 0


def test_random_workload_conserves_slots():
    rng = random.Random(0)
    alloc, cache = _cache(400)
    for _ in range(300):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        slots, node = cache.match_prefix(key)
        cache.inc_lock_ref(node)
        need = len(key) - len(slots)
        if alloc.available_size() < need:
            cache.evict(need)
        fresh = alloc.alloc(need)
        assert fresh is not None
        full = torch.cat([slots, fresh])
        n = cache.insert(key, full)
        alloc.free(full[len(slots):n])
        cache.dec_lock_ref(node)
        assert alloc.available_size() + cache.total_size() == 400
        assert cache.match_prefix(key)[0].numel() == len(key)


def test_disabled_cache_never_matches():
    alloc = TokenToKVPoolAllocator(10)
    cache = RadixCache(alloc.free, disable=True)
    s = alloc.alloc(3)
    assert cache.insert([1, 2, 3], s) == 3  # caller frees all
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0

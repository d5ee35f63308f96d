"""Property tests: random allocate / append / fork / free / evict sequences keep the
block pool and the KV cache manager consistent."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrag.core.block_hash import extend_block_hashes
from pagedrag.core.block_pool import BlockPool
from pagedrag.core.kv_cache_manager import KVCacheManager
from pagedrag.core.scheduler import Scheduler
from pagedrag.core.request import Request
from pagedrag.sampling_params import SamplingParams

BLOCK = 4


def check_manager(kv: KVCacheManager) -> None:
    pool = kv.pool
    pool.check_invariants()
    assert pool.num_free + pool.num_used == pool.num_blocks
    held = {}
    for table in kv.tables.values():
        for block in table:
            held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_count == held.get(block.block_id, 0), block


def test_lru_hands_out_oldest_freed_first_and_evicts_hash():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"h-a", [1, 2])
    pool.cache(b, b"h-b", [3, 4])
    pool.free([b, a])  # tail first
    assert pool.lookup(b"h-a", [1, 2]) is a
    assert pool.lookup(b"h-a", [1, 3]) is None  # hit confirmed against tokens
    assert pool.allocate(1) == [b]  # the least recently freed cached block goes first
    assert pool.lookup(b"h-a", [1, 2]) is a  # still findable until handed out
    pool.allocate(1)
    assert pool.lookup(b"h-a", [1, 2]) is None


def test_blocks_that_hold_no_cached_hash_are_reused_before_any_cached_block_is_evicted():
    """A block emptied without a hash (a rejected draft's slots, a partial last block) is taken
    first, however recently it was freed: cached blocks stay findable."""
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"h-a", [1, 2])
    pool.free([a])
    pool.free([c, b])
    assert sorted(block.block_id for block in pool.allocate(2)) == sorted([b.block_id, c.block_id])
    assert pool.lookup(b"h-a", [1, 2]) is a and pool.num_evictions == 0
    pool.check_invariants()


def test_blocks_cached_evict_early_go_after_hashless_and_before_other_cached_blocks():
    """Chunk reuse's blended blocks are cached ``evict_early``: a free one is evicted before
    any other cached block however recently it was freed, after every block with no hash; a
    prefix hit takes it back, and a reset of the prefix cache makes it a hashless block."""
    pool = BlockPool(5)
    a, b, c, d, e = pool.allocate(5)
    pool.cache(a, b"h-a", [1])
    pool.cache(b, b"h-b", [2], evict_early=True)
    pool.cache(c, b"h-c", [3], evict_early=True)
    pool.free([a, b, c, d])  # d holds no hash
    pool.check_invariants()
    assert pool.allocate(2) == [d, b] and pool.lookup(b"h-b", [2]) is None
    assert pool.lookup(b"h-c", [3]) is c and pool.lookup(b"h-a", [1]) is a
    pool.touch([c])  # a hit on it
    pool.free([c])
    pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.allocate(1) == [c] and not c.evict_early and pool.num_free == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "cache", "free", "touch", "reset"]),
                          st.integers(0, 7), st.booleans()), max_size=40))
def test_random_pool_operations_with_evict_early_keep_invariants(ops):
    pool = BlockPool(8)
    held: list = []
    for name, index, early in ops:
        if name == "allocate" and pool.num_free:
            held += pool.allocate(1 + index % pool.num_free)
        elif name == "cache" and held:
            block = held[index % len(held)]
            pool.cache(block, bytes([index, len(held)]), [index], evict_early=early)
        elif name == "free" and held:
            pool.free([held.pop(index % len(held))])
        elif name == "touch":
            cached = [block for block in pool.blocks if block.block_hash is not None]
            if cached:
                block = cached[index % len(cached)]
                pool.touch([block])
                held.append(block)
        elif name == "reset":
            pool.reset_prefix_cache()
        pool.check_invariants()
        assert pool.num_free + len({block.block_id for block in held}) == pool.num_blocks


def test_hash_chain_depends_on_salt_and_parent():
    tokens = list(range(8))
    plain, salted, other = [], [], []
    extend_block_hashes(plain, tokens, BLOCK)
    extend_block_hashes(salted, tokens, BLOCK, cache_salt="tenant-a")
    extend_block_hashes(other, [9] + tokens[1:], BLOCK)
    assert len(plain) == 2 and plain[0] != salted[0] and plain[1] != salted[1]
    assert plain[1] != other[1]  # same tokens in block 1, different parent


operation = st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(0, 3), min_size=1, max_size=14)),
    st.tuples(st.just("append"), st.integers(0, 20), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 20)),
    st.tuples(st.just("free"), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=40), st.integers(4, 24), st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, caching):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    live: list[Request] = []
    counter = 0
    for op in ops:
        if op[0] == "new":
            counter += 1
            request = Request(f"r{counter}", op[1], SamplingParams(), BLOCK)
            hits = kv.computed_blocks(request)
            num_hit = len(hits) * BLOCK
            assert num_hit < request.num_tokens  # the last prompt token is always computed
            if kv.allocate_slots(request, request.num_tokens - num_hit, hits):
                request.num_computed_tokens = request.num_tokens
                kv.cache_blocks(request)
                live.append(request)
        elif op[0] == "append" and live:
            request = live[op[1] % len(live)]
            for _ in range(op[2]):
                if not kv.allocate_slots(request, 1):
                    break
                request.append_token(request.num_tokens % 4)
                request.num_computed_tokens += 1
                kv.cache_blocks(request)
        elif op[0] == "fork" and live:
            parent = live[op[1] % len(live)]
            counter += 1
            child = parent.fork(f"r{counter}", 1, None)
            kv.fork(parent, child)
            live.append(child)
        elif op[0] == "free" and live:
            kv.free(live.pop(op[1] % len(live)))
        kv.take_step_transfers()
        check_manager(kv)
        for block_hash, block in list(kv.pool._cached.items()):
            assert kv.pool.lookup(block_hash, block.token_ids) is block
    for request in live:
        kv.free(request)
    check_manager(kv)
    assert kv.pool.num_free == num_blocks


def test_copy_on_write_copies_shared_partial_block():
    kv = KVCacheManager(8, BLOCK)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), BLOCK)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c", 1, None)
    kv.fork(parent, child)
    shared_tail = kv.tables["p"][1]
    assert shared_tail.ref_count == 2
    assert kv.allocate_slots(parent, 1)
    copies, _ = kv.take_step_transfers()
    assert copies == [(shared_tail.block_id, kv.tables["p"][1].block_id)]
    assert kv.tables["p"][0] is kv.tables["c"][0]  # the full block stays shared
    assert shared_tail.ref_count == 1
    assert kv.allocate_slots(child, 1)  # now the only holder: writes in place
    assert kv.take_step_transfers()[0] == []


def test_prefix_lookup_stops_at_first_miss_and_leaves_last_token():
    kv = KVCacheManager(16, BLOCK)
    first = Request("a", list(range(12)), SamplingParams(), BLOCK)
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_blocks(first)
    kv.free(first)
    same = Request("b", list(range(12)), SamplingParams(), BLOCK)
    assert len(kv.computed_blocks(same)) == 2  # 3 full blocks, but the last token is computed
    longer = Request("c", list(range(12)) + [7], SamplingParams(), BLOCK)
    assert len(kv.computed_blocks(longer)) == 3
    diverged = Request("d", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 5], SamplingParams(), BLOCK)
    assert len(kv.computed_blocks(diverged)) == 1


def test_update_after_step_caches_full_blocks_and_fails_requests_alone():
    """The scheduler's post-step bookkeeping: every scheduled request advances by its new
    tokens and caches its full blocks; an error in one request's caching goes to on_error
    and leaves the others' updates whole. ``completing`` is fixed when scheduled."""
    kv = KVCacheManager(16, BLOCK)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    good = Request("good", list(range(9)), SamplingParams(), BLOCK)
    bad = Request("bad", list(range(9)), SamplingParams(), BLOCK, cache_salt="poison")
    scheduler.add(good)
    scheduler.add(bad)
    step = scheduler.schedule()
    assert [(item.request, item.block_ids) for item in step.scheduled] == [
        (good, kv.block_ids(good)), (bad, kv.block_ids(bad))]
    real_cache_blocks = kv.cache_blocks

    def cache_blocks(request):
        if request is bad:
            raise RuntimeError("poisoned")
        real_cache_blocks(request)

    kv.cache_blocks = cache_blocks
    failed = []
    scheduler.update_after_step(step, lambda request, error: failed.append((request, str(error))))
    assert failed == [(bad, "poisoned")]
    assert good.num_computed_tokens == bad.num_computed_tokens == 9
    assert [item.request for item in step.completing] == [good, bad]
    assert kv.cached_prefix(good) == {"pool": 8}
    assert kv.cached_prefix(bad) == {"pool": 0}

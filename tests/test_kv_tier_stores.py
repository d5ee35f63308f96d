"""The KV tiers' stores on their own: the disk file format refuses anything but an intact file
of the key asked for, a writer killed with SIGKILL leaves nothing partial visible, processes
sharing one directory under load lose nothing and serve nothing wrong, and the size budget
holds across processes; the host store's LRU; the keyspace's weight fingerprint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedrag.kv_tiers import disk_format
from pagedrag.kv_tiers.disk_store import DiskStore
from pagedrag.kv_tiers.host_store import HostStore
from pagedrag.kv_tiers.keyspace import KeySpace, block_key, weights_fingerprint
from pagedrag.kv_tiers.store import StoredBlock

KEYSPACE = "ab" * 32
SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv heads, head_dim


def _block(seed: int) -> StoredBlock:
    generator = torch.Generator().manual_seed(seed)
    return StoredBlock(tuple(range(seed, seed + 4)), torch.randn(SHAPE, generator=generator))


def _key(seed: int) -> bytes:
    return block_key(KEYSPACE, seed.to_bytes(32, "little"))


def test_format_round_trip_and_every_refusal():
    block = _block(1)
    data = disk_format.encode(_key(1), KEYSPACE, block)
    back = disk_format.decode(data, _key(1), KEYSPACE)
    assert back.token_ids == block.token_ids and torch.equal(back.kv, block.kv)
    assert disk_format.decode(data, _key(2), KEYSPACE) is None  # another key
    assert disk_format.decode(data, _key(1), "cd" * 32) is None  # another keyspace
    assert disk_format.decode(data[:-1], _key(1), KEYSPACE) is None  # truncated
    assert disk_format.decode(b"", _key(1), KEYSPACE) is None


@settings(max_examples=60, deadline=None)
@given(position=st.integers(min_value=0), value=st.integers(min_value=1, max_value=255))
def test_any_changed_byte_is_refused(position, value):
    data = bytearray(disk_format.encode(_key(3), KEYSPACE, _block(3)))
    data[position % len(data)] ^= value
    assert disk_format.decode(bytes(data), _key(3), KEYSPACE) is None


def test_bfloat16_blocks_round_trip():
    block = StoredBlock((1, 2), torch.randn(SHAPE).to(torch.bfloat16))
    back = disk_format.decode(disk_format.encode(_key(4), KEYSPACE, block), _key(4), KEYSPACE)
    assert back.kv.dtype == torch.bfloat16 and torch.equal(back.kv, block.kv)


def test_disk_store_put_get_and_a_restart_finds_the_blocks(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    store.put(_key(5), _block(5))
    again = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    assert again.used_bytes == store.used_bytes > 0
    assert torch.equal(again.get(_key(5)).kv, _block(5).kv) and again.get(_key(6)) is None


def test_the_size_budget_evicts_least_recently_used_first(tmp_path):
    budget = sum(len(disk_format.encode(_key(seed), KEYSPACE, _block(seed))) for seed in range(10))
    store = DiskStore(tmp_path, budget, KEYSPACE)
    for seed in range(10):
        store.put(_key(seed), _block(seed))
        os.utime(store.path_of(_key(seed)), (1000 + seed, 1000 + seed))
    store.get(_key(0))  # a hit makes block 0 the most recently used
    store.put(_key(10), _block(10))
    assert store.used_bytes <= budget
    assert store.contains(_key(0)) and store.contains(_key(10)) and not store.contains(_key(1))


_WRITER = """
import sys, torch
from pagedrag.kv_tiers.disk_store import DiskStore
from pagedrag.kv_tiers.keyspace import block_key
from pagedrag.kv_tiers.store import StoredBlock
store = DiskStore(sys.argv[1], int(sys.argv[2]), sys.argv[3])
start, count = int(sys.argv[4]), int(sys.argv[5])
big = (8, 2, 16, 4, 64)
print("ready", flush=True)
for seed in range(start, start + count):
    g = torch.Generator().manual_seed(seed)
    store.put(block_key(sys.argv[3], seed.to_bytes(32, "little")),
              StoredBlock(tuple(range(seed, seed + 16)), torch.randn(big, generator=g)))
"""


def _writer(tmp_path, start: int, count: int, budget: int = 1 << 30) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(budget), KEYSPACE,
                             str(start), str(count)], stdout=subprocess.PIPE, text=True)


def _check_every_file(tmp_path) -> int:
    """Every visible block file decodes to exactly what its writer wrote; returns their number."""
    store = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    files = list(store.directory.rglob("*.kv"))
    for file in files:
        decoded = disk_format.decode(file.read_bytes(), bytes.fromhex(file.stem), KEYSPACE)
        assert decoded is not None, f"{file.name} is visible but not whole"
        seed = decoded.token_ids[0]
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(decoded.kv, torch.randn(decoded.kv.shape, generator=g))
    return len(files)


def test_a_writer_killed_mid_write_leaves_nothing_partial_visible(tmp_path):
    writer = _writer(tmp_path, 0, 100_000)
    assert writer.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while _count_files(tmp_path) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=60)
    assert _check_every_file(tmp_path) >= 20


def _count_files(tmp_path) -> int:
    return sum(1 for _ in tmp_path.rglob("*.kv"))


def test_processes_sharing_a_directory_lose_nothing_and_serve_nothing_wrong(tmp_path):
    """Three writers of overlapping keys and a reader in this process, all at once."""
    writers = [_writer(tmp_path, start, 60) for start in (0, 30, 60)]
    reader = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    served = 0
    while any(w.poll() is None for w in writers):
        for seed in range(0, 120, 7):
            block = reader.get(block_key(KEYSPACE, seed.to_bytes(32, "little")))
            if block is not None:
                g = torch.Generator().manual_seed(seed)
                assert block.token_ids[0] == seed and torch.equal(block.kv, torch.randn(block.kv.shape, generator=g))
                served += 1
    assert all(w.wait(timeout=600) == 0 for w in writers)
    assert _check_every_file(tmp_path) == 120  # every key once, none lost


def test_the_budget_holds_across_processes(tmp_path):
    one = len(disk_format.encode(_key(0), KEYSPACE, StoredBlock(tuple(range(16)), torch.zeros(8, 2, 16, 4, 64))))
    budget = 25 * one
    writers = [_writer(tmp_path, start, 40, budget) for start in (0, 1000)]
    assert all(w.wait(timeout=600) == 0 for w in writers)
    assert DiskStore(tmp_path, budget, KEYSPACE).used_bytes <= budget


def test_host_store_keeps_its_capacity_least_recently_used_first():
    size = _block(0).num_bytes
    store = HostStore(3 * size)
    for seed in range(3):
        store.put(_key(seed), _block(seed))
    store.get(_key(0))
    store.put(_key(3), _block(3))
    assert store.used_bytes == 3 * size
    assert [store.contains(_key(s)) for s in range(4)] == [True, False, True, True]


def test_weights_fingerprint_sees_one_changed_element_and_not_the_thread_count():
    model = torch.nn.Linear(64, 32)
    before = weights_fingerprint(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert weights_fingerprint(model) == before
    finally:
        torch.set_num_threads(threads)
    original = model.weight[5, 7].item()
    with torch.no_grad():
        model.weight[5, 7] = original + 1e-3
    assert weights_fingerprint(model) != before
    with torch.no_grad():
        model.weight[5, 7] = original
    assert weights_fingerprint(model) == before


def test_keyspace_changes_with_every_field():
    base = KeySpace("w", "torch.float32", "cpu", 16, 2, 2, 16)
    variants = [KeySpace("v", "torch.float32", "cpu", 16, 2, 2, 16), KeySpace("w", "torch.bfloat16", "cpu", 16, 2, 2, 16),
                KeySpace("w", "torch.float32", "cuda", 16, 2, 2, 16), KeySpace("w", "torch.float32", "cpu", 32, 2, 2, 16),
                KeySpace("w", "torch.float32", "cpu", 16, 2, 2, 16, tp_rank=1, tp_size=2),
                KeySpace("w", "torch.float32", "cpu", 16, 2, 2, 16, format_version=2)]
    assert len({base.fingerprint, *(v.fingerprint for v in variants)}) == 1 + len(variants)


def test_the_cost_model_turns_a_slow_tier_away_and_shrugs_off_a_compile_step():
    from pagedrag.kv_tiers.cost_model import TierCostModel

    cost = TierCostModel(block_size=16)
    assert cost.worth_loading("disk")  # nothing measured yet
    cost.observe_prefill(1000, 30.0)  # a first step that compiled kernels: 30 ms a token
    for _ in range(4):
        cost.observe_prefill(1000, 0.1)  # then 0.1 ms a token: a block computes in 1.6 ms
    cost.observe_load("disk", 0.005)
    cost.observe_load("host", 0.0002)
    assert not cost.worth_loading("disk") and cost.worth_loading("host")


def test_reads_queued_behind_a_slow_first_read_of_a_tier_become_misses(tmp_path):
    """Lookups find the blocks before any read is timed; once the first reads measure the tier
    slower than computing, the reads still queued are misses and never touch the store."""
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.tiers import KVTiers

    store = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    cost = TierCostModel(block_size=4)
    cost.observe_prefill(1000, 0.001)  # a block computes in 4 us
    tiers = KVTiers([store], KEYSPACE, cost)
    hashes = [seed.to_bytes(32, "little") for seed in range(12)]
    for seed, block_hash in enumerate(hashes):
        store.put(tiers.key(block_hash), _block(seed))
    gets = []
    real_get = store.get
    store.get = lambda key: (gets.append(key), time.sleep(0.05), real_get(key))[2]  # 50 ms a read
    results = [tiers.read(block_hash, _block(seed).token_ids) for seed, block_hash in enumerate(hashes)]
    found = [future.result()[0] is not None for future in results]
    tiers.close()
    assert found[0] and not found[-1]  # the first reads are served (and measured), the last is a miss
    assert len(gets) <= 5  # four measured reads (one more on the other reader thread) at most

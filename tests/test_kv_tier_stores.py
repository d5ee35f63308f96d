"""The KV tiers' stores on their own: the disk file format refuses anything but an intact file
of the key asked for, a writer killed with SIGKILL leaves nothing partial visible, processes
sharing one directory under load lose nothing and serve nothing wrong, and the size budget
holds across processes; the host store's LRU; the keyspace's weight fingerprint."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedrag.kv_tiers import disk_format
from pagedrag.kv_tiers.disk_store import _COUNT_FILE, DiskStore
from pagedrag.kv_tiers.host_store import HostStore
from pagedrag.kv_tiers.keyspace import KeySpace, block_key, config_fingerprint, mixed_checksum, weights_fingerprint
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


def test_room_is_made_before_a_block_is_published(tmp_path, monkeypatch):
    """Never over budget, not even while a put holds the lock: the directory's block files
    and the one being published fit it at the moment it gets its name."""
    from pagedrag.kv_tiers import disk_store
    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    store = DiskStore(tmp_path, 4 * one, KEYSPACE)
    publishing, real_link = [], os.link

    def link(source, target):
        publishing.append(sum(path.stat().st_size for path in tmp_path.rglob("*.kv")) + os.path.getsize(source))
        return real_link(source, target)

    monkeypatch.setattr(disk_store.os, "link", link)
    for seed in range(12):
        store.put(_key(seed), _block(seed))
    assert len(publishing) == 12 and max(publishing) <= 4 * one
    assert store.contains(_key(11)) and not store.contains(_key(0))


def test_a_block_over_the_whole_budget_is_not_written_and_evicts_nothing(tmp_path):
    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    DiskStore(tmp_path, 10 * one, KEYSPACE).put(_key(0), _block(0))  # another engine's block
    small = DiskStore(tmp_path, one - 1, "cd" * 32)
    assert not small.put(block_key("cd" * 32, bytes(32)), _block(1))
    assert DiskStore(tmp_path, 10 * one, KEYSPACE).contains(_key(0))


def test_the_budget_covers_every_keyspace_and_old_ones_age_out(tmp_path):
    """Engines of two checkpoints share one directory's budget: the one no engine writes any
    more is evicted first, and the directory never holds more than the budget."""
    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    old, new = DiskStore(tmp_path, 5 * one, KEYSPACE), DiskStore(tmp_path, 5 * one, "cd" * 32)
    for seed in range(5):
        old.put(_key(seed), _block(seed))
        os.utime(old.path_of(_key(seed)), (1000 + seed, 1000 + seed))
    for seed in range(5):
        new.put(block_key("cd" * 32, seed.to_bytes(32, "little")), _block(seed))
        assert sum(path.stat().st_size for path in tmp_path.rglob("*.kv")) <= 5 * one
    assert not any(old.contains(_key(seed)) for seed in range(5))
    assert all(new.contains(block_key("cd" * 32, seed.to_bytes(32, "little"))) for seed in range(2, 5))


def test_a_directory_at_a_blocks_path_is_a_miss_that_is_removed(tmp_path):
    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    store = DiskStore(tmp_path, 3 * one, KEYSPACE)
    planted = store.path_of(_key(1))
    (planted / "inside").mkdir(parents=True)
    assert store.contains(_key(1)) and store.get(_key(1)) is None
    assert store.num_dropped == 1 and not planted.exists()
    (planted / "inside").mkdir(parents=True)  # planted again: eviction passes it by
    for seed in range(2, 8):
        store.put(_key(seed), _block(seed))
    assert store.enabled and store.used_bytes <= 3 * one and store.get(_key(7)) is not None


def test_files_the_tier_did_not_write_are_never_counted_evicted_nor_swept(tmp_path):
    """A kv_disk_path that holds other data keeps every file that is not named as the tier names
    its own, however old, and whatever it ends in."""
    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    foreign = [tmp_path / "backups" / "2024" / "weights.kv", tmp_path / KEYSPACE[:16] / "ab" / "notes.kv",
               tmp_path / KEYSPACE[:16] / "zz" / f"{_key(1).hex()}.kv",
               tmp_path / "backups" / "2024" / f"x.kv{'.tmp-'}{'0' * 32}"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"user data" * 1000)
        os.utime(path, (1, 1))  # older than any block
    store = DiskStore(tmp_path, 3 * one, KEYSPACE)
    assert store.used_bytes == 0
    for seed in range(8):
        store.put(_key(seed), _block(seed))
    assert all(path.read_bytes() == b"user data" * 1000 for path in foreign)
    assert store.used_bytes <= 3 * one


def test_a_symlink_or_a_file_in_a_directorys_place_is_dropped_and_the_tier_stays_on(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    looping = store.path_of(_key(1))
    looping.parent.mkdir(parents=True)
    os.symlink(looping.name, looping)  # a symlink to itself: ELOOP
    in_the_way = store.path_of(_key(2)).parent
    if in_the_way == looping.parent:
        pytest.skip("the two keys share a directory")
    in_the_way.write_bytes(b"not a directory")
    again = DiskStore(tmp_path, 1 << 20, KEYSPACE)  # opening (a recount) passes both by
    assert again.enabled and again.get(_key(1)) is None and not os.path.lexists(looping)
    assert again.put(_key(2), _block(2)) and torch.equal(again.get(_key(2)).kv, _block(2).kv)
    assert again.enabled and again.num_dropped == 2


def test_a_negative_count_is_recounted_and_a_put_says_whether_it_wrote(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    assert store.put(_key(5), _block(5)) and not store.put(_key(5), _block(5))
    (tmp_path / _COUNT_FILE).write_bytes(b"-9999999999\n")
    assert store.put(_key(6), _block(6)) and store.used_bytes == _block_bytes_and_count(tmp_path)[1]


def test_a_block_the_pool_keeps_serving_stays_in_the_tiers_longest(tmp_path):
    """The tiers write each block once (write-through); a block that keeps hitting in the pool is
    refreshed in their LRU order (KVTiers.refresh), so it is not the first to go."""
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.tiers import KVTiers

    one = len(disk_format.encode(_key(0), KEYSPACE, _block(0)))
    host = HostStore(3 * _block(0).num_bytes, SHAPE, torch.float32)
    disk = DiskStore(tmp_path, 3 * one, KEYSPACE)
    tiers = KVTiers([disk, host], KEYSPACE, TierCostModel(4))
    hashes = [seed.to_bytes(32, "little") for seed in range(6)]
    for seed in range(3):
        tiers.write([(hashes[seed], _block(seed).token_ids, b"")], _block(seed).kv.unsqueeze(0), None)
        tiers.written().result()
        os.utime(disk.path_of(tiers.key(hashes[seed])), (1000 + seed, 1000 + seed))
    tiers.refresh([hashes[0]])  # block 0 hit in the pool
    tiers.refresh([hashes[0]])  # again at once: not touched twice
    for seed in range(3, 5):
        tiers.write([(hashes[seed], _block(seed).token_ids, b"")], _block(seed).kv.unsqueeze(0), None)
    tiers.written().result()
    assert [store.contains(tiers.key(hashes[0])) for store in (host, disk)] == [True, True]
    assert not any(store.contains(tiers.key(hashes[1])) for store in (host, disk))
    assert tiers.stats.bytes["host_to_disk"] == 5 * _block(0).num_bytes  # each block written once
    tiers.close()


_WRITER = """
import sys, torch
from pagedrag.kv_tiers.disk_store import _COUNT_FILE, DiskStore
from pagedrag.kv_tiers.keyspace import block_key
from pagedrag.kv_tiers.store import StoredBlock
store = DiskStore(sys.argv[1], int(sys.argv[2]), sys.argv[3])
start, count = int(sys.argv[4]), int(sys.argv[5])
big = (8, 2, 16, 4, 64)
print("ready", flush=True)
sys.stdin.readline()  # go
for seed in range(start, start + count):
    g = torch.Generator().manual_seed(seed)
    store.put(block_key(sys.argv[3], seed.to_bytes(32, "little")),
              StoredBlock(tuple(range(seed, seed + 16)), torch.randn(big, generator=g)))
"""


def _writer(tmp_path, start: int, count: int, budget: int = 1 << 30) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(budget), KEYSPACE,
                             str(start), str(count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _go(*writers: subprocess.Popen) -> None:
    """Start writers together once every one has opened its store (imports take seconds)."""
    assert all(w.stdout.readline().strip() == "ready" for w in writers)
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()


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
    _go(writer)
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
    _go(*writers)
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


def _block_bytes_and_count(tmp_path) -> tuple[int, int]:
    """Under the directory's lock (no put midway): its block files' bytes, and its shared count."""
    with open(tmp_path / _COUNT_FILE, "rb") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        return sum(path.stat().st_size for path in tmp_path.rglob("*.kv")), int(file.read())


def test_the_budget_holds_across_processes(tmp_path):
    """Four writers under one budget, two pairs racing on the same keys: whenever no put is
    midway, and after each writer exits, the block files fit the budget and the shared count is
    exactly their bytes (a raced block counted once); a restart finds the same."""
    one = len(disk_format.encode(_key(0), KEYSPACE, StoredBlock(tuple(range(16)), torch.zeros(8, 2, 16, 4, 64))))
    budget = 25 * one
    writers = [_writer(tmp_path, start, 40, budget) for start in (0, 0, 1000, 1000)]
    _go(*writers)
    while writers:
        time.sleep(0.02)
        exited = [w for w in writers if w.poll() is not None]
        used, count = _block_bytes_and_count(tmp_path)
        assert used == count <= budget
        assert all(w.returncode == 0 for w in exited)
        writers = [w for w in writers if w not in exited]
    assert used > 0.9 * budget - one  # evictions stopped at the low-water mark
    assert DiskStore(tmp_path, budget, KEYSPACE).used_bytes == used


def test_two_writers_of_one_key_count_it_once(tmp_path, monkeypatch):
    """The second writer finds no file when it looks, but the first publishes while it encodes."""
    first, second = DiskStore(tmp_path, 1 << 20, KEYSPACE), DiskStore(tmp_path, 1 << 20, KEYSPACE)
    encode = disk_format.encode

    def encode_while_the_first_publishes(key, keyspace, block):
        monkeypatch.setattr(disk_format, "encode", encode)
        first.put(key, block)
        return encode(key, keyspace, block)

    monkeypatch.setattr(disk_format, "encode", encode_while_the_first_publishes)
    second.put(_key(9), _block(9))
    size = first.path_of(_key(9)).stat().st_size
    assert first.used_bytes == second.used_bytes == _block_bytes_and_count(tmp_path)[1] == size
    names = {path.name for path in tmp_path.rglob("*")}
    assert names == {_COUNT_FILE, KEYSPACE[:16], _key(9).hex()[:2], f"{_key(9).hex()}.kv"}  # no temporary left


def test_a_restart_recounts_a_count_gone_wrong(tmp_path):
    """A count off by a killed writer's block, or damaged, is put right when a store opens."""
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    store.put(_key(5), _block(5))
    for wrong in (b"00000000000000000001\n", b"garbage"):
        (tmp_path / _COUNT_FILE).write_bytes(wrong)
        assert DiskStore(tmp_path, 1 << 20, KEYSPACE).used_bytes == store.used_bytes > 0
    assert _block_bytes_and_count(tmp_path)[1] == store.used_bytes


def test_a_count_file_that_cannot_be_opened_turns_the_tier_off_once(tmp_path, caplog):
    (tmp_path / _COUNT_FILE).mkdir(parents=True)  # opening it fails (EISDIR)
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE)
    store.put(_key(5), _block(5))
    assert not store.enabled and store.get(_key(5)) is None and not store.contains(_key(5))
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1


def test_host_store_keeps_its_capacity_least_recently_used_first():
    size = _block(0).num_bytes
    store = HostStore(3 * size, SHAPE, torch.float32)
    for seed in range(3):
        store.put(_key(seed), _block(seed))
    store.get(_key(0))
    store.put(_key(3), _block(3))
    assert store.used_bytes == 3 * size
    assert [store.contains(_key(s)) for s in range(4)] == [True, False, True, True]


def test_blocks_put_one_after_another_cross_to_the_pool_as_one_copy():
    from pagedrag.kernels import reference
    from pagedrag.worker.kv_cache import CacheShape, KVCacheTensors
    from pagedrag.worker.transfer import adjacent_runs

    store = HostStore(8 * _block(0).num_bytes, SHAPE, torch.float32)
    blocks = {seed: _block(seed) for seed in range(5)}
    for seed, block in blocks.items():
        store.put(_key(seed), block)
    in_order = [store.get(_key(seed)).kv for seed in range(5)]
    assert [(first, run.shape[0]) for first, run in adjacent_runs(in_order)] == [(0, 5)]
    shuffled = [store.get(_key(seed)).kv for seed in (3, 4, 0, 1, 2)]
    assert [(first, run.shape[0]) for first, run in adjacent_runs(shuffled)] == [(0, 2), (2, 3)]
    layers, _, block_size, heads, head_dim = SHAPE
    cache = KVCacheTensors(CacheShape(layers, block_size, heads, head_dim, torch.float32), 12, 0,
                           torch.device("cpu"), reference)
    pool_ids = [7, 2, 9, 3, 5]
    cache.load_blocks(list(zip(pool_ids, shuffled)))
    for pool_id, seed in zip(pool_ids, (3, 4, 0, 1, 2)):
        assert torch.equal(cache.device_pool[:, :, pool_id], blocks[seed].kv)
    mixed = [_block(8).kv, store.get(_key(1)).kv, store.get(_key(2)).kv, _block(9).kv]  # blocks read from disk beside host views
    cache.load_blocks(list(zip([0, 1, 4, 6], mixed)))
    assert all(torch.equal(cache.device_pool[:, :, pool_id], kv) for pool_id, kv in zip([0, 1, 4, 6], mixed))


def test_a_block_with_readers_is_not_evicted_while_its_view_lives_nor_until_its_reads_are_done():
    class Event:
        fired = False

        def query(self):
            return self.fired

    store = HostStore(2 * _block(0).num_bytes, SHAPE, torch.float32)
    store.put(_key(0), _block(0))
    store.put(_key(1), _block(1))
    view = store.get(_key(0)).kv  # a load holds it: block 0 has a reader
    store.put(_key(2), _block(2))  # evicts block 1, the least recently used
    store.put(_key(3), _block(3))  # block 0 is now the least recently used, but read: block 2 goes
    assert [store.contains(_key(s)) for s in range(4)] == [True, False, False, True]
    assert torch.equal(view, _block(0).kv)
    del view
    launched = Event()
    store.release_reads(launched)  # the view is gone, but a copy launched before may still read it
    store.put(_key(4), _block(4))
    assert [store.contains(_key(s)) for s in (0, 3, 4)] == [True, False, True]
    launched.fired = True
    store.put(_key(5), _block(5))  # now block 0 has no reader and goes
    assert [store.contains(_key(s)) for s in (0, 4, 5)] == [False, True, True]
    assert torch.equal(store.get(_key(4)).kv, _block(4).kv) and torch.equal(store.get(_key(5)).kv, _block(5).kv)
    assert store.used_bytes == store.capacity_bytes


def test_a_put_that_finds_every_block_read_drops_itself_and_evicts_nothing():
    store = HostStore(2 * _block(0).num_bytes, SHAPE, torch.float32)
    store.put(_key(0), _block(0))
    store.put(_key(1), _block(1))
    views = [store.get(_key(0)).kv, store.get(_key(1)).kv]
    store.put(_key(2), _block(2))
    assert [store.contains(_key(s)) for s in range(3)] == [True, True, False]
    assert all(torch.equal(view, _block(seed).kv) for seed, view in enumerate(views))
    store.put(_key(3), StoredBlock((1, 2), torch.zeros(3)))  # another shape: dropped, counted
    assert not store.contains(_key(3)) and store.num_dropped == 1
    assert not HostStore(_block(0).num_bytes - 1, SHAPE, torch.float32).enabled  # not one block: no tier


def test_a_disk_hit_is_served_from_its_host_memory_copy(tmp_path):
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.tiers import KVTiers

    host = HostStore(1 << 20, SHAPE, torch.float32)
    tiers = KVTiers([DiskStore(tmp_path, 1 << 20, KEYSPACE), host], KEYSPACE, TierCostModel(4))
    block_hash = (7).to_bytes(32, "little")
    tiers.stores[1].put(tiers.key(block_hash), _block(7))  # on disk only
    stored, tier = tiers.read(block_hash, _block(7).token_ids).result()
    assert tier == "disk" and torch.equal(stored.kv, _block(7).kv)
    kept = host.get(tiers.key(block_hash)).kv  # promoted, and what the load reads (pinned on CUDA)
    assert stored.kv.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    tiers.close()


def test_a_host_hit_is_read_at_once_with_one_reader():
    """A host-memory hit comes back done, as one view (one reader: the block is free to go once
    that view's copy ran), not as a view of a view."""
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.tiers import KVTiers

    host = HostStore(_block(0).num_bytes, SHAPE, torch.float32)
    tiers = KVTiers([host], KEYSPACE, TierCostModel(4))
    block_hash = (7).to_bytes(32, "little")
    host.put(tiers.key(block_hash), _block(7))
    read = tiers.read(block_hash, _block(7).token_ids)
    assert read.done()
    stored, tier = read.result()
    assert tier == "host" and torch.equal(stored.kv, _block(7).kv)
    del stored, read
    tiers.release_reads(None)
    host.put(_key(8), _block(8))  # the one slot: block 7 had one reader, now none, and goes
    assert host.contains(_key(8)) and not host.contains(tiers.key(block_hash))
    tiers.close()


def _fingerprints_of_changes(fingerprint, model: torch.nn.Module) -> list:
    """``fingerprint(model)`` before any change, after one changed element, after a change of
    three elements' bits by +d, -2d, +d (which a position-weighted sum would not see), and after
    putting every value back."""
    seen = [fingerprint(model)]
    bits = model.weight.data.view(-1).view(torch.int32)
    original = bits.clone()
    bits[37] += 1
    seen.append(fingerprint(model))
    bits.copy_(original)
    bits[10:13] += torch.tensor([1 << 8, -(2 << 8), 1 << 8], dtype=torch.int32)
    seen.append(fingerprint(model))
    bits.copy_(original)
    seen.append(fingerprint(model))
    return seen


def test_weights_fingerprint_sees_any_changed_element_and_not_the_thread_count():
    model = torch.nn.Linear(64, 32)
    before, one, pattern, restored = _fingerprints_of_changes(weights_fingerprint, model)
    assert len({before, one, pattern}) == 3 and restored == before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert weights_fingerprint(model) == before
    finally:
        torch.set_num_threads(threads)


def test_the_accelerators_checksum_sees_any_changed_element_and_not_the_thread_count():
    """The checksum weights on a GPU enter by (run here on CPU tensors)."""
    model = torch.nn.Linear(64, 32)
    def checksum(module):
        return mixed_checksum(module.weight.data.view(-1).view(torch.int32))
    before, one, pattern, restored = _fingerprints_of_changes(checksum, model)
    assert len({before, one, pattern}) == 3 and restored == before
    big = torch.randint(-(1 << 31), 1 << 31, (3 * (1 << 24) + 5,), dtype=torch.int32)  # several steps
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = mixed_checksum(big)
    finally:
        torch.set_num_threads(threads)
    assert mixed_checksum(big) == single


def test_weights_fingerprint_sees_buffers_kept_out_of_the_state_dict():
    model = torch.nn.Linear(4, 4)
    model.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
    before = weights_fingerprint(model)
    model.inv_freq *= 2
    assert weights_fingerprint(model) != before


def test_config_fingerprint_sees_values_no_weight_holds_and_not_where_it_was_loaded_from():
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6)
    moved = LlamaConfig(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6, name_or_path="/elsewhere")
    assert config_fingerprint(config) == config_fingerprint(moved)
    for changed in (LlamaConfig(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-5),
                    LlamaConfig(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=500.0)):
        assert config_fingerprint(changed) != config_fingerprint(config)


def test_keyspace_changes_with_every_field():
    base = KeySpace("w", "c", "torch.float32", "cpu", 16, 2, 2, 16)
    variants = [KeySpace("v", "c", "torch.float32", "cpu", 16, 2, 2, 16),
                KeySpace("w", "d", "torch.float32", "cpu", 16, 2, 2, 16),
                KeySpace("w", "c", "torch.bfloat16", "cpu", 16, 2, 2, 16),
                KeySpace("w", "c", "torch.float32", "cuda", 16, 2, 2, 16),
                KeySpace("w", "c", "torch.float32", "cpu", 32, 2, 2, 16),
                KeySpace("w", "c", "torch.float32", "cpu", 16, 2, 2, 16, tp_size=2),
                KeySpace("w", "c", "torch.float32", "cpu", 16, 2, 2, 16, format_version=2)]
    assert len({base.fingerprint, *(v.fingerprint for v in variants)}) == 1 + len(variants)


def test_the_cost_model_turns_a_slow_tier_away_and_shrugs_off_a_compile_step():
    from pagedrag.kv_tiers.cost_model import _MIN_LOADS, TierCostModel

    cost = TierCostModel(block_size=16)
    assert cost.slower_tiers() == frozenset()  # nothing measured yet
    cost.observe_prefill(1000, 30.0)  # a first step that compiled kernels: 30 ms a token
    for _ in range(4):
        cost.observe_prefill(1000, 0.1)  # then 0.1 ms a token: a block computes in 1.6 ms
    for _ in range(_MIN_LOADS - 1):
        cost.observe_load("disk", 0.005)
        cost.observe_load("host", 0.0002)
    assert cost.slower_tiers() == frozenset()  # too few loads to call a tier slow: trusted still
    cost.observe_load("disk", 0.005)
    cost.observe_load("host", 0.0002)
    assert cost.slower_tiers() == {"disk"}
    assert cost.snapshot()["disk_load_seconds_per_block"] == 0.005


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_read_block_starts_aligned_whatever_its_header_length(tmp_path, dtype):
    """The payload follows a padded header: the tensor a read gives (and one decoded from bytes)
    starts on a 64-byte boundary, for headers of many lengths."""
    store = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    for num_tokens in range(1, 40, 3):
        block = StoredBlock(tuple(range(1000, 1000 + num_tokens)), torch.randn(SHAPE).to(dtype))
        store.put(_key(num_tokens), block)
        read = store.get(_key(num_tokens))
        decoded = disk_format.decode(store.path_of(_key(num_tokens)).read_bytes(), _key(num_tokens), KEYSPACE)
        for kv in (read.kv, decoded.kv):
            assert kv.data_ptr() % disk_format.ALIGNMENT == 0 and torch.equal(kv, block.kv)


def _layout_1(key: bytes, block: StoredBlock) -> bytes:
    """A file as the first layout wrote it: no padding, the payload right after the header."""
    header = json.dumps({"key": key.hex(), "keyspace": KEYSPACE, "token_ids": list(block.token_ids),
                         "dtype": str(block.kv.dtype), "shape": list(block.kv.shape)}).encode()
    body = b"PDRAGKV1" + struct.pack("<I", len(header)) + header + block.kv.numpy().tobytes()
    return body + hashlib.sha256(body).digest()


def test_a_file_of_the_old_layout_is_a_miss_dropped_like_a_foreign_one(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    path = store.path_of(_key(7))
    path.parent.mkdir(parents=True)
    path.write_bytes(_layout_1(_key(7), _block(7)))
    assert store.contains(_key(7)) and store.get(_key(7)) is None
    assert store.num_dropped == 1 and not path.exists()


def test_a_fifo_a_huge_file_or_a_block_of_another_shape_is_a_miss_dropped(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, KEYSPACE, SHAPE, torch.float32)
    paths = [store.path_of(_key(seed)) for seed in (1, 2, 3)]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(paths[0])  # opening it for reading would wait for a writer for ever
    with open(paths[1], "wb") as file:
        file.truncate(1 << 36)  # sparse: 64 GiB that a read would try to allocate
    flat = StoredBlock(_block(3).token_ids, _block(3).kv.reshape(-1))  # intact, checksum and all
    paths[2].write_bytes(disk_format.encode(_key(3), KEYSPACE, flat))
    for seed in (1, 2, 3):
        assert store.contains(_key(seed)) and store.get(_key(seed)) is None
    assert store.num_dropped == 3 and not any(path.exists() for path in paths)


class _ShortReads:
    """A file whose reads return at most ``chunk`` bytes each, as some filesystems' do."""

    def __init__(self, file, chunk: int, end: int | None = None):
        self.file, self.chunk, self.end, self.position = file, chunk, end, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def fileno(self) -> int:
        return self.file.fileno()

    def readinto(self, buffer) -> int:
        size = self.chunk if self.end is None else min(self.chunk, self.end - self.position)
        count = self.file.readinto(memoryview(buffer)[:size])
        self.position += count
        return count


def test_short_reads_are_read_on_and_only_an_early_end_of_file_is_a_miss(tmp_path, monkeypatch):
    from pagedrag.kv_tiers import disk_store

    store = DiskStore(tmp_path, 1 << 30, KEYSPACE)
    store.put(_key(8), _block(8))

    def short_reads(end=None):
        monkeypatch.setattr(disk_store, "open", lambda *a, **k: _ShortReads(open(*a, **k), 100, end), raising=False)

    short_reads()
    assert torch.equal(store.get(_key(8)).kv, _block(8).kv)
    short_reads(end=500)
    assert store.get(_key(8)) is None  # truncated while read: a miss, and the file is left alone
    assert store.num_dropped == 0 and store.contains(_key(8))


def test_the_switch_interval_is_lowered_while_any_disk_tier_lives(tmp_path):
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.tiers import GIL_SWITCH_INTERVAL_S, KVTiers

    gc.collect()  # engines other tests dropped give it back
    original = sys.getswitchinterval()
    assert original > GIL_SWITCH_INTERVAL_S  # the process's default (5 ms)

    def tiers(*stores):
        return KVTiers(stores, KEYSPACE, TierCostModel(block_size=4))

    host_only = tiers(HostStore(1 << 20, SHAPE, torch.float32))
    assert sys.getswitchinterval() == original  # host reads run on the step loop
    for order in ((0, 1), (1, 0)):
        engines = [tiers(HostStore(1 << 20, SHAPE, torch.float32), DiskStore(tmp_path / str(n), 1 << 20, KEYSPACE)) for n in range(2)]
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S
        first, last = (engines[n] for n in order)
        first.close()
        del first, engines
        gc.collect()  # a closed engine collected gives back nothing more
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S  # the other one still runs
        last.close()
        assert sys.getswitchinterval() == original
    dropped = tiers(DiskStore(tmp_path / "dropped", 1 << 20, KEYSPACE))
    assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S
    del dropped  # never closed
    gc.collect()
    assert sys.getswitchinterval() == original
    host_only.close()
    assert sys.getswitchinterval() == original


def test_tiers_go_nearest_first_and_tier_hits_adds_up_tier_by_tier(tmp_path):
    from pagedrag.kv_tiers.cost_model import TierCostModel
    from pagedrag.kv_tiers.store import TIER_NAMES, tier_hits
    from pagedrag.kv_tiers.tiers import KVTiers

    tiers = KVTiers([DiskStore(tmp_path, 1 << 20, KEYSPACE), HostStore(1 << 20, SHAPE, torch.float32)], KEYSPACE, TierCostModel(4))
    assert [store.name for store in tiers.stores] == list(TIER_NAMES) == ["host", "disk"]
    tiers.close()
    assert tier_hits({"disk": 16}, None, {"disk": 16, "host": 32}) == {"disk": 32, "host": 32}
    assert list(tier_hits(dict.fromkeys(TIER_NAMES, 0), {"disk": 16})) == list(TIER_NAMES)
    assert tier_hits() == {}

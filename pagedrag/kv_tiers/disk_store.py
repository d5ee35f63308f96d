"""The disk tier: one content-addressed file per block in a directory that outlives the process
and that several engines (replicas on one host, or on a shared filesystem) may share.

Layout: ``<root>/<keyspace fingerprint[:16]>/<key[:2]>/<key>.kv``, each file as
disk_format.encode writes it.

Invariants:
- Writers write to a temporary name in the same directory and rename it into place
  (atomic on POSIX), so no reader ever sees a partial file, a writer killed mid-write leaves
  only a temporary file (swept at start), and two writers of one key are harmless (same bytes).
- The size budget holds across processes and restarts: each store counts the directory's
  bytes at start and after every eviction; over budget, the least recently used files (by
  modification time, which a hit refreshes) are removed until it is back under 90% of it.
- A file that fails to decode is removed and counted (``num_dropped``), and is a miss.
- An OSError of the medium (ENOSPC, EROFS, EACCES, a vanished directory) on write turns the
  store off with one warning; the engine goes on without it.
"""

from __future__ import annotations

import logging
import time
import os
import threading
import uuid
from pathlib import Path

from pagedrag.kv_tiers import disk_format
from pagedrag.kv_tiers.store import StoredBlock

logger = logging.getLogger("pagedrag")
_SUFFIX = ".kv"
_TEMP_MARK = ".tmp-"
_LOW_WATER = 0.9


class DiskStore:
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, keyspace: str):
        self.keyspace = keyspace
        self.capacity_bytes = int(capacity_bytes)
        self.directory = Path(root) / keyspace[:16]
        self.enabled = self.capacity_bytes > 0
        self.num_dropped = 0
        self._used = 0
        self._lock = threading.Lock()
        if self.enabled:
            self._open()

    # ---- set-up ----------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._sweep_temporaries()
            self._used = self._count_bytes()
        except OSError as error:
            self._turn_off(error)

    def _sweep_temporaries(self) -> None:
        """Remove temporary files older than a minute (left by a writer that was killed)."""
        cutoff = time.time() - 60
        for path in self.directory.glob(f"*/*{_TEMP_MARK}*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except FileNotFoundError:
                pass

    def _files(self) -> list[os.DirEntry]:
        entries = []
        for sub in os.scandir(self.directory):
            if sub.is_dir():
                entries.extend(e for e in os.scandir(sub.path) if e.name.endswith(_SUFFIX))
        return entries

    def _count_bytes(self) -> int:
        return sum(_size(entry) for entry in self._files())

    # ---- the store -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}{_SUFFIX}"

    def contains(self, key: bytes) -> bool:
        return self.enabled and self.path_of(key).exists()

    def get(self, key: bytes) -> StoredBlock | None:
        if not self.enabled:
            return None
        path = self.path_of(key)
        try:
            data = _read_file(path)
        except OSError:  # evicted by another engine meanwhile, or unreadable: a miss
            return None
        block = disk_format.decode(data, key, self.keyspace)
        if block is None:
            self._drop(path)
            return None
        _touch(path)
        return block

    def put(self, key: bytes, block: StoredBlock) -> None:
        if not self.enabled:
            return
        path = self.path_of(key)
        if path.exists():
            _touch(path)
            return
        data = disk_format.encode(key, self.keyspace, block)
        try:
            _write_atomically(path, data)
        except OSError as error:
            self._turn_off(error)
            return
        with self._lock:
            self._used += len(data)
            if self._used > self.capacity_bytes:
                self._evict()

    # ---- upkeep ----------------------------------------------------------------------------
    def _evict(self) -> None:
        """Remove least recently used files (every engine's) until under the low-water mark."""
        try:
            files = sorted(self._files(), key=_mtime)
        except OSError as error:
            self._turn_off(error)
            return
        used = sum(_size(entry) for entry in files)
        target = self.capacity_bytes * _LOW_WATER
        for entry in files:
            if used <= target:
                break
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # another engine evicted it first
                pass
            used -= _size(entry)
        self._used = used

    def _drop(self, path: Path) -> None:
        self.num_dropped += 1
        logger.warning("kv disk tier: %s is corrupt, truncated or foreign; removed (a miss)", path.name)
        try:
            path.unlink()
        except OSError:
            pass

    def _turn_off(self, error: OSError) -> None:
        if self.enabled:
            logger.warning("kv disk tier at %s turned off: %s; the engine goes on without it",
                           self.directory, error)
        self.enabled = False


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(exist_ok=True)
    temporary = path.with_name(f"{path.name}{_TEMP_MARK}{uuid.uuid4().hex}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _read_file(path: Path) -> bytearray:
    """The file's bytes in a buffer of their own (decode's tensor keeps it: no further copy)."""
    with open(path, "rb", buffering=0) as file:
        data = bytearray(os.fstat(file.fileno()).st_size)
        if file.readinto(data) != len(data):
            raise OSError(f"{path.name} changed size while it was read")
        return data


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return 0.0

"""The disk tier: one content-addressed file per block in a directory that outlives the process
and that several engines (replicas on one host, or on a shared filesystem) may share.

Layout: ``<root>/<keyspace fingerprint[:16]>/<key[:2]>/<key>.kv`` (lower-case hex names),
each file as disk_format.encode writes it, and ``<root>/used-bytes``: the shared byte count of every
keyspace's files (engines of other models, dtypes or checkpoints share the budget), and the
lock (an exclusive ``flock`` on it) that every store sharing the directory takes to
read-modify-write that count, publish a file or evict.

Invariants:
- Writers write to a temporary name in the same directory and publish it by linking it to its
  final name if that name is absent (atomic on POSIX), so no reader ever sees a partial file,
  a writer killed mid-write leaves only a temporary file (swept at start), and of two writers
  of one key only the first publishes (same bytes) and counts it.
- The count is exact while every writer lives: a file is counted in the locked step that
  publishes it, and evictions recount under the lock. Files removed as corrupt (``_drop``,
  without the lock) stay counted until the next eviction's recount (it comes early), and a
  writer killed between publishing and counting leaves its block uncounted; every store's
  open recounts, and so does every eviction.
- The size budget holds across processes and restarts: a put whose file would take the count
  over capacity first evicts, in the same locked step, the least recently used files of every
  engine and keyspace (by modification time, which a hit refreshes) down to 90% of it less the
  file: the blocks of a checkpoint no engine loads any more age out. So the directory never
  holds more than capacity bytes (that store's) of counted block files, whichever processes
  wrote them; beyond them only the temporary files of writes in flight and any blocks of
  killed writers left uncounted until a recount. Puts never scan the directory (it may hold
  100k files); open and eviction do.
- Only what the store's own names match is ever counted, evicted or swept: a directory shared
  with other files loses none of them. Of those, only regular files are counted and evicted.
- A file that fails to decode, or anything else at a block's path (a directory, a FIFO, a
  symlink), is removed and counted (``num_dropped``), and is a miss; so is a file where a
  ``<key[:2]>`` directory belongs, when a write needs the directory. Eviction skips what it
  cannot remove or read.
- A count file holding no count, or a negative one, is recounted.
- An OSError of the medium (ENOSPC, EROFS, EACCES, a vanished directory, a count file that
  cannot be created or locked) on open or write turns the store off with one warning; the
  engine goes on without it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from pagedrag.kv_tiers import disk_format
from pagedrag.kv_tiers.store import DISK_TIER, StoredBlock

logger = logging.getLogger("pagedrag")
_SUFFIX = ".kv"
_TEMP_MARK = ".tmp-"
_LOW_WATER = 0.9
_COUNT_FILE = "used-bytes"
_KEYSPACE_NAME = re.compile(r"[0-9a-f]{16}")
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(rf"([0-9a-f]{{2}})[0-9a-f]*{re.escape(_SUFFIX)}")
_TEMPORARY_NAME = re.compile(rf"[0-9a-f]+{re.escape(_SUFFIX)}{re.escape(_TEMP_MARK)}[0-9a-f]{{32}}")


class DiskStore:
    name = DISK_TIER

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, keyspace: str,
                 block_shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
        self.keyspace = keyspace
        self.block_shape, self.dtype = block_shape, dtype  # what every block read must be (None: any)
        self.capacity_bytes = int(capacity_bytes)
        self.root = Path(root)
        self.directory = self.root / keyspace[:16]  # this keyspace's blocks
        self.enabled = self.capacity_bytes > 0
        self.num_dropped = 0
        self._used = 0
        if self.enabled:
            self._open()

    # ---- set-up ----------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._sweep_temporaries()
            self._update_count(lambda used: used, recount=True)
        except OSError as error:
            self._turn_off(error)

    def _sweep_temporaries(self) -> None:
        """Remove temporary files older than a minute (left by a writer that was killed)."""
        cutoff = time.time() - 60
        for shard in self._shards():
            for entry in _entries(shard.path):
                if _TEMPORARY_NAME.fullmatch(entry.name) and _mtime(entry) < cutoff:
                    with suppress(OSError):
                        os.unlink(entry.path)

    def _shards(self) -> list[os.DirEntry]:
        """Every keyspace's ``<key[:2]>`` directories under the root, by the store's names."""
        return [shard for keyspace in _subdirectories(self.root) if _KEYSPACE_NAME.fullmatch(keyspace.name)
                for shard in _subdirectories(keyspace.path) if _SHARD_NAME.fullmatch(shard.name)]

    def _files(self) -> list[os.DirEntry]:
        """Every keyspace's block files under the root: regular files named as the store names them."""
        return [entry for shard in self._shards() for entry in _entries(shard.path)
                if (name := _BLOCK_NAME.fullmatch(entry.name)) and name.group(1) == shard.name
                and _is_regular(entry)]

    def _count_bytes(self) -> int:
        return sum(_size(entry) for entry in self._files())

    # ---- the store -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """The directory's shared count as this store last saw it (at open and at each put that
        wrote); 0 once the store is off, as it then holds nothing."""
        return self._used if self.enabled else 0

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
            data = _read_file(path, self.capacity_bytes)
        except _NotABlockFile:  # a FIFO, a directory, a file larger than the whole tier
            self._drop(path)
            return None
        except OSError:  # evicted by another engine meanwhile, or unreadable: a miss
            return None
        block = disk_format.decode(data, key, self.keyspace, self.block_shape, self.dtype)
        if block is None:
            self._drop(path)
            return None
        _touch(path)
        return block

    def touch(self, key: bytes) -> None:
        if self.enabled:
            _touch(self.path_of(key))

    def put(self, key: bytes, block: StoredBlock) -> bool:
        if not self.enabled:
            return False
        path = self.path_of(key)
        if path.exists():
            _touch(path)
            return False
        data = disk_format.encode(key, self.keyspace, block)
        if len(data) > self.capacity_bytes:  # the budget cannot hold it (build refuses such a tier)
            return False
        try:
            self._make_shard(path.parent)
            with _temporary_copy(path, data) as temporary:
                published = []
                self._update_count(lambda used: self._publish(temporary, path, used, published))
            return bool(published)
        except OSError as error:
            self._turn_off(error)
            return False

    def _make_shard(self, directory: Path) -> None:
        """The ``<key[:2]>`` directory of a write; anything else in its place is dropped first."""
        if os.path.lexists(directory) and not directory.is_dir():
            self._drop(directory)
        directory.mkdir(exist_ok=True)

    # ---- the shared count ------------------------------------------------------------------
    def _update_count(self, change: Callable[[int], int], recount: bool = False) -> None:
        """Under the directory's lock, replace its count by ``change(count)``. The count file is
        opened afresh each time: flock then excludes this process's other threads too, and a
        shared filesystem's close-to-open consistency hands the count on between hosts. A count
        file just created or unreadable is recounted."""
        fd = os.open(self.root / _COUNT_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            used = None if recount else _read_count(fd)
            used = change(self._count_bytes() if used is None else used)
            os.pwrite(fd, b"%020d\n" % used, 0)  # fixed width: overwrites the whole count
            self._used = used
        finally:
            os.close(fd)  # releases the lock

    def _publish(self, temporary: Path, path: Path, used: int, published: list) -> int:
        """Under the lock: give the written temporary file its final name unless a file has it
        already, and count it (noted in ``published``); returns the new count. Room is made
        first where the file would take the count over capacity."""
        size = temporary.stat().st_size
        if used + size > self.capacity_bytes:
            used = self._evict(room_for=size)
        try:
            os.link(temporary, path)
            used += size
            published.append(path)
        except FileExistsError:  # another writer published the same bytes, and counted them
            pass
        return used

    def _evict(self, room_for: int = 0) -> int:
        """Under the lock: remove least recently used files (every engine's) until the low-water
        mark less ``room_for`` bytes is reached; returns the bytes left, recounted."""
        files = sorted(self._files(), key=_mtime)
        used = sum(_size(entry) for entry in files)
        target = max(self.capacity_bytes * _LOW_WATER - room_for, 0)
        for entry in files:
            if used <= target:
                break
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # dropped as corrupt meanwhile
                pass
            except OSError as error:  # not removable (by this user): it stays, counted
                logger.warning("kv disk tier: cannot evict %s: %s", entry.path, error)
                continue
            used -= _size(entry)
        return used

    # ---- upkeep ----------------------------------------------------------------------------
    def _drop(self, path: Path) -> None:
        """Remove a bad file. Without the lock (a read never waits for a writer): the count keeps
        the file's bytes until the next eviction's recount, which makes that eviction early."""
        self.num_dropped += 1
        logger.warning("kv disk tier: %s is corrupt, truncated or foreign; removed (a miss)", path.name)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            pass

    def _turn_off(self, error: OSError) -> None:
        if self.enabled:
            logger.warning("kv disk tier at %s turned off: %s; the engine goes on without it",
                           self.directory, error)
        self.enabled = False


@contextmanager
def _temporary_copy(path: Path, data: bytes) -> Iterator[Path]:
    """``data`` in a temporary file beside ``path`` (its directory exists), removed when the
    block ends (published or not: a published file keeps its other name)."""
    temporary = path.with_name(f"{path.name}{_TEMP_MARK}{uuid.uuid4().hex}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        yield temporary
    finally:
        temporary.unlink(missing_ok=True)


def _read_count(fd: int) -> int | None:
    """The count file's count; None when it holds none (just created, or damaged)."""
    try:
        count = int(os.pread(fd, 64, 0))
    except ValueError:
        return None
    return count if count >= 0 else None


class _NotABlockFile(Exception):
    """What is at a block's path cannot be a block file."""


def _read_file(path: Path, max_bytes: int) -> memoryview:
    """The file's bytes in an aligned buffer of their own (decode's tensor keeps it: no further
    copy). A read may return fewer bytes than asked for; only an end of file before the size
    the file had when opened is an error (an OSError: truncated meanwhile). Opened without
    blocking (a FIFO planted there would block for ever), without following a symlink; raises
    _NotABlockFile for anything but a regular file of at most ``max_bytes``."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno == errno.ELOOP:  # a symlink (O_NOFOLLOW), looping or not
            raise _NotABlockFile(path.name) from None
        raise
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or status.st_size > max_bytes:
        os.close(descriptor)
        raise _NotABlockFile(path.name)
    with open(descriptor, "rb", buffering=0) as file:
        data = disk_format.aligned_buffer(status.st_size)
        filled = 0
        while filled < len(data):
            count = file.readinto(data[filled:])
            if not count:
                raise OSError(f"{path.name} ended at byte {filled} of {len(data)} while it was read")
            filled += count
        return data


def _subdirectories(path: str | os.PathLike) -> list[os.DirEntry]:
    return [entry for entry in _entries(path) if _is_directory(entry)]


def _entries(path: str | os.PathLike) -> list[os.DirEntry]:
    """The entries of a directory; none where it cannot be read (gone, or not a directory)."""
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _is_directory(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_regular(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:  # removed meanwhile, or unreadable
        return 0


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0

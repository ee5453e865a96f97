"""A dataset's keys in one compact file, memory-mapped and shared by every process of a node.

Ten million keys as a Python list cost about a gigabyte per process (an object per key), and
every DataLoader worker holds its own copy: forked workers copy the pages back as reference
counts change. Here the keys are two arrays in one file: the keys' UTF-8 bytes end to end,
and where each one starts. Mapped read-only, the pages live once in the page cache whatever
the number of processes, and a key costs nothing until it is read.

Layout (little-endian)::

    header   magic "ASKI", u16 version, u16 flags (0), 2 x u32 reserved (0),
             u64 count, u64 blob bytes, u64 xxh3-64 of the offsets, u64 xxh3-64 of the blob
    offsets  (count + 1) x u64: key i is blob[offsets[i]:offsets[i + 1]]
    blob     the keys' bytes, end to end (sorted, for an index built from a listing)

Both checksums are verified when the file is opened: a damaged index is rebuilt, never read.

Building it from a listing writes the keys as they arrive to ``<name>.partial``, each
followed by a NUL byte (no key holds one). An interrupted build resumes from its last
complete key with ``Store.list(start_after=...)``; a lock file makes the node's processes
build it once, the others waiting and then mapping the result.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import mmap
import os
import secrets
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, cast, overload

import anyio
import numpy as np
import numpy.typing as npt
import xxhash

from .._concurrency import shield
from .._flock import try_lock
from ..errors import IntegrityError, InvalidArgument
from ..stores import MAX_KEY_BYTES

__all__ = ["KeyIndex", "build_index", "write_index"]

_MAGIC = b"ASKI"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIIQQQQ")  # 48 bytes: the offsets that follow are aligned
_OFFSET = 8
# Keys handed to the writer per write, and between two flushes of a partial listing.
_CHUNK = 65_536

# Indexes whose keys would take at most this much memory as Python strings keep each key
# once decoded (see KeyIndex.take), in every process that reads them: about 60 bytes a key
# besides its own, whose characters take up to 4 bytes each when any is not ASCII.
_KEEP_DECODED_BYTES = 16 << 20


class KeyIndex(Sequence[str]):
    """Keys in compact form: ``index[i]`` is the i-th key, ``len(index)`` the count.

    Made by :meth:`from_keys` (in memory) or :meth:`open` (a file written by
    :func:`write_index` or :func:`build_index`, memory-mapped). Pickles small when mapped:
    a worker reopens the same file and checks it is the same index.
    """

    def __init__(self, buffer: bytes | mmap.mmap, path: str | None = None) -> None:
        where = path or "(memory)"
        # Checked through the header and checksums before any view is kept: a mapping
        # cannot close while views of it are alive, so none outlives a refusal.
        with memoryview(buffer) as view:
            if len(view) < _HEADER.size:
                raise IntegrityError(f"key index {where} is truncated")
            magic, version, flags, _, _, count, blob_bytes, offsets_sum, blob_sum = (
                _HEADER.unpack_from(view)
            )
            if magic != _MAGIC or version != _VERSION or flags:
                raise IntegrityError(f"{where} is not a key index of this version")
            offsets_end = _HEADER.size + (count + 1) * _OFFSET
            if offsets_end + blob_bytes != len(view):
                raise IntegrityError(
                    f"key index {where} holds {len(view)} bytes, its header says "
                    f"{offsets_end + blob_bytes}: it is truncated or damaged"
                )
            with view[_HEADER.size : offsets_end] as offsets, view[offsets_end:] as blob:
                if xxhash.xxh3_64_intdigest(offsets) != offsets_sum or (
                    xxhash.xxh3_64_intdigest(blob) != blob_sum
                ):
                    raise IntegrityError(f"key index {where} is damaged (checksum mismatch)")
                with offsets.cast("Q") as items:
                    if items[0] != 0 or items[count] != blob_bytes:
                        raise IntegrityError(f"key index {where} is damaged (offsets out of range)")
        self._buffer = buffer
        # The offsets as an array: a view of the mapping, shared with every process that
        # maps the file (ten million keys would be 80 MB private to each if copied).
        self._bounds = np.frombuffer(buffer, dtype=np.int64, count=count + 1, offset=_HEADER.size)
        self._blob_at = offsets_end  # where the keys' bytes start in the buffer
        self._blob_bytes: int = blob_bytes
        self._count: int = count
        self._path = path
        self._digest = (offsets_sum, blob_sum)
        # Small indexes keep each key once decoded: a warm epoch then hands out the same
        # str objects every time, so the cache's lookups match them by identity with their
        # hashes known, and no key is decoded twice (the loop's work per warm sample
        # went from 1.45 to 1.25 µs, measured alone). None for a larger index: its keys
        # stay compact.
        self._decoded: npt.NDArray[np.object_] | None = None
        if blob_bytes + 60 * count <= _KEEP_DECODED_BYTES:
            chars = np.frombuffer(buffer, dtype=np.uint8, count=blob_bytes, offset=offsets_end)
            wide = 4 if blob_bytes and chars.max() >= 0x80 else 1  # str's widest form
            if wide * blob_bytes + 60 * count <= _KEEP_DECODED_BYTES:
                self._decoded = np.full(count, None, dtype=object)

    @property
    def digest(self) -> tuple[int, int]:
        """The index's own checksums (xxh3-64 of the offsets and of the keys' bytes), taken
        when it was made or opened: an identity of the keys in their order, at no cost."""
        return self._digest

    # -- making one --------------------------------------------------------------------------

    @classmethod
    def from_keys(cls, keys: Iterable[str]) -> KeyIndex:
        """An in-memory index of ``keys``, in their order."""
        return cls(b"".join(_encode([key.encode() for key in keys])))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> KeyIndex:
        """Map the index file at ``path`` (raises :class:`IntegrityError` if it is damaged,
        :class:`FileNotFoundError` if it is missing)."""
        name = os.fspath(path)
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise IntegrityError(f"key index {name} is empty")
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            return cls(mapped, name)
        except BaseException:
            mapped.close()
            raise

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return self.take(range(*index.indices(self._count)))
        position = index + self._count if index < 0 else index
        if not 0 <= position < self._count:
            raise IndexError(f"key index {index} out of range({self._count})")
        return self.take((position,))[0]

    def take(self, indices: Iterable[int] | npt.NDArray[np.int64]) -> list[str]:
        """The keys at ``indices`` (each in ``range(len(self))``), in that order."""
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64)
        # A negative index would read the wrong bounds, and a wrong key kept decoded would
        # be handed out for every later read of its place.
        if len(indices) and not 0 <= indices.min() <= indices.max() < self._count:
            bad = indices[(indices < 0) | (indices >= self._count)][0]
            raise IndexError(f"key index {int(bad)} out of range({self._count})")
        decoded = self._decoded
        if decoded is None:
            return self._decode(indices)
        keys: list[str | None] = decoded[indices].tolist()
        if None in keys:  # decoded on first use
            missing = [at for at, key in enumerate(keys) if key is None]
            places = indices[missing]
            fresh = self._decode(places)
            decoded[places] = fresh
            for at, key in zip(missing, fresh, strict=True):
                keys[at] = key
        return cast("list[str]", keys)

    def _decode(self, indices: npt.NDArray[np.int64]) -> list[str]:
        # The keys at indices, decoded from the buffer.
        # Both ends of every key in two array lookups, then one slice of the buffer itself
        # (bytes, without a memoryview each) and one decode per key.
        bounds, at = self._bounds, self._blob_at
        first, last = bounds[indices], bounds[indices + 1]
        # Only the first and last offsets are checked at open: a file made to pass its
        # checksums could hold one out of order, or past 2**63 (negative here), which
        # would slice other parts of the file. Checked for these keys, in a few passes.
        if len(first) and not ((first >= 0) & (first <= last) & (last <= self._blob_bytes)).all():
            raise IntegrityError(
                f"key index {self._path or '(memory)'} is damaged (offsets out of order)"
            )
        starts, ends = (first + at).tolist(), (last + at).tolist()
        buffer = self._buffer
        try:
            return [buffer[start:end].decode() for start, end in zip(starts, ends, strict=True)]
        except UnicodeDecodeError:
            # Only a file made to pass its checksums gets here.
            raise IntegrityError(
                f"key index {self._path or '(memory)'} holds a key that is not UTF-8"
            ) from None

    def __iter__(self) -> Iterator[str]:
        for start in range(0, self._count, _CHUNK):
            yield from self.take(range(start, min(start + _CHUNK, self._count)))

    @property
    def path(self) -> str | None:
        """The file it is mapped from, or None in memory."""
        return self._path

    def __reduce__(self) -> tuple[Callable[..., KeyIndex], tuple[Any, ...]]:
        if self._path is None:
            return (KeyIndex, (bytes(self._buffer),))
        return (_reopen, (self._path, self._digest))

    def __repr__(self) -> str:
        return f"KeyIndex({self._count} keys, {self._path or 'in memory'})"


def _reopen(path: str, digest: tuple[int, int]) -> KeyIndex:
    index = KeyIndex.open(path)
    if index._digest != digest:
        raise IntegrityError(
            f"key index {path} changed since this dataset was made (the listing was "
            "rebuilt): make the dataset again"
        )
    return index


# -- writing ---------------------------------------------------------------------------------


def _encode(keys: list[bytes]) -> Iterator[bytes | memoryview]:
    """Header, offsets and blob of an index over ``keys`` (UTF-8), in their order."""
    # C-level passes over the list: ten million keys take about a second, not a minute.
    offsets = array.array("Q", itertools.accumulate(map(len, keys), initial=0))
    if sys.byteorder != "little":
        offsets.byteswap()
    blob = b"".join(keys)
    yield _HEADER.pack(
        _MAGIC,
        _VERSION,
        0,
        0,
        0,
        len(keys),
        len(blob),
        xxhash.xxh3_64_intdigest(offsets),
        xxhash.xxh3_64_intdigest(blob),
    )
    yield memoryview(offsets).cast("B")
    yield blob


def _canonical(keys: list[bytes]) -> list[bytes]:
    # Sorted (listings of some servers are not in byte order; sorting an ordered list is one
    # pass), duplicates dropped (a resumed listing may repeat a key): every node that lists
    # the same objects builds the same file, whatever order the pages came in.
    keys.sort()
    return [key for key, _ in itertools.groupby(keys)]


def write_index(path: str | os.PathLike[str], keys: Iterable[str]) -> None:
    """Write an index of ``keys``, in their order, to ``path``, atomically: a reader sees
    the old file or the new one, never part of one."""
    _write(os.fspath(path), [key.encode() for key in keys])


def _write(name: str, keys: list[bytes]) -> None:
    os.replace(_write_temp(name, keys), name)


def _write_temp(name: str, keys: list[bytes]) -> str:
    """An index of ``keys`` in a temp file beside ``name``; returns its path."""
    tmp = f"{name}.tmp{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            for part in _encode(keys):
                f.write(part)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


# -- building from a listing -----------------------------------------------------------------


async def build_index(
    path: str | os.PathLike[str],
    listing: Callable[[str], AsyncIterator[str]],
    *,
    lock_timeout: float = 3600.0,
) -> KeyIndex:
    """The index at ``path``, built from ``listing(start_after)`` unless a valid one is there.

    The keys are sorted and duplicates dropped, so every node listing the same objects
    builds the same index. An empty listing is not kept (the next call lists again).

    ``listing(start_after)`` yields keys after ``start_after`` ("" for all), as
    ``Store.list`` does. Keys are appended to ``<path>.partial`` as they arrive, so a build
    killed halfway resumes after its last complete key. The node's processes build it once:
    the first takes ``<path>.lock``; the others wait (up to ``lock_timeout`` seconds, with
    the event loop free) and map the finished file. A build cancelled midway finishes the
    file work it started before it lets the lock go.
    """
    name = os.fspath(path)
    partial = f"{name}.partial"
    with contextlib.suppress(FileNotFoundError, IntegrityError):
        found = KeyIndex.open(name)
        # A partial listing beside a valid index was left by a builder killed as it
        # published (earlier versions); a rebuild must not resume it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        return found
    os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
    lock = os.open(f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + lock_timeout
        pause = 0.001
        while not try_lock(lock):
            if time.monotonic() > deadline:
                raise InvalidArgument(
                    f"the key index {name} has been built by another process for "
                    f"{lock_timeout:.0f} s (it holds {name}.lock); wait for it, or stop it"
                )
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.1)
        with contextlib.suppress(FileNotFoundError, IntegrityError):
            found = KeyIndex.open(name)  # built by the process that held the lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)  # left by a builder killed after publishing
            return found
        for attempt in range(2):
            await _list_into(partial, listing)
            try:
                index: KeyIndex = await shield(anyio.to_thread.run_sync(_finish, name))
            except IntegrityError:
                if attempt:
                    raise
                # The partial listing was damaged (not UTF-8): list again from the start.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            else:
                return index
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        os.close(lock)  # releases the lock


async def _list_into(partial: str, listing: Callable[[str], AsyncIterator[str]]) -> None:
    # Append the listing to the partial file, resuming after its last complete key.
    last = await shield(anyio.to_thread.run_sync(_resume_point, partial))
    # Plain writes on this thread, a few MB each: nothing still writes once this returns or
    # is cancelled, so the lock is never released under a write in flight.
    fd = os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        pending: list[bytes] = []
        async for key in listing(last):
            pending.append(key.encode() + b"\0")
            if len(pending) >= _CHUNK:
                # Whole keys only: a kill leaves complete keys and at most a torn last one,
                # which the next build cuts off.
                _write_all(fd, b"".join(pending))
                pending.clear()
        _write_all(fd, b"".join(pending))
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    with memoryview(data) as view:
        while view:
            view = view[os.write(fd, view) :]


def _resume_point(partial: str) -> str:
    """The last complete key of a partial listing, or ""; a torn last key is cut off, and a
    partial listing whose tail is not a key is started over."""
    try:
        f = open(partial, "r+b")  # noqa: SIM115 -- closed by the with below
    except FileNotFoundError:
        return ""
    with f:
        size = os.fstat(f.fileno()).st_size
        # Keys are at most MAX_KEY_BYTES: this window holds the last complete one whole,
        # and the separator before it or the start of the file.
        window = min(size, 2 * (MAX_KEY_BYTES + 1))
        f.seek(size - window)
        tail = f.read(window)
        end = tail.rfind(b"\0")
        start = tail.rfind(b"\0", 0, max(end, 0)) + 1
        try:
            last = tail[start:end].decode() if end >= 0 else ""
        except UnicodeDecodeError:
            end, last = -1, ""  # damaged: start over
        f.truncate(size - window + end + 1 if end >= 0 else 0)
        return last


def _finish(name: str) -> KeyIndex:
    # The partial listing becomes the index: sorted (some servers list out of byte order),
    # without duplicates (a resumed listing may repeat its last page).
    partial = f"{name}.partial"
    with open(partial, "rb") as f:
        raw = f.read()
    try:
        raw.decode()  # every key UTF-8, in one pass
    except UnicodeDecodeError:
        raise IntegrityError(f"the partial listing {partial} is damaged") from None
    keys = _canonical([key for key in raw.split(b"\0") if key])
    del raw
    if not keys:
        os.unlink(partial)
        return KeyIndex(b"".join(_encode(keys)))  # nothing listed: nothing kept
    # The partial goes first: a kill between the two leaves no index and no partial (listed
    # again), never a finished index beside a stale partial that a later rebuild resumes.
    tmp = _write_temp(name, keys)
    os.unlink(partial)
    os.replace(tmp, name)
    return KeyIndex.open(name)

"""``file:///abs/path`` (or a plain path): objects as files under a local directory.

Every operation is one hop to a worker thread (a whole ``get`` or ``put`` is one hop, not one
per read call), through a limiter owned by the store, so slow disks cannot exhaust the
process's default thread pool. Writes go to a temporary file in the destination directory,
are fsynced, then renamed over the key: readers see the old file or the new one, never a mix.

This module owns the options (:class:`LocalConfig`), the store (:class:`LocalStore`: paths
and their containment in the root, errors, every operation) and its streaming reader and
writer; the temporary files themselves and their cleanup live in :mod:`._localwrite`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import stat as statmod
from collections.abc import AsyncIterator, Callable
from typing import IO, Annotated, Any, TypeVar

import msgspec

from .._concurrency import to_thread
from ..errors import AsyncStoreError, NotFound, PermissionDenied, StoreError
from ._base import ObjectInfo
from ._basestore import BaseStore
from ._keys import RESERVED_PREFIX, check_key, check_prefix
from ._localwrite import TempFile, abandoned_names, remove_abandoned, write_all
from ._streams import BaseReader, BaseWriter

__all__ = ["LocalConfig", "LocalStore"]

_T = TypeVar("_T")


class LocalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of a local store (``open_store(path, **options)``)."""

    max_inflight: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Worker threads doing file I/O at once. Local NVMe serves many requests in parallel; more
    threads than this mostly add contention on 2-8 core data-loader hosts."""

    fsync: bool = True
    """Flush each object (and its directory entry) to stable storage before it becomes visible,
    so a power loss cannot leave a zero-length or torn file under a key. Turn off only for
    scratch data that may be lost."""


def _etag(st: os.stat_result) -> str:
    # Renaming a new file over the key changes the inode, so overwrites always change the tag
    # even within one mtime tick.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


class LocalStore(BaseStore):
    """A store in a local directory; open it with ``open_store("file:///data")`` or a path.

    The directory is created on the first write. Keys map to files below it; a key never reads
    or writes outside it, symlinks included.
    """

    def __init__(self, root: str, config: LocalConfig | None = None) -> None:
        root = os.path.abspath(root)
        super().__init__(f"file://{root}")
        self._root = root
        self._config = config or LocalConfig()
        self._limiter = asyncio.Semaphore(self._config.max_inflight)

    @property
    def root(self) -> str:
        """The absolute path of the store's directory."""
        return self._root

    @property
    def config(self) -> LocalConfig:
        """The store's options."""
        return self._config

    async def _run(self, key: str, doing: str, func: Callable[..., _T], *args: object) -> _T:
        """Run ``func`` in a worker thread, translating ``OSError`` into asyncstore errors."""
        try:
            return await to_thread(func, *args, limiter=self._limiter)
        except AsyncStoreError:
            raise  # already translated (PermissionDenied is an OSError too)
        except OSError as exc:
            raise self.local_error(exc, key, doing) from exc

    # -- paths ---------------------------------------------------------------------------------

    def _inside(self, real: str) -> bool:
        root = os.path.realpath(self._root)
        return real == root or real.startswith(root + os.sep)

    def local_path(self, key: str) -> str:
        """The file of ``key`` (see :class:`~asyncstore.stores.LocalFiles`).

        Raises:
            PermissionDenied: the key leads outside the store's directory (a symlink).
        """
        path = os.path.join(self._root, key)
        if not self._inside(os.path.realpath(path)):
            raise PermissionDenied(
                f"{self.where(key)} resolves outside the store's directory through a symlink; "
                "asyncstore never reads outside a store's root"
            )
        return path

    def open_local_file(self, key: str) -> int:
        """Open the regular file at ``key`` for reading; return its descriptor (worker threads
        only; the caller closes it). See :class:`~asyncstore.stores.LocalFiles`.

        Raises:
            NotFound: nothing, a directory, or a file that is not regular (a FIFO, socket or
                device) is at the key.
            PermissionDenied: the key leads outside the store's directory.
            OSError: any other failure; :meth:`local_error` translates it.
        """
        path = self.local_path(key)
        # O_NONBLOCK: opening a FIFO for reading waits for a writer, forever, in a thread that
        # no cancellation or timeout reaches (and that keeps the process from exiting); a
        # device may block likewise. The type is then checked on the open descriptor, so
        # nothing can be swapped in between the check and the reads.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # what opening a unix socket answers
                raise
            raise self._not_regular(key, os.stat(path).st_mode) from None
        try:
            mode = os.fstat(fd).st_mode
            if not statmod.S_ISREG(mode):
                raise self._not_regular(key, mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _not_regular(self, key: str, mode: int) -> NotFound:
        # Only regular files are objects: list() skips everything else, so stat() and the
        # reads answer NotFound for them too, saying what is there instead.
        if statmod.S_ISDIR(mode):
            return NotFound(f"{self.where(key)} does not exist (it is a directory of keys)")
        kind = (
            "a FIFO (named pipe)"
            if statmod.S_ISFIFO(mode)
            else "a socket"
            if statmod.S_ISSOCK(mode)
            else "a device"
            if statmod.S_ISCHR(mode) or statmod.S_ISBLK(mode)
            else "not a regular file"
        )
        return NotFound(
            f"{self.where(key)} is {kind}, not an object: a local store reads only regular "
            "files (and lists no others)"
        )

    def _file_on_path(self, directory: str) -> bool:
        # Whether some segment of ``directory`` below the root exists and is not a directory.
        while directory != self._root and directory.startswith(self._root + os.sep):
            if os.path.lexists(directory) and not os.path.isdir(directory):
                return True
            directory = os.path.dirname(directory)
        return False

    def _dir_for_write(self, key: str) -> str:
        """Create the key's directory and return the key's path, checking it stays inside."""
        path = os.path.join(self._root, key)
        parent = os.path.dirname(path)
        # Check the deepest existing ancestor before creating anything below it: makedirs
        # through a symlink that leaves the root would create directories outside it.
        existing = parent
        while not os.path.lexists(existing) and existing != self._root:
            existing = os.path.dirname(existing)
        if not self._inside(os.path.realpath(existing)):
            raise PermissionDenied(
                f"{self.where(key)} resolves outside the store's directory through a symlink; "
                "asyncstore never writes outside a store's root"
            )
        for _ in range(3):
            try:
                os.makedirs(parent, exist_ok=True)
                break
            except (FileExistsError, NotADirectoryError):
                # Either a segment is a file (an object 'a' beside keys under 'a/'), or a
                # concurrent delete removed a directory it left empty between makedirs'
                # mkdir and its check that the directory exists: then make it again.
                if self._file_on_path(parent):
                    raise StoreError(
                        f"cannot write {self.where(key)}: a segment of its path is an object; "
                        "a local store cannot hold both 'a' and keys under 'a/'"
                    ) from None
        else:
            raise StoreError(
                f"cannot write {self.where(key)}: its directory keeps vanishing (another "
                "process deleting keys beside it?)"
            )
        if not self._inside(os.path.realpath(parent)):
            raise PermissionDenied(
                f"{self.where(key)} resolves outside the store's directory through a symlink; "
                "asyncstore never writes outside a store's root"
            )
        if os.path.islink(path) and not self._inside(os.path.realpath(path)):
            raise PermissionDenied(
                f"{self.where(key)} is a symlink leading outside the store's directory; "
                "asyncstore never writes outside a store's root"
            )
        return path

    async def clean_up_writes(self, key: str) -> int:
        """Remove temporary files that writers of ``key`` killed mid-write left behind.

        Readers never see them (their names are reserved), but they hold disk space: a
        killed checkpoint save can leave gigabytes. A file is removed only if no live
        process holds its lock; returns how many were removed.
        """
        key = check_key(key, self._url)
        self._check_open()
        return await self._run(key, "clean up", self._clean_up_writes, key)

    async def abandoned_writes(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, in ``prefix``'s directory, that killed writers left
        temporary files for (files no live process holds); see :meth:`clean_up_writes`."""
        prefix = check_prefix(prefix, self._url)
        self._check_open()
        head, _, start = prefix.rpartition("/")
        directory = os.path.join(self._root, head) if head else self._root
        names = await self._run(prefix, "list", abandoned_names, directory, start)
        return [f"{head}/{name}" if head else name for name in names]

    def _clean_up_writes(self, key: str) -> int:
        directory, name = os.path.split(os.path.join(self._root, key))
        return remove_abandoned(directory, name)

    def local_error(self, exc: OSError, key: str, doing: str) -> Exception:
        """The asyncstore error for ``exc``, raised while ``doing`` (``"read"``…) ``key``."""
        where = self.where(key)
        if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError):
            return NotFound(f"{where} does not exist")
        if isinstance(exc, PermissionError):
            return PermissionDenied(f"cannot {doing} {where}: permission denied ({exc.strerror})")
        if exc.errno == errno.ENOSPC:
            return StoreError(f"cannot {doing} {where}: the disk is full; free space and retry")
        if exc.errno == errno.EROFS:
            return PermissionDenied(f"cannot {doing} {where}: the file system is read-only")
        return StoreError(f"cannot {doing} {where}: {exc.strerror or exc}")

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key=key, size=st.st_size, etag=_etag(st), mtime=st.st_mtime)

    # -- operations (each runs whole in one worker thread) ------------------------------------

    def _get_sync(self, key: str, start: int, end: int | None) -> bytes:
        with open(self.open_local_file(key), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            stop = size if end is None else min(end, size)
            if start >= stop:
                return b""
            if start == 0 and stop == size:
                return f.readall()
            parts: list[bytes] = []
            offset = start
            while offset < stop:
                # pread returns short only at end of file, which a concurrent truncate can move.
                chunk = os.pread(f.fileno(), stop - offset, offset)
                if not chunk:
                    break
                parts.append(chunk)
                offset += len(chunk)
            return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _get(self, key: str, start: int, end: int | None) -> bytes:
        return await self._run(key, "read", self._get_sync, key, start, end)

    def _temp_file(self, key: str, direct: bool = False) -> TempFile:
        """The temporary file a write of ``key`` fills (see :class:`TempFile`)."""
        return TempFile(
            functools.partial(self._dir_for_write, key),
            self.where(key),
            fsync=self._config.fsync,
            direct=direct,
        )

    def _put_sync(self, key: str, data: memoryview) -> ObjectInfo:
        with self._temp_file(key) as tmp:
            write_all(tmp.file, data)
            return self._info(key, tmp.commit())

    async def _put(self, key: str, data: memoryview) -> ObjectInfo:
        return await self._run(key, "write", self._put_sync, key, data)

    def _stat_sync(self, key: str) -> ObjectInfo:
        st = os.stat(self.local_path(key))
        if not statmod.S_ISREG(st.st_mode):
            raise self._not_regular(key, st.st_mode)
        return self._info(key, st)

    async def _stat(self, key: str) -> ObjectInfo:
        return await self._run(key, "stat", self._stat_sync, key)

    def _delete_sync(self, key: str) -> None:
        path = os.path.join(self._root, key)
        if not self._inside(os.path.realpath(os.path.dirname(path))):
            raise PermissionDenied(
                f"{self.where(key)} resolves outside the store's directory through a symlink"
            )
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return  # deleting a missing key is not an error, as in S3
        except IsADirectoryError:
            return  # 'a' when only 'a/…' keys exist: there is no object 'a' to delete
        # S3 has no directories: drop the ones this delete left empty, so listings and disk
        # usage match. rmdir fails harmlessly on a non-empty or concurrently refilled one.
        parent = os.path.dirname(path)
        while parent != self._root and parent.startswith(self._root + os.sep):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    async def _delete(self, key: str) -> None:
        await self._run(key, "delete", self._delete_sync, key)

    def _scan(self, rel_dir: str, name_prefix: str) -> list[tuple[str, bool, ObjectInfo | None]]:
        """One directory's entries under ``name_prefix``, sorted as their keys sort.

        A directory sorts as ``name + "/"``: its keys all start so, and that puts them in the
        same place among the files as S3's lexicographic listing does.
        """
        directory = os.path.join(self._root, rel_dir) if rel_dir else self._root
        out: list[tuple[str, bool, ObjectInfo | None]] = []
        if rel_dir and not self._inside(os.path.realpath(directory)):
            return out  # a prefix through a symlink that leaves the root lists nothing
        try:
            entries = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return out
        with entries:
            for entry in entries:
                name = entry.name
                if not name.startswith(name_prefix) or name.startswith(RESERVED_PREFIX):
                    continue
                key = f"{rel_dir}/{name}" if rel_dir else name
                try:
                    # Follow a link only when it stays inside the root; never into a
                    # directory, which could loop or duplicate keys.
                    if entry.is_symlink() and (
                        entry.is_dir() or not self._inside(os.path.realpath(entry.path))
                    ):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        out.append((name + "/", True, None))
                    elif entry.is_file():
                        out.append((name, False, self._info(key, entry.stat())))
                except FileNotFoundError:
                    continue  # deleted while listing
        out.sort(key=lambda item: item[0])
        return out

    async def _list(self, prefix: str, start_after: str) -> AsyncIterator[ObjectInfo]:
        rel_dir, _, name_prefix = prefix.rpartition("/")
        # Depth-first over sorted directories: memory holds one listing per level, not the tree.
        stack: list[tuple[str, list[tuple[str, bool, ObjectInfo | None]], int]] = []
        first = await self._run(prefix, "list", self._scan, rel_dir, name_prefix)
        stack.append((rel_dir, first, 0))
        while stack:
            directory, entries, index = stack.pop()
            if index >= len(entries):
                continue
            stack.append((directory, entries, index + 1))
            name, is_dir, info = entries[index]
            if is_dir:
                sub = f"{directory}/{name[:-1]}" if directory else name[:-1]
                # Every key below starts with sub + "/": skip the directory unread when all
                # of them sort before start_after (it neither is nor extends that prefix).
                below = sub + "/"
                if below < start_after and not start_after.startswith(below):
                    continue
                stack.append((sub, await self._run(prefix, "list", self._scan, sub, ""), 0))
            elif info is not None and info.key > start_after:
                yield info

    def open_writer(self, key: str, *, direct: bool = False) -> BaseWriter:
        """Return a :class:`Writer` that streams an object to ``key``; see :class:`Writer`.

        Args:
            key: the object's key.
            direct: write around the page cache (``O_DIRECT``), for large objects written
                once, such as checkpoints: the device reads the written buffers itself, so
                no core copies the bytes and the writer is not throttled by dirty-page
                limits. Buffers whose address lines up with their offset in the object
                (modulo 4096) go without a copy; others are copied through a small aligned
                buffer. Where the file system refuses ``O_DIRECT`` the writer falls back to
                ordinary writes.
        """
        writer = super().open_writer(key)
        assert isinstance(writer, _LocalWriter)
        writer._direct = direct
        return writer

    def open_direct_writer(self, key: str) -> BaseWriter:
        """``open_writer(key, direct=True)``: for a large object written once."""
        return self.open_writer(key, direct=True)

    def reopen_args(self) -> tuple[str, dict[str, Any]]:
        """The directory as a path (a ``file://`` URL would not read back a name holding
        ``%`` or ``#`` as the same path) and the store's options."""
        return self._root, msgspec.structs.asdict(self._config)

    def _open_writer(self, key: str) -> BaseWriter:
        return _LocalWriter(self, key)

    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader:
        return _LocalReader(self, key, chunk_bytes)


class _LocalWriter(BaseWriter):
    _store: LocalStore

    def __init__(self, store: LocalStore, key: str) -> None:
        super().__init__(store, key)
        self._tmp: TempFile | None = None
        self._direct = False

    @property
    def direct_bytes(self) -> int:
        """Bytes written so far straight from the caller's buffers, around the page cache
        (``direct=True`` writers on file systems that allow it)."""
        appender = self._tmp.appender if self._tmp is not None else None
        return appender.direct_bytes if appender is not None else 0

    @property
    def settled(self) -> tuple[str, int] | None:
        """The file being written (its temporary name until the commit renames it) and how
        many of its leading bytes are written for good, for a reader that follows the write
        (a mirror's upload); ``None`` before the write has begun."""
        tmp = self._tmp
        if tmp is None or not tmp.tmp:
            return None
        return tmp.tmp, tmp.settled

    async def _begin(self) -> None:
        tmp = self._store._temp_file(self._key, self._direct)
        try:
            await self._store._run(self._key, "write", tmp.__enter__)
        finally:
            # Kept even when this is cancelled: the thread may have opened the file by then,
            # and the abort that follows must close and remove it.
            self._tmp = tmp

    async def _write(self, data: memoryview) -> None:
        assert self._tmp is not None
        await self._store._run(self._key, "write", self._tmp.write, data)

    async def _commit(self) -> ObjectInfo:
        assert self._tmp is not None
        st = await self._store._run(self._key, "write", self._tmp.commit)
        return self._store._info(self._key, st)

    async def _abort(self) -> None:
        if self._tmp is not None:
            await self._store._run(self._key, "clean up", self._tmp.abort)


class _LocalReader(BaseReader):
    _store: LocalStore

    def __init__(self, store: LocalStore, key: str, chunk_bytes: int) -> None:
        super().__init__(store, key, chunk_bytes)
        self._file: IO[bytes] | None = None

    def _open_sync(self) -> ObjectInfo:
        f = open(self._store.open_local_file(self._key), "rb", buffering=0)  # noqa: SIM115
        try:
            st = os.fstat(f.fileno())
        except BaseException:
            f.close()
            raise
        self._file = f
        return self._store._info(self._key, st)

    async def _open(self) -> ObjectInfo:
        return await self._store._run(self._key, "read", self._open_sync)

    def _read_sync(self, size: int) -> bytes:
        assert self._file is not None
        parts: list[bytes] = []
        remaining = size
        while remaining:
            chunk = self._file.read(remaining)
            if not chunk:
                break
            parts.append(chunk)
            remaining -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read(self, size: int) -> bytes:
        return await self._store._run(self._key, "read", self._read_sync, size)

    async def _on_close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

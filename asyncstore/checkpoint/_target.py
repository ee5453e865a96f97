"""Where a checkpoint goes or comes from: a store and key, or a binary file object."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import IO, Any

from .._concurrency import shield, to_thread
from ..errors import (
    AsyncStoreError,
    IntegrityError,
    InvalidArgument,
    InvalidTarget,
    InvalidURL,
    NotFound,
)
from ..stores import (
    CleansUpWrites,
    LentWrites,
    Loan,
    LocalFiles,
    PinnedReads,
    Store,
    Writer,
    check_key,
    is_local,
    local_path,
    open_store,
)

__all__ = ["Resolved", "Sink", "Source", "open_sink", "open_source", "resolve"]


class Sink:
    """Takes a checkpoint's bytes in order; :meth:`commit` makes them appear at once."""

    url: str

    @property
    def direct_bytes(self) -> int:
        """Bytes a local file took around the page cache, without a copy."""
        return 0

    async def write(self, data: memoryview | bytes | bytearray, loan: Loan | None = None) -> None:
        """Append ``data``. With ``loan``, its owner keeps it unchanged until the loan is
        returned, and the sink may hold a view of it instead of a copy (see
        :class:`~asyncstore.stores.LentWrites`)."""
        raise NotImplementedError

    def unlend(self) -> None:
        """Let go of lent memory held for bytes not being sent yet (copying them)."""

    async def commit(self) -> None:
        raise NotImplementedError

    async def abort(self, exc: BaseException) -> None:
        raise NotImplementedError


class Source:
    """Random access to a checkpoint's bytes."""

    url: str
    local_path: str | None = None

    async def size(self) -> int:
        raise NotImplementedError

    async def read(self, start: int, end: int) -> bytes:
        raise NotImplementedError

    async def read_into(self, start: int, out: list[memoryview]) -> None:
        """The bytes from ``start`` into ``out`` (views whose lengths add up to the range)."""
        data = memoryview(await self.read(start, start + sum(v.nbytes for v in out)))
        for view in out:
            if len(data) < view.nbytes:
                raise IntegrityError(f"{self.url} ends before the bytes asked for")
            view[:] = data[: view.nbytes]
            data = data[view.nbytes :]

    def sibling(self, name: str) -> Source:
        """The object ``name`` (a key relative to this one's directory) in the same place.

        Raises:
            InvalidArgument: there is no place beside this source (a file object).
        """
        raise InvalidArgument(
            f"{self.url}: a differential checkpoint's chunks lie in packs beside it; "
            "load it by path or URL, not from a file object"
        )

    def mappable(self) -> tuple[str, int] | None:
        """A local file holding these bytes and where they start in it, for a memory map
        (``load(mmap=True)``), or ``None`` when there is none (a remote object)."""
        if self.local_path is not None:
            return self.local_path, 0
        return None

    async def aclose(self) -> None:
        """Release what the source opened."""


class Resolved:
    """What a checkpoint target or source names: a store and key, or a file object."""

    def __init__(self, store: Store | None, key: str | None, file: IO[bytes] | None) -> None:
        self.store, self.key, self.file = store, key, file
        self.owned = False  # the store was opened here and is closed here
        self.local_path: str | None = None

    @property
    def url(self) -> str:
        if self.store is not None and self.key is not None:
            return f"{self.store.url}/{self.key}"
        name = getattr(self.file, "name", type(self.file).__name__)
        return f"<file object {name!r} at {id(self.file):#x}>"

    def sibling(self, name: str) -> Resolved:
        """The object ``name`` (a relative key) beside this one, in the same store.

        Raises:
            InvalidArgument: this is a file object: there is nothing beside it.
        """
        if self.store is None or self.key is None:
            raise InvalidArgument(
                f"{self.url}: a differential checkpoint's chunks lie in packs beside it; "
                "load it by path or URL, not from a file object"
            )
        head = self.key.rpartition("/")[0]
        key = f"{head}/{name}" if head else name
        resolved = Resolved(self.store, check_key(key, self.store.url), None)
        if isinstance(self.store, LocalFiles):
            resolved.local_path = self.store.local_path(key)
        return resolved

    async def aclose(self) -> None:
        """Close the store if it was opened for this target."""
        if self.owned and self.store is not None:
            await self.store.aclose()


async def open_sink(resolved: Resolved) -> Sink:
    """A sink that writes the checkpoint at ``resolved``, open and ready for its bytes."""
    if resolved.file is not None:
        return FileSink(resolved.file)
    assert resolved.store is not None
    assert resolved.key is not None
    if resolved.local_path is not None:
        os.makedirs(os.path.dirname(resolved.local_path), exist_ok=True)
    if resolved.store.remote:
        # Contacting the server (a client, the cleanup, the upload) is the save's work, not
        # the caller's: done on the first write, after the snapshot, so that save_async
        # returns once its tensors are copied and a server that is down fails the save's
        # future rather than the call.
        return StoreSink(resolved.store, resolved.key, deferred=True)
    if isinstance(resolved.store, CleansUpWrites):
        # What a save killed mid-write left: unfinished uploads, temp files.
        await resolved.store.clean_up_writes(resolved.key)
    sink = StoreSink(resolved.store, resolved.key)
    try:
        await sink.open()
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the original error is the one to report
            await shield(sink.abort(exc))
        raise
    return sink


def open_source(resolved: Resolved) -> Source:
    """A source that reads the checkpoint at ``resolved``."""
    if resolved.file is not None:
        return FileSource(resolved.file)
    assert resolved.store is not None
    assert resolved.key is not None
    return StoreSource(resolved.store, resolved.key, resolved.local_path)


def resolve(target: object, store_options: dict[str, Any] | None, *, writing: bool) -> Resolved:
    """Turn what the caller passed into a store and key, or a file object.

    Raises:
        InvalidArgument: ``target`` is none of a URL, a path, a ``(store, key)`` pair or a
            binary file object.
    """
    if isinstance(target, tuple):
        if len(target) != 2 or not isinstance(target[0], Store):
            raise InvalidArgument(
                f"target {target!r}: a pair must be (store, key), with an open asyncstore store"
            )
        store, key = target
        resolved = Resolved(store, check_key(key, store.url), None)
        if isinstance(store, LocalFiles):
            resolved.local_path = store.local_path(key)
        return resolved
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if isinstance(target, str):
        if not target:
            raise InvalidArgument("empty checkpoint path; pass a path, URL or (store, key)")
        options = _store_options(store_options)
        if is_local(target):
            # One URL-to-path function for every entry point: file:///d/my%20dir/a%20b.ckpt
            # is the file 'a b.ckpt' in '/d/my dir', exactly as open_store reads it.
            path = local_path(target)
            if os.path.isdir(path):
                raise InvalidArgument(
                    f"checkpoint path {target!r} is a directory; name a file inside it"
                )
            directory, key = os.path.split(path)
            resolved = Resolved(open_store(directory, **options), key, None)
            resolved.local_path = path
        else:
            head, _, key = target.rstrip("/").rpartition("/")
            if not key or head.endswith((":/", "://")):
                raise InvalidArgument(
                    f"checkpoint URL {target!r} names no object: add a file name, "
                    "as in 's3://bucket/run1/step-1000.ckpt'"
                )
            if head.endswith("/"):
                # 's3://bucket//x.ckpt' and 's3://b/run//x.ckpt': the empty segment is part
                # of the key on S3, and open_store refuses it in a prefix too.
                raise InvalidURL(
                    f"checkpoint URL {target!r} has an empty path segment ('//'); write "
                    f"{head.rstrip('/') + '/' + key!r}"
                )
            resolved = Resolved(open_store(head, **options), key, None)
        if resolved.key is not None and resolved.store is not None:
            check_key(resolved.key, resolved.store.url)
        resolved.owned = True
        return resolved
    if writing and hasattr(target, "write"):
        return Resolved(None, None, target)  # type: ignore[arg-type]
    if not writing and hasattr(target, "read") and hasattr(target, "seek"):
        return Resolved(None, None, target)  # type: ignore[arg-type]
    if not writing and hasattr(target, "read"):
        # torch.load's own words, which callers match on.
        raise InvalidTarget(
            f"checkpoint source {target!r} cannot seek. You can only torch.load from a file "
            "that is seekable. Please pre-load the data into a buffer like io.BytesIO and "
            "try to load from it instead."
        )
    kind = "a writable" if writing else "a readable, seekable"
    raise InvalidTarget(
        f"checkpoint target {target!r} is a {type(target).__name__}; pass a path, a URL "
        f"('s3://bucket/run/step.ckpt'), a (store, key) pair or {kind} binary file object"
    )


async def put_whole(target: object, store_options: dict[str, Any] | None, data: Any) -> str:
    """Write ``data`` (bytes-like) at ``target`` (a path, a URL or a ``(store, key)`` pair)
    in one put, atomic in every store; returns the URL written."""
    resolved = resolve(target, store_options, writing=True)
    try:
        assert resolved.store is not None
        assert resolved.key is not None
        await resolved.store.put(resolved.key, data)
        return resolved.url
    finally:
        await resolved.aclose()


def _store_options(options: object) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidArgument(
            f"store_options={options!r}: pass a dict of open_store options, such as "
            "{'endpoint_url': 'http://127.0.0.1:8333'}"
        )
    return options


class StoreSink(Sink):
    """Streams into a store's atomic writer: nothing is visible until :meth:`commit`."""

    def __init__(self, store: Store, key: str, *, deferred: bool = False) -> None:
        self.url = f"{store.url}/{key}"
        self._store, self._key = store, key
        self._writer: Writer | None = None
        self._opened = False
        if not deferred:
            self._writer = self._new_writer()

    def _new_writer(self) -> Writer:
        # A checkpoint is large and written once: a local file takes it around the page
        # cache (see LocalFiles.open_direct_writer).
        store, key = self._store, self._key
        return (
            store.open_direct_writer(key)
            if isinstance(store, LocalFiles)
            else store.open_writer(key)
        )

    async def open(self) -> None:
        if self._writer is None:
            # Deferred (see open_sink): what a save killed mid-write left goes first.
            if isinstance(self._store, CleansUpWrites):
                await self._store.clean_up_writes(self._key)
            self._writer = self._new_writer()
        await self._writer.__aenter__()
        self._opened = True

    @property
    def direct_bytes(self) -> int:
        return int(getattr(self._writer, "direct_bytes", 0))

    @property
    def bytes_written(self) -> int:
        """Bytes the sink took so far."""
        return 0 if self._writer is None else self._writer.bytes_written

    def settled(self) -> tuple[str, int] | None:
        """For a local file being written: its path (a temporary name until the commit)
        and how many of its leading bytes are written for good; ``None`` otherwise."""
        settled: tuple[str, int] | None = getattr(self._writer, "settled", None)
        return settled

    async def write(self, data: memoryview | bytes | bytearray, loan: Loan | None = None) -> None:
        if not self._opened:
            await self.open()
        writer = self._writer
        assert writer is not None
        if loan is not None and isinstance(data, memoryview) and isinstance(writer, LentWrites):
            await writer.write_lent(data, loan)
        else:
            await writer.write(data)

    def unlend(self) -> None:
        if isinstance(self._writer, LentWrites):
            self._writer.unlend()

    async def commit(self) -> None:
        if not self._opened:
            await self.open()
        assert self._writer is not None
        await self._writer.__aexit__(None, None, None)

    async def abort(self, exc: BaseException) -> None:
        if self._writer is not None:  # a deferred sink that never opened holds nothing
            await self._writer.__aexit__(type(exc), exc, exc.__traceback__)


def _write_fully(file: IO[bytes], data: memoryview | bytes | bytearray) -> None:
    # A raw file object may write less than asked (and say so): loop until all is down.
    view = memoryview(data).cast("B")
    while len(view):
        written = file.write(view)
        if written is None:
            written = len(view)  # a buffered writer takes everything or raises
        if not written:
            raise OSError(f"{file!r} accepted no bytes")
        view = view[written:]


class FileSink(Sink):
    """Writes into a binary file object the caller owns (in a thread; no atomicity)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.url = f"<file object {getattr(file, 'name', type(file).__name__)!r}>"
        self._file = file
        self._limiter = asyncio.Semaphore(1)

    async def write(self, data: memoryview | bytes | bytearray, loan: Loan | None = None) -> None:
        await to_thread(_write_fully, self._file, data, limiter=self._limiter)

    async def commit(self) -> None:
        await to_thread(self._file.flush, limiter=self._limiter)

    async def abort(self, exc: BaseException) -> None:
        return None  # the caller's file: what was written stays, as with torch.save


class StoreSource(Source):
    """Reads a checkpoint from a store. A local file is opened once: every read of a load
    comes from that file, even if a save renames a new checkpoint over it meanwhile."""

    def __init__(self, store: Store, key: str, local_path: str | None) -> None:
        self.url = f"{store.url}/{key}"
        self.local_path = local_path
        self._store, self._key = store, key
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        # S3: the version (ETag) that size() saw; every read is pinned to it, so a save over
        # the key during the load is reported as such rather than as a damaged checkpoint.
        self._etag: str | None = None

    def sibling(self, name: str) -> Source:
        head = self._key.rpartition("/")[0]
        key = check_key(f"{head}/{name}" if head else name, self._store.url)
        path = self._store.local_path(key) if isinstance(self._store, LocalFiles) else None
        return StoreSource(self._store, key, path if self.local_path is not None else None)

    def fd(self) -> int:
        """The local file's descriptor, opened on first use (worker threads only).

        Raises:
            NotFound: there is no file (or a directory) at the key.
            PermissionDenied: the key leads outside the store's directory, or cannot be read.
        """
        assert self.local_path is not None
        with self._fd_lock:
            if self._fd is None:
                self._fd = self._open()
            return self._fd

    def _open(self) -> int:
        # A local path comes with a local store (see resolve): its checks apply, a symlink
        # may not lead outside its directory, and a FIFO or device is refused, not waited on.
        assert isinstance(self._store, LocalFiles)
        try:
            return self._store.open_local_file(self._key)
        except OSError as exc:
            if isinstance(exc, AsyncStoreError):
                raise
            raise self._translate(exc) from exc

    def _translate(self, exc: OSError) -> Exception:
        if isinstance(self._store, LocalFiles):
            return self._store.local_error(exc, self._key, "read")
        return exc

    def _pread(self, start: int, end: int) -> bytes:
        try:
            fd = self.fd()
            data = os.pread(fd, end - start, start)
            while len(data) < end - start:
                more = os.pread(fd, end - start - len(data), start + len(data))
                if not more:
                    raise NotFound(f"{self.url} ended before byte {end}")
                data += more
        except NotFound:
            raise
        except OSError as exc:
            raise self._translate(exc) from exc
        return data

    async def size(self) -> int:
        if self.local_path is not None:
            return await to_thread(lambda: os.fstat(self.fd()).st_size)
        info = await self._store.stat(self._key)
        self._etag = info.etag
        return info.size

    async def read(self, start: int, end: int) -> bytes:
        if self.local_path is not None:
            return await to_thread(self._pread, start, end)
        if isinstance(self._store, PinnedReads) and self._etag is not None:
            return await self._store.get_pinned(self._key, start, end, self._etag)
        return await self._store.get(self._key, start, end)

    async def read_into(self, start: int, out: list[memoryview]) -> None:
        if isinstance(self._store, PinnedReads) and self._etag is not None:
            await self._store.get_pinned_into(self._key, start, out, self._etag)
            return
        await super().read_into(start, out)

    async def aclose(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class FileSource(Source):
    def __init__(self, file: IO[bytes]) -> None:
        self.url = f"<file object {getattr(file, 'name', type(file).__name__)!r}>"
        self._file = file
        self._lock = threading.Lock()
        self._start = file.tell()

    async def size(self) -> int:
        def measure() -> int:
            with self._lock:
                end = self._file.seek(0, os.SEEK_END)
                return end - self._start

        return await to_thread(measure)

    async def read(self, start: int, end: int) -> bytes:
        def read() -> bytes:
            with self._lock:
                self._file.seek(self._start + start)
                readinto = getattr(self._file, "readinto", None)
                data: bytes | bytearray
                if readinto is None:
                    data = self._file.read(end - start)
                else:
                    # Straight into one buffer, as torch.load reads: no copy per call.
                    buffer = bytearray(end - start)
                    view = memoryview(buffer)
                    got = 0
                    while got < len(buffer):
                        more = readinto(view[got:])
                        if not more:
                            break
                        got += more
                    data = buffer[:got] if got < len(buffer) else buffer
            if len(data) != end - start:
                raise NotFound(f"{self.url} ended before byte {end}")
            # A bytearray where read into: every caller uses it as bytes, without a copy.
            return data  # type: ignore[return-value]

        return await to_thread(read)

    @property
    def file(self) -> IO[bytes]:
        """The caller's file object."""
        return self._file

    def rewind(self) -> None:
        self._file.seek(self._start)

    def mappable(self) -> tuple[str, int] | None:
        # A file object opened on a local file (open(), a NamedTemporaryFile) names it.
        name = getattr(self._file, "name", None)
        if isinstance(name, str) and os.path.isfile(name):
            return name, self._start
        return None

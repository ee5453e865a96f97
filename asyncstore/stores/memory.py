"""``memory://NAME``: objects in this process's memory.

Stores opened with the same name share their objects for the life of the process, the way two
clients of one bucket do, so code under test can write through one store and read through
another. Use :func:`drop_memory_store` to free a name's objects.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator

import anyio.lowlevel
import xxhash

from ..errors import NotFound
from ._base import ObjectInfo
from ._basestore import BaseStore
from ._streams import BaseReader, BaseWriter

__all__ = ["MemoryStore", "drop_memory_store"]


class _Object:
    __slots__ = ("data", "etag", "mtime")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.etag = xxhash.xxh3_64_hexdigest(data)
        self.mtime = time.time()


# name -> {full key -> object}. A plain dict is enough: each access is one dict operation,
# atomic under the GIL, and objects are replaced, never mutated.
_BUCKETS: dict[str, dict[str, _Object]] = {}
_BUCKETS_LOCK = threading.Lock()


def drop_memory_store(name: str) -> None:
    """Forget every object of the memory store ``name`` (all prefixes), freeing their memory."""
    with _BUCKETS_LOCK:
        _BUCKETS.pop(name, None)


class MemoryStore(BaseStore):
    """A store in process memory; open it with ``open_store("memory://NAME[/prefix]")``.

    Meant for tests and small scratch data: objects are not shared with other processes and
    vanish when the process exits.
    """

    def __init__(self, name: str, prefix: str = "") -> None:
        super().__init__(f"memory://{name}/{prefix}" if prefix else f"memory://{name}")
        self._name = name
        self._prefix = f"{prefix}/" if prefix else ""
        self._objects_now()

    @property
    def identity(self) -> str:
        """See :attr:`Store.identity`: the URL and this process, since another process's
        ``memory://`` store of the same name holds other objects."""
        return f"{self.url} in process {os.getpid()}"

    def _lookup(self, key: str) -> _Object:
        # Re-read the registry so a drop_memory_store() is seen by stores already open.
        obj = _BUCKETS.get(self._name, {}).get(self._prefix + key)
        if obj is None:
            raise NotFound(f"{self.where(key)} does not exist")
        return obj

    def _info(self, key: str, obj: _Object) -> ObjectInfo:
        return ObjectInfo(key=key, size=len(obj.data), etag=obj.etag, mtime=obj.mtime)

    def _objects_now(self) -> dict[str, _Object]:
        with _BUCKETS_LOCK:
            return _BUCKETS.setdefault(self._name, {})

    async def _get(self, key: str, start: int, end: int | None) -> bytes:
        await anyio.lowlevel.checkpoint()
        data = self._lookup(key).data
        if start == 0 and (end is None or end >= len(data)):
            return data  # bytes are immutable: the whole object needs no copy
        return data[start:end]

    async def _put(self, key: str, data: memoryview) -> ObjectInfo:
        await anyio.lowlevel.checkpoint()
        source = data.obj
        # A whole bytes object is immutable: keep it as it is instead of copying it.
        whole = isinstance(source, bytes) and len(source) == data.nbytes
        obj = _Object(source if whole else data.tobytes())  # type: ignore[arg-type]
        self._objects_now()[self._prefix + key] = obj
        return self._info(key, obj)

    async def _stat(self, key: str) -> ObjectInfo:
        await anyio.lowlevel.checkpoint()
        return self._info(key, self._lookup(key))

    async def _delete(self, key: str) -> None:
        await anyio.lowlevel.checkpoint()
        self._objects_now().pop(self._prefix + key, None)

    async def _list(self, prefix: str, start_after: str) -> AsyncIterator[ObjectInfo]:
        full = self._prefix + prefix
        cut = len(self._prefix)
        # Snapshot the matching keys: the dict may change while the caller iterates.
        keys = sorted(
            k for k in list(self._objects_now()) if k.startswith(full) and k[cut:] > start_after
        )
        for index, full_key in enumerate(keys):
            if index % 1000 == 0:
                await anyio.lowlevel.checkpoint()
            obj = self._objects_now().get(full_key)
            if obj is not None:
                yield self._info(full_key[cut:], obj)

    def _open_writer(self, key: str) -> BaseWriter:
        return _MemoryWriter(self, key)

    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader:
        return _MemoryReader(self, key, chunk_bytes)


class _MemoryWriter(BaseWriter):
    _store: MemoryStore

    def __init__(self, store: MemoryStore, key: str) -> None:
        super().__init__(store, key)
        self._parts: list[bytes] = []

    async def _write(self, data: memoryview) -> None:
        await anyio.lowlevel.checkpoint()
        self._parts.append(data.tobytes())

    async def _commit(self) -> ObjectInfo:
        data = b"".join(self._parts)
        self._parts.clear()
        return await self._store._put(self._key, memoryview(data))

    async def _abort(self) -> None:
        self._parts.clear()


class _MemoryReader(BaseReader):
    _store: MemoryStore

    def __init__(self, store: MemoryStore, key: str, chunk_bytes: int) -> None:
        super().__init__(store, key, chunk_bytes)
        self._data = b""
        self._offset = 0

    async def _open(self) -> ObjectInfo:
        await anyio.lowlevel.checkpoint()
        obj = self._store._lookup(self._key)
        self._data = obj.data  # a snapshot: a concurrent put replaces, never mutates, it
        return self._store._info(self._key, obj)

    async def _read(self, size: int) -> bytes:
        await anyio.lowlevel.checkpoint()
        chunk = self._data[self._offset : self._offset + size]
        self._offset += len(chunk)
        return chunk

    async def _on_close(self) -> None:
        self._data = b""

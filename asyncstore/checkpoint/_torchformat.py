"""``save(..., format="torch")``: the file ``torch.save`` writes, through asyncstore's stores.

Two steps, so that the caller waits for a snapshot only, as with asyncstore's own format:

1. The snapshot (the caller waits for it). On a worker thread, with the caller's
   ``torch.serialization.skip_data()`` and ``FakeTensorMode`` in effect there too, torch's
   own serializer (the function ``torch.save`` runs) pickles the object into a
   :class:`_Records` that stands in for torch's zip writer: the pickle, torch's small
   records, and every storage's bytes, copied where the caller could change them
   afterwards (a storage on the host) and taken as they are where torch made them (torch
   copies a device's storage to the host itself).
2. The write (in the background). The save's writer task replays those records, in order,
   into torch's zip writer (``torch._C.PyTorchFileWriter``, with which ``torch.save``
   writes a file object) on a worker thread; its bytes stream into the target's sink in
   bounded pieces (:class:`_Stream`), and the sink's commit makes the file appear at once.

The file is therefore byte for byte what ``torch.save(obj, file_object)`` writes with the
same torch and the same arguments (given a path, torch names its records after the file,
``step/data.pkl`` rather than ``archive/data.pkl``; ``torch.load`` reads either).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import io
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import IO, Any, NamedTuple, cast

import torch
import torch.serialization
import xxhash

from .._concurrency import TaskSet, abandon, forget_errors, shield, to_thread
from ..errors import AsyncStoreError, InvalidArgument, StoreClosed, UnsafeCheckpoint
from ._contexts import TorchContexts, entered
from ._handle import SaveHandle, SaveResult
from ._target import Resolved, Sink, open_sink

__all__ = ["DEFAULT_PROTOCOL", "PIECE_BYTES", "save_torch_format"]

MiB = 1 << 20

# torch.save's own default, not asyncstore's (4): the file is torch's, byte for byte.
DEFAULT_PROTOCOL: int = torch.serialization.DEFAULT_PROTOCOL

# The unit the file's bytes go to the store in. Small writes of torch's zip writer (headers,
# small records) gather into a piece; one piece is written while the next fills, so the file
# is never in memory: about four pieces at most, whatever its size.
PIECE_BYTES = 8 * MiB

# The writer tasks of format="torch" saves still writing in this process.
_WRITERS = TaskSet("asyncstore torch-format saves")

# Values whose pickling cannot reach a tensor (see _held_storages).
_PLAIN = frozenset(
    {int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size}
)


class _Record(NamedTuple):
    name: str  # the record's name inside the archive ("data.pkl", "data/0"...)
    data: Any  # str or bytes, a host storage, or None: a storage's place only (skip_data)
    nbytes: int


class _Records:
    """Stands in for torch's zip writer while torch's serializer runs: keeps every record
    in order. A storage the caller holds on the host is copied while the copies stay within
    ``budget`` bytes, and kept as it is beyond (``borrowed``: the caller must then wait
    for the write); one torch made itself (a device's storage, copied to the host) is kept
    as it is. ``held`` names the caller's host storages (by ``_cdata``); ``None`` when that
    is not known, and then every storage is treated as the caller's."""

    def __init__(self, held: frozenset[int] | None, budget: int) -> None:
        self.records: deque[_Record] = deque()
        self.held = held
        self.budget = budget
        self.copied = 0  # bytes copied into fresh host memory
        self.borrowed = 0  # bytes left in the caller's own storages
        self.raw = 0  # the pickle's bytes and the storages'
        self.storages = 0

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        """Keep a record: the pickle, a small record of torch's, or a storage's bytes."""
        if isinstance(data, torch.UntypedStorage):
            self.storages += 1
            self.raw += nbytes
            if self.held is None or data._cdata in self.held:
                if self.copied + nbytes <= self.budget:
                    data = _copy(data)
                    self.copied += nbytes
                else:
                    self.borrowed += nbytes
        elif name == "data.pkl":
            self.raw += nbytes
        self.records.append(_Record(name, data, nbytes))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        """Keep a storage's place without its bytes (under ``skip_data()``)."""
        self.storages += 1
        self.raw += nbytes
        self.records.append(_Record(name, None, nbytes))


def _copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    # Through a uint8 tensor: a tensor's copy is vectorised and spread over torch's threads,
    # a storage's own clone() is many times slower.
    source = torch.empty(0, dtype=torch.uint8).set_(storage)
    return source.clone().untyped_storage()


def _held_storages(obj: Any, limit: int = 1_000_000) -> frozenset[int] | None:
    """The storages (by ``_cdata``) of the host tensors in ``obj``, when ``obj`` is nothing
    but nested dicts, lists and tuples of plain tensors and plain values (a state dict);
    ``None`` when it holds anything else, whose pickling may reach storages this walk does
    not see. Knowing them spares a second copy of a device's storage: torch copies it to
    the host while pickling, and that copy is the caller's no more."""
    held: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        limit -= 1
        if limit < 0:
            return None
        value = stack.pop()
        kind = type(value)
        if kind in _PLAIN:
            continue
        if kind in (torch.Tensor, torch.nn.Parameter):
            if (
                value.layout != torch.strided
                or value.is_quantized
                or value.is_nested
                or getattr(value, "__dict__", None)
            ):
                return None
            if value.device.type == "cpu":
                held.add(value.untyped_storage()._cdata)
            continue
        if kind in (dict, collections.OrderedDict):
            stack.extend(value.keys())
            stack.extend(value.values())
            # A state dict's OrderedDict carries its _metadata, pickled with it.
            stack.extend(getattr(value, "__dict__", {}).values())
            continue
        if kind in (list, tuple):
            stack.extend(value)
            continue
        return None
    return frozenset(held)


def _check_pickle_module(module: Any) -> Any:
    if module is None:
        return pickle
    if not isinstance(getattr(module, "Pickler", None), type):
        raise InvalidArgument(
            f"pickle_module={module!r} has no Pickler class: pass a module such as pickle or dill"
        )
    check_dill = getattr(torch.serialization, "_check_dill_version", None)
    if check_dill is not None:
        try:
            check_dill(module)
        except ValueError as exc:
            raise InvalidArgument(f"pickle_module={module!r}: {exc}") from exc
    return module


def _snapshot(
    obj: Any,
    pickle_module: Any,
    protocol: int,
    disable_byteorder: bool,
    contexts: TorchContexts,
    budget: int,
) -> _Records:
    # On a worker thread: the caller's skip_data() and FakeTensorMode (per thread in
    # torch) are entered here, where torch's serializer and Tensor.__reduce_ex__ read them.
    records = _Records(_held_storages(obj), budget)
    try:
        with entered(contexts):
            torch.serialization._save(  # type: ignore[no-untyped-call]
                obj, records, pickle_module, protocol, disable_byteorder
            )
    except InvalidArgument:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UnsafeCheckpoint(f"the object cannot be saved: {exc}") from exc
    return records


class _Stream:
    """The file object torch's zip writer writes into, on a worker thread.

    Small writes gather into a piece; a full piece goes to the sink on the event loop while
    the next one fills (one piece in flight at a time, so the pieces arrive in order). A
    write of a piece or more (a storage's bytes) goes out in pieces without a copy, and
    returns once the sink has them all (torch's buffer is only lent for the call). Every
    byte is hashed on its way.
    """

    def __init__(self, sink: Sink, loop: asyncio.AbstractEventLoop, piece_bytes: int) -> None:
        self._sink = sink
        self._loop = loop
        self._piece = piece_bytes
        self._pending = bytearray()
        self._inflight: concurrent.futures.Future[None] | None = None
        self._zeros: bytes | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.tasks = TaskSet(f"the writes to {sink.url}")
        self.error: BaseException | None = None  # the first error of a write, if any
        self.position = 0
        self._hash = xxhash.xxh3_64()

    @property
    def digest(self) -> str:
        """xxh3-64 of every byte written, in hex."""
        return self._hash.hexdigest()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._hash.update(view)
            self.position += len(view)
            if len(view) >= self._piece:
                self._flush_pending()
                self._put(view, lent=True)
            else:
                self._pending += view
                if len(self._pending) >= self._piece:
                    self._flush_pending()
        except BaseException as exc:
            self._failed(exc)
            raise
        return len(view)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # torch's zip writer skips a storage's place under skip_data() by seeking forward
        # from where it is; a file then holds zeros there, and so does this stream.
        if whence != os.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("a checkpoint stream only skips forward")
        if self._zeros is None:
            self._zeros = bytes(min(self._piece, offset))
        while offset:
            size = min(offset, len(self._zeros))
            self.write(memoryview(self._zeros)[:size])
            offset -= size
        return self.position

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        try:
            self._flush_pending()
            self._wait()
        except BaseException as exc:
            self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _flush_pending(self) -> None:
        if self._pending:
            piece, self._pending = self._pending, bytearray()
            self._put(memoryview(piece), lent=False)

    def _put(self, view: memoryview, *, lent: bool) -> None:
        for start in range(0, len(view), self._piece):
            self._send(view[start : start + self._piece])
        if lent:
            self._wait()

    def _send(self, data: memoryview) -> None:
        self._wait()  # the piece before is in the sink first
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise AsyncStoreError(f"the save to {self._sink.url} was stopped")
            self._inflight = done
        self._loop.call_soon_threadsafe(self._start_write, data, done)

    def _start_write(self, data: memoryview, done: concurrent.futures.Future[None]) -> None:
        # On the event loop: the write runs as a task of this stream, which stop() ends.
        try:
            task = self.tasks.spawn(self._sink.write(data), name="write a piece")
        except StoreClosed as exc:
            done.set_exception(exc)
            return
        task.add_done_callback(lambda ended: _settle(ended, done))

    def _wait(self) -> None:
        done, self._inflight = self._inflight, None
        if done is not None:
            done.result()

    def settle(self) -> None:
        """Wait for the piece in flight, whatever its outcome (the thread's last act)."""
        done, self._inflight = self._inflight, None
        if done is not None:
            with contextlib.suppress(BaseException):
                done.result()

    async def stop(self) -> None:
        """Stop the writes (on the event loop): the piece in flight is cancelled, no other
        starts, and this returns once none runs."""
        with self._lock:
            self._stopped = True
        await self.tasks.aclose()


def _settle(task: asyncio.Task[None], done: concurrent.futures.Future[None]) -> None:
    if task.cancelled():
        done.set_exception(AsyncStoreError("a write of the save was cancelled"))
    elif (error := task.exception()) is not None:
        done.set_exception(error)
    else:
        done.set_result(None)


def _write_file(records: deque[_Record], stream: _Stream, crc32: bool, alignment: int) -> None:
    # On a worker thread: torch's zip writer, as torch.save runs it on a file object.
    try:
        writer = torch._C.PyTorchFileWriter(cast(IO[bytes], stream), crc32, alignment)
        while records:
            record = records.popleft()  # a copy's memory goes as soon as it is written
            if record.data is None:
                writer.write_record_metadata(  # type: ignore[attr-defined]
                    record.name, record.nbytes
                )
            else:
                writer.write_record(record.name, record.data, record.nbytes)
            del record
        writer.write_end_of_file()
        stream.flush()
    except BaseException:
        # torch's writer reports a failed write as its own RuntimeError; the write's
        # error (the store's) is the one that says what happened.
        if stream.error is not None:
            raise stream.error from None
        raise
    finally:
        stream.settle()


def _zip_options() -> tuple[bool, int]:
    # What torch.save gives its zip writer: CRC-32s or not, and the storages' alignment.
    crc32 = getattr(torch.serialization, "get_crc32_options", lambda: True)()
    alignment = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)()
    return bool(crc32), int(alignment)


class _TorchWrite:
    """The background half of a ``format="torch"`` save: replays the records into the
    sink, then commits; on every path lets go of the sink and the target."""

    def __init__(
        self,
        sink: Sink,
        records: _Records,
        release_target: Callable[[], Awaitable[None]],
        *,
        background: bool,
        piece_bytes: int,
    ) -> None:
        self._sink = sink
        self._records = records
        self._release_target = release_target
        self._background = background
        self._stream = _Stream(sink, asyncio.get_running_loop(), piece_bytes)

    async def run(self, started: float, snapshot_seconds: float) -> SaveResult:
        error: BaseException | None = None
        stream = self._stream
        try:
            crc32, alignment = _zip_options()
            thread = stream.tasks.spawn(
                to_thread(
                    _write_file,
                    self._records.records,
                    stream,
                    crc32,
                    alignment,
                    background=self._background,
                ),
                name="write torch's zip file",
            )
            try:
                await asyncio.wait([thread])
            except asyncio.CancelledError:
                # The thread ends at its next write; the piece in flight is cancelled.
                await shield(stream.stop())
                forget_errors([thread])
                raise
            thread.result()
            await self._sink.commit()
            total = time.perf_counter() - started
            if self._records.borrowed:
                snapshot_seconds = total  # the caller waited for the whole write
            return SaveResult(
                url=self._sink.url,
                raw_bytes=self._records.raw,
                stored_bytes=stream.position,
                storages=self._records.storages,
                chunks=0,
                compressed_storages=0,
                snapshot_seconds=snapshot_seconds,
                total_seconds=total,
                digest=stream.digest,
                direct_bytes=self._sink.direct_bytes,
            )
        except BaseException as exc:
            error = exc
            raise
        finally:
            await shield(self._close(error))

    async def _close(self, error: BaseException | None) -> None:
        try:
            await self._stream.stop()
            self._records.records.clear()
            if error is not None:
                with contextlib.suppress(Exception):  # the save's own error is the one to report
                    await self._sink.abort(error)
        finally:
            await self._release_target()


async def save_torch_format(
    obj: Any,
    resolved: Resolved,
    release_target: Callable[[], Awaitable[None]],
    started: float,
    *,
    pickle_module: Any,
    pickle_protocol: int,
    staging_bytes: int,
    background: bool,
    contexts: TorchContexts,
    disable_byteorder: bool = False,
    piece_bytes: int = PIECE_BYTES,
) -> SaveHandle:
    """Start a ``format="torch"`` save of ``obj`` to ``resolved`` (its target locked by the
    caller: ``release_target`` unlocks and closes it, once the save ends); return once the
    snapshot is taken (see the module's docstring).

    ``contexts``: the caller's ``skip_data()`` and ``FakeTensorMode``, read on its thread
    (``_contexts.current``).
    ``staging_bytes`` bounds the host memory the snapshot copies into; when the caller's
    host storages need more, the rest is written from them directly and this returns only
    once the file is written (as ``torch.save`` would).

    Raises:
        InvalidArgument: a bad ``pickle_module``.
        UnsafeCheckpoint: ``obj`` cannot be pickled.
    """
    sink: Sink | None = None
    try:
        pickle_module = _check_pickle_module(pickle_module)
        sink = await open_sink(resolved)
        snapshot_started = time.perf_counter()
        records = await to_thread(
            _snapshot,
            obj,
            pickle_module,
            pickle_protocol,
            disable_byteorder,
            contexts,
            staging_bytes,
        )
        snapshot_seconds = time.perf_counter() - snapshot_started
        job = _TorchWrite(
            sink, records, release_target, background=background, piece_bytes=piece_bytes
        )
    except BaseException as exc:
        if sink is not None:
            with contextlib.suppress(Exception):  # the original error is the one to report
                await shield(sink.abort(exc))
        await shield(release_target())
        raise
    # From here the job releases everything, however the save ends.
    writer = _WRITERS.spawn(job.run(started, snapshot_seconds), name=f"save to {sink.url}")
    if records.borrowed:
        # Some of the caller's own storages are written as they are: the caller may change
        # them only once the file is written.
        try:
            await asyncio.wait([writer])
        except asyncio.CancelledError:
            await abandon(writer)
            raise
    return SaveHandle(writer, resolved.url)

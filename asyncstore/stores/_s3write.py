"""Writes to S3: :class:`S3Writer`, behind every ``open_writer`` of an S3 store and every
``put`` larger than one part, and :func:`put_object`, a single PUT.

A writer gathers up to one part. An object that fits in one part becomes a single PUT; a
larger one becomes a multipart upload whose parts go out in background tasks, at most
``upload_max_inflight`` at a time, and which is aborted if the write fails or is cancelled.
Bodies go out on the fast path (:mod:`._s3fast`): from memory as they lie, the payload
unsigned, each with its CRC32C for the server to check.

A part is a list of views. Bytes given with :meth:`~S3Writer.write` are copied once, into
the part's buffer; bytes *lent* (:meth:`~S3Writer.write_lent`: a checkpoint's staging
slabs, a ``put`` of an in-memory object, an immutable ``bytes``) are not copied at all: the
part keeps a view of them and holds their :class:`~._streams.Loan` until it is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec

from .._concurrency import TaskSet, forget_errors, to_thread, wait_shared
from ..errors import NotFound, StoreError
from ._base import ObjectInfo
from ._s3base import S3StoreBase
from ._s3fast import combined_crc32c, crc32c_of
from ._s3responses import error_code, object_info
from ._streams import BaseWriter, Loan

_T = TypeVar("_T")
_logger = logging.getLogger("asyncstore.s3")

_MAX_PARTS = 10_000
# Below this, a body's checksums are computed on the event loop: a thread hop costs more.
_INLINE_DIGEST = 1 << 20
# Lent pieces smaller than this are copied all the same: a part of many small views would
# cost a socket write and a checksum call for each.
_LEND_FROM = 64 << 10


async def _digests(store: S3StoreBase, body: list[memoryview]) -> tuple[str | None, str | None]:
    """The CRC32C (when the store sends checksums) and SHA-256 (when it signs payloads) of
    ``body``'s views one after the other, on a worker thread for a large body."""
    config = store.config

    def digest() -> tuple[str | None, str | None]:
        crc = crc32c_of(*body) if config.checksum == "crc32c" else None
        sha = None
        if config.sign_payload:
            hasher = hashlib.sha256()
            for view in body:
                hasher.update(view)
            sha = hasher.hexdigest()
        return crc, sha

    if config.checksum is None and not config.sign_payload:
        return None, None
    size = sum(view.nbytes for view in body)
    return digest() if size <= _INLINE_DIGEST else await to_thread(digest)


def _release(loans: list[Loan]) -> None:
    for loan in loans:
        loan.release()
    loans.clear()


def _checked(store: S3StoreBase, key: str, sent: str | None, headers: Mapping[str, str]) -> bool:
    """Whether the server checked the body against ``sent``: it returns the checksum it
    verified. ``False`` for a server that ignores checksums (it returns none)."""
    if sent is None:
        return False
    returned = headers.get("x-amz-checksum-crc32c")
    if returned is None:
        return False
    if returned != sent:
        raise StoreError(
            f"{store.where(key)}: the server returned checksum {returned!r} for a body sent "
            f"with {sent!r}; it may have stored other bytes: write it again"
        )
    return True


async def put_object(
    store: S3StoreBase, key: str, body: list[memoryview]
) -> tuple[ObjectInfo, bool]:
    """One PUT of ``body`` (views, one after the other) to ``key`` on the fast path; returns
    the object's info and whether the server checked the body's checksum."""
    crc, sha = await _digests(store, body)

    async def attempt(_: Any) -> Mapping[str, str]:
        assert store._fast is not None
        return await store._fast.put(store._root + key, body, crc32c=crc, sha256=sha)

    headers = await store._call(key, "put", attempt)
    size = sum(view.nbytes for view in body)
    info = object_info(key, {"ETag": headers.get("ETag")}, size=size)
    return msgspec.structs.replace(info, mtime=time.time()), _checked(store, key, crc, headers)


class S3Writer(BaseWriter):
    """Gathers up to one part; a small object becomes one PUT, a large one a multipart
    upload whose parts upload in background tasks, ``upload_max_inflight`` at a time."""

    _store: S3StoreBase

    def __init__(self, store: S3StoreBase, key: str) -> None:
        super().__init__(store, key)
        # The part being gathered: views in order, then what is being copied (a BytesIO,
        # not a bytearray: getvalue() hands its storage over without a copy).
        self._views: list[memoryview] = []
        self._copy = io.BytesIO()
        self._gathered = 0  # bytes of the part so far, views and copy
        self._loans: list[Loan] = []  # held for the views of the part being gathered
        self._upload_id: str | None = None
        self._uploads = TaskSet(f"the upload of {store.where(key)}")
        self._parts: list[asyncio.Task[dict[str, Any]]] = []  # in part order
        self._creating: asyncio.Future[str] | None = None
        self._next_part = 1
        self._server_checked = False

    @property
    def server_checked(self) -> bool:
        """After the commit: whether the server checked every part against the checksum
        sent with it (see :class:`~asyncstore.stores.CheckedUploads`)."""
        return self.info is not None and self._server_checked

    def _part_bytes(self) -> int:
        # Grow parts every 1000 so that 10,000 parts reach 55,000 x part_bytes (880 GiB at
        # 16 MiB) instead of stopping a long stream at 10,000 x part_bytes.
        return self._store.config.part_bytes * (1 + (self._next_part - 1) // 1000)

    def _seal(self) -> None:
        # The bytes copied so far become the part's next view.
        if self._copy.tell():
            self._views.append(memoryview(self._copy.getvalue()))
            self._copy = io.BytesIO()

    def _take_part(self) -> tuple[list[memoryview], list[Loan]]:
        self._seal()
        views, loans = self._views, self._loans
        self._views, self._loans, self._gathered = [], [], 0
        return views, loans

    async def _write(self, data: memoryview) -> None:
        await self._gather(data, None)

    async def _write_lent(self, data: memoryview, loan: Loan) -> None:
        await self._gather(data, loan)

    async def _gather(self, data: memoryview, loan: Loan | None) -> None:
        offset = 0
        while offset < len(data):
            size = self._part_bytes()
            take = min(size - self._gathered, len(data) - offset)
            piece = data[offset : offset + take]
            if loan is None or take < _LEND_FROM:
                self._copy.write(piece)
            else:
                self._seal()
                loan.retain()
                self._loans.append(loan)
                self._views.append(piece)
            self._gathered += take
            offset += take
            if self._gathered >= size:
                await self._send(*self._take_part())

    def unlend(self) -> None:
        """Copy the lent views of the part being gathered, and let go of their loans."""
        if not self._loans:
            return
        self._seal()
        joined = b"".join(self._views)
        self._views = [memoryview(joined)] if joined else []
        _release(self._loans)

    async def _send(self, part: list[memoryview], loans: list[Loan]) -> None:
        # Sends ``part``, holding ``loans`` until it is sent; lets go of them on every path.
        try:
            if self._upload_id is None:
                self._upload_id = await self._create()
            # Back-pressure: wait for the oldest part when the window is full, so memory
            # stays bounded and an upload failure surfaces at the next write, not only at
            # the end.
            limit = self._store.config.upload_max_inflight
            while sum(not t.done() for t in self._parts) >= limit:
                await asyncio.wait(
                    [t for t in self._parts if not t.done()], return_when=asyncio.FIRST_COMPLETED
                )
            for task in self._parts:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            number = self._next_part
            self._next_part += 1
            if number > _MAX_PARTS:
                raise StoreError(
                    f"{self._store.where(self._key)}: more than {_MAX_PARTS} parts; "
                    "open the store with a larger part_bytes"
                )
            upload = self._upload_part(number, part)
            task = self._uploads.spawn(upload, name=f"upload part {number}")
        except BaseException:
            _release(loans)
            raise
        # Done callbacks run however the task ends, even cancelled before its first step.
        task.add_done_callback(lambda _: _release(loans))
        self._parts.append(task)

    async def _create(self) -> str:
        async def attempt(client: Any) -> str:
            extra = {"ChecksumAlgorithm": "CRC32C"} if self._store.config.checksum else {}
            resp = await client.create_multipart_upload(
                Bucket=self._store.bucket, Key=self._store._root + self._key, **extra
            )
            return str(resp["UploadId"])

        # In a task of its own, shared with _abort(): once the request is sent, only its answer
        # says which upload to abort, so a cancellation must not drop that answer.
        self._creating = self._uploads.spawn(
            self._store._call(self._key, "start upload", attempt), name="start upload"
        )
        upload_id = await wait_shared(self._creating)
        self._creating = None
        return upload_id

    async def _upload_part(self, number: int, body: list[memoryview]) -> dict[str, Any]:
        crc, sha = await _digests(self._store, body)
        query = {"partNumber": str(number), "uploadId": str(self._upload_id)}

        async def attempt(_: Any) -> Mapping[str, str]:
            fast = self._store._fast
            assert fast is not None
            return await fast.put(
                self._store._root + self._key, body, crc32c=crc, sha256=sha, query=query
            )

        headers = await self._upload_call(f"upload part {number}", attempt)
        done: dict[str, Any] = {"PartNumber": number, "ETag": headers.get("ETag")}
        if crc is not None:
            done["ChecksumCRC32C"] = crc
        done["checked"] = _checked(self._store, self._key, crc, headers)
        return done

    async def _upload_call(self, what: str, attempt: Callable[[Any], Awaitable[_T]]) -> _T:
        """A request on this writer's upload; says what happened if the upload is gone."""
        try:
            return await self._store._call(self._key, what, attempt)
        except NotFound as exc:
            if error_code(exc.__cause__ or exc)[0] != "NoSuchUpload":
                raise
            # Not "does not exist": the key may well exist. Another writer of this key (a
            # second process saving to it aborts unfinished uploads before it starts, see
            # clean_up_writes) aborted this upload.
            raise StoreError(
                f"nothing was written to {self._store.where(self._key)}: another writer of the "
                "same key aborted this writer's multipart upload (a second process saving to "
                "it aborts unfinished uploads when it starts) and replaces the object; write "
                "each key from one writer at a time"
            ) from exc

    async def _commit(self) -> ObjectInfo:
        if self._upload_id is None:
            # Everything fit in one part: a single PUT, no multipart overhead.
            views, loans = self._take_part()
            try:
                info, self._server_checked = await put_object(self._store, self._key, views)
            finally:
                _release(loans)
            return info
        if self._gathered:
            await self._send(*self._take_part())
        done = [await task for task in self._parts]
        flags = [part.pop("checked") for part in done]  # out of every part: not S3's field
        checked = all(flags)
        upload_id = self._upload_id

        async def attempt(client: Any) -> dict[str, Any]:
            # Retried like every request: a retry after a lost answer completes the same
            # upload again and succeeds (tested against SeaweedFS through a reset).
            return dict(
                await client.complete_multipart_upload(
                    Bucket=self._store.bucket,
                    Key=self._store._root + self._key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                )
            )

        resp = await self._upload_call("complete upload", attempt)
        self._upload_id = None  # committed: nothing left to abort
        returned = resp.get("ChecksumCRC32C")
        if checked and returned is not None:
            # The object's checksum is its parts' checksums, checksummed: the server joined
            # exactly the parts it checked, in order.
            expected = combined_crc32c([part["ChecksumCRC32C"] for part in done])
            if returned != expected:
                raise StoreError(
                    f"{self._store.where(self._key)}: the server's checksum of the joined "
                    f"parts is {returned!r}, not {expected!r}; write it again"
                )
        self._server_checked = checked
        info = object_info(self._key, {"ETag": resp.get("ETag")}, size=self._written)
        return msgspec.structs.replace(info, mtime=time.time())

    async def _abort(self) -> None:
        _release(self._take_part()[1])
        creating, self._creating = self._creating, None
        if creating is not None and self._upload_id is None:
            # Cancelled while CreateMultipartUpload was in flight (no part was sent yet):
            # learn the id to abort it.
            try:
                self._upload_id = await creating
            except BaseException:
                creating.cancel()  # failed (no upload), or our own cleanup timed out
        await self._uploads.aclose()  # part uploads stop; their errors no longer matter
        forget_errors(self._parts)
        self._parts.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return

        async def attempt(client: Any) -> None:
            await client.abort_multipart_upload(
                Bucket=self._store.bucket, Key=self._store._root + self._key, UploadId=upload_id
            )

        try:
            await self._store._call(self._key, "abort upload", attempt)
        except NotFound:
            pass  # already gone
        except Exception as exc:
            # The data is not visible under the key either way; say what to clean up.
            _logger.warning(
                "could not abort multipart upload %s of %s (%s); a bucket lifecycle rule for "
                "incomplete uploads will remove it",
                upload_id,
                self._store.where(self._key),
                exc,
            )

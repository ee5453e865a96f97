"""Writes to S3: :class:`S3Writer`, behind every ``open_writer`` of an S3 store and every
``put`` larger than one part.

A writer buffers up to one part. An object that fits in one part becomes a single PUT; a
larger one becomes a multipart upload whose parts go out in background tasks, at most
``upload_max_inflight`` at a time, and which is aborted if the write fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from .._concurrency import TaskSet, forget_errors, to_thread, wait_shared
from ..errors import NotFound, StoreError
from ._base import ObjectInfo
from ._s3base import S3StoreBase
from ._s3responses import error_code, object_info
from ._streams import BaseWriter

_T = TypeVar("_T")
_logger = logging.getLogger("asyncstore.s3")

_MAX_PARTS = 10_000
_SMALL_BODY = 1 << 20  # bodies up to this size go to aiohttp as bytes (see payload)
# An ETag that is an MD5: of the object (single PUT), or of its parts' MD5s, "-" and their
# count (multipart). Server-side encryption with KMS, and some servers, give others.
_MD5_ETAG = re.compile(r'^"?([0-9a-f]{32})(-\d+)?"?$')


def _md5(data: bytes | memoryview) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def payload(data: bytes) -> bytes | io.BytesIO:
    """A request body for ``data``, made anew for every attempt.

    aiohttp writes a bytes body to the socket in one call, which blocks the event loop while
    the kernel buffer drains and warns above 1 MiB; a ``BytesIO`` is streamed in 64 KiB
    pieces under flow control instead. ``BytesIO(bytes)`` shares the bytes until written to,
    so this costs no copy.
    """
    return io.BytesIO(data) if len(data) > _SMALL_BODY else data


class S3Writer(BaseWriter):
    """Buffers up to one part; a small object becomes one PUT, a large one a multipart upload
    whose parts upload in background tasks, ``upload_max_inflight`` at a time."""

    _store: S3StoreBase

    def __init__(self, store: S3StoreBase, key: str) -> None:
        super().__init__(store, key)
        # A BytesIO, not a bytearray: getvalue() hands its storage over as bytes without a
        # copy, so each byte is copied once on its way to the socket (into this buffer).
        self._buffer = io.BytesIO()
        self._upload_id: str | None = None
        self._uploads = TaskSet(f"the upload of {store.where(key)}")
        self._parts: list[asyncio.Task[dict[str, Any]]] = []  # in part order
        self._creating: asyncio.Future[str] | None = None
        self._next_part = 1
        self._md5s: dict[int, bytes] | None = None  # by part number, when tracked
        self._expected_etag: str | None = None

    def track_md5(self) -> None:
        """Compute the MD5 of every part sent, so that :attr:`md5_matches` can tell whether
        the server stored exactly that (see :class:`~asyncstore.stores.CheckedUploads`)."""
        if self._written or self._next_part > 1:
            raise StoreError(f"{self._store.where(self._key)}: track_md5() after a write")
        self._md5s = {}

    @property
    def md5_matches(self) -> bool | None:
        """After the commit: whether the ETag is the MD5 of what was sent (``None``: cannot
        tell, or not tracked)."""
        if self._expected_etag is None or self.info is None or self.info.etag is None:
            return None
        match = _MD5_ETAG.match(self.info.etag.lower())
        if match is None:
            return None
        return f"{match.group(1)}{match.group(2) or ''}" == self._expected_etag

    async def write_in_place(self, data: memoryview) -> None:
        """Write all of an in-memory object, each part a slice of ``data`` (no copy into the
        part buffer): ``data`` must stay unchanged until the writer commits."""
        await self._write(data, copy=False)
        self._written += len(data)

    def _part_bytes(self) -> int:
        # Grow parts every 1000 so that 10,000 parts reach 55,000 x part_bytes (880 GiB at
        # 16 MiB) instead of stopping a long stream at 10,000 x part_bytes.
        return self._store.config.part_bytes * (1 + (self._next_part - 1) // 1000)

    def _take_buffer(self) -> bytes:
        data = self._buffer.getvalue()
        self._buffer = io.BytesIO()
        return data

    async def _write(self, data: memoryview, *, copy: bool = True) -> None:
        offset = 0
        while offset < len(data):
            size = self._part_bytes()
            buffered = self._buffer.tell()
            if not buffered and len(data) - offset >= size and not copy:
                # put() of an in-memory object: each part is one slice of it.
                await self._send(data[offset : offset + size].tobytes())
                offset += size
                continue
            take = min(size - buffered, len(data) - offset)
            self._buffer.write(data[offset : offset + take])
            offset += take
            if buffered + take >= size:
                await self._send(self._take_buffer())

    async def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = await self._create()
        # Back-pressure: wait for the oldest part when the window is full, so memory stays
        # bounded and an upload failure surfaces at the next write, not only at the end.
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
        self._parts.append(
            self._uploads.spawn(self._upload_part(number, part), name=f"upload part {number}")
        )

    async def _create(self) -> str:
        async def attempt(client: Any) -> str:
            resp = await client.create_multipart_upload(
                Bucket=self._store.bucket, Key=self._store._root + self._key
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

    async def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        if self._md5s is not None:
            self._md5s[number] = await to_thread(_md5, part)

        async def attempt(client: Any) -> dict[str, Any]:
            resp = await client.upload_part(
                Bucket=self._store.bucket,
                Key=self._store._root + self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=payload(part),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        return await self._upload_call(f"upload part {number}", attempt)

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
            body = self._take_buffer()
            if self._md5s is not None:
                self._expected_etag = (await to_thread(_md5, body)).hex()
            return await self._store._put(self._key, memoryview(body))
        if self._buffer.tell():
            await self._send(self._take_buffer())
        parts = [await task for task in self._parts]
        upload_id = self._upload_id
        if self._md5s is not None:
            digests = b"".join(self._md5s[part["PartNumber"]] for part in parts)
            self._expected_etag = (
                f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"
            )

        async def attempt(client: Any) -> dict[str, Any]:
            # Retried like every request: a retry after a lost answer completes the same
            # upload again and succeeds (tested against SeaweedFS through a reset).
            return dict(
                await client.complete_multipart_upload(
                    Bucket=self._store.bucket,
                    Key=self._store._root + self._key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            )

        resp = await self._upload_call("complete upload", attempt)
        self._upload_id = None  # committed: nothing left to abort
        info = object_info(self._key, {"ETag": resp.get("ETag")}, size=self._written)
        return msgspec.structs.replace(info, mtime=time.time())

    async def _abort(self) -> None:
        self._buffer = io.BytesIO()
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

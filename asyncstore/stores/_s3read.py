"""Streaming reads from S3: :class:`S3Reader`, behind every ``open_reader`` of an S3 store.

A reader streams one GET and holds one of the store's request slots while it is open. When
the connection breaks or the body is cut short, it resumes from the offset reached with a
ranged GET pinned to the same version of the object (``If-Match``), so a read never ends
early and never mixes two versions.
"""

from __future__ import annotations

import contextlib
from typing import Any

from botocore import exceptions as bex

from ._base import ObjectInfo
from ._s3base import S3StoreBase
from ._s3responses import (
    Precondition,
    ShortBody,
    error_code,
    object_info,
    parse_content_range,
    retryable,
)
from ._streams import BaseReader


class S3Reader(BaseReader):
    """Streams one GET; if the connection breaks mid-body, resumes from the current offset
    with a ranged GET pinned to the same version (If-Match)."""

    _store: S3StoreBase

    def __init__(self, store: S3StoreBase, key: str, chunk_bytes: int) -> None:
        super().__init__(store, key, chunk_bytes)
        self._body: Any = None
        self._offset = 0
        self._size = 0
        self._etag: str | None = None
        self._slot_held = False

    async def _request(self, client: Any) -> dict[str, Any]:
        extra: dict[str, str] = {}
        if self._offset:
            extra["Range"] = f"bytes={self._offset}-"
        if self._etag:
            extra["IfMatch"] = f'"{self._etag}"'
        try:
            resp = dict(
                await client.get_object(
                    Bucket=self._store.bucket, Key=self._store._root + self._key, **extra
                )
            )
        except bex.ClientError as exc:
            if error_code(exc)[1] == 412:
                raise Precondition from exc
            raise
        self._body = resp["Body"]
        try:
            resp["ContentLength"] = await self._expected_length(client, resp)
        except BaseException:
            await self._drop_body()
            raise
        return resp

    async def _expected_length(self, client: Any, resp: dict[str, Any]) -> int:
        """How many bytes this response's body must have, from its headers.

        A resumed read must get a ``Content-Range`` starting at the offset asked for; a
        first read without ``Content-Length`` (a close-delimited or chunked body, rewritten by
        a middlebox) asks the size with a HEAD of the same version, so that a body cut short
        is still noticed by the reader (see :meth:`_read`).
        """
        parsed = parse_content_range(resp.get("ContentRange"))
        if parsed is not None:
            first, stop, total = parsed
            if first != self._offset or (total is not None and stop != total):
                raise ShortBody(
                    f"asked for bytes from {self._offset}, got {resp.get('ContentRange')!r}"
                )
            return stop - first
        if self._offset:
            raise ShortBody("a resumed read was answered without Content-Range")
        if resp.get("ContentLength") is not None:
            return int(resp["ContentLength"])
        etag = str(resp.get("ETag", "")).strip('"')
        try:
            head = await client.head_object(
                Bucket=self._store.bucket,
                Key=self._store._root + self._key,
                **({"IfMatch": f'"{etag}"'} if etag else {}),
            )
        except bex.ClientError as exc:
            if error_code(exc)[1] == 412:
                raise Precondition from exc
            raise
        if head.get("ContentLength") is None:
            raise ShortBody("neither the GET nor a HEAD announced the size")
        return int(head["ContentLength"])

    async def _open(self) -> ObjectInfo:
        # The reader holds a request slot for its lifetime: its connection is in use all along.
        await self._store._slots.acquire()
        self._slot_held = True
        try:
            resp = await self._store._call(self._key, "read", self._request, slot=False)
        except BaseException:
            self._release()
            raise
        info = object_info(self._key, resp)
        self._size, self._etag = info.size, info.etag
        return info

    async def _read(self, size: int) -> bytes:
        parts: list[bytes] = []
        wanted = min(size, self._size - self._offset)
        got = 0
        failures = 0
        while got < wanted:
            try:
                chunk: bytes = await self._body.read(wanted - got)
                if not chunk:
                    raise bex.IncompleteReadError(
                        actual_bytes=self._offset, expected_bytes=self._size
                    )
            except Exception as exc:
                # A body that ends before the size announced (a short read above, or aiohttp
                # noticing a cut chunked body) is resumed from the offset, pinned to the
                # version with If-Match; it never ends the read early.
                if not retryable(exc):
                    raise self._store._error(exc, self._key) from exc
                failures += 1
                if failures >= self._store.config.max_attempts:
                    raise self._store._error(exc, self._key, failures) from exc
                await self._drop_body()
                try:
                    await self._store._call(self._key, "resume read", self._request, slot=False)
                except Precondition as changed:
                    raise self._store._error(changed, self._key) from exc
                continue
            parts.append(chunk)
            got += len(chunk)
            self._offset += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                await body.aclose()

    def __del__(self) -> None:
        # Dropped without aclose() (a plain 'async for' left with break): warn, and give the
        # request slot and the connection back, or the store would run out of slots.
        if getattr(self, "_state", "closed") == "open":
            super().__del__()
            body, self._body = self._body, None
            if body is not None:
                with contextlib.suppress(Exception):
                    body.close()
            self._release()

    def _release(self) -> None:
        if self._slot_held:
            self._slot_held = False
            self._store._slots.release()

    async def _on_close(self) -> None:
        try:
            await self._drop_body()
        finally:
            self._release()

"""``s3://bucket/prefix``: objects in any S3-compatible server, through aiobotocore.

Requests in flight are bounded by ``max_inflight``; every request is retried with backoff
(:mod:`._retry`) on throttling, server errors, timeouts and broken connections, and never on
other client errors. botocore's own retries are switched off so that one policy, with one
attempt count, governs everything.

Large transfers are split into ``part_bytes`` pieces: a ``get`` of a large object fetches its
ranges in parallel, pinned to one version of the object with ``If-Match``; a write becomes a
multipart upload with several parts in flight, aborted if anything fails.

This module owns the store (:class:`S3Store`) and every operation but streaming. Below it,
:mod:`._s3base` holds the client's lifetime and the request plumbing that the operations,
:mod:`._s3write` (uploads) and :mod:`._s3read` (streams) share; :mod:`._s3pool` shares
clients, :mod:`._s3client` creates them, :mod:`._s3config` holds the options
(:class:`S3Config`, importable without aiobotocore) and :mod:`._s3responses` classifies
answers and errors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .._concurrency import bounded_map
from ..errors import NotFound
from ._base import ObjectInfo
from ._keys import check_key, check_prefix
from ._s3base import S3StoreBase
from ._s3config import S3Config
from ._s3fast import S3HTTPError
from ._s3read import S3Reader
from ._s3responses import Precondition, ShortBody, check_body, object_info
from ._s3write import S3Writer, put_object
from ._streams import BaseReader, BaseWriter, unchanging

__all__ = ["S3Config", "S3Store"]


class S3Store(S3StoreBase):
    """A store in an S3 bucket, under an optional prefix.

    Open it with ``open_store("s3://bucket/prefix", **options)``; see :class:`S3Config` for
    the options. The client connects on first use (or in ``async with``) and belongs to the
    event loop that used it first. Stores opened with the same endpoint, credentials and
    client settings on one event loop share one client; closing a store gives its share
    back, and the client stays open for the next store (see :mod:`._s3pool`).
    """

    # -- get -----------------------------------------------------------------------------

    async def _range(
        self, key: str, start: int, end: int, etag: str | None
    ) -> tuple[bytes, int, str | None]:
        """Fetch ``[start, end)``; return the bytes, the object's size and its ETag."""

        async def attempt(_: Any) -> tuple[bytes, int, str | None]:
            assert self._fast is not None
            try:
                data, headers = await self._fast.get(self._root + key, start, end, etag)
            except S3HTTPError as exc:
                if exc.code == "InvalidRange" or exc.status == 416:
                    # The range starts at or past the end (or the object is empty): slicing
                    # semantics say b"". A missing key answers NoSuchKey instead, so the
                    # object does exist.
                    return b"", -1, None
                if exc.code == "PreconditionFailed" or exc.status == 412:
                    raise Precondition from exc
                raise
            tag = headers.get("ETag")
            content_range = headers.get("Content-Range")
            if content_range is None:
                # The server ignored Range and sent the whole object: check it from 0.
                total = check_body(len(data), 0, None, headers.get("Content-Length"))
                data = data[start:end]
            else:
                total = check_body(len(data), start, content_range, None)
                if start + len(data) != min(end, total):
                    # A consistent header can still promise less than was asked for.
                    raise ShortBody(
                        f"asked for bytes {start}-{end - 1}, got {content_range!r} of {total}"
                    )
            return data, total, tag.strip('"') if tag else None

        return await self._call(key, "get", attempt)

    async def get_pinned(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``[start, end)`` of exactly the version ``etag`` (from :meth:`stat`).

        For a reader of several ranges of one object (the checkpoint loader): a concurrent
        overwrite then raises :class:`StoreError` saying so, instead of mixing two versions
        that only a checksum would catch, as "damaged".
        """
        self._check_open()
        return await self._get(check_key(key, self.url), start, end, pin=etag)

    async def get_pinned_into(
        self, key: str, start: int, out: list[memoryview], etag: str | None
    ) -> None:
        """Bytes of exactly the version ``etag`` from ``start`` into ``out`` (views whose
        lengths add up to the range), with one copy: from each block received into place.
        Ranges of ``part_bytes`` go in parallel, as a large ``get``'s do.

        Raises:
            StoreError: the object was replaced since (its ETag changed).
            NotFound: the range lies past the object's end, or the object is gone.
        """
        self._check_open()
        key = check_key(key, self.url)
        pieces = _split(out, start, self._config.part_bytes)

        async def fetch(piece: tuple[int, list[memoryview]]) -> None:
            await self._range_into(key, piece[0], piece[1], etag)

        try:
            await bounded_map(fetch, pieces, limit=len(pieces), name="get range")
        except Precondition as exc:
            raise self._replaced(key) from exc

    async def _range_into(
        self, key: str, start: int, out: list[memoryview], etag: str | None
    ) -> None:
        want = sum(view.nbytes for view in out)

        async def attempt(_: Any) -> None:
            assert self._fast is not None
            try:
                got, headers = await self._fast.get_into(self._root + key, start, out, etag)
            except S3HTTPError as exc:
                if exc.code == "PreconditionFailed" or exc.status == 412:
                    raise Precondition from exc
                if exc.code == "InvalidRange" or exc.status == 416:
                    raise NotFound(f"{self.where(key)} ends before byte {start}") from exc
                raise
            except OverflowError as exc:
                raise ShortBody(f"asked for {want} bytes from {start}: {exc}") from exc
            if got != want or headers.get("Content-Range") is None:
                raise ShortBody(f"asked for {want} bytes from {start}, got {got}")
            check_body(got, start, headers.get("Content-Range"), None)

        await self._call(key, "get", attempt)

    async def _get(self, key: str, start: int, end: int | None, *, pin: str | None = None) -> bytes:
        if end is not None and start == end:
            await self._stat(key)  # an empty range still says whether the key exists
            return b""
        part = self._config.part_bytes
        for _ in range(3):
            first_end = start + part if end is None else min(end, start + part)
            try:
                data, total, etag = await self._range(key, start, first_end, pin)
            except Precondition as exc:
                raise self._replaced(key) from exc
            stop = total if end is None else min(end, total)
            if total < 0 or start + len(data) >= stop:
                return data
            # A large object: fetch the rest in parallel, all from the version the first
            # response came from (If-Match), so a concurrent overwrite cannot mix versions.
            offsets = range(start + len(data), stop, part)

            async def fetch(offset: int, etag: str | None = etag, stop: int = stop) -> bytes:
                piece, _, _ = await self._range(key, offset, min(offset + part, stop), etag)
                return piece

            try:
                # Every range at once: the store's request slots bound what is in flight.
                pieces = await bounded_map(fetch, offsets, limit=len(offsets), name="get range")
            except Precondition:
                if pin is not None:
                    raise self._replaced(key) from None
                continue  # overwritten mid-read: start again on the new version
            return b"".join([data, *pieces])  # each piece's length was checked in _range
        raise self._error(Precondition(), key)

    # -- put, stat, delete, list -------------------------------------------------------------

    async def _put(self, key: str, data: memoryview) -> ObjectInfo:
        if len(data) > self._config.part_bytes:
            writer = S3Writer(self, key)
            async with writer:
                # put() returns after the commit: ``data`` stays unchanged until then.
                await writer.write_lent(data, unchanging())
            assert writer.info is not None
            return writer.info
        info, _ = await put_object(self, key, [data.cast("B")])
        return info

    async def _stat(self, key: str) -> ObjectInfo:
        async def attempt(client: Any) -> ObjectInfo:
            head = await client.head_object(Bucket=self._bucket, Key=self._root + key)
            return object_info(key, head)

        try:
            return await self._call(key, "stat", attempt)
        except NotFound:
            # A HEAD answers a bare 404 for a missing bucket too: tell the two apart, once.
            if self._bucket_exists:
                raise
            if await self._bucket_found(await self._get_client(key)) is False:
                raise self._missing_bucket(key) from None
            self._bucket_exists = True
            raise

    async def _delete(self, key: str) -> None:
        async def attempt(client: Any) -> None:
            await client.delete_object(Bucket=self._bucket, Key=self._root + key)

        await self._call(key, "delete", attempt)

    async def abandoned_writes(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` that have unfinished multipart uploads.

        S3 cannot tell a killed writer's upload from a live one's: call
        :meth:`clean_up_writes` on these keys only when no other writer of them can be
        running.
        """
        prefix = check_prefix(prefix, self.url)
        self._check_open()
        full = self._root + prefix
        keys: set[str] = set()
        markers: dict[str, str] = {}
        while True:

            async def listing(client: Any, markers: dict[str, str] = markers) -> dict[str, Any]:
                return dict(
                    await client.list_multipart_uploads(Bucket=self._bucket, Prefix=full, **markers)
                )

            page = await self._call(prefix, "list uploads", listing)
            keys.update(u["Key"][len(self._root) :] for u in page.get("Uploads", ()))
            if not page.get("IsTruncated"):
                return sorted(keys)
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }

    async def clean_up_writes(self, key: str) -> int:
        """Abort every unfinished multipart upload of ``key``; returns how many there were.

        A writer killed mid-upload (SIGKILL, a lost machine) cannot abort its own upload, and
        its parts are stored, unseen and billed, until something aborts it. Call this before
        writing ``key`` again — the checkpoint engine does — when no other writer of ``key``
        can be running. (An ``AbortIncompleteMultipartUpload`` lifecycle rule on the bucket
        is the catch-all.)
        """
        key = check_key(key, self.url)
        self._check_open()
        full = self._root + key

        uploads: list[str] = []
        markers: dict[str, str] = {}
        while True:  # every page: a busy prefix can hold more than 1000 uploads

            async def listing(client: Any, markers: dict[str, str] = markers) -> dict[str, Any]:
                return dict(
                    await client.list_multipart_uploads(Bucket=self._bucket, Prefix=full, **markers)
                )

            page = await self._call(key, "list uploads", listing)
            uploads += [u["UploadId"] for u in page.get("Uploads", ()) if u.get("Key") == full]
            if not page.get("IsTruncated"):
                break
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }
        for upload_id in uploads:

            async def abort(client: Any, upload_id: str = upload_id) -> None:
                await client.abort_multipart_upload(
                    Bucket=self._bucket, Key=full, UploadId=upload_id
                )

            await self._call(key, "abort upload", abort)
        return len(uploads)

    async def _list(self, prefix: str, start_after: str) -> AsyncIterator[ObjectInfo]:
        token: str | None = None
        cut = len(self._root)
        while True:

            async def attempt(client: Any, token: str | None = token) -> dict[str, Any]:
                extra: dict[str, str] = {}
                if token:
                    extra["ContinuationToken"] = token
                elif start_after:
                    extra["StartAfter"] = self._root + start_after
                return dict(
                    await client.list_objects_v2(
                        Bucket=self._bucket, Prefix=self._root + prefix, MaxKeys=1000, **extra
                    )
                )

            page = await self._call(prefix, "list", attempt)
            for item in page.get("Contents", ()):
                modified = item.get("LastModified")
                yield ObjectInfo(
                    key=item["Key"][cut:],
                    size=int(item.get("Size", 0)),
                    etag=str(item.get("ETag", "")).strip('"') or None,
                    mtime=modified.timestamp() if modified is not None else None,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _open_writer(self, key: str) -> BaseWriter:
        writer = S3Writer(self, key)
        self._writers.add(writer)
        return writer

    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader:
        return S3Reader(self, key, chunk_bytes)


def _split(out: list[memoryview], start: int, part: int) -> list[tuple[int, list[memoryview]]]:
    """``out`` (read from ``start``) cut into ranges of at most ``part`` bytes, each with the
    views (or parts of views) it fills."""
    pieces: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    at, room = start, part
    begin = start
    for view in out:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        while view.nbytes:
            n = min(room, view.nbytes)
            current.append(view[:n])
            view, room, at = view[n:], room - n, at + n
            if room == 0:
                pieces.append((begin, current))
                current, room, begin = [], part, at
    if current:
        pieces.append((begin, current))
    return pieces


# Shown where users meet it (reprs, tracebacks: asyncstore.S3Store), whichever import
# reached it first: the package imports this module only when it is first used.
S3Store.__module__ = "asyncstore"

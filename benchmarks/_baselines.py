"""Hand-written aiobotocore code that benchmarks measure asyncstore against: what a careful
user would write without it."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from asyncstore.testing import SeaweedFS


@asynccontextmanager
async def aiobotocore_client(server: SeaweedFS, connections: int) -> AsyncIterator[Any]:
    """One aiobotocore S3 client for ``server``: path-style, no retries, no extra checksums."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(
        max_pool_connections=connections,
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": 1},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    async with get_session().create_client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=config,
    ) as client:
        yield client


async def multipart_put(
    client: Any, bucket: str, key: str, data: bytes | bytearray, part: int, inflight: int
) -> None:
    """Upload ``data`` as a multipart upload of ``part``-byte parts, ``inflight`` at once."""
    upload = await client.create_multipart_upload(Bucket=bucket, Key=key)
    limit = asyncio.Semaphore(inflight)

    async def one(number: int, offset: int) -> dict[str, Any]:
        async with limit:
            resp = await client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload["UploadId"],
                PartNumber=number,
                Body=io.BytesIO(data[offset : offset + part]),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

    parts = await asyncio.gather(
        *(one(n + 1, off) for n, off in enumerate(range(0, len(data), part)))
    )
    await client.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": list(parts)},
    )


async def ranged_get_to_file(
    client: Any, bucket: str, key: str, path: str, size: int, part: int, inflight: int
) -> None:
    """Download the ``size`` bytes of ``key`` into the file ``path`` as ranged GETs of
    ``part`` bytes, ``inflight`` at once, each written at its offset as it arrives."""
    limit = asyncio.Semaphore(inflight)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        async def piece(offset: int) -> None:
            async with limit:
                resp = await client.get_object(
                    Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + part - 1}"
                )
                async with resp["Body"] as body:
                    chunk: bytes = await body.read()
            if len(chunk) != min(part, size - offset):
                raise OSError(f"{key}: range at {offset} returned {len(chunk)} bytes")
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(fd, view, offset + len(chunk) - len(view)) :]

        await asyncio.gather(*(piece(offset) for offset in range(0, size, part)))
    finally:
        os.close(fd)

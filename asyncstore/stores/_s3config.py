"""The options of an S3 store, :class:`S3Config`.

Apart from the store itself (:mod:`.s3`) so that checking options, and opening a local or
memory store, never imports aiobotocore, botocore and aiohttp: a command line that lists a
local run should not wait for them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = ["S3Config"]

_MiB = 1 << 20
_MIN_PART = 5 * _MiB  # S3's minimum size for every part but the last
_MAX_PART = 5 * 1024 * _MiB

_SECRET_FIELDS = ("aws_secret_access_key", "aws_session_token")


class S3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of an S3 store (``open_store("s3://bucket/prefix", **options)``).

    Credentials not given here come from the standard AWS chain (environment variables, shared
    config and credentials files, instance metadata).
    """

    endpoint_url: str | None = None
    """The server, for S3-compatible services (``http://127.0.0.1:8333``). Defaults to
    ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``, then AWS itself."""

    region: str | None = None
    """The region to sign requests for; by default the AWS chain's, else ``us-east-1``."""

    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    profile: str | None = None
    """A named profile of the shared AWS config files."""

    max_inflight: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    """Requests in flight at once (an open reader holds one). S3 clients degrade beyond about
    32 concurrent requests each: latency climbs while throughput stays flat."""

    part_bytes: Annotated[int, msgspec.Meta(ge=_MIN_PART, le=_MAX_PART)] = 16 * _MiB
    """Size of multipart-upload parts and of the ranges a large ``get`` fetches in parallel.
    16 MiB keeps per-request overhead under a few percent at local-network speeds while a
    failed part costs little to resend."""

    upload_max_inflight: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    """Parts of one upload in flight at once. A writer holds at most this many parts plus the
    one it is filling: 80 MiB at the defaults."""

    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    """Attempts per request, the first included, before :class:`StoreUnavailable`."""

    retry_base_delay: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    """First backoff cap in seconds; it doubles with each retry (full jitter)."""

    retry_max_delay: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Largest backoff cap in seconds."""

    connect_timeout: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Seconds to establish a connection."""

    read_timeout: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """Seconds to wait for the next bytes of a response before retrying the request."""

    create: bool = False
    """Create the bucket when the store is first used (or opened with ``async with``) and
    it does not exist yet; a bucket that exists, or that another process creates at the
    same moment, is used as it is. Off by default: a misspelt bucket name should fail,
    not create a second bucket. Creating needs the ``s3:CreateBucket`` permission."""

    checksum: Literal["crc32c"] | None = "crc32c"
    """The checksum sent with every upload (``x-amz-checksum-crc32c``) for the server to check
    before it stores anything: a body damaged on the way is refused and sent again, and the
    checksum the server returns tells the writer it checked (see
    :class:`~asyncstore.stores.CheckedUploads`). ``None`` sends none: the transport's own
    checks only."""

    sign_payload: bool = False
    """Sign each upload's payload (its SHA-256 in the signature), for a server that refuses
    ``UNSIGNED-PAYLOAD``. Off by default: the SHA-256 costs the client and the server a pass
    over every byte (several times CRC32C's cost) and adds no integrity the checksum does not
    give; the request itself stays signed either way."""

    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """``auto`` uses path-style URLs with a custom ``endpoint_url`` (what S3-compatible
    servers expect) and botocore's choice otherwise."""

    def _masked_fields(self) -> list[tuple[str, Any]]:
        # Never let a secret reach a log line or a traceback through a repr.
        return [
            (name, "***" if name in _SECRET_FIELDS and getattr(self, name) is not None
             else getattr(self, name))
            for name in self.__struct_fields__
        ]  # fmt: skip

    def __repr__(self) -> str:
        """The options, with the secret key and the session token masked (also ``str``)."""
        fields = ", ".join(f"{name}={value!r}" for name, value in self._masked_fields())
        return f"S3Config({fields})"

    def __rich_repr__(self) -> Any:
        """What ``rich`` prints: msgspec's own would show the secrets."""
        yield from self._masked_fields()

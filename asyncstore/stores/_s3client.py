"""The botocore side of an S3 store: sessions, client creation and what each client is set
up with.

A client is made on first use (:func:`open_client`) and shared by the stores opened with the
same options (:mod:`._s3pool`). The process keeps one
botocore session per profile and thread, so that opening many stores parses S3's service
model once. Each client sends bodies without ``Expect: 100-continue``, has botocore's own
retries and per-request checksums off (the store retries, and checks integrity end to end),
and has its credentials masked in botocore's debug log.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import TYPE_CHECKING, Any

from botocore import exceptions as bex

from ..errors import StoreError
from . import _redact
from ._s3fast import SignedRequests
from ._s3responses import describe

if TYPE_CHECKING:
    from ._s3config import S3Config


def resolved_endpoint(config: S3Config) -> str | None:
    """The server to talk to: the option, else the AWS environment variables; ``None`` for
    AWS itself."""
    return (
        config.endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


_SESSIONS: dict[tuple[str | None, int], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def _session(profile: str | None) -> Any:
    """A botocore session per profile and thread, reused by every store.

    Creating a client parses S3's service model, about 0.3 s of CPU; a session caches the
    parsed model, so the second store opened in a process (a data-loader worker, a test) pays
    nothing. One per thread, because botocore sessions are not safe to share across threads.
    """
    from aiobotocore.session import AioSession

    key = (profile, threading.get_ident())
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            session = AioSession(profile=profile) if profile else AioSession()
            _SESSIONS[key] = session
    return session


def _no_expect_header(params: dict[str, Any], **_: Any) -> None:
    """Send request bodies without ``Expect: 100-continue``.

    botocore asks for it on every streamed upload. It costs a round trip per PUT before the
    first body byte moves, and aiohttp writes the headers of such a request outside its error
    handling, so a connection reset at that moment surfaces as an unretrieved task exception
    besides the error the caller gets. Without it, a rejected upload wastes its body's
    bandwidth instead, which the retry policy bounds anyway.
    """
    params.get("headers", {}).pop("Expect", None)


async def _keep_credentials_out_of_logs(session: Any, config: S3Config) -> None:
    """Mask this store's credentials in botocore's DEBUG log (see :mod:`._redact`).

    The values come from the options or, when those have none, from the AWS chain the client
    resolved, so credentials from the environment or a profile are masked too.
    """
    secrets = [config.aws_secret_access_key, config.aws_session_token]
    if config.aws_secret_access_key is None:
        with contextlib.suppress(Exception):  # no credentials: nothing to mask
            credentials = await session.get_credentials()
            if credentials is not None:
                frozen = credentials.get_frozen_credentials()
                if inspect.isawaitable(frozen):  # aiobotocore's refreshable credentials
                    frozen = await frozen
                secrets += [frozen.secret_key, frozen.token]
    for secret in secrets:
        _redact.remember_secret(secret)
    _redact.install()


class NoCredentials(Exception):
    """No credentials were found to sign requests with (the store says for which object)."""


def no_credentials_message(where: str, endpoint: str | None) -> str:
    """What a :class:`PermissionDenied` for missing credentials says: where asyncstore
    looked, in the order it looks."""
    return (
        f"{where}: no credentials to sign requests to {endpoint or 'AWS S3'} with. "
        "asyncstore looks for them, in this order, in the store options "
        "aws_access_key_id/aws_secret_access_key (and aws_session_token), the environment "
        "variables AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), the "
        "shared config files ~/.aws/credentials and ~/.aws/config (or the files that "
        "AWS_SHARED_CREDENTIALS_FILE and AWS_CONFIG_FILE name; the profile option or "
        "AWS_PROFILE picks the profile), then container or instance metadata: set one of them"
    )


async def open_client(
    config: S3Config, endpoint: str | None, bucket: str, url: str
) -> tuple[Any, Any, SignedRequests]:
    """A new client for the store at ``url``: its context manager (whose ``__aexit__``
    closes it), the client, and the fast path (signed GETs and PUTs) beside it.

    Raises:
        NoCredentials: no credentials were found (the caller names the object).
        StoreError: the client cannot be created, or requests cannot be signed.
    """
    from aiobotocore.config import AioConfig

    style = config.addressing_style
    if style == "auto":
        style = "path" if endpoint else "auto"
    client_config = AioConfig(
        # A little above our own limit, so a slot never waits for a connection.
        max_pool_connections=config.max_inflight + 4,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        retries={"total_max_attempts": 1},  # ours, not botocore's: see module doc
        s3={"addressing_style": style},
        # Integrity is end to end in asyncstore (xxh3 on cache entries and checkpoint
        # chunks), and uploads go through the fast path with their own CRC32C: botocore's
        # requests here are small (create, complete, list, head).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        session = _session(config.profile)
        region = config.region or session.get_config_variable("region") or "us-east-1"
        cm = session.create_client(
            "s3",
            region_name=region,
            endpoint_url=endpoint,
            aws_access_key_id=config.aws_access_key_id,
            aws_secret_access_key=config.aws_secret_access_key,
            aws_session_token=config.aws_session_token,
            config=client_config,
        )
        client = await cm.__aenter__()
        client.meta.events.register_last("before-call.s3", _no_expect_header)
        await _keep_credentials_out_of_logs(session, config)
    except Exception as exc:
        raise StoreError(f"cannot create an S3 client for {url}: {describe(exc)}") from exc
    try:
        fast = await open_signed(client, config, bucket, url)
    except BaseException:
        await cm.__aexit__(None, None, None)
        raise
    return cm, client, fast


async def open_signed(client: Any, config: S3Config, bucket: str, url: str) -> SignedRequests:
    """The fast path (signed GETs and PUTs) to ``bucket`` beside a live ``client``.

    Raises:
        NoCredentials: no credentials were found (the caller names the object).
        StoreError: requests cannot be signed.
    """
    try:
        return await SignedRequests.create(client, _session(config.profile), bucket, config)
    except Exception as exc:
        if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
            raise NoCredentials(describe(exc)) from exc
        raise StoreError(
            f"cannot sign requests for {url}: {describe(exc)}; check that "
            "credentials are configured (options, environment or AWS profile)"
        ) from exc

"""open_store(): from a URL to a store."""

from __future__ import annotations

import os
import re
import typing
from typing import Any, TypeVar
from urllib.parse import SplitResult, quote, unquote, urlsplit

import msgspec

from .._config import build
from ..errors import InvalidArgument, InvalidURL
from ._base import Store
from ._keys import check_prefix
from ._s3config import S3Config
from .local import LocalConfig, LocalStore
from .memory import MemoryStore

C = TypeVar("C", bound=msgspec.Struct)

# S3 bucket naming rules: 3-63 characters of lower-case letters, digits, '.' and '-',
# starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SCHEMES = "memory://NAME, file:///absolute/path (or a plain path) and s3://bucket/prefix"


def open_store(url: str | os.PathLike[str], **options: typing.Any) -> Store:
    """Open the store at ``url``; no I/O happens until the store is used.

    Args:
        url: ``memory://NAME[/prefix]``, ``file:///absolute/path``, a plain local path
            (relative paths are taken from the current directory), or ``s3://bucket[/prefix]``.
        **options: the store's options, checked at once: :class:`LocalConfig` fields for
            local stores, :class:`S3Config` fields for S3 (``endpoint_url``, ``region``,
            credentials, ``create=True`` to create a missing bucket, ``max_inflight``,
            ``part_bytes``, ``max_attempts``, timeouts…). S3 stores opened with the same
            endpoint, credentials and client settings share one client.

    Returns:
        The store, an async context manager: use ``async with open_store(...) as store``.

    Raises:
        InvalidURL: the URL has an unknown scheme, no bucket, an invalid bucket name, embedded
            credentials or a malformed path.
        InvalidArgument: an option is unknown or has a bad value.

    Example::

        async with asyncstore.open_store("file:///tmp/data") as store:
            await store.put("train/0.bin", b"...")
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise InvalidURL(
            f"store URL {url!r} is a {type(url).__name__}; pass a str such as "
            f"'s3://bucket/prefix' ({_SCHEMES})"
        )
    if not url:
        raise InvalidURL(f"empty store URL; use {_SCHEMES}")
    if "\x00" in url:
        raise InvalidURL(f"store URL {_redact(url)!r} contains a NUL byte")
    if is_local(url):
        return open_local(local_path(url), options)
    shown = _redact(url)
    parts = _split(url, shown)
    scheme = parts.scheme.lower()
    _check_url_parts(parts.username, parts.password, parts.query, parts.fragment, shown)
    if scheme == "memory":
        name = parts.netloc
        if not name:
            raise InvalidURL(f"memory URL {shown!r} needs a name, for example memory://scratch")
        prefix = _prefix(parts.path, shown)
        if options:
            raise InvalidArgument(
                f"memory stores take no options; got {', '.join(sorted(options))} for {shown}"
            )
        return MemoryStore(name, prefix)
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise InvalidURL(f"S3 URL {shown!r} has no bucket; use s3://bucket/prefix")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise InvalidURL(
                f"S3 URL {shown!r}: {bucket!r} is not a valid bucket name (3-63 characters: "
                "lower-case letters, digits, '.' and '-', starting and ending with a letter or "
                "digit)"
            )
        prefix = _prefix(parts.path, shown)
        config = build(S3Config, options, shown)
        endpoint = config.endpoint_url
        if endpoint is not None:
            ep = urlsplit(endpoint)
            if ep.username is not None or ep.password is not None:
                raise InvalidURL(
                    f"endpoint_url {_redact(endpoint)!r} for {shown} embeds credentials; pass "
                    "them as aws_access_key_id/aws_secret_access_key or through the environment"
                )
            if ep.scheme not in ("http", "https") or not ep.hostname:
                raise InvalidURL(
                    f"endpoint_url {_redact(endpoint)!r} for {shown} is not an http(s) URL; "
                    "use for example http://127.0.0.1:8333"
                )
        # Imported here: aiobotocore, botocore and aiohttp take a while to import, and a
        # program (or a command line) that opens only local stores never needs them.
        from .s3 import S3Store

        return S3Store(bucket, prefix, config)
    raise InvalidURL(f"unknown scheme {parts.scheme!r} in store URL {shown!r}; use {_SCHEMES}")


def options_from_text(url: str, options: dict[str, str]) -> dict[str, Any]:
    """The options of the store at ``url``, given as text (a command line's ``key=value``),
    each converted by the type its option declares, ready for ``open_store(url, **result)``.

    ``part_bytes="5242880"`` becomes an int and ``create="true"`` a bool, while a str
    option keeps its text even when it looks like a number (a secret key ``12345``, a
    region ``2024``): the option says what its value is, never the text's look. Options for
    a memory store or a URL of an unknown scheme are passed on as they are, for
    :func:`open_store` to refuse.

    Raises:
        InvalidArgument: an option is unknown (the message names the closest one), or its
            text is not a value of its type (the message names the option, its text unless
            it is a credential, and what the option takes).
        InvalidURL: ``url`` is a ``file:`` URL that :func:`local_path` refuses.
    """
    if not options:
        return {}
    cls: type[msgspec.Struct]
    if is_local(url):
        cls, where = LocalConfig, f"file://{local_path(url)}"
    elif url.partition("://")[0].lower() == "s3":
        cls, where = S3Config, _redact(url)
    else:
        return dict(options)
    config = build(cls, options, where, text=True)
    # Only the options given: the rest keep open_store's defaults (and the AWS chain's).
    return {name: getattr(config, name) for name in options}


def is_local(url: str) -> bool:
    """Whether ``url`` names a local path: a ``file:`` URL or a plain path."""
    return "://" not in url or url[:5].lower() == "file:"


def local_path(url: str) -> str:
    """The absolute, normalised local path that a ``file:`` URL or a plain path names.

    The one place where every entry point (``open_store``, checkpoint targets, the
    ``torch.save``/``torch.load`` adapters) turns a local URL into a path, so that they all
    agree. A ``file:`` URL (``file:///abs``, ``file://localhost/abs``, ``file:/abs``) is
    percent-decoded (``my%20dir`` is ``my dir``); its path must be absolute, and empty,
    ``.`` and ``..`` segments are refused rather than resolved behind the caller's back. A
    plain path is taken as the OS takes it: relative to the current directory, with a
    leading ``~`` expanded to the home directory.

    Raises:
        InvalidURL: a ``file:`` URL names another host, embeds credentials, has a query,
            a fragment, a relative path, a refused segment, a NUL byte or bytes that are not
            UTF-8 once decoded; or a plain path contains a NUL byte.
    """
    shown = _redact(url)
    if "\x00" in url:
        raise InvalidURL(f"local path {shown!r} contains a NUL byte")
    if url[:5].lower() != "file:":
        return os.path.abspath(os.path.expanduser(url))
    parts = _split(url, shown)
    _check_url_parts(parts.username, parts.password, parts.query, parts.fragment, shown)
    if parts.netloc.lower() not in ("", "localhost"):
        raise InvalidURL(
            f"file URL {shown!r} names host {parts.hostname!r}; asyncstore reads local files "
            "only: write file:///absolute/path (three slashes)"
        )
    raw = parts.path
    if not raw.startswith("/"):
        raise InvalidURL(f"file URL {shown!r} needs an absolute path: file:///absolute/path")
    try:
        path = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise InvalidURL(
            f"file URL {shown!r} is not UTF-8 once percent-decoded; asyncstore takes UTF-8 "
            "file names"
        ) from None
    if "\x00" in path:
        raise InvalidURL(f"file URL {shown!r} contains a NUL byte (%00)")
    segments = path.split("/")[1:]
    if segments[-1] == "":
        segments.pop()  # one trailing '/' is a directory's usual spelling
    if any(segment in ("", ".", "..") for segment in segments):
        # Resolved lexically, '..' would differ from what the OS does through a symlink:
        # refuse, and show the URL the caller probably meant.
        meant = "file://" + quote(os.path.normpath(path))
        raise InvalidURL(
            f"file URL {shown!r} has an empty, '.' or '..' segment; asyncstore does not "
            f"resolve them: write the path itself, for example {meant!r}"
        )
    return os.path.normpath(path)


def open_local(path: str, options: dict[str, Any]) -> LocalStore:
    """A local store at ``path`` (from :func:`local_path`) with ``options``."""
    config = build(LocalConfig, options, f"file://{path}")
    root = os.path.normpath(path)
    if os.path.isfile(root):
        raise InvalidURL(f"file://{root} is a file; a local store's root is a directory")
    return LocalStore(root, config)


def _split(url: str, shown: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL" and the like
        raise InvalidURL(f"store URL {shown!r} is malformed: {exc}") from None


def _check_url_parts(
    username: str | None, password: str | None, query: str, fragment: str, shown: str
) -> None:
    if username is not None or password is not None:
        raise InvalidURL(
            f"store URL {shown!r} embeds credentials; pass them as options "
            "(aws_access_key_id=…, aws_secret_access_key=…) or through the environment"
        )
    if query or fragment:
        raise InvalidURL(f"store URL {shown!r} has a query or fragment; asyncstore uses neither")


def _prefix(path: str, shown: str) -> str:
    # One '/' separates the bucket or name from the prefix, and one may end it: any other
    # empty segment ('s3://bucket//x') is refused, never silently dropped, since 'x' and
    # '/x' are different keys on S3.
    if path.startswith("//") or path.endswith("//"):
        scheme, _, rest = shown.partition("://")
        netloc = rest.split("/", 1)[0]
        meant = f"{scheme}://{netloc}/" + "/".join(s for s in path.split("/") if s)
        raise InvalidURL(f"store URL {shown!r} has an empty path segment ('//'); write {meant!r}")
    prefix = path.strip("/")
    if prefix:
        try:
            check_prefix(prefix + "/", shown)
        except InvalidArgument as exc:
            raise InvalidURL(f"store URL {shown!r} has a malformed path: {exc}") from None
    return prefix


def _redact(url: str) -> str:
    """``url`` without any user:password part, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}{sep}{netloc}{slash}{path}"

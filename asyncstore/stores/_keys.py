"""Key and prefix validation, shared by every store.

One set of rules for all stores means a key that works against local disk works against S3
too, and that no key can name anything outside a store's root.
"""

from __future__ import annotations

from ..errors import InvalidArgument, InvalidKey

MAX_KEY_BYTES = 1024
"""S3's limit on the length of an object key, applied to every store alike."""

MAX_SEGMENT_BYTES = 255
"""The longest segment (a file or directory name on local disk: NAME_MAX), applied to every
store alike, so that a key S3 takes is one a local store can hold too."""

RESERVED_PREFIX = ".asyncstore"
"""Segments starting with this are reserved: local stores keep their temporary files there."""

_EXAMPLE = "keys are '/'-separated relative paths such as 'train/00001.jpg'"


def check_key(key: object, where: str) -> str:
    """Return ``key`` if it is a valid key, else raise :class:`InvalidKey`.

    ``where`` is the store's URL, used in the message.
    """
    # The common case in a few C-level string scans (hot: every cache and prefetch call).
    # ASCII means valid UTF-8 of len(key) bytes; no segment starting with '.' rules out
    # '.', '..' and reserved segments; no '//' or trailing '/' rules out empty ones.
    if (
        type(key) is str
        and key
        and key.isascii()
        and len(key) <= MAX_KEY_BYTES
        and (len(key) <= MAX_SEGMENT_BYTES or _segments_fit(key))
        and key[0] not in "/."
        and key[-1] != "/"
        and "/." not in key
        and "//" not in key
        and "\x00" not in key
    ):
        return key
    if not isinstance(key, str):
        raise InvalidKey(
            f"key {key!r} for {where} is a {type(key).__name__}, not a str; {_EXAMPLE}"
        )
    if not key:
        raise InvalidKey(f"empty key for {where}; {_EXAMPLE}")
    reason = _problem(key)
    if reason is None:
        for segment in key.split("/"):
            reason = _segment_problem(segment)
            if reason is not None:
                break
    if reason is not None:
        raise InvalidKey(f"invalid key {_show(key)} for {where}: {reason}; {_EXAMPLE}")
    return key


def check_key_list(keys: list[str], where: str) -> list[str]:
    """Return ``keys`` if every one is a valid key, else raise :class:`InvalidKey` for the
    first that is not (as :func:`check_key` would).

    For long lists (a plan's slice): the common case is a few scans of the keys joined
    with NUL, which no valid key holds, instead of a call per key.
    """
    joined = "\x00".join(keys) if set(map(type, keys)) <= {str} else None
    if (
        joined is not None
        and joined.count("\x00") == len(keys) - 1
        and joined.isascii()
        and (not keys or max(map(len, keys)) <= MAX_SEGMENT_BYTES)
        and joined[:1] not in "/.\x00"
        and joined[-1:] not in "/\x00"
        and "/." not in joined
        and "//" not in joined
        and "\x00/" not in joined
        and "\x00." not in joined
        and "/\x00" not in joined
        and "\x00\x00" not in joined
    ):
        return keys
    for key in keys:
        check_key(key, where)
    return keys


def check_prefix(prefix: object, where: str) -> str:
    """Return ``prefix`` if it can start a key, else raise :class:`InvalidKey`.

    A prefix may be empty, may end with ``/`` and may end in the middle of a segment
    (``"train/000"``); its complete segments follow the key rules.
    """
    if not isinstance(prefix, str):
        raise InvalidKey(
            f"prefix {prefix!r} for {where} is a {type(prefix).__name__}, not a str; {_EXAMPLE}"
        )
    if not prefix:
        return prefix
    reason = _problem(prefix)
    if reason is None:
        segments = prefix.split("/")
        # The last piece may be a partial segment ("0000" of "0000123.jpg") or empty ("train/").
        complete, last = segments[:-1], segments[-1]
        for segment in complete:
            reason = _segment_problem(segment)
            if reason is not None:
                break
        if reason is None and last in (".", ".."):
            reason = "'.' and '..' segments are not allowed"
        if reason is None:
            reason = _length_problem(last)  # no key could start with it
    if reason is not None:
        raise InvalidKey(f"invalid prefix {_show(prefix)} for {where}: {reason}; {_EXAMPLE}")
    return prefix


def check_range(start: object, end: object, where: str) -> tuple[int, int | None]:
    """Validate a byte range and return it as ``(start, end)`` with ``start`` filled in.

    ``end`` is exclusive; ``None`` means the end of the object.
    """
    for name, value in (("start", start), ("end", end)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(
                f"{name}={value!r} for {where}: byte offsets are ints (or None), "
                f"not {type(value).__name__}"
            )
        if value < 0:
            raise InvalidArgument(
                f"{name}={value} for {where}: byte offsets count from the start of the object "
                "and cannot be negative"
            )
    first = 0 if start is None else start
    assert isinstance(first, int)
    if end is not None:
        assert isinstance(end, int)
        if end < first:
            raise InvalidArgument(
                f"end={end} is before start={first} for {where}: the range is [start, end), "
                "end exclusive"
            )
        return first, end
    return first, None


def _problem(text: str) -> str | None:
    if text.startswith("/"):
        return "absolute paths are not allowed (remove the leading '/')"
    if "\x00" in text:
        return "NUL bytes are not allowed"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"longer than {MAX_KEY_BYTES} bytes in UTF-8"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid Unicode (lone surrogate)"
    return None


def _segments_fit(key: str) -> bool:
    return max(map(len, key.split("/"))) <= MAX_SEGMENT_BYTES


def _length_problem(segment: str) -> str | None:
    size = len(segment.encode("utf-8", "surrogatepass"))
    if size > MAX_SEGMENT_BYTES:
        return (
            f"segment {_show(segment)} is {size} bytes in UTF-8, over the limit of "
            f"{MAX_SEGMENT_BYTES} (the longest file name local disks take); split it with '/'"
        )
    return None


def _segment_problem(segment: str) -> str | None:
    if segment == "":
        return "empty segments ('//' or a trailing '/') are not allowed"
    if segment in (".", ".."):
        return "'.' and '..' segments are not allowed"
    if segment.startswith(RESERVED_PREFIX):
        return f"segments starting with {RESERVED_PREFIX!r} are reserved for asyncstore's own files"
    return _length_problem(segment)


def _show(text: str) -> str:
    # A 1 MiB key in an error message helps nobody: keep the start and say how long it was.
    if len(text) > 120:
        return f"{text[:100]!r}… ({len(text)} characters)"
    return repr(text)

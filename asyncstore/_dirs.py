"""Local directories given by the user: made and checked where they are given, so that a
wrong path is refused with a clear error at construction, not later in a worker or as a
feature silently off."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable

from .errors import InvalidArgument, PermissionDenied

__all__ = ["check_disk_dir", "make_dir"]

# What makes a directory unusable for good: the path, or this process's rights over it,
# which no retry changes. Other errors (a read-only or full file system, an I/O error) are
# faults of the device.
_NOT_PERMITTED = frozenset({errno.EACCES, errno.EPERM})
_NOT_A_DIRECTORY = frozenset(
    {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP}
)


def _refusal(exc: OSError, path: str, parameter: str, choose: str) -> Exception | None:
    # The asyncstore error for a path that can never work; None for a device fault.
    if exc.errno in _NOT_PERMITTED:
        return PermissionDenied(
            f"{parameter}={path!r}: this process (uid {os.geteuid()}) may not write "
            f"there ({exc.strerror}); {choose}"
        )
    if exc.errno == errno.EEXIST:
        return InvalidArgument(f"{parameter}={path!r} is a file, not a directory; {choose}")
    if exc.errno == errno.ENOTDIR:
        return InvalidArgument(
            f"{parameter}={path!r}: a part of that path is a file, not a directory; {choose}"
        )
    if exc.errno in _NOT_A_DIRECTORY:
        return InvalidArgument(
            f"{parameter}={path!r} cannot be created as a directory ({exc.strerror}); {choose}"
        )
    return None


def _attempt(
    action: Callable[[], object], path: str, parameter: str, choose: str
) -> OSError | None:
    # ``action()``; a path that can never work raises its asyncstore error, a device fault
    # is returned for the caller to decide on.
    try:
        action()
    except OSError as exc:
        refusal = _refusal(exc, path, parameter, choose)
        if refusal is not None:
            raise refusal from exc
        return exc
    return None


def make_dir(path: str, parameter: str, choose: str) -> OSError | None:
    """Create the directory ``path`` (and its parents) if it is missing; write nothing in
    one that exists (it may be read-only on purpose).

    Args:
        path: the directory.
        parameter: its parameter's name, for the message.
        choose: what to do instead, for the message.

    Returns:
        None when the directory is there; the error when the device failed (a read-only or
        full file system, an I/O error), for the caller to decide on.

    Raises:
        PermissionDenied: this process may not create the directory.
        InvalidArgument: the path is a file, lies under one, or cannot be a directory.
    """
    return _attempt(lambda: os.makedirs(path, exist_ok=True), path, parameter, choose)


def check_disk_dir(path: str, parameter: str, without: str) -> OSError | None:
    """Create the directory ``path`` if it is missing and check that this process can write
    in it (a file created and removed): a disk tier's directory, which is written to.

    Args:
        path: the directory.
        parameter: its parameter's name, for the message (``"disk_dir"``, ``"cache_dir"``).
        without: how to go without a disk tier, for the message.

    Returns:
        None when the directory is usable; the error when the device failed (a read-only
        or full file system, an I/O error): the disk tier then switches itself off when it
        opens, as it does when that happens later.

    Raises:
        PermissionDenied: this process may not create the directory or write in it.
        InvalidArgument: the path is a file, lies under one, or cannot be made a directory.
    """
    choose = f"choose a directory this process can write, or {without}"
    failed = make_dir(path, parameter, choose)
    if failed is not None:
        return failed
    return _attempt(lambda: _probe(path), path, parameter, choose)


def _probe(path: str) -> None:
    fd, probe = tempfile.mkstemp(prefix=".asyncstore-probe-", dir=path)
    os.close(fd)
    os.unlink(probe)

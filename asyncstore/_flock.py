"""Advisory whole-file locks between processes (``flock``): released by the kernel when
their holder dies, so a killed process never leaves one behind."""

from __future__ import annotations

import fcntl

__all__ = ["try_lock"]


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on ``fd`` if no other open file holds one; never waits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True

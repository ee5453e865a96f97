"""Writes of local stores, in worker threads: the temporary file beside a key that becomes
the object on commit, and the cleanup of those that killed writers left behind.

A temporary file's name carries the reserved prefix (no key or listing ever sees it), 12 hex
digits, and the start of the target's name for whoever inspects a crashed directory. Its
writer holds a lock on it until the rename; a file nobody holds a lock on is abandoned, which
is how :func:`remove_abandoned` tells the two apart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import threading
from collections.abc import Callable
from typing import IO

from .._flock import try_lock
from ..errors import StoreError
from ._direct import DirectAppender
from ._keys import RESERVED_PREFIX

_TMP_PREFIX = f"{RESERVED_PREFIX}-tmp-"


def _hint(name: str) -> str:
    # File names are limited to 255 bytes: keep at most 150 bytes of the target's name.
    return name.encode()[:150].decode(errors="ignore")


def _is_temp(entry: str) -> bool:
    # Exactly the names TempFile gives: prefix, 12 hex digits, "-", the target's name.
    digits = entry[len(_TMP_PREFIX) : len(_TMP_PREFIX) + 12]
    return (
        entry.startswith(_TMP_PREFIX)
        and len(digits) == 12
        and all(c in "0123456789abcdef" for c in digits)
        and entry[len(_TMP_PREFIX) + 12 : len(_TMP_PREFIX) + 13] == "-"
    )


def abandoned_names(directory: str, start: str) -> list[str]:
    """The names, starting with ``start``, of the keys in ``directory`` that have a
    temporary file no live writer holds. (A name longer than the 150 bytes a temporary
    file's name keeps cannot be told whole, and is left out.)"""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found: set[str] = set()
    for entry in names:
        if not _is_temp(entry):
            continue
        name = entry[len(_TMP_PREFIX) + 13 :]
        if not name.startswith(start) or len(name.encode()) >= 150:
            continue
        try:
            fd = os.open(os.path.join(directory, entry), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if try_lock(fd):
                found.add(name)
        finally:
            os.close(fd)  # closing drops the lock taken to look
    return sorted(found)


def remove_abandoned(directory: str, name: str) -> int:
    """Remove the temporary files of the key ``name`` in ``directory`` whose writers are
    gone (no live process holds their lock); return how many were removed."""
    hint = _hint(name)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    removed = 0
    for entry in names:
        if not (_is_temp(entry) and entry[len(_TMP_PREFIX) + 13 :] == hint):
            continue
        path = os.path.join(directory, entry)
        try:
            # O_NONBLOCK: a FIFO given a reserved name must not block the cleanup.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        if not try_lock(fd):
            os.close(fd)
            continue  # its writer is alive
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


def write_all(file: IO[bytes], data: memoryview) -> None:
    """Write all of ``data`` to an unbuffered file."""
    # An unbuffered write is one system call, which may write less than asked (Linux stops
    # at 2 GiB - 4 KiB per call): loop until every byte is down.
    while len(data):
        written = file.write(data)
        if not written:
            raise OSError(errno.EIO, "the file accepted no bytes")
        data = data[written:]


class TempFile:
    """A temporary file beside a key, renamed over it on :meth:`commit`, removed otherwise.

    Used from worker threads only; every method blocks.

    Args:
        make_path: creates the key's directory and returns the key's path; called again when
            the directory vanishes before the file is made.
        where: the key and store, as messages name them.
        fsync: flush the file and its directory entry to stable storage on commit.
        direct: write around the page cache (see :class:`DirectAppender`).
    """

    def __init__(
        self, make_path: Callable[[], str], where: str, *, fsync: bool, direct: bool = False
    ) -> None:
        self.make_path = make_path
        self.where = where
        self.fsync = fsync
        self.path = ""
        self.tmp = ""
        self.file: IO[bytes]
        self.done = False
        self.direct = direct
        self.appender: DirectAppender | None = None
        self._appended = 0  # bytes written through ``file`` (without an appender)
        # Held by each write, commit and abort: an abort waits for a write still running in
        # its thread (a cancelled caller does not stop the thread) before closing the file.
        self.lock = threading.Lock()

    def __enter__(self) -> TempFile:
        for _ in range(3):
            self.path = self.make_path()
            directory, name = os.path.split(self.path)
            # The name carries the target's name for whoever inspects a crashed directory, and
            # the reserved prefix so no listing or key can ever see it.
            self.tmp = os.path.join(directory, f"{_TMP_PREFIX}{secrets.token_hex(6)}-{_hint(name)}")
            try:
                self.file = open(self.tmp, "xb", buffering=0)
            except FileNotFoundError:
                continue  # a concurrent delete removed the empty directory: create it again
            # Held until the file is renamed or removed; the kernel drops it when this
            # process dies, which is how clean_up_writes() tells abandoned temp files.
            if not self._lock_own_file():
                continue  # a cleanup took it between its creation and the lock: start over
            if self.direct:
                try:
                    self.appender = DirectAppender(self.tmp, self.file.fileno())
                except BaseException:
                    self.abort()
                    raise
            return self
        raise StoreError(
            f"cannot write {self.where}: its directory keeps vanishing, or its "
            "temporary files are removed as they are made (another process cleaning up?)"
        )

    def _lock_own_file(self) -> bool:
        # Another process's clean_up_writes() may lock and remove the file in the moment
        # before this lock: then the name no longer leads to our file, and we must not write
        # into a file nobody can see.
        fd = self.file.fileno()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            ours = os.fstat(fd)
            there = os.stat(self.tmp)
            if (ours.st_dev, ours.st_ino) == (there.st_dev, there.st_ino):
                return True
        except (BlockingIOError, FileNotFoundError):
            pass
        self.file.close()
        return False

    def write(self, data: memoryview) -> None:
        """Append ``data``; refused once the file is committed or abandoned."""
        with self.lock:
            if self.done:
                raise OSError(errno.EBADF, "the write was abandoned")
            if self.appender is not None:
                self.appender.write(data)
            else:
                write_all(self.file, data)
                self._appended += len(data)

    @property
    def settled(self) -> int:
        """How many leading bytes of the file are written for good (a reader sees them and
        they never change): all but what an appender still holds back. Read from any
        thread; it only grows."""
        return self.appender.settled if self.appender is not None else self._appended

    def commit(self) -> os.stat_result:
        """Make the file the key's object; return the file's status."""
        with self.lock:
            return self._commit()

    def _commit(self) -> os.stat_result:
        if self.appender is not None:
            self.appender.finish()
            self.appender.close()
        fd = self.file.fileno()
        if self.fsync:
            os.fsync(fd)
        st = os.fstat(fd)
        try:
            # Renamed while still open (and locked), so that no cleanup can take it first.
            os.rename(self.tmp, self.path)
        except IsADirectoryError:
            raise StoreError(
                f"cannot write {self.where}: keys under it exist, and a local "
                "store cannot hold both 'a' and keys under 'a/'"
            ) from None
        self.done = True
        self.file.close()
        if self.fsync:
            # The rename is durable only once the directory entry is on disk too.
            dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return st

    def abort(self) -> None:
        """Close and remove the file unless it was committed (after a write in progress)."""
        with self.lock:
            if self.done:
                return
            self.done = True
            if self.appender is not None:
                self.appender.close()
            file = getattr(self, "file", None)  # None if __enter__ failed before opening it
            if file is not None:
                file.close()
        if self.tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)

    def __exit__(self, *exc_info: object) -> None:
        self.abort()

"""The errors asyncstore raises.

Every error derives from :class:`AsyncStoreError`. The categories below say what went wrong
from the caller's point of view, so a handler can decide what to do without knowing which store
or library was underneath: foreign exceptions (botocore, aiohttp, ``OSError``) are translated at
the store boundary and kept as ``__cause__``.

Messages name the URL and key and say what to do next; they never contain credentials.
"""

from __future__ import annotations

import pickle

__all__ = [
    "AsyncStoreError",
    "InvalidArgument",
    "InvalidKey",
    "InvalidURL",
    "NotFound",
    "PermissionDenied",
    "StoreUnavailable",
    "StoreError",
    "StoreClosed",
    "IntegrityError",
    "UnsafeCheckpoint",
    "InvalidTarget",
    "Unsupported",
    "Unpicklable",
]


class AsyncStoreError(Exception):
    """The root of every error asyncstore raises; catch it to handle them all."""


class InvalidArgument(AsyncStoreError, ValueError, TypeError):
    """Raised when a public entry point is given a value it cannot use.

    The message names the parameter, the offending value and what is accepted. Also a
    :class:`ValueError` and a :class:`TypeError` (the standard library and torch raise
    either for a bad argument, depending on the case), so a handler written for them keeps
    working when asyncstore's functions replace theirs.
    """


class InvalidTarget(InvalidArgument, AttributeError):
    """Raised for a checkpoint target that is none of a path, a URL, a ``(store, key)``
    pair or a file object: it lacks ``write`` (saving) or ``read``/``seek`` (loading).

    An :class:`InvalidArgument`, and also an :class:`AttributeError`, which ``torch.save``
    and ``torch.load`` raise for such an object, so their callers' handlers keep working.
    """


class Unsupported(InvalidArgument, RuntimeError):
    """Raised for arguments this machine or this combination of options cannot honour:
    tensors for a device it lacks (CUDA without CUDA), a ``pickle_module`` with
    ``weights_only=True``, a nested or quantized tensor under
    ``torch.serialization.skip_data()``.

    An :class:`InvalidArgument`, and also a :class:`RuntimeError`, which torch raises for
    the same, so its callers' handlers keep working.
    """


class InvalidKey(InvalidArgument):
    """Raised when a key is not a valid ``/``-separated relative path.

    Empty keys, absolute paths, empty, ``.`` or ``..`` segments, NUL bytes, keys over 1024
    UTF-8 bytes, segments over 255 UTF-8 bytes (the longest file name a local disk takes) and
    segments reserved by asyncstore (``.asyncstore*``) are refused, for every store alike, so
    a key that works in one store works in all of them and can never escape a store's root.
    """


class InvalidURL(InvalidArgument):
    """Raised by :func:`asyncstore.open_store` for a URL it cannot open.

    For example an unknown scheme, an S3 URL without a bucket, a bucket name that is not a valid
    DNS name, or credentials embedded in the URL.
    """


class NotFound(AsyncStoreError, FileNotFoundError):
    """Raised when a key (or the bucket or directory holding it) does not exist.

    Also a :class:`FileNotFoundError`, like the error ``open()`` raises for a missing file.
    """


class PermissionDenied(AsyncStoreError, PermissionError):
    """Raised when the store refuses the operation: wrong or missing credentials, a policy that
    denies access, or a file the process may not read or write."""


class StoreUnavailable(AsyncStoreError):
    """Raised when the store could not be reached, or kept failing, after every retry.

    Connection errors, timeouts, throttling and server errors are retried with backoff first;
    this error means the last attempt failed too. It names the URL, the number of attempts and
    the last failure. Retrying later may succeed.
    """


class StoreError(AsyncStoreError):
    """Raised when the store answers with an error that no other category describes.

    For example a request the server rejects as malformed, or a local path that is a file where
    a directory is needed. Retrying the same call will not help.
    """


class StoreClosed(AsyncStoreError):
    """Raised when a store, reader or writer is used after it was closed."""


class IntegrityError(AsyncStoreError):
    """Raised when bytes do not match their checksum or a format is not what it claims to be.

    The message names what failed (object, chunk, offset) and where it came from.
    """


class UnsafeCheckpoint(AsyncStoreError, pickle.UnpicklingError):
    """Raised when a checkpoint cannot be saved or loaded safely as asked.

    Loading with ``weights_only=True`` (the default) raises it for a checkpoint that names any
    Python global beyond tensors, containers and plain values, before importing it: a crafted
    file cannot run code. It also raises it for a structure that builds a tensor past the end
    of its storage, attaches backward hooks or other state, or would turn a few bytes into a
    huge allocation, and for sizes that need more memory than the machine has free or more
    than the stored bytes can decode to, before anything of that size is allocated. Saving
    raises it (as :class:`Unpicklable`) for an object that cannot be pickled.

    Also a :class:`pickle.UnpicklingError`, the error ``torch.load`` raises for what its
    ``weights_only`` refuses, so a handler written for ``torch.load`` keeps working.
    """


class Unpicklable(UnsafeCheckpoint, pickle.PicklingError, AttributeError, TypeError):
    """Raised by a save for an object that cannot be pickled (a lambda, a lock, a local
    class, a FakeTensor outside ``skip_data(materialize_fake_tensors=True)``).

    An :class:`UnsafeCheckpoint`, and also the :class:`pickle.PicklingError`,
    :class:`AttributeError` and :class:`TypeError` that pickle, and so ``torch.save``,
    raise for such objects, so their callers' handlers keep working. The pickling error is
    its ``__cause__``.
    """

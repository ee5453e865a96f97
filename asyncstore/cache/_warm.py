"""Warming a cache: reading many keys through it, a bounded number at once; reading the
blocks of a range a window at a time; and the check of a ``keys`` argument that the cache's
methods share.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable

from .._concurrency import bounded_each, bounded_map
from ..errors import InvalidArgument


def check_keys(keys: object, method: str) -> None:
    """Refuse a ``keys`` argument of ``method`` that is not an iterable of keys.

    Raises:
        InvalidArgument: ``keys`` is a single str (or bytes), or not iterable.
    """
    # A str is iterable too, and each of its characters a valid key: refuse it rather than
    # read "a", "b", "c".
    if isinstance(keys, str | bytes | bytearray | memoryview):
        raise InvalidArgument(
            f"{method}(keys={keys!r}): keys is a {type(keys).__name__}; pass an iterable of "
            f"keys, for example [{keys!r}]"
        )
    if not isinstance(keys, Iterable | AsyncIterable):
        raise InvalidArgument(
            f"{method}(keys={keys!r}): keys is a {type(keys).__name__}; pass an iterable "
            "of str keys"
        )


def _positive(name: str, value: object, *, allow_none: bool = False, unit: str = "bytes") -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{name}={value!r}: pass a positive number of {unit}")


async def read_all(
    get: Callable[[str], Awaitable[bytes]],
    keys: Iterable[str] | AsyncIterable[str],
    max_inflight: int,
) -> int:
    """Call ``get`` on every key of ``keys``, ``max_inflight`` at a time; returns how many
    succeeded (all of them, when it returns). Keys are taken only as reads end: a million
    keys never become a million tasks, nor a list.

    Raises:
        InvalidArgument: ``max_inflight`` is not a positive int.
        Exception: the first error a ``get`` raised, as itself, not inside an
            ``ExceptionGroup``; the calls still running are cancelled.
    """
    _positive("max_inflight", max_inflight, unit="reads at once, for example 32")
    return await bounded_each(get, keys, limit=max_inflight, name="warm")


RANGE_WINDOW = 16
"""Most blocks of one ranged read fetched at once: 128 MiB of 8 MiB blocks in flight keeps
a store busy, and bounds the empty reads past an object's end a too-long range costs."""


async def read_blocks(
    get_block: Callable[[int], Awaitable[bytes]], first: int, last: int | None, size: int
) -> bytes:
    """Blocks ``first`` to ``last`` (to the object's end for None) of ``size`` bytes each,
    joined: the first alone, then windows of :data:`RANGE_WINDOW`, stopping at the first
    short block (the object's end). A range past the end costs at most one window of empty
    reads, never one read per block asked for (``end=2**63`` is a valid range), and the
    wait can be cancelled between windows."""
    blocks: list[bytes] = []
    index, window = first, 1
    while last is None or index <= last:
        stop = index + window if last is None else min(index + window, last + 1)
        got = await bounded_map(get_block, range(index, stop), limit=window, name="block")
        blocks.extend(got)
        if any(len(block) < size for block in got):
            break
        index, window = stop, RANGE_WINDOW
    return b"".join(blocks)

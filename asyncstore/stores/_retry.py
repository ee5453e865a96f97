"""Retries with exponential backoff and full jitter.

Full jitter (a delay drawn uniformly from ``[0, min(cap, base * 2**attempt))``) spreads the
retries of many clients that failed together, so they do not come back in lockstep and
overload a recovering server again; see "Exponential Backoff And Jitter", AWS Architecture
Blog, 2015.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

logger = logging.getLogger("asyncstore.retry")


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """The pause before retry number ``attempt`` (1 for the first retry)."""
    return random.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    max_attempts: int,
    base_delay: float,
    max_delay: float,
    retryable: Callable[[BaseException], bool],
    exhausted: Callable[[Exception, int], Exception],
    what: str,
) -> T:
    """Run ``call`` until it succeeds, retrying the failures ``retryable`` accepts.

    After ``max_attempts`` attempts the last failure is handed to ``exhausted(exc, attempts)``,
    whose error is raised from it. Failures that are not retryable propagate at once.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as exc:
            if not retryable(exc):
                raise
            if attempt >= max_attempts:
                raise exhausted(exc, attempt) from exc
            delay = backoff_delay(attempt, base_delay, max_delay)
            logger.debug(
                "%s failed (attempt %d of %d: %s); retrying in %.3f s",
                what,
                attempt,
                max_attempts,
                type(exc).__name__,
                delay,
            )
            await anyio.sleep(delay)

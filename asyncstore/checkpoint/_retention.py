"""Which versions retention deletes: a pure function of what the run holds and the policy.

The rules (docs/checkpoints.md, "What retention keeps"):

- Versions are ordered by when they were saved (:attr:`Candidate.saved`; the step breaks
  ties). After a rollback (a save at a lower step than others there) the version saved
  last is the newest, whatever its step.
- The *window* runs from the newest version back to the ``keep_last``-th one that is
  loadable; every version in it is kept, damaged ones included (they are evidence, and
  they cost a slot of nothing). So a damaged version never takes the place of a good one,
  and a run whose versions are all damaged loses none of them.
- Older than the window, a version is kept when its step is a multiple of ``keep_every``
  or it is protected (the version just saved, one still uploading to the mirror, one a
  save in flight writes); every other one is a victim.

Whether a version is loadable costs reads, so the caller checks lazily, newest first:
:func:`window` says in which order, and :func:`victims` reads the flags only within the
window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Candidate", "newest_first", "victims"]


class Candidate(NamedTuple):
    """One version as retention sees it."""

    step: int
    saved: float  # when it was saved (Unix seconds): orders versions, newest last
    protected: bool = False  # kept whatever the policy says
    loadable: bool | None = None  # None: not checked (only needed within the window)


def newest_first(candidates: Iterable[Candidate]) -> list[Candidate]:
    """``candidates`` from the most recently saved to the oldest (ties: higher step first)."""
    return sorted(candidates, key=lambda c: (c.saved, c.step), reverse=True)


def victims(candidates: Iterable[Candidate], keep_last: int, keep_every: int | None) -> list[int]:
    """The steps to delete, in ascending order.

    ``candidates`` may be in any order; each one in the window (see the module's doc) must
    have ``loadable`` set, and the others need not.

    Raises:
        ValueError: ``keep_last`` < 1 or ``keep_every`` < 1; or a version in the window was
            not checked (a bug of the caller's, not a reason to delete anything).
    """
    if keep_last < 1 or (keep_every is not None and keep_every < 1):
        raise ValueError(f"keep_last={keep_last}, keep_every={keep_every}: both must be >= 1")
    order = newest_first(candidates)
    good = 0
    end = len(order)
    for index, candidate in enumerate(order):
        if good == keep_last:
            end = index
            break
        if candidate.loadable is None:
            raise ValueError(f"step {candidate.step} is in the window but was not checked")
        good += candidate.loadable
    return sorted(
        c.step
        for c in order[end:]
        if not c.protected and (keep_every is None or c.step % keep_every != 0)
    )

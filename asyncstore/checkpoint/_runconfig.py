"""The options and reports of a :class:`~asyncstore.checkpoint.Checkpointer`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .._config import SaveConfig

__all__ = ["CheckpointerConfig", "CheckpointerStats", "VerifyReport"]


class CheckpointerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :class:`Checkpointer`; see its docstring for each."""

    keep_last: Annotated[int, msgspec.Meta(ge=1)] = 3
    """Three: a damaged newest version still leaves two to fall back on, at three times a
    checkpoint's size on disk."""

    keep_every: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Nothing kept for good unless asked: long-term versions are a choice of the run."""

    differential: bool = True
    """On: a training run changes some tensors between saves (frozen layers, embeddings,
    buffers), and rewriting unchanged gigabytes costs time, disk and upload bandwidth."""

    full_every: Annotated[int, msgspec.Meta(ge=1)] = 10
    """Ten: a chain of differential versions shares the chunks of its full one, so a
    damaged pack damages up to that many versions, and a pack with one chunk still in use
    keeps all its bytes. A full save every tenth bounds both, at about 1.9 times the bytes
    of saving a tenth each time."""

    mirror_timeout: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Ten seconds: a listing waits this long for a mirror that does not answer, then
    goes on with the local versions (a resume must not hang on a stalled mirror), while a
    healthy S3 lists a run's versions in well under a second."""

    close_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = 300.0
    """Five minutes: closing waits this long for uploads still running, then abandons
    them (they stay local; the next checkpointer on the run uploads them), so that a job
    ends even when its mirror stalls. ``None`` waits for them however long they take."""

    save: SaveConfig = msgspec.field(default_factory=SaveConfig)
    """The options every save of the run is made with (its own saves, its distributed
    versions' writers), as for :func:`asyncstore.save`; ``chunk_bytes`` is also what a
    differential save compares: a chunk whose bytes did not change is not written again.
    ``metadata`` is stored with every version, beside what each save adds."""

    # The save options as they were read before they moved into ``save``.

    @property
    def compression(self) -> Literal["auto", "zstd"] | None:
        """``save.compression``."""
        return self.save.compression

    @property
    def staging_bytes(self) -> int:
        """``save.staging_bytes``."""
        return self.save.staging_bytes

    @property
    def priority(self) -> Literal["low", "normal"]:
        """``save.priority``."""
        return self.save.priority

    @property
    def chunk_bytes(self) -> int:
        """``save.chunk_bytes``."""
        return self.save.chunk_bytes


class CheckpointerStats(msgspec.Struct):
    """What a :class:`Checkpointer` did so far (a snapshot: see :meth:`Checkpointer.stats`).

    Attributes:
        saves: versions committed.
        failed: saves that raised or were cancelled.
        blocking_seconds: time callers waited in :meth:`~Checkpointer.save` (the snapshots),
            summed.
        last_blocking_seconds, last_total_seconds: the newest committed save's snapshot,
            and its time from the call to the commit.
        bytes_written: bytes stored by committed saves.
        bytes_skipped: raw bytes not written again because an earlier version's pack
            holds them (differential saves).
        deleted: versions retention removed (from either store).
        uploads: versions copied to the mirror and checked there.
        upload_failures: upload attempts that failed (each is retried, with a warning).
        last_upload_seconds: the newest upload, from its start (with its pack, while the
            save was still writing it) to the check of its copy.
        last_upload_lag_seconds: from the newest mirrored version's local commit to the
            end of its upload.
        bytes_uploaded: bytes copied to the mirror and checked there.
        bytes_uploaded_early: of those, the bytes a save's new pack sent while the save was
            still writing it (the mirror follows the local write; the rest goes after the
            local commit).
    """

    saves: int = 0
    failed: int = 0
    blocking_seconds: float = 0.0
    last_blocking_seconds: float = 0.0
    last_total_seconds: float = 0.0
    bytes_written: int = 0
    bytes_skipped: int = 0
    deleted: int = 0
    uploads: int = 0
    upload_failures: int = 0
    last_upload_seconds: float = 0.0
    last_upload_lag_seconds: float = 0.0
    bytes_uploaded: int = 0
    bytes_uploaded_early: int = 0


class VerifyReport(msgspec.Struct, frozen=True):
    """What :meth:`Checkpointer.verify` found.

    Attributes:
        step: the version checked.
        ok: every chunk matched its checksum.
        error: what was wrong, when not ``ok``.
    """

    step: int
    ok: bool
    error: str | None = None

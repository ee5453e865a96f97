"""Configuration: one msgspec Struct per component, validated in one place.

Public constructors and functions keep keyword arguments; they build these Structs with
:func:`build`, which checks every bound declared in the Struct (``msgspec.Meta``) and turns a
failure into an :class:`~asyncstore.InvalidArgument` that names the argument, the value given
and what the argument means. Beside each default stands the reason for it.

Vocabulary: sizes end in ``_bytes``; bounds on requests in flight are ``max_inflight``.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from .errors import InvalidArgument

__all__ = ["CacheConfig", "DatasetConfig", "LoadConfig", "PrefetchConfig", "SaveConfig", "build"]

C = TypeVar("C", bound=msgspec.Struct)

MiB = 1 << 20

Positive = Annotated[int, msgspec.Meta(ge=1)]

# Defaults that function signatures repeat (a Struct's class attribute is a descriptor, not
# its default); the reason for each stands beside its field below.
DEFAULT_TTL = 60.0
DEFAULT_BLOCK_BYTES = 8 * MiB
DEFAULT_MAX_INFLIGHT = 32
DEFAULT_PREFETCH_BYTES = 256 * MiB
DEFAULT_SAVE_CHUNK_BYTES = 32 * MiB
DEFAULT_STAGING_BYTES = 2 << 30

_FIELD = re.compile(r"`\$\.(\w+)([^`]*)`")

# What a text value that does not convert is told, by msgspec's message for it.
_TEXT_EXPECTED = {
    "expected int, got str": "expected an int",
    "expected float, got str": "expected a number",
    "expected bool, got str": "expected true or false",
    "expected int | null, got str": "expected an int",
    "expected float | null, got str": "expected a number",
    "expected bool | null, got str": "expected true or false",
}


def build(cls: type[C], values: dict[str, Any], where: str, *, text: bool = False) -> C:
    """``cls`` from ``values`` (argument name to value), every bound checked.

    With ``text=True`` the values are text, as a command line gives them, and each is
    converted by the type its field declares: ``"5242880"`` becomes an int only for an int
    field, ``"true"``/``"false"`` (or ``1``/``0``) a bool only for a bool field, and a str
    field keeps the text even when it looks like a number (a secret key ``12345``). Nothing
    is guessed from how a value looks. Python callers keep the default: real typed values,
    checked strictly.

    Raises:
        InvalidArgument: a value has the wrong type or is out of bounds, or a name is not
            one of ``cls``'s fields. The message starts with ``name=value:`` (credentials,
            whose names start with ``aws_``, are never echoed) and says what was expected.
    """
    try:
        return msgspec.convert(values, cls, strict=not text)
    except msgspec.ValidationError as exc:
        message = str(exc)
        # msgspec ends its message with where the value was: " - at `$.name`",
        # " - at `$.name[0]`", or " - at `key` in `$.name`" for a dict key.
        problem, _, at = message.partition(" - at ")
        field = _FIELD.search(at)
        if field is None:
            if message.startswith("Object contains unknown field"):
                unknown = message.split("`")[1] if message.count("`") >= 2 else ""
                raise InvalidArgument(
                    f"{where}: unknown option {unknown!r}{_closest(unknown, cls)}; the options "
                    f"are: {', '.join(cls.__struct_fields__)}"
                ) from None
            raise InvalidArgument(message) from None  # a relation between fields, said in full
        name, inside = field.group(1), field.group(2)
        problem = problem.replace("`", "")
        problem = problem[:1].lower() + problem[1:]
        if text:
            # Every value given as text is a str: say only what the option takes.
            problem = _TEXT_EXPECTED.get(problem, problem.removesuffix(", got str"))
        if at.startswith("`key`"):
            problem += f" for a key of {name}"
        elif inside:
            problem += f" in {name}{inside}"
        choices = _choices(cls, name)
        if choices and not inside:
            problem += f"; use one of {', '.join(map(repr, choices))}"
        given = f"{name}=<hidden>" if name.startswith("aws_") else f"{name}={values.get(name)!r}"
        raise InvalidArgument(f"{given}: {problem} (an option of {where})") from None


def _closest(name: str, cls: type[msgspec.Struct]) -> str:
    # " (did you mean 'endpoint_url'?)" for a near miss (a typo, or part of a name).
    fields = cls.__struct_fields__
    near = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if not near and name:
        near = [f for f in fields if f.startswith(name) or f.endswith(name) or name in f][:1]
    return f" (did you mean {near[0]!r}?)" if near else ""


def _choices(cls: type[msgspec.Struct], name: str) -> list[object]:
    # The values a Literal field (or a union holding one) takes, for the error message.
    hints = typing.get_type_hints(cls)
    found: list[object] = []
    pending = [hints.get(name)]
    while pending:
        hint = pending.pop()
        if typing.get_origin(hint) is Literal:
            found.extend(typing.get_args(hint))
        elif typing.get_origin(hint) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(hint))
    return found


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :class:`~asyncstore.TieredCache`; see its docstring for each."""

    memory_bytes: Positive
    """The memory tier's hard budget. No default: it is the one figure every cache needs
    sized to its machine."""

    disk_dir: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """The disk tier's directory; ``None`` for no disk tier (nothing is written unasked)."""

    disk_bytes: Positive | None = None
    """The disk tier's hard budget; required with ``disk_dir`` (a disk fills otherwise)."""

    policy: Literal["lru", "plan"] = "lru"
    """LRU by default: it needs no plan, and ``plan`` helps only a reader that gives one."""

    validate: Literal["none", "etag"] = "none"
    """``none`` by default: training datasets are written once and read many times."""

    ttl: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_TTL
    """Seconds an ETag check stays valid with ``validate="etag"``: a changed object is seen
    within a minute at the cost of one ``stat`` per object per minute. (NaN is refused: no
    age is ever below it, so every read would check without saying so.)"""

    block_bytes: Positive = DEFAULT_BLOCK_BYTES
    """Block size of ranged reads: large enough that a block costs one request's overhead
    per 8 MiB, small enough that a scattered access pattern does not pull in much it never
    reads."""

    def __post_init__(self) -> None:
        if self.disk_dir is not None and self.disk_bytes is None:
            raise InvalidArgument(
                f"disk_dir={self.disk_dir!r} needs disk_bytes, the disk tier's budget"
            )
        if self.disk_dir is None and self.disk_bytes is not None:
            raise InvalidArgument("disk_bytes was given without disk_dir; pass both or neither")


class PrefetchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :class:`~asyncstore.Prefetcher`; see its docstring for each."""

    lookahead: Positive | Literal["auto"] = "auto"
    """``auto`` adapts the window to the consumer, which no fixed figure suits both a
    warm epoch (hardly any needed) and a cold one over S3 (dozens)."""

    max_inflight: Positive = DEFAULT_MAX_INFLIGHT
    """S3 clients degrade beyond about 32 requests in flight: latency climbs while
    throughput stays flat."""

    max_bytes: Positive = DEFAULT_PREFETCH_BYTES
    """Bytes fetched ahead of the consumer: 256 MiB holds thousands of samples, or a few
    large shards, without crowding a training process's memory."""

    on_error: Literal["raise", "skip"] = "raise"
    """``raise`` by default: a missing sample is an error unless the caller says otherwise."""


class DatasetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :class:`~asyncstore.torch.StreamingDataset` that each process (the
    main one and every DataLoader worker) opens its cache and prefetcher with; see its
    docstring for each."""

    cache_dir: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """No disk tier unless asked: nothing is written to a node's disk unasked."""

    memory_bytes: Positive = 512 * MiB
    """Per process: 512 MiB leaves room for the model on a small machine, and with two
    workers stays under 2 GiB in all."""

    disk_bytes: Positive | None = None
    """With ``cache_dir``, its budget; ``None`` there means 64 GiB."""

    shuffle: bool = False
    """Off by default: the order of the listing, as a plain dataset would give it."""

    seed: int = 0
    """The same order on every run unless the caller varies it."""

    lookahead: Positive | Literal["auto"] = "auto"
    """See :class:`PrefetchConfig`."""

    max_inflight: Positive = DEFAULT_MAX_INFLIGHT
    """See :class:`PrefetchConfig`."""

    cache_policy: Literal["lru", "plan"] = "plan"
    """``plan`` by default: the dataset knows each epoch's order, and following it gives the
    most memory hits possible when the dataset does not fit (Belady's rule)."""

    rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """With ``world_size``; by default both come from ``torch.distributed``."""

    world_size: Positive | None = None
    """See ``rank``."""

    batch_size: Positive = 1
    """Set it to the DataLoader's: workers then take whole batches in turn, and the stream
    comes out in exactly the plan's order (exact mid-epoch resume)."""

    def __post_init__(self) -> None:
        # Relations between fields, checked where the fields are; build() reports them.
        if (self.rank is None) != (self.world_size is None):
            raise InvalidArgument(
                f"rank={self.rank!r}, world_size={self.world_size!r}: pass rank and "
                "world_size together, or neither"
            )
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise InvalidArgument(
                f"rank={self.rank!r} is not in range(world_size={self.world_size}): pass an "
                "int from 0 to world_size - 1"
            )
        if self.disk_bytes is not None and self.cache_dir is None:
            raise InvalidArgument(
                f"disk_bytes={self.disk_bytes!r} was given without cache_dir, the directory "
                "that budget is for; pass both or neither"
            )


class SaveConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :func:`asyncstore.save` (all but ``store_options``, which open the
    target's store); see its docstring for each."""

    compression: Literal["auto", "zstd"] | None = "auto"
    """``auto`` compresses a storage only where its first chunk shrinks and the encoders
    keep up with the target's measured write speed: never slower than not compressing."""

    level: Annotated[int, msgspec.Meta(ge=-7, le=22)] = 1
    """zstd level 1: most of the reduction a checkpoint's floats allow (after byte
    shuffling), at hundreds of MB/s per core; higher levels gain little on floats."""

    chunk_bytes: Annotated[int, msgspec.Meta(ge=4096)] = DEFAULT_SAVE_CHUNK_BYTES
    """32 MiB: large enough that per-chunk costs (a checksum, a frame, a manifest entry, a
    thread hop) vanish, small enough that a ranged read of one tensor reads little else."""

    staging_bytes: Annotated[int, msgspec.Meta(ge=4096)] = DEFAULT_STAGING_BYTES
    """2 GiB of host memory: enough for the copying and the writing of a save to overlap
    fully, little beside a training process's own; a larger state streams through."""

    exclude: tuple[str, ...] = ()
    """No exclusions: ``auto`` already leaves incompressible storages raw."""

    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """Kept in the manifest; empty unless the caller has something to say."""

    priority: Literal["low", "normal"] = "low"
    """``low``: a save's background work runs on threads of the lowest priority, so a
    training step's threads get the cores whenever they want them."""

    def __post_init__(self) -> None:
        if self.staging_bytes < self.chunk_bytes:
            raise InvalidArgument(
                f"staging_bytes={self.staging_bytes} is smaller than chunk_bytes="
                f"{self.chunk_bytes}: the pool must hold at least one chunk (two or more let "
                "copying and writing overlap)"
            )
        try:
            msgspec.msgpack.encode(self.metadata)
        except (TypeError, msgspec.EncodeError) as exc:
            raise InvalidArgument(
                f"metadata cannot be stored ({exc}): use str keys and plain values "
                "(numbers, strings, lists, dicts)"
            ) from None


class LoadConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The plain-valued options of :func:`asyncstore.load`; see its docstring for each.

    ``map_location``, ``into`` and ``safe_globals`` hold live objects (devices, tensors,
    classes) and are checked where they are used.
    """

    weights_only: bool = True
    """``True``: a crafted checkpoint cannot run code; ``False`` only for trusted files."""

    keys: tuple[str, ...] | None = None
    """Every entry unless asked for fewer."""

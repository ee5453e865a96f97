"""``load(into=...)`` and ``keys=``: pairing a loaded object with the caller's tensors,
worked out in full before anything is changed, then filled in place one storage at a
time (see :func:`asyncstore.load`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import IntegrityError, InvalidArgument
from . import _format as fmt
from ._reader import ChunkReader
from ._staging import byte_view
from ._unpickle import check_view

__all__ = ["check_read", "fill", "placeholders", "plan_into", "refuse_meta", "select"]


class _Plan:
    """What ``into=`` gets from a loaded object, worked out before anything is changed (a
    mismatch anywhere leaves ``into`` as it was): the tensors to fill in place, as
    ``(path, loaded, target)``, and the values to store, as ``(top-level key, container,
    key or index, value)``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.sets: list[tuple[str, Any, Any, Any]] = []


def plan_into(obj: Mapping[str, Any], into: dict[str, Any]) -> _Plan:
    """What ``into`` gets from the loaded ``obj``; raises :class:`InvalidArgument` for a
    mismatch anywhere, before anything is changed."""
    plan = _Plan()
    for key, target in into.items():
        value = _merge(obj[key], target, f"into[{key!r}]", plan, key)
        if value is not target:
            plan.sets.append((key, into, key, value))
    _check_targets(plan.pairs)
    return plan


def _check_targets(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Refuse targets that cannot hold what is loaded: on the meta device (no memory), or
    overlapping another target's memory without being the same tensor (one would
    overwrite the other). The same tensor twice (tied weights) is fine."""
    spans: list[tuple[int, int, str, torch.Tensor]] = []
    for path, _, target in pairs:
        if target.device.type == "meta":
            raise InvalidArgument(
                f"{path} is on the meta device, which has no memory to load into; "
                "materialise it first (for example with to_empty())"
            )
        if target.numel() == 0:
            continue
        reach = sum((n - 1) * abs(st) for n, st in zip(target.shape, target.stride(), strict=True))
        start = target.data_ptr()
        spans.append((start, start + (reach + 1) * target.element_size(), path, target))
    spans.sort(key=lambda span: span[0])
    widest: tuple[int, int, str, torch.Tensor] | None = None  # reaching furthest so far
    for span in spans:
        if widest is not None and span[0] < widest[1]:
            first, second = widest[3], span[3]
            same = (
                first.data_ptr() == second.data_ptr()
                and first.shape == second.shape
                and first.stride() == second.stride()
                and first.dtype == second.dtype
            )
            if not same and first.device == second.device:
                raise InvalidArgument(
                    f"{widest[2]} and {span[2]} share memory, so one would overwrite the "
                    "other; pass tensors that do not overlap"
                )
        if widest is None or span[1] > widest[1]:
            widest = span


def _merge(loaded: Any, target: Any, path: str, plan: _Plan, top: str) -> Any:
    """What takes ``target``'s place (``target`` itself when it is filled in place):
    tensors are paired with the saved ones, dicts, lists and tuples are gone through at
    any depth, any other value is replaced by the saved one."""
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise InvalidArgument(
                f"{path} is a tensor, but the checkpoint holds a {type(loaded).__name__} there"
            )
        _check_pair(path, loaded, target)
        plan.pairs.append((path, loaded, target))
        return target
    if isinstance(target, dict) and isinstance(loaded, Mapping):
        lacking = [k for k in target if k not in loaded]
        if lacking:
            some = ", ".join(repr(k) for k in list(loaded)[:8])
            raise InvalidArgument(
                f"{path} has entries {lacking!r} that the checkpoint lacks there (it has "
                f"{some}{', …' if len(loaded) > 8 else ''}); remove them from into="
            )
        for key, value in loaded.items():
            old = target.get(key, _MISSING)
            new = value if old is _MISSING else _merge(value, old, f"{path}[{key!r}]", plan, top)
            if new is not old:
                plan.sets.append((top, target, key, new))
        return target
    if (
        isinstance(target, list | tuple)
        and isinstance(loaded, list | tuple)
        and len(target) == len(loaded)
    ):
        items = [
            _merge(value, old, f"{path}[{i}]", plan, top)
            for i, (value, old) in enumerate(zip(loaded, target, strict=True))
        ]
        if isinstance(target, list):
            for i, (new, old) in enumerate(zip(items, target, strict=True)):
                if new is not old:
                    plan.sets.append((top, target, i, new))
            return target
        if all(new is old for new, old in zip(items, target, strict=True)):
            return target
        # A tuple cannot change: a new one of the saved type, holding into='s tensors.
        make = getattr(type(loaded), "_make", None)  # a namedtuple
        return make(items) if make is not None else type(loaded)(items)
    if _holds_tensor(target):
        raise InvalidArgument(
            f"{path} is a {type(target).__name__} holding tensors, but the checkpoint holds "
            f"{_describe(loaded)} there"
        )
    return loaded


_MISSING = object()


def _describe(value: Any) -> str:
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v) for v in value)
    return False


def placeholders(
    url: str, meta: dict[int, int], plan: _Plan, entries: dict[str, list[int]] | None
) -> set[int]:
    """The storages (ids) of the placeholder tensors in the values ``plan`` stores; raises
    if the manifest does not list one under its entry (as :func:`check_read` does)."""
    found: set[int] = set()
    if not meta:
        return found
    assert entries is not None
    seen: set[int] = set()
    for top, _, _, value in plan.sets:
        listed = set(entries[top])
        for tensor in _tensors(value, seen):
            sid = meta.get(tensor.untyped_storage()._cdata)
            if sid is None:
                continue
            if sid not in listed:
                raise IntegrityError(
                    f"{url}: the manifest does not list every storage entry {top!r} uses "
                    "(damaged or crafted); load it whole, or load an earlier checkpoint"
                )
            found.add(sid)
    return found


def _tensors(value: Any, seen: set[int]) -> Iterable[torch.Tensor]:
    """The strided tensors anywhere in ``value`` (containers and objects' attributes)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.layout == torch.strided:
                yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())


def check_read(url: str, meta: dict[int, int], entries: Iterable[tuple[str, Any]]) -> None:
    """Raise if a tensor in ``entries`` still sits on a placeholder storage: the manifest's
    list of the storages an entry uses left one out (it is damaged or crafted), and the
    caller would get a tensor without data."""
    if not meta:
        return
    seen: set[int] = set()
    for key, value in entries:
        for tensor in _tensors(value, seen):
            if tensor.untyped_storage()._cdata in meta:
                raise IntegrityError(
                    f"{url}: the manifest does not list every storage entry {key!r} uses "
                    "(damaged or crafted); load it whole, or load an earlier checkpoint"
                )


async def fill(
    reader: ChunkReader,
    by_id: dict[int, fmt.Storage],
    plan: _Plan,
    meta: dict[int, int],
    url: str,
) -> None:
    """Fill ``plan``'s tensors in place: the storages an ``into`` tensor's memory holds
    whole are read straight into it, all together; the others one at a time (read it, copy
    its tensors into their targets, let it go); then store ``plan``'s other values."""
    refuse_meta(plan, meta)
    users: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for pair in plan.pairs:
        _, loaded, target = pair
        sid = meta.get(loaded.untyped_storage()._cdata)
        if sid is None:  # already read (it is shared with a value loaded whole)
            with torch.no_grad():
                target.copy_(loaded)
        else:
            users.setdefault(sid, []).append(pair)
    direct: list[tuple[fmt.Storage, memoryview]] = []
    staged: list[tuple[int, list[tuple[str, torch.Tensor, torch.Tensor]]]] = []
    for sid, pairs in users.items():
        memory = _whole(pairs, by_id[sid])
        if memory is None:
            staged.append((sid, pairs))
        else:
            direct.append((by_id[sid], memory))  # the target's own memory is the storage
    if direct:
        await reader.read_into(direct)
    for sid, pairs in staged:
        storage = (await reader.storages([by_id[sid]]))[sid]
        for _, loaded, target in pairs:
            offset, shape, stride = loaded.storage_offset(), tuple(loaded.shape), loaded.stride()
            check_view(storage, offset, shape, stride, loaded.dtype, url)
            view = torch.empty(0, dtype=loaded.dtype).set_(storage, offset, shape, stride)
            with torch.no_grad():
                target.copy_(view)
        del storage
    _apply(plan)


def refuse_meta(plan: _Plan, placeholders: Mapping[int, int]) -> None:
    """Raise :class:`InvalidArgument`, before anything is changed, if ``plan`` pairs an
    ``into`` tensor with a tensor the checkpoint saved on the meta device (a shape without
    data, which cannot fill it); tensors on ``placeholders`` (storages not read yet) are
    fine."""
    for path, loaded, _ in plan.pairs:
        if loaded.is_meta and loaded.untyped_storage()._cdata not in placeholders:
            raise InvalidArgument(
                f"{path}: the checkpoint holds a tensor on the meta device there, which has "
                "no data to fill it with; load that entry without into="
            )


def _apply(plan: _Plan) -> None:
    for _, container, key, value in plan.sets:
        container[key] = value


def _whole(
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]], entry: fmt.Storage
) -> memoryview | None:
    """The memory of the one ``into`` tensor that a storage fills whole (the saved tensor
    is all of its storage, contiguous; the target contiguous on the CPU), or None. Tied
    names (one saved tensor under several, loaded into one tensor under as many) are one."""
    _, loaded, target = pairs[0]
    for _, other_loaded, other in pairs[1:]:
        if not (
            other.data_ptr() == target.data_ptr()
            and other.dtype == target.dtype
            and other.shape == target.shape
            and other.stride() == target.stride()
            and other_loaded.storage_offset() == loaded.storage_offset()
            and other_loaded.shape == loaded.shape
            and other_loaded.stride() == loaded.stride()
        ):
            return None
    if (
        loaded.storage_offset() != 0
        or not loaded.is_contiguous()
        or loaded.numel() * loaded.element_size() != entry.nbytes
        or entry.nbytes == 0
        or target.device.type != "cpu"
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
    ):
        return None
    return byte_view(target.view(-1).view(torch.uint8))


def _check_pair(path: str, loaded: torch.Tensor, target: torch.Tensor) -> None:
    """Raise unless the ``into`` tensor at ``path`` has the saved shape and dtype."""
    if loaded.shape != target.shape or loaded.dtype != target.dtype:
        raise InvalidArgument(
            f"{path} is {tuple(target.shape)} {target.dtype}, the checkpoint "
            f"holds {tuple(loaded.shape)} {loaded.dtype}"
        )


def select(obj: Any, wanted: list[str] | None, into: dict[str, Any] | None, url: str) -> Any:
    """``keys=`` and ``into=`` for an object loaded whole (a ``torch.save`` file)."""
    if wanted is None:
        return obj
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{url} does not hold a dict: keys= and into= need one")
    missing = [k for k in wanted if k not in obj]
    if missing:
        raise InvalidArgument(f"{url} has no entries {missing!r}")
    if into is None:
        return type(obj)((k, obj[k]) for k in wanted)
    plan = plan_into(obj, into)
    refuse_meta(plan, {})
    with torch.no_grad():
        for _, loaded, target in plan.pairs:
            target.copy_(loaded)
    _apply(plan)
    return into

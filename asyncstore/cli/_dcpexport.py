"""``asyncstore export`` of a distributed (DCP) checkpoint: the whole, un-sharded state
written as one plain ``torch.save`` file, the file that
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes from a checkpoint in
DCP's own file format.

The state is rebuilt from ``.metadata`` as DCP rebuilds it (its ``_EmptyStateDictLoadPlanner``
allocates every tensor whole, at its full shape), read through
:class:`asyncstore.torch.dcp.StorageReader` (every chunk verified, every non-tensor value
checked with ``weights_only=True``), saved with ``torch.save``, and written to the
destination in one atomic put: a failure at any point leaves the destination as it was.
Like ``dcp_to_torch_save``, this holds the whole state in memory (and here the file's bytes
too, for the atomic put).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from ..checkpoint._target import put_whole
from ..errors import AsyncStoreError, IntegrityError
from ..torch.dcp import StorageReader
from ._common import progress

__all__ = ["export_dcp"]


def export_dcp(src: str, dst: str, options: dict[str, Any], dst_options: dict[str, Any]) -> str:
    """Write the distributed checkpoint at ``src`` (its directory's URL) as one
    ``torch.save`` file at ``dst`` (a path or URL); ``options`` and ``dst_options`` are
    the two stores' options. Returns the URL written. A progress bar
    shows the tensor bytes read when stderr is a terminal.

    Raises:
        NotFound: there is no complete checkpoint at ``src``.
        IntegrityError: it is damaged (a chunk, a rank object, ``.metadata``).
        UnsafeCheckpoint: a value in it needs a trusted load.
    """
    state = _load_whole(src, options)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    del state
    return asyncio.run(put_whole(dst, dst_options, buffer.getbuffer()))


def _load_whole(src: str, options: dict[str, Any]) -> dict[str, Any]:
    # DCP's own conversion (dcp_to_torch_save's planner and loader), read through
    # asyncstore, in this process alone (no process group).
    state: dict[str, Any] = {}
    with progress(None, "exporting") as bar:
        reader = _ProgressReader(src, store_options=options)
        reader.bar = bar
        try:
            _load_state_dict(
                state,
                storage_reader=reader,
                planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                no_dist=True,
            )
        except CheckpointException as exc:
            raise _cause(exc, src) from None
    return state


def _cause(exc: CheckpointException, src: str) -> Exception:
    # DCP wraps what a step raised (with its traceback) per rank: the user wants ours.
    causes = [failure[0] for failure in exc.failures.values()]
    for cause in causes:
        if isinstance(cause, AsyncStoreError):
            return cause
    said = "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes)
    return IntegrityError(f"{src} could not be read as a distributed checkpoint ({said})")


class _ProgressReader(StorageReader):
    """The plugin's reader, reading one rank object at a time and counting the tensor
    bytes read on a progress bar."""

    bar: Any = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As the plugin's, and size the bar: every tensor's bytes, whole."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._dtypes = {
            fqn: meta.properties.dtype
            for fqn, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        if self.bar is not None:
            self.bar.reset(
                total=sum(
                    math.prod(meta.size) * meta.properties.dtype.itemsize
                    for meta in metadata.state_dict_metadata.values()
                    if isinstance(meta, TensorStorageMetadata)
                )
            )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """As the plugin's, one rank object after another, the bar moving after each."""
        groups: dict[object, list[ReadItem]] = {}
        for item in plan.items:
            where = self.storage_data.get(item.storage_index)
            groups.setdefault(where[0] if isinstance(where, tuple) else None, []).append(item)
        done: Future[None] | None = None
        for items in groups.values():
            done = super().read_data(dataclasses.replace(plan, items=items), planner)
            done.wait()
            if self.bar is not None:
                self.bar.update(sum(self._item_bytes(item) for item in items))
        return done if done is not None else super().read_data(plan, planner)

    def _item_bytes(self, item: ReadItem) -> int:
        dtype = self._dtypes.get(item.storage_index.fqn)
        return 0 if dtype is None else math.prod(item.lengths) * dtype.itemsize

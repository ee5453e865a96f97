"""The engine's parts below the user API, for the front ends built on it.

:mod:`asyncstore.torch` (the DCP plugin, ``save``/``load``, the sync ``Checkpointer``) and
:mod:`asyncstore.cli` build on these; this module is their one way into the engine, so that
no other package reaches into ``asyncstore.checkpoint``'s private modules (checked by the
private-modules contract in ``make test``). A program that saves and loads wants
:mod:`asyncstore.checkpoint` instead: names here follow the engine, with no promise kept
between minor versions.

Groups:

- **saving**: :func:`build_save_config` (one :class:`~asyncstore.SaveConfig` from an entry
  point's keywords), :func:`start_save` (the engine's one way to start a save),
  ``SaveOptions`` (those keywords, typed); :func:`put_whole` (one object written atomically);
- **loading**: ``LoadOptions``; :func:`resolve` (a path, URL or ``(store, key)`` to a
  store and key); :func:`read_manifest_of` (a manifest by two ranged reads, no torch);
- **torch's contexts**: :func:`capture` and :func:`carrying` take ``skip_data()`` and
  ``FakeTensorMode`` from the caller's thread to the engine's;
- **runs**: :func:`scan`, :func:`in_save_order`, :func:`saved_of` (a run's versions),
  :func:`dcp_prefix` (a distributed version's directory), :func:`copy_version` and
  :func:`copy_object` (what the mirror copies);
- **distributed layout**: ``METADATA``, ``RANK_OBJECT``, :func:`read_metadata`,
  :func:`encode_metadata`, :func:`is_rank_object`, :func:`objects_named`, and
  ``DistributedVersion`` (a distributed version's bookkeeping in a run).

Names are imported on first use, as :mod:`asyncstore.checkpoint`'s are: listing a run's
versions imports no torch.
"""

from __future__ import annotations

import typing

from .._lazy import lazy_names as _lazy_names

if typing.TYPE_CHECKING:
    from ._contexts import capture, carrying
    from ._dcpversion import DistributedVersion
    from ._distributed import (
        METADATA,
        RANK_OBJECT,
        encode_metadata,
        is_rank_object,
        objects_named,
        read_metadata,
    )
    from ._format import read_manifest_of
    from ._load import LoadOptions
    from ._mirror import copy_object, copy_version
    from ._save import SaveOptions, build_save_config, start_save
    from ._target import put_whole, resolve
    from ._versions import dcp_prefix, in_save_order, saved_of, scan

__all__ = [
    "build_save_config",
    "start_save",
    "SaveOptions",
    "put_whole",
    "LoadOptions",
    "resolve",
    "read_manifest_of",
    "capture",
    "carrying",
    "scan",
    "in_save_order",
    "saved_of",
    "dcp_prefix",
    "copy_version",
    "copy_object",
    "METADATA",
    "RANK_OBJECT",
    "read_metadata",
    "encode_metadata",
    "is_rank_object",
    "objects_named",
    "DistributedVersion",
]

_HOMES = {
    "build_save_config": "._save",
    "start_save": "._save",
    "SaveOptions": "._save",
    "put_whole": "._target",
    "resolve": "._target",
    "LoadOptions": "._load",
    "read_manifest_of": "._format",
    "capture": "._contexts",
    "carrying": "._contexts",
    "scan": "._versions",
    "in_save_order": "._versions",
    "saved_of": "._versions",
    "dcp_prefix": "._versions",
    "copy_version": "._mirror",
    "copy_object": "._mirror",
    "METADATA": "._distributed",
    "RANK_OBJECT": "._distributed",
    "read_metadata": "._distributed",
    "encode_metadata": "._distributed",
    "is_rank_object": "._distributed",
    "objects_named": "._distributed",
    "DistributedVersion": "._dcpversion",
}

__getattr__, __dir__ = _lazy_names(__name__, _HOMES)

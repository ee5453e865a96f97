"""The streaming checkpoint engine: non-blocking saves, verified loads (needs torch).

Names are imported on first use: most of the engine imports torch (seconds), which a
command line that only lists a run's versions never needs.
"""

from __future__ import annotations

import typing

from .._lazy import lazy_names as _lazy_names

if typing.TYPE_CHECKING:
    from ._format import FORMAT_VERSION, Manifest
    from ._handle import SaveHandle, SaveResult
    from ._inspect import CheckpointInfo, TensorInfo, inspect
    from ._load import load, read_manifest, verify
    from ._manager import Checkpointer, CheckpointerConfig, CheckpointerStats, VerifyReport
    from ._save import save
    from ._staging import StagingPool, staging_pool
    from ._versions import Version

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "CheckpointerStats",
    "Version",
    "VerifyReport",
    "save",
    "load",
    "SaveHandle",
    "SaveResult",
    "StagingPool",
    "staging_pool",
    "read_manifest",
    "verify",
    "inspect",
    "CheckpointInfo",
    "TensorInfo",
    "Manifest",
    "FORMAT_VERSION",
]

# Where each name lives.
_HOMES = {
    "FORMAT_VERSION": "._format",
    "Manifest": "._format",
    "SaveHandle": "._handle",
    "SaveResult": "._handle",
    "CheckpointInfo": "._inspect",
    "TensorInfo": "._inspect",
    "inspect": "._inspect",
    "load": "._load",
    "read_manifest": "._load",
    "verify": "._load",
    "Checkpointer": "._manager",
    "CheckpointerConfig": "._manager",
    "CheckpointerStats": "._manager",
    "VerifyReport": "._manager",
    "Version": "._versions",
    "save": "._save",
    "StagingPool": "._staging",
    "staging_pool": "._staging",
}

__getattr__, __dir__ = _lazy_names(__name__, _HOMES)

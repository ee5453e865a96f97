"""The streaming checkpoint engine: non-blocking saves, verified loads (needs torch)."""

from ._format import FORMAT_VERSION, Manifest
from ._handle import SaveHandle, SaveResult
from ._inspect import CheckpointInfo, TensorInfo, inspect
from ._load import load, read_manifest, verify
from ._manager import Checkpointer, CheckpointerConfig, CheckpointerStats, VerifyReport, Version
from ._save import save
from ._staging import StagingPool, staging_pool

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

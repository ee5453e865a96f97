"""The streaming checkpoint engine: non-blocking saves, verified loads (needs torch)."""

from ._format import FORMAT_VERSION, Manifest
from ._load import load, read_manifest
from ._save import SaveHandle, SaveResult, StagingPool, save, staging_pool

__all__ = [
    "save",
    "load",
    "SaveHandle",
    "SaveResult",
    "StagingPool",
    "staging_pool",
    "read_manifest",
    "Manifest",
    "FORMAT_VERSION",
]

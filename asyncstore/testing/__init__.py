"""Test helpers: a local S3-compatible server and a fault-injecting HTTP proxy."""

from asyncstore.testing._proxy import FaultProxy
from asyncstore.testing._seaweedfs import SeaweedFS

__all__ = ["FaultProxy", "SeaweedFS"]

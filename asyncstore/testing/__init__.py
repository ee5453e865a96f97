"""Test helpers: a local S3-compatible server, a fault-injecting HTTP proxy, and the offline
optimum that cache policies are graded against."""

from asyncstore.testing._belady import belady_hits
from asyncstore.testing._proxy import FaultProxy
from asyncstore.testing._seaweedfs import SeaweedFS

__all__ = ["FaultProxy", "SeaweedFS", "belady_hits"]

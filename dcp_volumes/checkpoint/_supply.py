"""What a source hands the reader for one file (``_tiers``' read side), free of torch.

A source (the local tier, the peer tier) answers for each file it has with a
``Supply``; ``FileRead`` reads it whole, checks it against the manifest, and
falls back to the volume on ``CopyMissing``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass

from dcp_volumes._volume import Volume

#: ``put(offset, data)``: puts a file's bytes, arriving in pieces, at their offset in a
#: read's buffers (``FileRead.lay_out_whole``).
PutBytes = Callable[[int, memoryview], None]


@dataclass(frozen=True)
class Arrived:
    """A file a source sent in whole, checked against the manifest on arrival: its
    checksum, and whether it is in the read's buffers (else in the supply's volume)."""

    checksum: str
    in_buffers: bool


class CopyMissing(Exception):
    """A file a source was to send did not arrive whole and matching the manifest (a
    damaged copy, a failed transfer): it is read from the volume."""


@dataclass(frozen=True)
class Supply:
    """Where a source has one file: ``volume`` holds it (a local directory), or will once
    ``arrival`` settles (a transfer under way; its bytes may land in the read's buffers
    instead)."""

    volume: Volume
    arrival: ThreadFuture[Arrived] | None = None

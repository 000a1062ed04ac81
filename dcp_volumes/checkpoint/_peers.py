"""The peer tier: a copy of each node's local-tier files on another node (``local_replicas``).

A lost node takes its local tier with it; with ``local_replicas=1`` another node
holds a copy of its files, so the replacement node (or the survivors, when the
job shrinks) restores them from there instead of from the volume.

Pairing (deterministic, the same on every rank): the nodes (torchrun's
``GROUP_RANK``) are sorted; the ``i``-th rank of the ``k``-th node sends its
files to the ``i``-th rank (modulo that node's number of ranks) of node
``(k + j) % nodes``, for ``j = 1 .. local_replicas`` (at most ``nodes - 1``
replicas): never to a rank of its own node while there is more than one node.
Two nodes of two ranks (ranks 0, 1 on node 0; 2, 3 on node 1): 0 -> 2, 1 -> 3,
2 -> 0, 3 -> 1. One node: no replicas.

The bytes travel over a gloo group of their own (the coordinator's ``side_group``,
made by every rank with the manager: replication runs in a thread beside the
saves, and its operations have a short timeout), in chunks of ``_CHUNK`` bytes,
``_WINDOW`` chunks per peer in flight: memory stays bounded whatever the
checkpoint's size. Every operation on the group has
``TIMEOUT_S``: a dead or hung peer fails the transfer, never the job.

Call order (each call on every rank, on the peer group)::

    replicate(name)   background thread, after ``name`` committed: all_gather of
                      every rank's files (and the coordinator's copy of the
                      manifest); then each rank sends its files to its targets and
                      receives its sources' files; each file is checked against
                      the manifest's size and checksum on arrival and kept in
                      ``<local_dir>/replicas/node-<source node>/<name>`` (newest only)
    offer(...)        in ``VolumeReader.read_data`` (``dcp.load``), as its source: all_gather of
                      what each node holds and what each rank needs; then, in a
                      thread of its own (``Exchange``), the holders send the files a
                      rank lacks while every rank loads the files it has: each file
                      is checked against the manifest on arrival, as replicas are,
                      and used as soon as it is in (copied into the restore's
                      tensors as it arrives, up to the reader's ``prefetch_bytes``;
                      written into the local tier beyond); one that fails, and the
                      files no node holds, come from the volume

Only a committed checkpoint is replicated (``replicate`` runs after the commit),
and a restore uses replicas only of the checkpoint it chose, every file checked
against that checkpoint's manifest before use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes._volume import Volume
from dcp_volumes._world import World
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._coordination import Coordinator, summary
from dcp_volumes.checkpoint._local_tier import (
    LocalTier,
    copy_dir,
    copy_dirs,
    data_files,
    replica_dir,
)
from dcp_volumes.checkpoint._manifest import Checksum, FileRecord, Manifest
from dcp_volumes.checkpoint._supply import Arrived, CopyMissing, PutBytes, Supply

logger = logging.getLogger(__name__)

__all__ = ["TIMEOUT_S", "Exchange", "PeerTier", "sources_of", "targets_of"]

#: Seconds any one operation on the peer group may take before the transfer is given up.
TIMEOUT_S = 60.0
# Bytes of one message, and messages in flight per peer and direction: the memory a
# transfer holds per peer and direction is their product.
_CHUNK = 8 * 2**20
_WINDOW = 2


# -- pairing --------------------------------------------------------------------------------


def _by_node(nodes: Sequence[int]) -> dict[int, list[int]]:
    """Node -> its ranks, ascending (``nodes[rank]`` is the rank's node)."""
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    return dict(sorted(ranks.items()))


def targets_of(nodes: Sequence[int], rank: int, replicas: int) -> list[int]:
    """The ranks that keep ``rank``'s replicas (see the module's docstring)."""
    by_node = _by_node(nodes)
    order = list(by_node)
    k = order.index(nodes[rank])
    i = by_node[nodes[rank]].index(rank)
    targets = []
    for j in range(1, min(replicas, len(order) - 1) + 1):
        peers = by_node[order[(k + j) % len(order)]]
        targets.append(peers[i % len(peers)])
    return targets


def sources_of(nodes: Sequence[int], rank: int, replicas: int) -> list[int]:
    """The ranks whose replicas ``rank`` keeps."""
    return [r for r in range(len(nodes)) if rank in targets_of(nodes, r, replicas)]


# -- moving files over the group -------------------------------------------------------------


class PeerTransferError(Exception):
    """A peer died, hung past ``TIMEOUT_S`` or left the group during a transfer."""


@dataclass
class _Send:
    """One file on its way to a peer: where it is read from and how far it got (the
    transfer's state, not facts of the file: kept apart from ``FileRecord``)."""

    peer: int
    path: str | None  # None: the file is gone; zeros are sent (the receiver's check fails)
    size: int
    sent: int = 0
    file: io.FileIO | None = None


@dataclass
class _Receive:
    """One file arriving from a peer: the manifest's record it is checked against, where
    it goes and how far it got (the transfer's state: kept apart from ``FileRecord``)."""

    peer: int
    record: FileRecord  # the manifest's: its size, and the checksum checked on arrival
    dest: str | None  # None: handed to ``copy_to`` (a restore reads it from there)
    copy_to: PutBytes | None = None  # puts the file's bytes in the reader's buffers
    got: int = 0
    file: io.BufferedWriter | None = None
    hasher: Checksum = field(default_factory=Checksum)
    failed: str | None = None
    arrival: Future[Arrived] | None = None  # told when the file ends (a restore's)

    @property
    def size(self) -> int:
        return self.record.size

    @property
    def part(self) -> str:
        return f"{self.dest}.part"


def _chunks(items: Sequence[_Send] | Sequence[_Receive]) -> dict[int, deque[tuple[Any, int]]]:
    """The messages of each peer's stream, in order: (file, bytes) per chunk (none for an
    empty file: its receiver makes it)."""
    streams: dict[int, deque[tuple[Any, int]]] = {}
    for item in items:
        for start in range(0, item.size, _CHUNK):
            streams.setdefault(item.peer, deque()).append((item, min(_CHUNK, item.size - start)))
    return streams


def _next_chunk(send: _Send, buf: bytearray) -> int:
    """Read the next chunk of ``send`` into ``buf``; a file that fails to read sends zeros."""
    n = min(_CHUNK, send.size - send.sent)
    view = memoryview(buf)[:n]
    got = 0
    if send.path is not None:
        try:
            if send.file is None:
                send.file = open(send.path, "rb", buffering=0)  # noqa: SIM115 - closed at its end
            while got < n and (k := send.file.readinto(view[got:])):
                got += k
        except OSError as exc:
            logger.warning("peer tier: cannot read %s (%s): sending a placeholder that fails "
                           "its checksum", send.path, summary(exc))
            send.path = None
    view[got:n] = bytes(n - got)
    send.sent += n
    return n


def _take_chunk(item: _Receive, data: torch.Tensor) -> None:
    """Copy a received chunk to its file's buffers or file, and hash it: a disk error
    marks the file failed, its bytes are dropped."""
    at, item.got = item.got, item.got + data.numel()
    if item.failed is not None:
        return
    view = data.numpy().data
    try:
        if item.dest is None:
            assert item.copy_to is not None  # a receive has a file or a copy_to
            item.copy_to(at, view)
        else:
            if item.file is None:
                os.makedirs(os.path.dirname(item.dest), exist_ok=True)
                item.file = open(item.part, "wb")  # noqa: SIM115 - closed by _end
            item.file.write(view)
        item.hasher.update(view)
    except OSError as exc:
        item.failed = f"cannot write {item.dest}: {summary(exc)}"


def _end(item: _Receive, done: set[str]) -> None:
    """Close a received file: keep it if whole and matching its checksum, else drop it."""
    if item.dest is not None and item.failed is None:
        try:
            if item.file is None:  # an empty file
                os.makedirs(os.path.dirname(item.dest), exist_ok=True)
                item.file = open(item.part, "wb")  # noqa: SIM115 - closed just below
            item.file.close()
            item.file = None
        except OSError as exc:
            item.failed = f"cannot write {item.dest}: {summary(exc)}"
    actual = item.hasher.hexdigest()
    if item.failed is None and actual != item.record.checksum:
        item.failed = (f"{item.record.path} from rank {item.peer} fails its checksum ({actual}, "
                       f"manifest {item.record.checksum})")
    if item.failed is None and item.dest is not None:
        try:
            os.replace(item.part, item.dest)
        except OSError as exc:
            item.failed = f"cannot write {item.dest}: {summary(exc)}"
    if item.failed is None:
        done.add(item.record.path)
        if item.arrival is not None:
            item.arrival.set_result(Arrived(actual, in_buffers=item.dest is None))
        item.copy_to, item.arrival = None, None
        return
    logger.warning("peer tier: %s; the file is skipped (it comes from the volume if needed)",
                   item.failed)
    _discard(item, item.failed)


def _discard(item: _Receive, why: str) -> None:
    item.copy_to = None
    if item.arrival is not None and not item.arrival.done():
        item.arrival.set_exception(CopyMissing(why))
    if item.dest is None:
        return
    if item.file is not None:
        with contextlib.suppress(OSError):
            item.file.close()
        item.file = None
    with contextlib.suppress(OSError):
        os.unlink(item.part)


def transfer(
    group: dist.ProcessGroup,
    sends: Sequence[_Send],
    receives: Sequence[_Receive],
    *,
    done: set[str],
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Send and receive files with the peers, chunk by chunk; received files go in ``done``.

    Both sides list the same files of each pair in the same order with the same
    sizes, so every message is matched by its position: in round ``n`` each
    stream (one per peer and direction) moves its ``n``-th chunk, and up to
    ``_WINDOW`` rounds are in flight (a chunk is read, or copied to its file or
    buffers, while the next one travels): ``_WINDOW * _CHUNK`` bytes a stream.
    Chunks arrive in these reused windows, never straight into a receive's
    buffers: a peer that sends after the transfer gave up on it cannot write
    into memory the reader has taken back. A file
    that cannot be written or fails its checksum is dropped (its bytes still
    drain, the stream stays in step); a peer that fails raises
    ``PeerTransferError``. Each receive's ``arrival`` is settled when its file ends,
    or when the transfer does.
    """
    outgoing = _chunks(sends)
    incoming = _chunks(receives)
    send_bufs = {peer: [bytearray(_CHUNK) for _ in range(_WINDOW)] for peer in outgoing}
    recv_bufs = {peer: [torch.empty(_CHUNK, dtype=torch.uint8) for _ in range(_WINDOW)]
                 for peer in incoming}
    wait = timedelta(seconds=timeout_s)
    rounds: deque[tuple[list[Any], list[tuple[_Receive, torch.Tensor]]]] = deque()
    failure: str | None = None

    def finish_round() -> None:
        works, arriving = rounds.popleft()
        for work in works:
            if work is not None:
                work.wait(wait)
        for item, chunk in arriving:
            _take_chunk(item, chunk)
            if item.got >= item.size:
                _end(item, done)

    try:
        for item in receives:
            if item.size == 0:
                _end(item, done)
        r = 0
        while outgoing or incoming:
            if len(rounds) >= _WINDOW:  # its buffers are the ones this round reuses
                finish_round()
            works = []
            arriving: list[tuple[_Receive, torch.Tensor]] = []
            for peer, queue in list(outgoing.items()):
                send, _ = queue.popleft()
                buf = send_bufs[peer][r % _WINDOW]
                n = _next_chunk(send, buf)
                works.append(dist.isend(torch.frombuffer(buf, dtype=torch.uint8)[:n],
                                        dst=peer, group=group))
                if send.sent >= send.size and send.file is not None:
                    send.file.close()
                    send.file = None
                if not queue:
                    del outgoing[peer]
            for peer, rqueue in list(incoming.items()):
                item, n = rqueue.popleft()
                chunk = recv_bufs[peer][r % _WINDOW][:n]
                works.append(dist.irecv(chunk, src=peer, group=group))
                arriving.append((item, chunk))
                if not rqueue:
                    del incoming[peer]
            rounds.append((works, arriving))
            r += 1
        while rounds:
            finish_round()
    except Exception as exc:
        failure = summary(exc)
        raise PeerTransferError(failure) from exc
    finally:
        for item in receives:
            if item.record.path not in done:
                _discard(item, failure or "the transfer ended early")
        for send in sends:
            if send.file is not None:
                with contextlib.suppress(OSError):
                    send.file.close()


# -- the tier ---------------------------------------------------------------------------------


class PeerTier:
    """This rank's part of the peer tier: what it replicates where, and restores from whom.

    Made by ``connect`` (collective). ``submit`` queues a replication for a
    background thread; ``offer`` runs in a restore, on the calling thread: the tier
    is one of the reader's sources (``_tiers.FileSource``).
    """

    name = "peer"

    def __init__(
        self,
        local_dir: str,
        *,
        nodes: Sequence[int],
        rank: int,
        replicas: int,
        group: dist.ProcessGroup,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.local_dir = local_dir
        self.nodes = list(nodes)
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s
        self.targets = targets_of(self.nodes, rank, replicas)
        self.sources = sources_of(self.nodes, rank, replicas)
        self._by_node = _by_node(self.nodes)
        self._queue: deque[str] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._broken: str | None = None  # why the group is unusable (a peer failed)
        self._thread: threading.Thread | None = None

    @classmethod
    def connect(
        cls, local_dir: str, *, coordinator: Coordinator, replicas: int
    ) -> PeerTier | None:
        """Every rank: learn each rank's node; a tier with its own group, or ``None`` on one node.

        Collective on the coordinator's group, then (more than one node) on the default
        group: the tier's ``side_group``.
        """
        rank, world_size = coordinator.rank, coordinator.world_size
        nodes: list[Any] = [None] * world_size
        dist.all_gather_object(nodes, World.from_env().node, group=coordinator.group)
        count = len(set(nodes))
        if count < 2:
            logger.info("local_replicas: all %d ranks are on one node; no replicas are kept "
                        "(a node loss restores from the volume)", world_size)
            return None
        peer_group = coordinator.side_group(timeout_s=TIMEOUT_S)
        assert peer_group is not None  # several nodes: distributed
        tier = cls(local_dir, nodes=nodes, rank=rank, replicas=replicas, group=peer_group)
        logger.debug("peer tier: rank %d (node %d) replicates to %s, keeps replicas of %s",
                     rank, nodes[rank], tier.targets, tier.sources)
        return tier

    # -- replication (background) --------------------------------------------------------

    def submit(self, name: str) -> None:
        """Queue the replication of the committed checkpoint ``name`` (every rank, in order)."""
        with self._cond:
            self._queue.append(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcpv-replicate",
                                                 daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self) -> None:
        """Until every queued replication is done (each operation is bounded by the timeout)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                name = self._queue.popleft()
                self._busy = True
            try:
                self.replicate(name)
            except Exception as exc:  # never let the thread die: later saves still queue
                logger.warning("peer tier: replication of %s failed: %s", name, summary(exc))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def replicate(self, name: str) -> None:
        """Send this rank's files of ``name`` to its targets, keep its sources' files."""
        if self._broken is not None:
            logger.warning("peer tier: no replica of %s (the peer group failed earlier: %s); a "
                           "node loss restores from the volume", name, self._broken)
            return
        own = os.path.join(self.local_dir, name)
        start = _layout.rank_name_start(self.rank)
        mine = {rel: size for rel, size in data_files(own).items()
                if rel.rsplit("/", 1)[-1].startswith(start)}
        manifest_json: bytes | None = None
        if self.rank == 0:
            with contextlib.suppress(OSError), open(
                os.path.join(own, _layout.MANIFEST_NAME), "rb"
            ) as f:
                manifest_json = f.read()
        gathered: list[Any] = [None] * len(self.nodes)
        try:
            dist.all_gather_object(gathered, (mine, manifest_json), group=self.group)
        except Exception as exc:
            self._fail(name, exc)
            return
        coordinator_manifest = gathered[0][1]
        if coordinator_manifest is None:
            logger.warning("peer tier: rank 0 has no local copy of the manifest of %s; it is "
                           "not replicated", name)
            return
        manifest = Manifest.from_json(coordinator_manifest, where=f"local copy of {name}")

        def expected(rank: int) -> list[tuple[str, int]]:
            files: Mapping[str, int] = gathered[rank][0]
            return [(rel, size) for rel, size in sorted(files.items())
                    if (rec := manifest.files.get(rel)) is not None and rec.size == size]

        sends = [_Send(t, os.path.join(own, *rel.split("/")), size)
                 for t in self.targets for rel, size in expected(self.rank)]
        receives = []
        for source in self.sources:
            base = os.path.join(replica_dir(self.local_dir, self.nodes[source]), name)
            for rel, _ in expected(source):
                _layout.inside(rel, f"the replica of {name} from rank {source}")
                receives.append(_Receive(source, manifest.files[rel],
                                         os.path.join(base, *rel.split("/"))))
        done: set[str] = set()
        try:
            transfer(self.group, sends, receives, done=done, timeout_s=self.timeout_s)
        except PeerTransferError as exc:
            self._fail(name, exc)
            return
        kept = len(done) == len(receives)
        if kept:
            for source in self.sources:
                LocalTier(replica_dir(self.local_dir, self.nodes[source]),
                          owner=True).keep_only(name)
        sent = sum(s.size for s in sends)
        logger.info("peer tier: %s replicated: %d files (%.1f MiB) to rank(s) %s; kept %d of "
                    "%d files from rank(s) %s", name, len(sends), sent / 2**20, self.targets,
                    len(done), len(receives), self.sources)

    def _fail(self, name: str, exc: BaseException) -> None:
        self._broken = summary(exc)
        logger.warning("peer tier: the replica of %s is missing (a peer failed: %s); the save "
                       "itself is committed; a node loss restores its files from the volume",
                       name, self._broken)

    # -- restore --------------------------------------------------------------------------

    def offer(
        self,
        checkpoint: str,
        wanted: Mapping[str, FileRecord],
        *,
        into: Callable[[str], PutBytes] | None = None,
        memory_bytes: int = 0,
    ) -> Exchange:
        """Every rank, in a load: agree with the peers (one collective) on who sends which
        of the files in ``wanted`` (rel -> its manifest record) that another node holds,
        and start the transfer in a thread of its own: the holders send while they load
        their own files, and each file can be used as soon as it has arrived.

        Every file is checked against the manifest's checksum on arrival: the first
        ``memory_bytes`` of them (in name order) go to ``into(rel)`` (asked before the
        transfer starts: it copies bytes to their offset in the reader's target tensors
        and scratch), the rest are written into this node's copy of ``checkpoint``. The
        returned ``Exchange`` supplies each file this rank receives: its arrival settles
        when it is in, or that it will not be (a damaged replica, a failed peer: the
        reader reads it from the volume); ``Exchange.join`` before the group is used again.
        """
        dest = copy_dir(self.local_dir, checkpoint)
        if self._broken is not None:
            logger.warning("peer tier: not asking peers for %s (the peer group failed earlier: "
                           "%s)", checkpoint, self._broken)
            return Exchange(self, checkpoint, dest, [], [])
        mine_node = self.nodes[self.rank]
        first_of_node = self._by_node[mine_node][0] == self.rank
        dirs = self.held_dirs(checkpoint)
        held: dict[str, int] | None = None
        if first_of_node:
            held = {}
            for directory in reversed(dirs):  # the node's own copy wins
                held.update(data_files(directory))
        gathered: list[Any] = [None] * len(self.nodes)
        try:
            sizes = {rel: record.size for rel, record in wanted.items()}
            dist.all_gather_object(gathered, (held, sizes), group=self.group)
        except Exception as exc:
            self._broken = summary(exc)
            logger.warning("peer tier: could not ask peers for the files of %s (%s): they come "
                           "from the volume", checkpoint, self._broken)
            return Exchange(self, checkpoint, dest, [], [])
        holdings = {self.nodes[r]: h for r, (h, _) in enumerate(gathered) if h is not None}
        sends: list[_Send] = []
        receives: list[_Receive] = []
        for rank, (_, asked) in enumerate(gathered):
            for rel, size in sorted(asked.items()):
                nodes = [n for n, files in holdings.items()
                         if n != self.nodes[rank] and files.get(rel) == size]
                if not nodes:
                    continue
                node = nodes[rank % len(nodes)]
                ranks = self._by_node[node]
                holder = ranks[rank % len(ranks)]
                if holder == self.rank:
                    sends.append(_Send(rank, _find(dirs, rel, size), size))
                if rank == self.rank:
                    _layout.inside(rel, f"a peer's listing of {checkpoint}")
                    to = into(rel) if into is not None and size <= memory_bytes else None
                    memory_bytes -= size if to is not None else 0
                    path = None if to is not None else os.path.join(dest, *rel.split("/"))
                    receives.append(_Receive(holder, wanted[rel], path, copy_to=to,
                                             arrival=Future()))
        return Exchange(self, checkpoint, dest, sends, receives)

    def held_dirs(self, name: str) -> list[str]:
        """This node's directories that may hold files of ``name``: its own copy, then replicas."""
        return copy_dirs(self.local_dir, name)


class Exchange:
    """A restore's transfer with the peers (``PeerTier.offer``), in a thread of its own.

    ``supplies``: the files this rank receives, rel -> its ``Supply``: the directory it
    is written to, and a future of the file (``Arrived``) once it arrived whole and
    matching the manifest, or of ``CopyMissing`` (a damaged replica, a failed peer).
    Every operation of the transfer is bounded by the tier's timeout: every future is
    settled.
    """

    def __init__(self, tier: PeerTier, name: str, dest: str, sends: Sequence[_Send],
                 receives: Sequence[_Receive]) -> None:
        self.supplies: dict[str, Supply] = {
            r.record.path: Supply(Volume(dest), r.arrival)
            for r in receives if r.arrival is not None}
        self._tier, self._name = tier, name
        self._sends, self._receives = sends, receives
        self._thread: threading.Thread | None = None
        if sends or receives:
            self._thread = threading.Thread(target=self._run, name="dcpv-peer-restore",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        done: set[str] = set()
        try:
            transfer(self._tier.group, self._sends, self._receives, done=done,
                     timeout_s=self._tier.timeout_s)
        except PeerTransferError as exc:
            self._tier._broken = str(exc)
            logger.warning("peer tier: a transfer of %s's files failed (%s): %d of %d files "
                           "arrived, the rest come from the volume", self._name, exc, len(done),
                           len(self._receives))
        received = sum(r.size for r in self._receives if r.record.path in done)
        logger.info("peer tier: %s: received %d files (%.1f MiB) from peers, sent %d files "
                    "(%.1f MiB), in %.2f s", self._name, len(done), received / 2**20,
                    len(self._sends), sum(s.size for s in self._sends) / 2**20,
                    time.perf_counter() - started)

    def join(self) -> None:
        """Until this rank's sends and receives have ended (bounded by the timeout)."""
        if self._thread is not None:
            self._thread.join()


def _find(dirs: Sequence[str], rel: str, size: int) -> str | None:
    for directory in dirs:
        path = os.path.join(directory, *rel.split("/"))
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == size:
                return path
    return None


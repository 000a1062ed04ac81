"""The peer tier (``keep_local=True, local_replicas=1``): a node loss restores from a peer node.

Two "nodes" on this machine: two torchrun agents (``--nnodes=2``, c10d rendezvous
on 127.0.0.1), one rank each, each with its own local-tier directory, saving to
moto through a request-counting proxy (tests/scripts/peer_train.py). A node is
lost by removing its directory (and, mid-replication, by killing its agent and
rank); the restarted job's requests to the volume and its restored bytes are
what the tests check.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes import CheckpointManager, ConfigurationError
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._peers import sources_of, targets_of
from testkit.ports import free_port
from testkit.proxy import LatencyProxy
from testkit.ranks import run_ranks
from tests.test_cli import run_cli
from tests.test_disk_full import small_disk  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "peer_train.py"

pytestmark = pytest.mark.emulator


def _agents(root: str, out: Path, mode: str, dirs: list[Path], options: dict[str, Any],
            *, saved_world: int = 2, reader_options: dict[str, Any] | None = None,
            encryption_key: bytes | None = None) -> list[subprocess.Popen[bytes]]:
    """One torchrun agent ("node") per directory, one rank each."""
    out.mkdir(parents=True, exist_ok=True)
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for i, local in enumerate(dirs):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "PEER_LOCAL_DIR": str(local),
               "PEER_TEST": json.dumps({"storage_options": options, "saved_world": saved_world,
                                        "reader_options": reader_options,
                                        "encryption_key": encryption_key.hex()
                                        if encryption_key else None})}
        conf = f"is_host={'true' if i == 0 else 'false'},join_timeout=60"
        log = open(out / f"agent-{i}.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(dirs)}",
             "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", "--max-restarts=0",
             "--monitor-interval=0.5", str(SCRIPT), root, str(out), mode],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def _logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(out.glob("*.log")))


def _finish(procs: list[subprocess.Popen[bytes]], out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            assert p.wait(timeout=max(1, deadline - time.monotonic())) == 0, _logs(out)
    except subprocess.TimeoutExpired:
        raise AssertionError("the job hung:\n" + _logs(out)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _gets(proxy: LatencyProxy) -> dict[str, int]:
    """GETs of objects seen by the proxy (not listings, which are GETs of the bucket):
    file name -> count."""
    return {path.rsplit("/", 1)[-1]: n for (method, path), n in proxy.requests.items()
            if method == "GET" and len(path.strip("/").split("/")) >= 2}


def _data_gets(proxy: LatencyProxy) -> dict[str, int]:
    return {name: n for name, n in _gets(proxy).items() if ".distcp" in name}


@pytest.fixture(scope="module")
def proxy(moto_server: Any) -> Iterator[LatencyProxy]:
    with LatencyProxy.in_front_of(moto_server) as px:
        yield px


@pytest.fixture(scope="module")
def saved(moto_server: Any, proxy: LatencyProxy,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Path]:
    """Two nodes saved steps 1 and 2 with a replica each: (root, options, template dirs)."""
    root = moto_server.create_bucket(f"peer-{uuid.uuid4().hex[:10]}") + "/run"
    options = moto_server.storage_options(proxy.endpoint)
    base = tmp_path_factory.mktemp("peer-saved")
    dirs = [base / "node-a", base / "node-b"]
    out = base / "out"
    _finish(_agents(root, out, "save", dirs, options), out)
    reports = _reports(out)
    assert [r["saved"] for r in reports] == [2, 2]
    assert len({r["node"] for r in reports}) == 2  # two nodes, as torchrun numbered them
    return root, options, base


def _copy(base: Path, tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / "node-a", tmp_path / "node-b"]
    for name, d in zip(("node-a", "node-b"), dirs, strict=True):
        shutil.copytree(base / name, d)
    return dirs


def _survivor(out: Path) -> dict[str, Any]:
    return next((r for r in _reports(out) if Path(r["local_dir"]).name == "node-a"), {})


def _exact(reports: list[dict[str, Any]]) -> None:
    assert reports and all(r["step"] == 2 and r["exact"] for r in reports), reports


def test_pairing_never_puts_a_replica_on_its_own_node() -> None:
    nodes = [0, 0, 1, 1]  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert [targets_of(nodes, r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert [sources_of(nodes, r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    uneven = [5, 5, 5, 9, 2]  # nodes by GROUP_RANK, any numbering, uneven sizes
    for r in range(5):
        assert all(uneven[t] != uneven[r] for t in targets_of(uneven, r, 2))
        assert len(targets_of(uneven, r, 2)) == 2
    assert targets_of([0, 0], 1, 1) == []  # one node: no replica


def test_each_node_keeps_the_other_nodes_files_beside_its_own(
        saved: tuple[str, dict[str, Any], Path]) -> None:
    _, _, base = saved
    for mine, other in (("node-a", "node-b"), ("node-b", "node-a")):
        own = {p.name for p in (base / mine / "step-00000002").rglob("*.distcp")}
        replicas = list((base / mine / "replicas").glob("node-*/step-00000002"))
        assert len(replicas) == 1  # newest only: step 1's replica was dropped
        assert not list((base / mine / "replicas").glob("node-*/step-00000001"))
        held = {p.name for p in replicas[0].rglob("*.distcp")}
        theirs = {p.name for p in (base / other / "step-00000002").rglob("*.distcp")}
        assert held == theirs and own and not own & held


def test_a_lost_node_restores_from_its_peer_reading_only_metadata_and_manifest(
        saved: tuple[str, dict[str, Any], Path], proxy: LatencyProxy, tmp_path: Path) -> None:
    root, options, base = saved
    dirs = _copy(base, tmp_path)
    shutil.rmtree(dirs[1])  # node b is lost with its disk; its replacement starts empty
    proxy.reset_counts()
    out = tmp_path / "out"
    _finish(_agents(root, out, "restore", dirs, options), out)
    reports = _reports(out)
    _exact(reports)
    assert _data_gets(proxy) == {}
    assert set(_gets(proxy)) <= {METADATA_NAME, MANIFEST_NAME}, _gets(proxy)
    by_dir = {Path(r["local_dir"]).name: r["sources"] for r in reports}
    assert by_dir["node-b"]["peer"] > 0 and by_dir["node-b"]["volume"] == 0
    assert by_dir["node-a"]["local"] > 0 and by_dir["node-a"]["peer"] == 0


def test_peer_files_beyond_the_readers_prefetch_bytes_go_through_the_local_tier(
        saved: tuple[str, dict[str, Any], Path], proxy: LatencyProxy, tmp_path: Path) -> None:
    # Files that fit in prefetch_bytes are copied into the restore's tensors as they
    # arrive (the test above); the files node b's rank needs (its 384 KiB one, rank 0's
    # with the shared entry) do not fit in 150 KiB: they are written into the new
    # node's local tier, checked, and read back from there.
    root, options, base = saved
    dirs = _copy(base, tmp_path)
    shutil.rmtree(dirs[1])
    proxy.reset_counts()
    out = tmp_path / "out"
    _finish(_agents(root, out, "restore", dirs, options,
                    reader_options={"prefetch_bytes": "150KiB"}), out)
    _exact(_reports(out))
    assert _data_gets(proxy) == {}
    held = {p.name: p.read_bytes() for p in dirs[0].glob("**/step-00000002/*.distcp")}
    written = {p.name: p.read_bytes() for p in dirs[1].glob("step-00000002/*.distcp")}
    assert len(written) == 2 and all(held[name] == blob for name, blob in written.items())
    assert not list(dirs[1].glob("step-00000002/*.part"))


def test_a_damaged_replica_file_comes_from_the_volume(
        saved: tuple[str, dict[str, Any], Path], proxy: LatencyProxy, tmp_path: Path) -> None:
    root, options, base = saved
    dirs = _copy(base, tmp_path)
    shutil.rmtree(dirs[1])
    victim = sorted(dirs[0].glob("replicas/node-*/step-00000002/**/*.distcp"))[0]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size: only the checksum tells
    victim.write_bytes(bytes(blob))
    proxy.reset_counts()
    out = tmp_path / "out"
    _finish(_agents(root, out, "restore", dirs, options), out)
    _exact(_reports(out))
    assert set(_data_gets(proxy)) == {victim.name}
    assert "fails its checksum" in _logs(out)
    assert "from rank" in _logs(out)  # checked on arrival, before the reader saw it


def test_a_job_shrunk_to_one_node_restores_from_its_own_and_replica_files(
        saved: tuple[str, dict[str, Any], Path], proxy: LatencyProxy, tmp_path: Path) -> None:
    root, options, base = saved
    dirs = _copy(base, tmp_path)
    shutil.rmtree(dirs[1])  # node b is gone and not replaced: one node, one rank
    proxy.reset_counts()
    out = tmp_path / "out"
    _finish(_agents(root, out, "restore", dirs[:1], options), out)
    reports = _reports(out)
    _exact(reports)  # DCP reshards: the one rank reads both ranks' files
    assert _data_gets(proxy) == {}
    assert reports[0]["sources"]["volume"] == 0 and reports[0]["sources"]["local"] > 0


def test_a_peer_killed_during_replication_leaves_the_commit_and_the_restore_falls_back(
        moto_server: Any, proxy: LatencyProxy, tmp_path: Path) -> None:
    root = moto_server.create_bucket(f"peer-{uuid.uuid4().hex[:10]}") + "/run"
    options = moto_server.storage_options(proxy.endpoint)
    dirs = [tmp_path / "node-a", tmp_path / "node-b"]
    out = tmp_path / "hold"
    procs = _agents(root, out, "hold", dirs, options)
    try:
        deadline = time.monotonic() + 90
        while not (len(_reports(out)) == 2 and list(out.glob("replicating-*"))):
            assert all(p.poll() is None for p in procs), _logs(out)
            assert time.monotonic() < deadline, "no replication started:\n" + _logs(out)
            time.sleep(0.05)
        victim = next(r for r in _reports(out) if Path(r["local_dir"]).name == "node-b")
        os.killpg(procs[1].pid, signal.SIGKILL)  # node b: its agent...
        os.kill(victim["pid"], signal.SIGKILL)  # ...and its rank (in a session of its own)
        (out / "stop").touch()
        # The surviving rank closes its manager (its agent then waits for the lost one in
        # torchrun's exit barrier: not the library's to shorten).
        deadline = time.monotonic() + 90
        while "close_seconds" not in _survivor(out):
            assert time.monotonic() < deadline, "the surviving rank hung:\n" + _logs(out)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert _survivor(out)["close_seconds"] < 30, _logs(out)  # the exit did not hang
    assert "replica of step-00000002 is missing" in _logs(out)
    with CheckpointManager(root, storage_options=options) as mgr:
        assert [i.step for i in mgr.list() if i.complete] == [1, 2]  # the commit landed

    shutil.rmtree(dirs[1])
    proxy.reset_counts()
    again = tmp_path / "out"
    _finish(_agents(root, again, "restore", dirs, options), again)
    reports = _reports(again)
    _exact(reports)
    by_dir = {Path(r["local_dir"]).name: r["sources"] for r in reports}
    assert by_dir["node-b"]["volume"] > 0  # no whole replica of it anywhere: the volume
    assert by_dir["node-a"]["volume"] == 0


def test_cli_ls_and_inspect_show_what_a_node_holds_locally_and_replicated(
        saved: tuple[str, dict[str, Any], Path]) -> None:
    root, options, base = saved
    node_a = base / "node-a"
    result = run_cli("ls", root, "--local-dir", str(node_a), "--json", options=options)
    assert result.returncode == 0, result.stderr
    held = {c["step"]: c["held"] for c in json.loads(result.stdout)["checkpoints"]}
    assert held[1] == {}  # step 1's copies were dropped when step 2 committed
    own = {p.name for p in node_a.joinpath("step-00000002").rglob("*.distcp")}
    assert held[2]["own"]["files"] == len(own)
    (replica,) = [k for k in held[2] if k != "own"]
    other = next(n for n in node_a.joinpath("replicas").iterdir())
    assert replica == other.name and held[2][replica]["files"] > 0

    table = run_cli("ls", root, "--local-dir", str(node_a), options=options)
    assert table.returncode == 0 and "LOCAL" in table.stdout and f"{replica} (" in table.stdout
    shown = run_cli("inspect", f"{root}/2", "--local-dir", str(node_a), options=options)
    assert shown.returncode == 0 and f"replicas kept: {replica} (" in shown.stdout
    missing = run_cli("ls", root, "--local-dir", str(base / "nowhere"), options=options)
    assert missing.returncode != 0 and "Fix:" in missing.stderr


def test_local_replicas_needs_a_local_tier(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="keep_local=True"):
        CheckpointManager(str(tmp_path / "run"), local_replicas=1)
    with pytest.raises(ConfigurationError, match="integer >= 0"):
        CheckpointManager(str(tmp_path / "run"), keep_local=True, local_replicas=-1)


def _save_with_a_full_replica_disk(rank: int, world: int, root: str, dirs: list[str]
                                   ) -> dict[str, Any]:
    """Ranks 0 and 1 on nodes 0 and 1; node 1's replica disk is full: saves still commit."""
    import logging

    import torch

    os.environ["GROUP_RANK"] = str(rank)  # one rank a node
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logging.getLogger("dcp_volumes").addHandler(Keep())
    with CheckpointManager(root, keep_local=True, local_dir=dirs[rank], local_replicas=1,
                           writer_options={"file_size": "128KiB"}) as mgr:
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            mgr.save(step, {f"rank{rank}": torch.randn(96 * 1024, generator=g)})
        mgr.wait()
    return {"warnings": records}


def test_a_full_disk_on_the_receiving_node_skips_the_replica_and_the_saves_commit(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    dirs = [tmp_path / "node-0", tmp_path / "node-1"]
    full = dirs[1] / "replicas"
    full.parent.mkdir()
    disk = request.getfixturevalue("small_disk")("64k")  # test_disk_full's tmpfs
    full.symlink_to(disk)  # node 1 keeps replicas on a disk with no room for them
    root = str(tmp_path / "run")
    results = run_ranks(_save_with_a_full_replica_disk, 2, root, [str(d) for d in dirs],
                        timeout=120)
    with CheckpointManager(root) as mgr:
        assert [i.step for i in mgr.list() if i.complete] == [1, 2]
    assert any("No space left" in w and "skipped" in w for w in results[1]["warnings"])
    assert not list(disk.rglob("*.distcp")) and not list(disk.rglob("*.part"))
    # The other direction is unaffected: node 0 keeps node 1's files.
    assert list(dirs[0].glob("replicas/node-1/step-00000002/**/*.distcp"))
    assert results[0]["warnings"] == []


def _exchange_with_slow_chunks(rank: int, world: int, base: str) -> dict[str, Any]:
    """Node 0 keeps node 1's replica (one file of it damaged) and sends it, a chunk every
    30 ms; node 1 takes each chunk 30 ms late. What each side saw, and when."""
    import torch.distributed as dist

    from dcp_volumes.checkpoint import _peers
    from dcp_volumes.checkpoint._local_tier import replica_dir
    from dcp_volumes.checkpoint._manifest import FileRecord, checksum_bytes
    from dcp_volumes.checkpoint._supply import CopyMissing

    name = "step-00000002"
    blobs = {f"__1_0_{i}.distcp": bytes([i + 1]) * (4 * 65536) for i in range(3)}
    local = os.path.join(base, f"node-{rank}")
    if rank == 0:
        held = Path(replica_dir(local, 1), name)
        held.mkdir(parents=True)
        for rel, blob in blobs.items():
            held.joinpath(rel).write_bytes(blob)
        held.joinpath("__1_0_1.distcp").write_bytes(bytes(4 * 65536))  # damaged: same size
    _peers._CHUNK = 65536  # four chunks a file
    chunk_times: list[float] = []
    read_chunk, take_chunk = _peers._next_chunk, _peers._take_chunk

    def slow_read(send: Any, buf: bytearray) -> int:
        time.sleep(0.03)
        chunk_times.append(time.monotonic())
        return read_chunk(send, buf)

    def slow_take(item: Any, data: Any) -> None:
        time.sleep(0.03)
        take_chunk(item, data)

    _peers._next_chunk, _peers._take_chunk = slow_read, slow_take
    tier = _peers.PeerTier(local, nodes=[0, 1], rank=rank, replicas=1,
                           group=dist.new_group(backend="gloo"))
    needs = {rel: FileRecord(len(b), checksum_bytes(b), path=rel) for rel, b in blobs.items()}
    into = {rel: bytearray(len(b)) for rel, b in blobs.items()}

    def copy_to(rel: str) -> Any:
        def put(at: int, data: memoryview) -> None:
            into[rel][at:at + len(data)] = data
        return put

    exchange = tier.offer(name, needs if rank == 1 else {}, into=copy_to, memory_bytes=2**20)
    returned = time.monotonic()
    report: dict[str, Any] = {"arrivals": sorted(exchange.supplies)}
    arrivals = {rel: supply.arrival for rel, supply in exchange.supplies.items()}
    if rank == 1:
        first = arrivals["__1_0_0.distcp"].result(timeout=60)
        report["last_pending_at_first"] = not arrivals["__1_0_2.distcp"].done()
        last = arrivals["__1_0_2.distcp"].result(timeout=60)
        report["exact"] = [first.in_buffers and last.in_buffers] + [
            bytes(into[rel]) == blobs[rel] for rel in ("__1_0_0.distcp", "__1_0_2.distcp")]
        try:
            arrivals["__1_0_1.distcp"].result(timeout=60)
            report["damaged"] = "arrived"
        except CopyMissing as exc:
            report["damaged"] = str(exc)
    exchange.join()
    if rank == 0:
        report["returned_before_last_chunk"] = returned < chunk_times[-1]
        report["chunks"] = len(chunk_times)
    return report


def test_a_restore_exchange_runs_beside_the_load_and_files_are_usable_as_they_arrive(
        tmp_path: Path) -> None:
    # The holder's exchange returns at once (it loads its own files while it sends), and
    # the receiver can use each file once it is in, checked, while the next still travels;
    # a damaged file is reported as missing (the reader then reads it from the volume).
    sender, receiver = run_ranks(_exchange_with_slow_chunks, 2, str(tmp_path), timeout=120)
    assert sender["arrivals"] == [] and sender["chunks"] == 12
    assert sender["returned_before_last_chunk"]
    assert receiver["arrivals"] == [f"__1_0_{i}.distcp" for i in range(3)]
    assert receiver["last_pending_at_first"] and receiver["exact"] == [True, True, True]
    assert "fails its checksum" in receiver["damaged"] and "from rank 0" in receiver["damaged"]

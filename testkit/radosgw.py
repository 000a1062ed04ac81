"""Ceph radosgw, a real S3 server, on a private one-node cluster for tests and benchmarks.

One ceph-mon, one memstore ceph-osd (data in RAM) and radosgw (beast frontend), all on
127.0.0.1, in a private temporary directory (config, logs, pid files, admin sockets,
mon/osd data) that ``stop()`` removes. Auth is off inside the cluster; S3 requests are
signed with the fixed fake credentials of one rgw user (``dcpvtest``/``dcpvtestsecret``).

Install the binaries with ``sudo bash testkit/install_radosgw.sh`` (Debian/Ubuntu
packages ``radosgw ceph-mon ceph-osd ceph-common``; Ceph 16 on Debian 12).

Measured on a 2-core Debian 12 machine (Ceph 16.2.15): ``start()`` 1.6-1.9 s idle,
2.7 s with the machine busy (mon 0.15 s, OSD 0.2 s, rgw with its pools 0.7 s, user
0.1 s, warm-up 0.5 s; the key is a short paxos propose interval, else ~18 s),
``stop()`` 0.4 s. Resident memory ~145 MiB idle (mon 36, OSD 52, rgw 56 MiB); stored
data adds to the OSD's RAM (490 MiB after one 256 MiB object). boto3 on one 256 MiB
object: ~160 MiB/s put, ~280 MiB/s get. A watchdog shell process stops the daemons
within ~2 s if the owner dies without ``stop()`` (even by SIGKILL).

Behaviour of this Ceph 16 worth knowing (probed with boto3 1.43, obstore 0.12.1):
conditional PutObject ``IfNoneMatch='*'`` is honoured (412), but a conditional
CompleteMultipartUpload is not (it overwrites); ``IfMatch`` on PutObject only matches
an *unquoted* ETag, so a standard quoted ETag always gets 412; CompleteMultipartUpload
answers with an empty ``<ETag>`` (HEAD has the right one). botocore's default request
checksums work over plain HTTP here. Bucket names need at least 3 characters.

Usable outside pytest: ``sys.path.insert(0, repo_root)``, then
``from testkit.radosgw import RadosGW``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .emulators import Emulator, EmulatorError, S3Api
from .ports import free_port

__all__ = ["INSTALL_COMMAND", "RadosGW"]

INSTALL_COMMAND = "sudo bash testkit/install_radosgw.sh"

# The testing KMS backend's keys (id -> base64 of 32 bytes): fixed fakes, for SSE-KMS tests.
TEST_KMS_KEYS = {
    "testkey-1": "YmNkZWZnaGlqa2xtbm9wcXJzdHV2d3h5ejAxMjM0NTY=",
    "testkey-2": "MDEyMzQ1Njc4OWFiY2RlZmdoaWprbG1ub3BxcnN0dXY=",
}

# Fixed fake credentials of the rgw user; they grant access to this private server only.
_RGW_KEY = "dcpvtest"
_RGW_SECRET = "dcpvtestsecret"
_RGW_UID = "dcpvtest"

_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool")

_GiB = 1 << 30

# Watchdog, one per cluster: when the owner process dies without stop() (SIGKILL,
# a SIGTERM that skips atexit, a cancelled CI job), it stops the daemons, newest
# first, and removes the work dir. Args: owner pid, work dir.
_WATCHDOG = r"""
owner=$1; dir=$2
# Alive and not a zombie (an init that does not reap would keep zombies around).
alive() { read -r _ _ st _ < "/proc/$1/stat" 2>/dev/null && [ "$st" != Z ]; }
while alive "$owner"; do sleep 1; done
for pid in $(tac "$dir/daemons.pid" 2>/dev/null); do
    kill -TERM "-$pid" 2>/dev/null
    n=0
    while alive "$pid" && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
    kill -KILL "-$pid" 2>/dev/null
done
rm -rf "$dir"
"""


@dataclass
class _Daemon:
    name: str  # ceph entity name: mon.a, osd.0, client.rgw.a
    proc: subprocess.Popen[bytes]
    out_path: Path  # stdout/stderr; the daemon's own log is <workdir>/<name>.log


class RadosGW(S3Api, Emulator):
    """A private single-node Ceph cluster serving S3 through radosgw on 127.0.0.1.

    ``disk_bytes``: the OSD keeps its data in BlueStore on a sparse file of that size in
    the work dir instead of RAM (for data sets larger than RAM; slower to start).

    ``memstore_bytes`` is the OSD's capacity, 2 GiB by default. Memstore does not
    reserve it (RAM is used as data arrives), but once the OSD is ~95% full Ceph
    *blocks* writes: PUTs hang until the client times out, there is no error. rgw
    frees the data of deleted objects beyond their first 4 MiB only when its garbage
    collector runs: every ~30 s here (Ceph's default is 2 h), and at once in
    ``reset()`` / ``collect_garbage()``. ``warm_up`` makes rgw create its index, data
    and multipart pools during ``start()`` (~0.5 s), so that the first bucket of a
    test or benchmark does not pay for that.
    """

    scheme = "s3"
    protocol = "s3"
    name = "radosgw"
    access_key = _RGW_KEY
    secret_key = _RGW_SECRET
    ready_timeout_s = 120.0  # rgw waits for its pools; a loaded CI box is slow

    def __init__(
        self,
        *,
        memstore_bytes: int = 2 * _GiB,
        disk_bytes: int | None = None,
        region: str = "us-east-1",
        warm_up: bool = True,
        bin_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.memstore_bytes = memstore_bytes
        # Data larger than RAM: BlueStore on a sparse file of this size in the work dir.
        self.disk_bytes = disk_bytes
        self.region = region
        self.warm_up = warm_up
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self._workdir: Path | None = None
        self._daemons: list[_Daemon] = []
        self._mon_port = 0
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._boto: Any = None
        # Seconds per start-up step of the last start(): mon, osd, rgw, user, warm_up.
        self.timings: dict[str, float] = {}

    # -- binaries ------------------------------------------------------------
    @staticmethod
    def find_binaries() -> Path | None:
        """The directory holding radosgw, ceph-mon, ceph-osd and the CLI tools, or None."""
        search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/sbin"])
        found = shutil.which("radosgw", path=search)
        if found is None:
            return None
        bin_dir = Path(found).parent
        if all((bin_dir / b).exists() for b in _BINARIES):
            return bin_dir
        return None

    def _bin(self, name: str) -> str:
        assert self._bin_dir is not None
        return str(self._bin_dir / name)

    @staticmethod
    def _lib_dirs(bin_dir: Path) -> dict[str, str]:
        """Plugin and class dirs of the install (Debian multiarch or RPM lib64)."""
        prefix = bin_dir.parent
        candidates = [
            *sorted(glob.glob(str(prefix / "lib*" / "*" / "ceph"))),
            str(prefix / "lib64" / "ceph"),
            str(prefix / "lib" / "ceph"),
        ]
        for plugin_dir in candidates:
            if Path(plugin_dir, "erasure-code").is_dir():
                return {
                    "plugin dir": plugin_dir,
                    "erasure code dir": str(Path(plugin_dir, "erasure-code")),
                    "osd class dir": str(Path(plugin_dir).parent / "rados-classes"),
                }
        return {}  # fall back to the paths compiled into the binaries

    # -- lifecycle -----------------------------------------------------------
    def _start(self) -> None:
        if self._bin_dir is None:
            self._bin_dir = self.find_binaries()
        if self._bin_dir is None or not all((self._bin_dir / b).exists() for b in _BINARIES):
            where = f"in {self._bin_dir}" if self._bin_dir else "on PATH or in /usr/bin"
            raise EmulatorError(
                f"Ceph binaries not found {where} ({', '.join(_BINARIES)}). Install them with "
                f"`{INSTALL_COMMAND}` (apt-get install --no-install-recommends radosgw "
                "ceph-mon ceph-osd ceph-common)."
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="dcpv-radosgw-"))
        self.timings = {}
        try:
            wd = str(self._workdir)
            self._watchdog = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG, "dcpv-radosgw-watchdog", str(os.getpid()), wd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self._timed("mon", self._start_mon)
            self._timed("osd", self._start_osd)
            self._timed("rgw", self._start_rgw)
            self._timed("user", self._create_user)
            if self.warm_up:
                self._timed("warm_up", self._warm_up)
        except BaseException:
            self._teardown()
            raise

    def _timed(self, what: str, step: Callable[[], None]) -> None:
        t0 = time.monotonic()
        step()
        self.timings[what] = time.monotonic() - t0

    def _stop(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        self._boto = None
        # Reverse start order: rgw, then the OSD, then the mon (seen here: rgw and
        # the OSD ignore SIGTERM for seconds once their mon is gone).
        while self._daemons:
            self._kill(self._daemons.pop())
        if self._watchdog is not None:
            watchdog, self._watchdog = self._watchdog, None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(watchdog.pid, signal.SIGKILL)  # its `sleep` child too
            watchdog.wait(timeout=10)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self.port = 0
        self._mon_port = 0

    @staticmethod
    def _kill(daemon: _Daemon, grace_s: float = 5.0) -> None:
        proc = daemon.proc
        if proc.poll() is not None:
            return
        # The daemons run in their own session: signal the group so that no helper
        # they forked outlives them.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    # -- cluster bring-up ----------------------------------------------------
    @property
    def conf_path(self) -> Path:
        if self._workdir is None:
            raise EmulatorError("radosgw is not started")
        return self._workdir / "ceph.conf"

    def _write_conf(self, fsid: str) -> None:
        assert self._workdir is not None and self._bin_dir is not None
        d = self._workdir
        settings = {
            "fsid": fsid,
            "mon host": f"[v2:127.0.0.1:{self._mon_port}]",
            # Loopback only, msgr2 only (one port per daemon role, no v1 twin).
            "public addr": "127.0.0.1",
            "cluster addr": "127.0.0.1",
            "ms bind ipv6": "false",
            "ms bind msgr1": "false",
            # No cephx: nothing here is secret, and keyrings would only slow start-up.
            "auth cluster required": "none",
            "auth service required": "none",
            "auth client required": "none",
            # Without crc modes rgw loops on auth error -13 against the mon.
            "ms mon client mode": "crc",
            "ms client mode": "crc",
            "ms mon service mode": "crc",
            "ms service mode": "crc",
            "ms mon cluster mode": "crc",
            "ms cluster mode": "crc",
            # One OSD: one replica, a flat CRUSH map, few PGs (rgw makes ~8 pools).
            "osd pool default size": "1",
            "osd pool default min size": "1",
            "mon allow pool size one": "true",
            "mon warn on pool no redundancy": "false",
            "osd crush chooseleaf type": "0",
            "osd pool default pg num": "8",
            "osd pool default pgp num": "8",
            "osd pool default pg autoscale mode": "off",
            "mon max pg per osd": "1000",
            **self._store_settings(d),
            # Keep every file inside the work dir (defaults point into /var).
            "run dir": str(d / "run"),
            "crash dir": str(d / "crash"),
            "log file": str(d / "$name.log"),
            "pid file": str(d / "$name.pid"),
            "mon cluster log file": str(d / "cluster.log"),
            "mon data": str(d / "$name"),
            "osd data": str(d / "$name"),
            "rgw data": str(d / "$name"),
            "keyring": str(d / "keyring"),
            # Each osdmap change (OSD boot, every rgw pool) waits one propose
            # interval (1 s by default); a lone mon has nobody to batch with.
            "paxos propose interval": "0.05",
            "paxos min wait": "0.01",
            # The mon refuses to run on a nearly full disk; test data is in RAM.
            "mon data avail warn": "1",
            "mon data avail crit": "0",
            # Free deleted objects' data in seconds, not hours: it sits in RAM.
            "rgw gc obj min wait": "30",
            "rgw gc processor period": "30",
            # Server-side encryption for tests (Ceph's vstart.sh does the same for its
            # s3-tests): SSE-C and SSE-KMS over plain http, KMS keys from this config.
            "rgw crypt require ssl": "false",
            "rgw crypt s3 kms backend": "testing",
            "rgw crypt s3 kms encryption keys": " ".join(
                f"{kid}={key}" for kid, key in TEST_KMS_KEYS.items()),
            **self._lib_dirs(self._bin_dir),
        }
        lines = ["[global]"] + [f"{k} = {v}" for k, v in settings.items()]
        (d / "run").mkdir(exist_ok=True)
        (d / "crash").mkdir(exist_ok=True)
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _store_settings(self, d: Path) -> dict[str, str]:
        """The OSD's object store: memstore (RAM), or BlueStore on a sparse file."""
        if self.disk_bytes is None:
            return {"osd objectstore": "memstore",
                    "memstore device bytes": str(self.memstore_bytes)}
        return {
            "osd objectstore": "bluestore",
            "bluestore block path": str(d / "osd.0.block"),  # not inside: mkfs links it there
            "bluestore block create": "true",
            "bluestore block size": str(self.disk_bytes),
            "bluestore fsck on mkfs": "false",
            # A small cache: the point of the disk is to keep RAM for the benchmark.
            "osd memory target": str(_GiB),
            "bluestore cache autotune": "false",
            "bluestore cache size": str(256 << 20),
        }

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # /usr/bin/ceph is a Python script: a venv's PYTHONPATH/HOME must not leak in.
        for var in ("PYTHONPATH", "PYTHONHOME", "CEPH_ARGS"):
            env.pop(var, None)
        env["CEPH_CONF"] = str(self.conf_path)
        return env

    def _run(self, args: list[str], timeout: float = 60.0) -> str:
        """Run a Ceph tool to completion; its stdout, or EmulatorError with its output."""
        cmd = [self._bin(args[0]), "-c", str(self.conf_path), *args[1:]]
        try:
            res = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=self._env(),
                cwd=self._workdir,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise EmulatorError(
                f"radosgw: `{' '.join(cmd)}` did not finish within {timeout:.0f} s"
                + self._logs_tail()
            ) from exc
        if res.returncode != 0:
            raise EmulatorError(
                f"radosgw: `{' '.join(cmd)}` exited with {res.returncode}:\n"
                f"{res.stderr.decode(errors='replace')[-2000:]}" + self._logs_tail()
            )
        return res.stdout.decode(errors="replace")

    def pids(self) -> list[int]:
        """The running daemons' process ids (mon, OSD, rgw): whose CPU a benchmark counts."""
        return [d.proc.pid for d in self._daemons if d.proc.poll() is None]

    def _spawn(self, name: str, args: list[str]) -> _Daemon:
        assert self._workdir is not None
        out_path = self._workdir / f"{name}.out"
        cmd = [self._bin(args[0]), "-f", "-c", str(self.conf_path), *args[1:]]
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self._workdir,
                # Own process group: a Ctrl-C reaches the owner, which stops in order.
                start_new_session=True,
            )
        daemon = _Daemon(name, proc, out_path)
        self._daemons.append(daemon)
        # For the watchdog; the pid is also the process group id (own session).
        with open(self._workdir / "daemons.pid", "a") as pids:
            pids.write(f"{proc.pid}\n")
        return daemon

    def _logs_tail(self, *names: str) -> str:
        """Last lines of the given daemons' logs (all of them when none given)."""
        if self._workdir is None:
            return ""
        names = names or tuple(d.name for d in self._daemons)
        parts = []
        for name in names:
            for path in (self._workdir / f"{name}.log", self._workdir / f"{name}.out"):
                if path.exists() and path.stat().st_size:
                    parts.append(f"\n--- last lines of {path.name} ---\n{_tail(path, 25)}")
        return "".join(parts)

    def _wait(self, daemon: _Daemon, ready: Callable[[], bool], what: str) -> bool:
        """Poll ``ready()`` while the daemon lives. False: it exited (e.g. port taken)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            for other in self._daemons:
                if other.proc.poll() is not None:
                    if other is daemon:
                        return False
                    raise EmulatorError(
                        f"radosgw: {other.name} exited with code {other.proc.returncode} "
                        f"while waiting for {what}" + self._logs_tail(other.name, daemon.name)
                    )
            if ready() and daemon.proc.poll() is None:
                return True
            time.sleep(0.1)
        raise EmulatorError(
            f"radosgw: {what} not ready within {self.ready_timeout_s:.0f} s" + self._logs_tail()
        )

    def _port_clash(self, daemon: _Daemon) -> bool:
        assert self._workdir is not None
        text = ""
        for path in (self._workdir / f"{daemon.name}.log", daemon.out_path):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return "Address already in use" in text

    def _start_mon(self) -> None:
        assert self._workdir is not None
        fsid = str(uuid.uuid4())
        # A free port can be taken between probe and bind: retry with another.
        for _attempt in range(3):
            self._mon_port = free_port()
            self._write_conf(fsid)
            shutil.rmtree(self._workdir / "mon.a", ignore_errors=True)
            monmap = str(self._workdir / "monmap")
            self._run(
                [
                    "monmaptool",
                    "--create",
                    "--clobber",
                    "--fsid",
                    fsid,
                    "--addv",
                    "a",
                    f"[v2:127.0.0.1:{self._mon_port}]",
                    monmap,
                ]
            )
            self._run(["ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap])
            mon = self._spawn("mon.a", ["ceph-mon", "-i", "a"])
            if self._wait(mon, lambda: _tcp_open(self._mon_port), "ceph-mon"):
                return
            if not self._port_clash(mon):
                break
            self._daemons.remove(mon)
        raise EmulatorError(
            f"radosgw: ceph-mon exited with code {mon.proc.returncode}" + self._logs_tail("mon.a")
        )

    def _start_osd(self) -> None:
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run(["ceph", "--connect-timeout", "30", "osd", "new", osd_uuid]).strip()
        if osd_id != "0":
            raise EmulatorError(f"radosgw: `ceph osd new` gave id {osd_id!r}, expected 0")
        assert self._workdir is not None
        (self._workdir / "osd.0").mkdir()  # memstore's mkfs does not create it
        self._run(["ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid])
        # The OSD picks its own free ports (ms bind port min..max) on public addr.
        self._spawn("osd.0", ["ceph-osd", "-i", "0"])

    def _start_rgw(self) -> None:
        for _attempt in range(3):
            self.port = free_port()
            rgw = self._spawn(
                "client.rgw.a",
                [
                    "radosgw",
                    "-n",
                    "client.rgw.a",
                    "--rgw-frontends",
                    # tcp_nodelay: without it beast's second write of a small
                    # response waits for the client's delayed ACK (~40 ms a request).
                    f"beast endpoint=127.0.0.1:{self.port} tcp_nodelay=1",
                ],
            )
            if self._wait(rgw, self._probe, "radosgw"):
                return
            if not self._port_clash(rgw):
                break
            self._daemons.remove(rgw)
        raise EmulatorError(
            f"radosgw: radosgw exited with code {rgw.proc.returncode}"
            + self._logs_tail("client.rgw.a", "osd.0")
        )

    def _probe(self) -> bool:
        return _http_answers(self.endpoint + "/")

    def _create_user(self) -> None:
        self._run(
            [
                "radosgw-admin",
                "user",
                "create",
                f"--uid={_RGW_UID}",
                "--display-name=dcp_volumes tests",
                f"--access-key={_RGW_KEY}",
                f"--secret-key={_RGW_SECRET}",
            ]
        )

    def _warm_up(self) -> None:
        # rgw creates its index, data and multipart pools on first use.
        s3 = self.boto3_client()
        bucket = f"dcpv-warmup-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="k", Body=b"x")
        upload = s3.create_multipart_upload(Bucket=bucket, Key="m")
        s3.abort_multipart_upload(Bucket=bucket, Key="m", UploadId=upload["UploadId"])
        s3.delete_object(Bucket=bucket, Key="k")
        s3.delete_bucket(Bucket=bucket)

    # -- clients -------------------------------------------------------------
    def collect_garbage(self) -> None:
        """Free the RAM of deleted objects now instead of at rgw's next GC pass."""
        self._run(["radosgw-admin", "gc", "process", "--include-all"])

    def reset(self) -> None:
        """Delete every bucket with its objects, versions and unfinished uploads.

        Also runs rgw's garbage collector, so that the OSD's RAM is freed at once.
        """
        s3 = self.boto3_client()
        for bucket in s3.list_buckets().get("Buckets", []):
            name = bucket["Name"]
            for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=name):
                for up in page.get("Uploads", []):
                    s3.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
            # Versions (not just keys): a versioned bucket keeps data under delete markers.
            for page in s3.get_paginator("list_object_versions").paginate(Bucket=name):
                doomed = [
                    {"Key": v["Key"], "VersionId": v["VersionId"]}
                    for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
                ]
                if doomed:
                    res = s3.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})
                    if res.get("Errors"):
                        raise EmulatorError(f"radosgw reset: {name}: {res['Errors'][:3]}")
            s3.delete_bucket(Bucket=name)
        self.collect_garbage()


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _http_answers(url: str) -> bool:
    """True when an HTTP server answers at ``url`` (any status)."""
    # No proxies: a proxy from the environment must never see emulator traffic.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"

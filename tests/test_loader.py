"""DataLoader: tuned defaults, metrics (per batch, windows, sinks), a DCP-friendly global
state, and real gloo ranks sharing one listing and one sample stream."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_volumes import ConfigurationError, DataLoader, VolumeDataset
from dcp_volumes.data._loader import default_num_workers
from testkit.emulators import LatencyProxy, MotoServer
from testkit.ranks import process_running, run_ranks
from tests.test_data_support import read_id, run_job, to_list, write_samples


@pytest.fixture
def local_data(tmp_path: Path) -> tuple[str, str]:
    src = str(tmp_path / "src")
    write_samples(src, None, 24, size=1000)
    return src, str(tmp_path / "cache")


def test_tuned_defaults_and_explicit_arguments_win(local_data: tuple[str, str]) -> None:
    src, cache = local_data
    ds = VolumeDataset(src, cache_dir=cache)
    tuned = DataLoader(ds, batch_size=4)
    assert tuned.num_workers == default_num_workers(1) >= 1
    assert tuned.persistent_workers and tuned.prefetch_factor == 4
    assert tuned.pin_memory == torch.cuda.is_available()
    assert len(tuned) == 6 and tuned.global_batch_size == 4
    mine = DataLoader(ds, batch_size=4, num_workers=0, pin_memory=False)
    assert mine.num_workers == 0 and not mine.persistent_workers and mine.prefetch_factor is None
    explicit = DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=False,
                          prefetch_factor=2)
    assert not explicit.persistent_workers and explicit.prefetch_factor == 2
    split = DataLoader(ds, global_batch_size=12, rank=1, world_size=3)
    assert split.batch_size == 4 and split.global_batch_size == 12 and len(split) == 2


def test_metrics_per_batch_windows_and_worker_counters(
    local_data: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    src, cache = local_data
    ds = VolumeDataset(src, cache_dir=cache, transform=read_id, prefetch=4)
    loader = DataLoader(ds, batch_size=4, num_workers=2, metrics_window_s=3600)
    m = loader.metrics
    with caplog.at_level(logging.INFO, logger="dcp_volumes.data"):
        for _ in loader:
            time.sleep(0.02)  # the "training step"
    assert len(m.fetch_seconds) == 6 and all(s >= 0 for s in m.fetch_seconds)
    assert len(m.between_next_seconds) == 5 and min(m.between_next_seconds) >= 0.02
    window = m.last
    assert window is not None and len(m.windows) == 1  # flushed at the end of the epoch
    assert window["batches"] == 6 and window["step"] == 6
    assert window["between_next_seconds"] >= 0.02
    assert math.isclose(window["fetch_seconds"], sum(m.fetch_seconds) / 6, rel_tol=1e-9)
    # Worker-side counters reached the main process with the batches.
    assert (window["cache_misses"], window["cache_hits"]) == (24, 0)
    assert window["bytes_fetched"] == 24 * 1000 and window["download_mib_s"] > 0
    assert window["prefetch_depth"] >= 0
    assert "dataloader rank 0 step 6" in caplog.text
    # Second epoch: all local; a break flushes the partial window.
    it = iter(loader)
    for _ in range(2):
        next(it)
    del it
    gc.collect()
    assert len(m.windows) == 2
    assert m.last is not None and m.last["batches"] == 2 and m.last["cache_hit_rate"] == 1.0
    assert m.flush() is None  # nothing pending
    assert m.summary()["batches"] == 8


def test_windows_close_on_time(local_data: tuple[str, str]) -> None:
    src, cache = local_data
    loader = DataLoader(VolumeDataset(src, cache_dir=cache), batch_size=4, num_workers=0,
                        metrics_window_s=0.05)
    for _ in loader:
        time.sleep(0.03)
    assert len(loader.metrics.windows) >= 3
    assert sum(w["batches"] for w in loader.metrics.windows) == 6


def test_mlflow_sink(local_data: tuple[str, str], tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A local file store; no telemetry (no network here).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mlflow = pytest.importorskip(
        "mlflow", reason="mlflow is not installed (optional extra dcp_volumes[mlflow])")
    src, cache = local_data
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    mlflow.set_experiment("dcp_volumes-test")
    loader = DataLoader(VolumeDataset(src, cache_dir=cache), batch_size=4, num_workers=0)
    with mlflow.start_run() as run:
        for _ in loader:
            pass
    history = mlflow.tracking.MlflowClient().get_metric_history(
        run.info.run_id, "dataloader/fetch_seconds/rank_0")
    assert history and history[-1].step == 6


def test_state_is_global_dcp_friendly_and_resumes(local_data: tuple[str, str],
                                                  tmp_path: Path) -> None:
    src, cache = local_data
    reference, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4)
    ds = VolumeDataset(src, cache_dir=cache, transform=read_id)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    head = []
    for batch in loader:
        head += to_list(batch)
        if len(head) == 12:
            break
    state = loader.state_dict()
    assert all(isinstance(v, (int, str)) for v in state.values())
    assert state["position"] == 12 and state["epoch"] == 0 and state["step"] == 3
    dcp.save({"data": loader}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")))
    # Iterating again continues from what was delivered, not from what the (persistent)
    # workers had prefetched.
    assert [i for batch in loader for i in to_list(batch)] == reference[12:]
    fresh = DataLoader(VolumeDataset(src, cache_dir=cache, transform=read_id), batch_size=4,
                       num_workers=1)
    dcp.load({"data": fresh}, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")))
    assert fresh.state_dict() == state
    tail = [i for batch in fresh for i in to_list(batch)]
    assert head + tail == reference
    assert fresh.epoch == 1 and fresh.state_dict()["position"] == 0
    with pytest.raises(ConfigurationError, match="version"):
        fresh.load_state_dict({"epoch": 0})


def test_any_dataset_gets_defaults_and_metrics_but_no_state() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_size=5, num_workers=0)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert len(loader.metrics.fetch_seconds) == 2
    with pytest.raises(ConfigurationError, match="VolumeDataset"):
        loader.state_dict()


def _rank_stream(rank: int, world_size: int, url: str, opts: dict[str, Any], cache: str,
                 ck: str) -> dict[str, Any]:
    ds = VolumeDataset(url, storage_options=opts, cache_dir=f"{cache}-{rank}",
                       transform=read_id)
    # Ranks are spawned (so spawn became their default start method); torchrun's ranks
    # would fork their workers, which is also much faster here.
    loader = DataLoader(ds, global_batch_size=8, num_workers=1, multiprocessing_context="fork")
    batches = [to_list(b) for b in loader]
    dcp.save({"data": loader}, storage_writer=dcp.FileSystemWriter(ck))
    dist.barrier()
    return {"batches": batches, "state": loader.state_dict(), "files": ds.num_files}


def test_gloo_ranks_list_once_and_share_one_stream(moto_server: MotoServer,
                                                   s3_bucket: tuple[str, Any],
                                                   tmp_path: Path) -> None:
    url, direct = s3_bucket
    write_samples(url, direct, 24)
    with LatencyProxy.in_front_of(moto_server) as proxy:
        opts = moto_server.storage_options(proxy.endpoint)
        VolumeDataset(url, storage_options=opts, cache_dir=tmp_path / "c0")
        listing_requests = sum(proxy.requests.values())
        proxy.reset_counts()
        results = run_ranks(_rank_stream, 2, url, opts, str(tmp_path / "cache"),
                            str(tmp_path / "ck"), timeout=180)
        gets = sum(n for (method, path), n in proxy.requests.items()
                   if method == "GET" and path.count("/") > 1)
        # Rank 0 listed, rank 1 received the manifest: the same listing requests as one process.
        assert sum(proxy.requests.values()) - gets == listing_requests
    reference, _ = run_job(url, direct, str(tmp_path / "ref"), world=1, workers=0,
                           global_batch_size=8)
    stream = [i for step in zip(*(r["batches"] for r in results), strict=True)
              for batch in step for i in batch]
    assert stream == reference and sorted(stream) == list(range(24))
    assert results[0]["state"] == results[1]["state"]
    assert gets == 24  # each file downloaded once (each rank has its own cache here)


def _as_tensor(path: str) -> torch.Tensor:
    return torch.tensor([read_id(path)])


def test_forkserver_workers_deliver_the_same_stream_and_state(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    # The start method to use when the training process has threads that may be
    # inside OpenSSL at a fork (see the DataLoader docstring): workers get the
    # dataset pickled (shared-memory plan and hot table included) instead of
    # forked, and the delivered stream and the state must not change.
    url, direct = s3_bucket
    write_samples(url, direct, 24)
    opts = moto_server.storage_options()

    def loader_for(context: str, cache: str) -> DataLoader:
        ds = VolumeDataset(url, storage_options=opts, cache_dir=tmp_path / cache,
                           transform=read_id, seed=3)
        return DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context,
                          timeout=120)

    def run(loader: DataLoader, stop_after: int | None = None) -> list[int]:
        seen: list[int] = []
        for batch in loader:
            seen += to_list(batch)
            if stop_after is not None and len(seen) >= stop_after:
                break
        return seen

    forked = run(loader_for("fork", "c-fork"))
    served = run(loader := loader_for("forkserver", "c-fs"))
    assert served == forked and sorted(served) == list(range(24))
    assert loader.metrics.totals["misses"] == 24  # the counters travel from the workers
    partial = run(paused := loader_for("forkserver", "c-fs2"), stop_after=8)
    resumed = loader_for("forkserver", "c-fs2")
    resumed.load_state_dict(paused.state_dict())
    assert partial + run(resumed) == forked


def test_a_worker_stuck_creating_its_client_fails_fast(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker forked while another thread held an OpenSSL lock blocks forever
    # creating its S3 client (seen in the data benchmark: SSL_CTX_new waiting on a
    # lock no thread of the worker holds). Here the creation blocks for good; the
    # watchdog must log why and stop the worker, so the loop fails, not hangs.
    import obstore.store
    import s3fs

    from dcp_volumes._volume import STUCK_EXIT_CODE

    url, direct = s3_bucket
    write_samples(url, direct, 8)
    ds = VolumeDataset(url, storage_options=moto_server.storage_options(),
                       cache_dir=tmp_path / "c", transform=read_id)
    # Whichever client the forked worker creates (obstore, or s3fs after the
    # parent used obstore), its creation blocks.
    monkeypatch.setattr(obstore.store, "S3Store", lambda *a, **k: time.sleep(3600))
    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", lambda *a, **k: time.sleep(3600))
    monkeypatch.setenv("DCP_VOLUMES_CLIENT_START_TIMEOUT", "1")
    log_file = tmp_path / "worker.log"
    handler = logging.FileHandler(log_file)  # forked workers inherit it
    watchdog_log = logging.getLogger("dcp_volumes._volume._client_watchdog")
    watchdog_log.addHandler(handler)
    try:
        loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"exit code {STUCK_EXIT_CODE}|exited unexpectedly"):
            list(loader)
        assert time.monotonic() - started < 60
    finally:
        watchdog_log.removeHandler(handler)
        handler.close()
    logged = log_file.read_text()
    assert "has not finished after 1 s" in logged and "forkserver" in logged
    assert "Stopping this DataLoader worker" in logged


def test_client_start_timeout_takes_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_volumes import _env

    monkeypatch.setenv("DCP_VOLUMES_CLIENT_START_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match="'soon' is not a number of seconds"):
        _env.client_start_timeout()
    monkeypatch.setenv("DCP_VOLUMES_CLIENT_START_TIMEOUT", "0")
    assert _env.client_start_timeout() == 0.0  # the watchdog is off
    monkeypatch.delenv("DCP_VOLUMES_CLIENT_START_TIMEOUT")
    assert _env.client_start_timeout() == 120.0


def test_a_stuck_client_outside_a_worker_is_only_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dcp_volumes._volume._client_watchdog import watch_client_start

    monkeypatch.setenv("DCP_VOLUMES_CLIENT_START_TIMEOUT", "0.05")
    watchdog_log = "dcp_volumes._volume._client_watchdog"
    with caplog.at_level(logging.ERROR, logger=watchdog_log), watch_client_start("S3"):
        time.sleep(0.5)  # stuck past the limit; this process goes on
    assert "has not finished after 0 s" in caplog.text
    assert "Stopping" not in caplog.text


def test_the_volume_layer_imports_nothing_of_the_layers_above() -> None:
    """The data layer registers what the watchdog stops (a DataLoader worker); the
    volume layer knows neither it nor torch's loader."""
    import ast

    import dcp_volumes._volume

    above = ("torch.utils.data", "dcp_volumes.data", "dcp_volumes.checkpoint")
    found = []
    for path in Path(dcp_volumes._volume.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.name}: {n}" for n in names if n.startswith(above)]
    assert not found, found


def test_counters_survive_the_pin_memory_step() -> None:
    from dcp_volumes.data._loader import _Delivery

    delivery = _Delivery(["a", "b"], {"hits": 2})
    pinned = delivery.pin_memory()  # what torch's pin-memory thread calls
    assert pinned.batch == ["a", "b"] and pinned.stats == {"hits": 2}


@pytest.mark.gpu
def test_pinned_batches_on_cuda(local_data: tuple[str, str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    src, cache = local_data
    loader = DataLoader(VolumeDataset(src, cache_dir=cache, transform=_as_tensor), batch_size=4,
                        num_workers=1)
    assert loader.pin_memory  # the tuned default with CUDA present
    batches = list(loader)
    assert all(b.is_pinned() for b in batches)
    assert sorted(int(i) for b in batches for i in b) == list(range(24))
    assert loader.metrics.last is not None and loader.metrics.last["cache_misses"] == 24


# -- fork safety with obstore (S3/Azure): workers after a save and after a listing ----------


def _save_then_load(url: str, opts: dict[str, Any], cache: Path, transform: Any,
                    context: str | None = None) -> tuple[list[int], Any]:
    # The training process does I/O through obstore first (a checkpoint save and
    # the dataset listing), then starts workers: a forked worker could not use
    # obstore after that and would hang on its first call.
    from dcp_volumes import VolumeWriter

    dcp.save({"w": torch.arange(8)}, storage_writer=VolumeWriter(
        url + "/ckpt", storage_options=opts), no_dist=True)
    ds = VolumeDataset(url + "/data", storage_options=opts, cache_dir=cache,
                       transform=transform, seed=1)
    kwargs: dict[str, Any] = {} if context is None else {"multiprocessing_context": context}
    loader = DataLoader(ds, batch_size=4, num_workers=2, timeout=60, **kwargs)
    seen: list[int] = []
    for batch in loader:
        seen += to_list(batch)
    return seen, loader


@pytest.mark.timeout(180)
def test_workers_start_safely_after_the_parent_used_obstore(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    from dcp_volumes._volume import obstore_used_here

    url, direct = s3_bucket
    write_samples(url + "/data", direct, 16)
    seen, loader = _save_then_load(url, moto_server.storage_options(), tmp_path / "c", read_id)
    assert obstore_used_here()
    assert sorted(seen) == list(range(16))
    # forkserver was chosen for the workers (the default would have been fork).
    assert loader.multiprocessing_context is not None
    assert loader.multiprocessing_context.get_start_method() == "forkserver"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_workers_end_when_the_training_process_is_killed(
    local_data: tuple[str, str], tmp_path: Path
) -> None:
    # A forkserver worker's parent is the fork server, which a killed training process
    # leaves behind; server and workers then keep each other alive for good.
    src, cache = local_data
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.killed_loader", src, cache, str(pid_dir)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        workers = [int(p.read_text()) for p in pid_dir.iterdir()]
        assert len(workers) == 2 and all(process_running(w) for w in workers)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(process_running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if process_running(w)], "workers outlived the training process"


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_workers_survive_a_sigterm_to_the_training_process_group(
    local_data: tuple[str, str], tmp_path: Path, context: str
) -> None:
    # torchrun's agent killpg's each rank with SIGTERM (a preemption); the rank handles
    # it and trains on to the step its ranks save at. Its workers must not die of it.
    src, cache = local_data
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.signalled_loader", src, cache, context],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).parent.parent, start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "noticed 1" in out
    assert "delivered 24" in out  # the whole epoch, after the signal too


@pytest.mark.timeout(180)
def test_the_fork_server_starts_with_the_loader_and_its_workers_share_one_manager(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    """The fork server's imports are most of a new process's time to its first batch; it
    starts as the loader is built, so they run beside what comes before the first
    ``iter()`` (a restore). Each worker starting its own torch_shm_manager cost ~0.3 s
    of every loader start."""
    url, direct = s3_bucket
    write_samples(url + "/data", direct, 12)
    # A fresh interpreter: the forkserver (and what it preloads) is once per process.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.forkserver_workers", url + "/data",
         json.dumps(moto_server.storage_options()), str(tmp_path / "c")],
        capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["start_method"] == "forkserver"
    # Running before the first iter(), and the one the workers came from.
    assert len(found["servers_when_built"]) == 1, found
    assert found["servers"] == found["servers_when_built"], found
    assert found["workers_of_server"] == 3, found
    assert found["managers"] == 1, found  # the server's, not one per worker (3)
    assert found["ids"] == list(range(12))


@pytest.mark.timeout(180)
def test_a_rank_with_one_cpu_forks_its_workers_and_they_fetch_through_fsspec(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    """A fork server's second torch import has no CPU to run on beside a rank that has
    one: it would delay every restart. Such a rank forks its workers after its obstore
    I/O, on purpose, so the workers' fallback to fsspec is no warning."""
    url, direct = s3_bucket
    write_samples(url + "/data", direct, 12)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.forkserver_workers", url + "/data",
         json.dumps(moto_server.storage_options()), str(tmp_path / "c"), "1"],
        capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["start_method"] == "fork", found
    assert found["servers_when_built"] == [] and found["servers"] == [], found
    assert found["ids"] == list(range(12))  # fetched by the workers: the cache was empty
    assert "has 1 CPU(s), too few to start a fork server" in proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]


def test_the_fork_server_preload_does_not_import_checkpoint_code() -> None:
    """Every worker comes from the fork server after its preload (torch, the loader,
    ``_forkserver_preload``): importing torch.distributed.checkpoint there as well
    (DTensor, sympy) added about a second to every loader's first batch."""
    code = (
        "import sys, torch, dcp_volumes.data._loader, dcp_volumes.data._forkserver_preload\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

@pytest.mark.timeout(180)
def test_an_unpicklable_transform_keeps_fork_and_falls_back_to_fsspec(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, direct = s3_bucket
    write_samples(url + "/data", direct, 12)
    with caplog.at_level(logging.WARNING, logger="dcp_volumes"):
        seen, loader = _save_then_load(url, moto_server.storage_options(), tmp_path / "c",
                                       lambda path: read_id(path))
    assert sorted(seen) == list(range(12))  # completed: no worker hung
    assert loader.multiprocessing_context is None  # torch's default, fork
    assert any("cannot be pickled" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(180)
def test_explicit_fork_after_obstore_io_completes_through_fsspec(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    url, direct = s3_bucket
    write_samples(url + "/data", direct, 12)
    seen, loader = _save_then_load(url, moto_server.storage_options(), tmp_path / "c",
                                   read_id, context="fork")
    assert sorted(seen) == list(range(12))
    assert loader.multiprocessing_context.get_start_method() == "fork"

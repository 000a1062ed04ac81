"""CheckpointManager: one checkpoint per step under a root, resume, retention, local tier.

Layout under the root URL (one directory per step, standard DCP inside)::

    <root>/step-00000100/.metadata                    commit marker, written last
    <root>/step-00000100/.dcp_volumes.manifest.json   sizes + checksums of the data files
    <root>/step-00000100/__0_0.distcp ...             the data files

Checkpoints that other tools wrote into the root (``step_100``, ``100``,
``checkpoint-100``...) are listed and restorable too (see ``_discovery``).

Call order with a process group (every call below is made on all ranks)::

    save(step, state)   all ranks: wait for the previous save (its error, if any, is
                        this rank's status); Stateful.state_dict(); stage (host copy)
                        coordinator: refuse a committed step (unless overwrite), note
                        a partial leftover of the step
                        all ranks: all_gather of every rank's status; if any rank
                        failed, every rank raises and nothing is written
                        coordinator: delete the leftover (or the overwritten one),
                        then all_gather again
                        all ranks: dcp.async_save (or dcp.save) through VolumeWriter
                        background, after the commit: coordinator applies retention;
                        local rank 0 drops older local copies; with local_replicas,
                        all ranks queue the replication (``_peers``: its own thread
                        and gloo group, never on the commit's path)
    restore(state)      coordinator: list, pick the newest complete checkpoint
                        all ranks: broadcast of the choice, then dcp.load (with
                        local_replicas, its read_data asks the peers for the files
                        this node lacks: one all_gather, then point-to-point)

Checkpoint collectives run on a private gloo group (created on all ranks by
the constructor) so that a background save never interleaves with the
training loop's own collectives on the default group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from dcp_volumes._exceptions import (
    CheckpointError,
    CheckpointExistsError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeError,
    storage_error,
)
from dcp_volumes._prompt_exit import skip_final_collection
from dcp_volumes._volume import RetryPolicy, Volume
from dcp_volumes.checkpoint._coordination import Coordinator, Prestaged, summary, typed_errors
from dcp_volumes.checkpoint._discovery import (
    CheckpointInfo,
    ManifestCache,
    choose_checkpoint,
    newest_complete,
    scan,
    step_dir,
)
from dcp_volumes.checkpoint._encryption import Encryption
from dcp_volumes.checkpoint._layout import METADATA_NAME, is_commit_marker
from dcp_volumes.checkpoint._local_tier import LocalCopies, LocalTier
from dcp_volumes.checkpoint._manager_options import ManagerOptions
from dcp_volumes.checkpoint._peers import PeerTier
from dcp_volumes.checkpoint._preemption import PreemptionWatch, signals_of
from dcp_volumes.checkpoint._reader import VolumeReader
from dcp_volumes.checkpoint._retention import (
    DEFAULT_PARTIAL_GRACE_S,
    apply_retention,
    delete_checkpoint,
)
from dcp_volumes.checkpoint._state_copy import free_pooled_buffers
from dcp_volumes.checkpoint._tiers import SOURCE_NAMES, FileSource
from dcp_volumes.checkpoint._writer import VolumeWriter
from dcp_volumes.goodput import _recorder as goodput_recording
from dcp_volumes.goodput._report import GoodputReport

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "CheckpointManager", "ManagerOptions"]

# How to fix a restore that DCP's planner refused (the state does not match the checkpoint).
_MISMATCH_FIX = (
    "The state given to restore() must have the checkpoint's keys and shapes. Fix: build the "
    "model (and optimizer) with the configuration the checkpoint was saved with; or, to load "
    "only the keys the checkpoint has and leave the others as they are, pass "
    "planner=DefaultLoadPlanner(allow_partial_load=True) (from "
    "torch.distributed.checkpoint) to restore()."
)


class CheckpointManager:
    """Save, list, restore and prune the checkpoints of one training run.

    One checkpoint per step, in ``<root>/step-00000100`` (step zero-padded to 8+ digits), written
    with ``VolumeWriter``: standard DCP format plus a manifest, ``.metadata``
    last. A crash at any instant leaves at worst a partial directory, which is
    never restored and is deleted by retention once a newer checkpoint commits.

    Args:
        root_url: where the run's checkpoints live: ``s3://bucket/run1``,
            ``gs://...``, ``az://...``, a local or mounted path, any fsspec URL.
        keep_last: keep the newest N complete checkpoints (None: keep all).
            Older complete ones and partial ones older than the newest complete
            are deleted in the background after each commit.
        storage_options: client options (endpoint, credentials...); ``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``, if set. Explicit options, ``{}`` included,
            are used alone.
        staging_dir: local NVMe directory for serialised shards before upload
            (default: ``DCP_VOLUMES_STAGING`` or a temp dir).
        async_save: ``save`` returns after the in-memory staging copy and the
            upload runs in the background (``dcp.async_save``); ``False`` uses
            ``dcp.save`` and returns after the commit.
        keep_local: keep the newest checkpoint's staged files on local disk, so
            a restart on the same node reads them instead of downloading
            (files whose checksum does not match the manifest are downloaded).
        local_dir: where the local copies live (default:
            ``<staging dir>/dcp_volumes-local/<hash of root_url>``).
        local_replicas: with ``keep_local``, how many other nodes keep a copy of
            each node's local files (``1`` survives the loss of any one node; ``0``,
            the default: none). After each commit the files go, in the background
            over a private gloo group, to a rank on another node (node: torchrun's
            ``GROUP_RANK``; the pairing is in ``checkpoint/_peers.py``), which checks
            them against the manifest and keeps them in
            ``<local_dir>/replicas/node-<n>/<step dir>`` (newest only). A restore
            reads a file from this node's copies, else from the node that holds it,
            else from the volume; ``restore_sources`` says how many bytes came from
            where. A failed replication only logs a warning: the save is committed.
        verify: ``restore`` compares every checksum with the manifest before
            loading (downloads the checkpoint twice on object stores).
        overwrite: let ``save`` replace a complete checkpoint of the same step
            (default: ``CheckpointExistsError``).
        create_root: create a missing local root directory.
        partial_grace: seconds a partial checkpoint (no ``.metadata``) is kept after
            its last file was written, whatever its step: another job saving into
            the same root may be writing it. Older partial ones are crashed saves
            and go with retention.
        process_group: group for checkpoint collectives (default: a new gloo
            group over all ranks when ``torch.distributed`` is initialised).
        writer_options: extra ``VolumeWriter`` arguments (``part_size``, ...).
        reader_options: extra ``VolumeReader`` arguments (``read_concurrency``, ...).
        retry: retry policy for volume calls.
        encryption: ``Encryption(...)``: every save is encrypted with its current
            key and ``restore`` reads with its keys (see ``VolumeWriter``);
            the local tier and peer replicas hold the same ciphertext.
        save_interval_steps: ``should_save(step)`` is true every that many steps
            (``None``: only when a preemption is noticed).
        preemption_signals: signals that announce a preemption (``SIGTERM`` from
            Kubernetes, spot VMs and torchrun's agent; ``SIGUSR1`` with SLURM's
            ``--signal=USR1@120``). Opt-in: with none (the default) no handler
            is installed and ``should_save`` costs nothing. With some, the
            manager must be created on the main thread, and ``should_save`` is
            collective: call it once per step on every rank.
        preemption_grace_s: seconds from the signal within which the preemption
            save must commit (keep it below the platform's wait before SIGKILL).
        goodput: record where this rank's time goes (start-up, restore, steps, input
            waits, saves, commits, preemption, exit) for ``goodput()`` and
            ``dcp-volumes goodput ROOT``: in memory, in a journal in the staging dir, and
            in ``<root>/goodput/``, the new events as one small object with each save and
            at close (no request per step). ``False``: nothing is recorded or written.

    Preemption, Orbax's shape (``save_interval_steps=500,
    preemption_signals=(signal.SIGTERM,)``)::

        step = mgr.restore(state) or 0
        while step < total:
            train_step(); step += 1
            if mgr.should_save(step):         # the interval, or a preemption any rank saw
                mgr.save(step, state)
            if mgr.reached_preemption(step):  # that step is committed on the volume
                break                         # leave the `with` and exit 0

    Use as a context manager, or call ``close()`` at the end: it waits for the
    last upload and raises its error, if any.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        storage_options: Mapping[str, Any] | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        async_save: bool = True,
        keep_local: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        local_replicas: int = 0,
        verify: bool = False,
        overwrite: bool = False,
        create_root: bool = True,
        partial_grace: float = DEFAULT_PARTIAL_GRACE_S,
        process_group: dist.ProcessGroup | None = None,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        save_interval_steps: int | None = None,
        preemption_signals: Sequence[int | signal.Signals] | None = None,
        preemption_grace_s: float = 25.0,
        encryption: Encryption | None = None,
        goodput: bool = True,
    ) -> None:
        signals = signals_of(preemption_signals)
        self.options = ManagerOptions(
            keep_last=keep_last,
            async_save=bool(async_save),
            keep_local=bool(keep_local),
            local_replicas=local_replicas,
            verify=bool(verify),
            overwrite=bool(overwrite),
            create_root=bool(create_root),
            partial_grace_s=partial_grace,
            writer_options=dict(writer_options or {}),
            reader_options=dict(reader_options or {}),
            encryption=encryption,
            save_interval_steps=save_interval_steps,
            preemption_grace_s=preemption_grace_s,
            goodput=goodput,
        )
        # None stays None: each Volume then takes DCP_VOLUMES_STORAGE_OPTIONS.
        self.storage_options = None if storage_options is None else dict(storage_options)
        self._volume = Volume(root_url, storage_options=self.storage_options, retry=retry)
        self._retry = retry
        self.staging_dir = os.fspath(staging_dir) if staging_dir is not None else None
        self._coord = Coordinator(process_group)
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        skip_final_collection()  # a restart waits for this process's exit
        self._local: LocalTier | None = None
        if self.options.keep_local:
            directory = LocalTier.default_dir(
                local_dir, staging_dir=self.staging_dir, root_url=self._volume.url
            )
            self._local = LocalTier(directory, owner=self._coord.local_rank == 0)
        self._coord.agree(f"open the checkpoint root {self._volume.display_url}",
                          self._check_root())
        # A side group: its agreement runs on the training thread while a save's
        # collectives run in DCP's thread.
        self._watch: PreemptionWatch | None = None
        if signals:
            self._watch = PreemptionWatch(signals, grace_s=self.options.preemption_grace_s,
                                          group=self._coord.side_group())
        self._peers: PeerTier | None = None
        if self._local is not None and self.options.local_replicas and self._coord.distributed:
            self._peers = self._connect_peers(self._local.directory)
        self._restore_sources: dict[str, int] = {}
        self._committed_step: int | None = None  # the newest step this manager committed
        self._abandoned = False  # a preemption stopped waiting for the save in flight
        self._unwinding = False  # an exception leaves the manager's with-block
        self._writer: VolumeWriter | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpv-manager")
        self._job: Future[None] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Manifests never change once written: read each one once per manager.
        self._manifests: ManifestCache = {}
        #: The step directories this manager has seen listed or has saved into; None
        #: before its first listing. A save into one outside it skips the coordinator's
        #: LIST for a crashed save's files (a request in the blocking path).
        self._known_dirs: set[str] | None = None
        self._recorder: goodput_recording.Recorder | None = None
        self._live: goodput_recording.LiveView | None = None
        if self.options.goodput:
            self._start_recording()

    # -- properties -----------------------------------------------------------------------

    @property
    def root_url(self) -> str:
        """URL of the root (plain path for local volumes)."""
        return self._volume.url

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank lists, deletes and decides."""
        return self._coord.is_coordinator

    def url_of(self, step: int) -> str:
        """URL of the checkpoint directory of ``step``."""
        return self._volume.url_of(step_dir(step))

    def __repr__(self) -> str:
        keep = self.options.keep_last
        return f"CheckpointManager({self._volume.display_url!r}, keep_last={keep})"

    # -- queries (local, read-only; any rank may call them) --------------------------------

    def list(self) -> list[CheckpointInfo]:
        """All checkpoints under the root, complete or not, oldest first."""
        infos = scan(self._volume, manifests=self._manifests)
        names = {i.name for i in infos}
        self._known_dirs = (self._known_dirs or set()) | names
        self._manifests = {k: m for k, m in self._manifests.items() if k[0] in names}
        return infos

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or ``None``."""
        return newest_complete(self.list())

    # -- when to save: the interval and preemption --------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: every ``save_interval_steps``, or the step at which
        every rank agreed that the job is being preempted.

        With ``preemption_signals`` this is collective: call it once per step, on
        every rank, with the same step (the ranks agree through it).
        """
        if self._recorder is not None:
            self._recorder.step(step)
        interval = self.options.save_interval_steps
        due = interval is not None and step % interval == 0
        # A save step checks at once (every rank knows it is one): a notice never
        # waits for the check schedule across saves that slow the steps down.
        if self._watch is not None and self._watch.poll(step, now=due):
            return self._watch.agreed_step == step
        return due

    def step(self, step: int) -> None:
        """Mark the end of ``step`` for the goodput record, in loops that decide their saves
        themselves (``should_save(step)`` marks it too: call either, once per step).
        Local: no collective, no request to the store."""
        if self._recorder is not None:
            self._recorder.step(step)

    def goodput(self) -> GoodputReport:
        """The goodput of the run so far: the earlier attempts' records under
        ``<root>/goodput/`` and this rank's record of this attempt (reads the store).

        Raises:
            ConfigurationError: the manager was created with ``goodput=False``.
        """
        if self._live is None:
            raise ConfigurationError(
                "This CheckpointManager records no goodput (goodput=False). Fix: create it "
                "without goodput=False, or read earlier runs with "
                "dcp_volumes.goodput_report(root)."
            )
        return self._live.report(refresh=True)

    def _start_recording(self) -> None:
        """Every rank: the attempt's id (the coordinator's), then this rank's recorder."""
        attempt, started = self._coord.broadcast(
            goodput_recording.new_attempt_id() if self.is_coordinator else None)
        self._recorder = goodput_recording.Recorder(
            self._volume, attempt=attempt, rank=self.rank, world=self.world_size,
            journal=goodput_recording.journal_dir(self.staging_dir, self._volume.url),
            recover=self._coord.local_rank == 0, started=started)
        self._live = goodput_recording.LiveView(self._recorder)
        goodput_recording.install(self._recorder)

    def _record_commit(self, step: int) -> None:
        """Background, after a commit: the record to the store; the coordinator logs the
        breakdown so far."""
        recorder = self._recorder
        if recorder is None:
            return
        recorder.add("commit", step=step)
        recorder.put("commit")
        if self.is_coordinator and self._live is not None:
            try:
                goodput_recording.emit(self._live.report(), step)
            except Exception as exc:  # a report must never fail a save
                logger.warning("goodput: no live report after step %d: %s", step, exc)

    def reached_preemption(self, step: int) -> bool:
        """Whether the job is being preempted and the save made for it is committed.

        ``True`` once every rank agreed on a preemption (see ``should_save``) and
        the save in flight has committed: leave the training loop and exit 0. It
        waits for that save, within ``preemption_grace_s`` of the signal.

        Raises:
            CheckpointError: the preemption save failed, or a second signal or the
                end of the grace period stopped the wait; the message names the
                newest step that is committed (a restart resumes there).
        """
        watch = self._watch
        if watch is None or not watch.agreed:
            return False
        self._drain()
        error = self._take_error()
        if error is not None:
            raise error
        survivor = self._committed_step
        if self._recorder is not None and not self._recorder.preempted:
            self._recorder.preempted = True
            self._recorder.add("preempted", step=watch.agreed_step)
            self._recorder.put("preempt")
        if survivor is not None and survivor == watch.agreed_step:
            logger.warning("preemption: step %d is committed at %s; stop now (%.1f s of "
                           "grace left)", survivor, self.url_of(survivor), watch.remaining_s())
        else:
            logger.warning("preemption: no save was made at step %d (should_save said so); "
                           "the newest step this job committed is %s", watch.agreed_step,
                           survivor if survivor is not None else "none")
        return True

    # -- save -------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> str:
        """Save ``state`` as the checkpoint of ``step``; returns its URL.

        Waits for the previous save first (never two uploads at once). With
        ``async_save`` it returns once ``state`` is copied to host memory; the
        upload, the commit and retention continue in the background and their
        errors are raised by the next ``save``, ``wait`` or ``close``.
        Collective: call it on every rank with the same step.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigurationError(f"step={step!r} must be an integer >= 0.")
        if self._recorder is None:
            return self._save(step, state)
        self._recorder.save_started(step)
        try:
            return self._save(step, state)
        finally:
            self._recorder.add("save1", step=step)

    def _save(self, step: int, state: Mapping[str, Any]) -> str:
        self._drain()
        error = self._take_error()
        if self._abandoned and error is not None:
            # The abandoned save still runs collectives on the coordinator's group in
            # DCP's thread: no collective here may cross them. This rank stops alone.
            raise error
        logger.debug("step %d: staging", step)
        name = step_dir(step)
        url = self._volume.url_of(name)
        plain: dict[str, Any] = {}
        staged: Any = None
        writer: VolumeWriter | None = None
        clear = False
        if error is None:
            try:
                plain = {
                    k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()
                }
                if self.is_coordinator:
                    clear = self._check_target(step, name)
                writer = self._writer_for(name)
                if self.options.async_save:
                    staged = writer.stage(plain)
                    if isinstance(staged, Future):
                        staged = staged.result()
            except Exception as exc:
                error = exc
        what = f"save step {step} to {url}"
        if self._coord.agree(what, error, flag=clear):
            # Only once every rank is ready: a failed rank must not cost the old checkpoint.
            if clear:
                try:
                    logger.warning("removing %s before saving step %d", url, step)
                    delete_checkpoint(self._volume, name)
                except Exception as exc:
                    error = exc
            self._coord.agree(what, error)
        if writer is None:  # unreachable (agree raised); keeps the type checker honest
            raise CheckpointError("internal: no writer")
        no_dist = not self._coord.distributed
        pg = self._coord.group
        if self.options.async_save:
            with self._coord.quiet():
                response = state_dict_saver.async_save(
                    staged,
                    checkpoint_id=url,
                    storage_writer=writer,
                    process_group=pg,
                    async_stager=Prestaged(staged),
                    no_dist=no_dist,
                )
            # torch >= 2.9 returns an AsyncSaveResponse (staging + upload futures).
            upload = cast("Future[Any]", getattr(response, "upload_completion", response))
            logger.info("checkpoint step %d staged; uploading to %s", step, url)
        else:
            try:
                with typed_errors(f"save step {step} to {url}"), self._coord.quiet():
                    state_dict_saver.save(plain, checkpoint_id=url, storage_writer=writer,
                                          process_group=pg, no_dist=no_dist)
            except Exception:
                self._drop_local(name)
                raise
            upload = Future()
            upload.set_result(None)
        self._job = self._executor.submit(self._finish_save, step, name, upload)
        return url

    def _check_target(self, step: int, name: str) -> bool:
        """Coordinator: refuse a committed step (unless overwrite); True if it must be cleared."""
        known = self._known_dirs
        if known is not None and name not in known:
            known.add(name)  # a step directory no listing showed and no save of ours made
            return False
        files = {f.path for f in self._volume.list(name)}
        # A rank-local checkpoint (its __<rank>.metadata markers) is committed too.
        if any(is_commit_marker(f.rsplit("/", 1)[-1]) for f in files):
            if not self.options.overwrite:
                raise CheckpointExistsError(
                    f"Step {step} already has a complete checkpoint at "
                    f"{self._volume.url_of(name)}. Fix: save under a new step, pass "
                    "overwrite=True to replace it, or delete it first."
                )
            return True
        # Files left by a crashed save of this step must not mix with the new ones.
        return bool(files)

    def _writer_for(self, name: str) -> VolumeWriter:
        # One writer serves every save (its staging buffers are reused); each save
        # points it at its step directory through checkpoint_id. Its local copy
        # lands in <local_dir>/<step dir> (the layout writer and reader share).
        if self._writer is None:
            self._writer = VolumeWriter(
                self._volume.url_of(name),
                staging_dir=self.staging_dir,
                storage_options=self.storage_options,
                local_copy_dir=self.local_dir,
                retry=self._retry,
                encryption=self.options.encryption,
                **self.options.writer_options,
            )
        return self._writer

    def _finish_save(self, step: int, name: str, upload: Future[Any]) -> None:
        """Background: wait for the commit, then local-tier cleanup and retention."""
        url = self._volume.url_of(name)
        try:
            upload.result()
        except BaseException as exc:
            self._drop_local(name)
            why = summary(storage_error(exc) or exc)  # ours, not DCP's wrapper
            logger.error("checkpoint step %d was NOT saved to %s: %s", step, url, why)
            raise CheckpointError(
                f"The background save of step {step} to {url} failed: {why.rstrip('.')}. No "
                f"{METADATA_NAME} was written, so the previous checkpoint is still the latest."
            ) from exc
        logger.info("checkpoint step %d committed at %s", step, url)
        self._committed_step = step
        self._record_commit(step)
        if self._local is not None:
            self._local.keep_only(name)
        # A preempted job's last step: the job exits now, within its grace period. A replica
        # is for a node lost while it runs (the step is committed on the volume and in the
        # local tier), and the next attempt's first save applies retention.
        last = self._watch is not None and self._watch.agreed
        if self._peers is not None and not last:
            self._peers.submit(name)
        if self.is_coordinator and not last:
            try:
                apply_retention(self._volume, keep_last=self.options.keep_last,
                                protect=[name], manifests=self._manifests,
                                partial_grace_s=self.options.partial_grace_s)
            except BaseException as exc:
                logger.error("retention after step %d failed under %s: %s", step,
                             self._volume.display_url, summary(exc))
                raise CheckpointError(
                    f"Step {step} was saved, but deleting old checkpoints under "
                    f"{self._volume.display_url} failed: {summary(exc)}. Nothing complete was "
                    "lost; retention runs again after the next save."
                ) from exc
        logger.debug("step %d: save finished", step)

    # -- local tier ----------------------------------------------------------------------

    @property
    def local_dir(self) -> str | None:
        """Directory of the local tier (``keep_local=True``), else ``None``."""
        return self._local.directory if self._local is not None else None

    @property
    def restore_sources(self) -> dict[str, int]:
        """Bytes this rank's last ``restore`` read from ``"local"`` files (its node's
        local tier and the replicas it keeps), from ``"peer"`` nodes and from the
        ``"volume"`` (all zero before a restore; ``.metadata`` and the manifest are
        not counted)."""
        return {k: self._restore_sources.get(k, 0) for k in SOURCE_NAMES}

    def _connect_peers(self, directory: str) -> PeerTier | None:
        """Every rank: the peer tier (``local_replicas``), or ``None`` on one node."""
        if self.world_size != dist.get_world_size():
            raise ConfigurationError(
                f"local_replicas={self.options.local_replicas} needs the checkpoint group to "
                f"span the job: this one has {self.world_size} of its {dist.get_world_size()} "
                "ranks. Fix: leave process_group unset (or pass the whole world's), or "
                "pass local_replicas=0."
            )
        return PeerTier.connect(directory, coordinator=self._coord,
                                replicas=self.options.local_replicas)

    # -- restore --------------------------------------------------------------------------

    def restore(
        self,
        state: dict[str, Any],
        *,
        step: int | None = None,
        planner: LoadPlanner | None = None,
    ) -> int | None:
        """Load the newest complete checkpoint (or ``step``) into ``state``.

        ``Stateful`` values are restored in place (``load_state_dict``), other
        values are replaced. Partial checkpoints are skipped with a warning.
        Returns the step loaded, or ``None`` when there is no complete
        checkpoint. Collective: every rank loads the step the coordinator chose.

        Args:
            state: what to load into; its keys and shapes must be the checkpoint's.
            step: load this step instead of the newest complete one.
            planner: ``dcp.load``'s planner (default: DCP's ``DefaultLoadPlanner``);
                ``DefaultLoadPlanner(allow_partial_load=True)`` loads only the keys
                the checkpoint has and leaves the others of ``state`` as they are.

        Raises:
            CheckpointError: the checkpoint does not match ``state`` (a key it lacks,
                another shape): the message names the rank, the key and the shapes.
        """
        self._check_open()
        self._drain()
        if self._peers is not None:
            self._peers.wait()  # its group serves the restore next
        if self._recorder is not None:
            self._recorder.add("restore0")
        choice = self._agree_on_checkpoint(step)
        if choice is None:
            logger.info("no complete checkpoint under %s: starting fresh", self._volume.display_url)
            if self._recorder is not None:
                self._recorder.add("restore1", step=None, sources={})
            return None
        self._load_checkpoint(state, *choice, planner=planner)
        if self._recorder is not None:
            self._recorder.add("restore1", step=choice[0], sources=self.restore_sources)
        return choice[0]

    def _agree_on_checkpoint(self, step: int | None) -> tuple[int, str, bool] | None:
        """(step, name, rank-local) of the checkpoint to restore, as the coordinator
        chose it (the newest complete one, or ``step``), on every rank; None: none."""
        error = self._take_error()
        choice: tuple[int, str, bool] | None = None
        if error is None and self.is_coordinator:
            try:
                info = choose_checkpoint(self._volume, self.list(), step=step,
                                         verify=self.options.verify)
                if info is not None:
                    self._check_loadable(info)
                choice = (info.step, info.name, info.rank_local) if info is not None else None
            except Exception as exc:
                error = exc
        self._coord.agree("choose a checkpoint to restore", error)
        agreed: tuple[int, str, bool] | None = self._coord.broadcast(choice)
        return agreed

    def _load_checkpoint(
        self, state: dict[str, Any], chosen_step: int, name: str, rank_local: bool, *,
        planner: LoadPlanner | None,
    ) -> None:
        """Load checkpoint ``name`` into ``state``: local and peer copies first, where the
        local tier holds them, the rest from the volume."""
        url = self._volume.url_of(name)
        local = self.local_dir if self._local is not None and (
            self._peers is not None or self._local.has(name) or self._local.has_replicas()
        ) else None
        # The reader's sources, asked in this order before the volume.
        sources: list[FileSource] = []
        if local is not None:
            sources.append(LocalCopies(local))
        if self._peers is not None:
            sources.append(self._peers)
        reader = VolumeReader(
            url,
            storage_options=self.storage_options,
            local_copy_dir=local,
            retry=self._retry,
            _sources=sources,
            encryption=self.options.encryption,
            **self.options.reader_options,
        )
        logger.info("restoring step %d from %s%s", chosen_step, url,
                    f" (local copy in {local})" if local else "")
        with typed_errors(f"restore {url}", refused_fix=_MISMATCH_FIX):
            # Read .metadata here first: where DCP fails on it, it keeps only the
            # message (its AssertionError joins the texts), not our typed error.
            # A rank-local checkpoint: each rank loads its own __<rank>.metadata.
            if rank_local:
                reader.read_metadata_ahead(rank=self.rank)
            else:
                self._read_once(reader)
            with self._coord.quiet():
                state_dict_loader.load(
                    state, checkpoint_id=url, storage_reader=reader, planner=planner,
                    process_group=self._coord.group, no_dist=not self._coord.distributed,
                )
        self._restore_sources = reader.sources
        if local is not None:
            mib = {k: v / 2**20 for k, v in self._restore_sources.items()}
            logger.info("restored step %d: %.1f MiB from local files, %.1f MiB from peers, "
                        "%.1f MiB from the volume", chosen_step, mib["local"], mib["peer"],
                        mib["volume"])

    def _read_once(self, reader: VolumeReader) -> None:
        """The coordinator reads ``.metadata`` and the manifest and broadcasts them: one
        GET of each per restore, where every rank asking the store for the same two
        objects made 2 x ranks (all ranks)."""
        read: Any = None
        if self.is_coordinator:
            try:
                reader.read_metadata_ahead()
                read = reader.shared_read_ahead()
            except Exception as exc:
                # The same typed error on every rank, as when each read for itself.
                shared = exc if isinstance(exc, DcpVolumesError) else CheckpointError(
                    f"Could not read the .metadata of {reader.volume.display_url}: "
                    f"{summary(exc)}"
                )
                self._coord.broadcast(shared)
                raise
        read = self._coord.broadcast(read)
        if isinstance(read, BaseException):
            raise read
        if not self.is_coordinator:
            reader.use_shared_read_ahead(read)

    def _check_loadable(self, info: CheckpointInfo) -> None:
        """Refuse a rank-local checkpoint saved by another number of ranks (coordinator)."""
        if info.rank_local and info.ranks != self.world_size:
            raise CheckpointError(
                f"The checkpoint to restore, {info.url} (step {info.step}), is rank-local "
                f"(saved with use_collectives=False by {info.ranks} ranks: each rank wrote its "
                f"own __<rank>.metadata), and this job has {self.world_size} ranks. A rank-local "
                f"checkpoint loads only on the ranks that saved it; it is not resharded. Fix: "
                f"restart with {info.ranks} ranks, or restore(step=...) a checkpoint saved with "
                "collectives."
            )

    # -- waiting, errors, agreement ------------------------------------------------------

    def wait(self) -> None:
        """Block until the in-flight save (and its retention) is done; raise its error."""
        self._drain()
        error = self._take_error()
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for in-flight work, release resources and raise any pending error."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._peers is not None and not self._abandoned:
                self._peers.wait()  # each of its operations is bounded by its timeout
            if self._watch is not None:
                self._watch.close()
            # An abandoned save stops at its next upload; nothing waits for it.
            self._executor.shutdown(wait=not self._abandoned, cancel_futures=True)
            self._close_writer()
            free_pooled_buffers()  # the job's saves are over: give the staging memory back
            recorder, self._recorder = self._recorder, None
            if recorder is not None:
                recorder.close(clean=not self._unwinding)
                goodput_recording.uninstall(recorder)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # An exception is already propagating: do not mask it with a save error. A stop
        # signal during it means the job is being torn down (torchrun stops the survivors
        # of a dead rank): the save in flight is abandoned, not waited on (_drain).
        self._unwinding = True
        try:
            self.close()
        except Exception as pending:
            logger.error("checkpoint error while handling another exception: %s",
                         summary(pending))

    def _drop_local(self, name: str) -> None:
        if self._local is not None:
            self._local.drop(name)

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        closer = getattr(writer, "close", None)
        if callable(closer):
            with contextlib.suppress(Exception):
                closer()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("This CheckpointManager is closed; create a new one.")

    def _drain(self) -> None:
        """Wait for the in-flight job; keep its error for the caller to raise."""
        job, self._job = self._job, None
        if job is None:
            return
        try:
            self._result_within_grace(job)
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc

    def _result_within_grace(self, job: Future[None]) -> None:
        """``job.result()``; once a preemption is noticed, only while the watch allows."""
        watch = self._watch
        while watch is not None and (watch.noticed or self._unwinding):
            torn_down = self._unwinding and watch.noticed
            if watch.gave_up or torn_down:
                self._abandoned = True
                if self._writer is not None:
                    self._writer.abandon()
                survivor = self._committed_step
                fix = ("Fix: raise preemption_grace_s (and the platform's grace period), or "
                       "save more often.")
                if torn_down:
                    why, fix = "a stop signal came while the job was failing", ""
                elif watch.remaining_s() > 0:
                    why = "a second signal came"
                else:
                    why = f"the {watch.grace_s:.0f} s of preemption_grace_s ran out"
                raise CheckpointError(
                    f"Preempted: stopped waiting for the save in flight ({why}"
                    + "). It is abandoned and never taken for complete (no .metadata); the "
                    + (f"newest checkpoint this job committed is step {survivor}"
                       if survivor is not None else "job committed no checkpoint")
                    + f", where a restart resumes. {fix}".rstrip()
                )
            try:
                job.result(timeout=0.1)
                return
            except FutureTimeout:
                continue
        job.result()

    def _take_error(self) -> BaseException | None:
        with self._lock:
            error, self._error = self._error, None
        return error

    def _check_root(self) -> Exception | None:
        """Why the root cannot take checkpoints on this rank, or ``None``."""
        try:
            self._volume.check_root(create=self.options.create_root)
            local = self._volume.capabilities.local_files
            if local and not os.access(self._volume.root, os.W_OK | os.X_OK):
                raise VolumeAccessError(
                    f"The checkpoint root {self._volume.root} is not writable by this "
                    "process. Fix: change its permissions or choose another root."
                )
        except DcpVolumesError as exc:
            return exc
        except OSError as exc:
            error = VolumeError(
                f"Cannot use {self._volume.display_url} as a checkpoint root: {summary(exc)}. "
                "Fix: point root_url at a writable directory or bucket prefix."
            )
            error.__cause__ = exc
            return error
        return None

"""One rank of a rank-local save (``use_collectives=False``), killed by the test at a set phase.

Run by tests/test_rank_local.py in spawned processes, started the way torchrun
starts ranks. Every rank saves step 1 completely, then step 2; during step 2
the doomed rank stops at ``phase`` and tells the parent (a file in
``signal_dir``), which SIGKILLs it there:

* ``before_upload``: before its first data file reaches the volume (only the
  world size other ranks' manifests record shows it took part);
* ``before_commit``: its files and manifest are uploaded, ``__<rank>.metadata`` is not.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

PHASES = ("before_upload", "before_commit")


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step`` (different on every rank: a rank-local save)."""
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"w": torch.randn(4096, generator=g), "b": torch.arange(16) * rank, "step": step}


def _hold(signal_dir: str, rank: int) -> None:
    open(os.path.join(signal_dir, f"rank{rank}.held"), "w").close()
    while True:  # until the parent's SIGKILL
        time.sleep(1)


def main(rank: int, world: int, port: int, root: str, options: dict[str, Any], phase: str,
         doomed: int, signal_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter
    from dcp_volumes._volume import Volume
    from dcp_volumes.checkpoint import _rank_save
    from dcp_volumes.checkpoint._layout import rank_metadata_name

    dist.init_process_group("gloo")
    url = root.rstrip("/")
    dcp.save(rank_state(1, rank), storage_writer=VolumeWriter(f"{url}/step-1",
             storage_options=options), use_collectives=False)
    if rank == doomed:
        if phase == "before_upload":
            def stop_upload(*args: Any, **kwargs: Any) -> Any:
                _hold(signal_dir, rank)

            _rank_save.VolumeUpload.put = stop_upload  # type: ignore[method-assign]
        else:
            publish = Volume.publish

            def stop_commit(self: Volume, relpath: str, data: Any, **kwargs: Any) -> None:
                if relpath == rank_metadata_name(rank):
                    _hold(signal_dir, rank)
                publish(self, relpath, data, **kwargs)

            Volume.publish = stop_commit  # type: ignore[method-assign]
    dcp.save(rank_state(2, rank), storage_writer=VolumeWriter(f"{url}/step-2",
             storage_options=options), use_collectives=False)
    # The other ranks reach DCP's closing barrier and wait there for the doomed one.
    dist.destroy_process_group()

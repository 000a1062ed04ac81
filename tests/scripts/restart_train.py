"""A torchrun job written as users write one (run by tests/test_torchrun_restarts.py).

``restart_train.py DATA_URL ROOT TOTAL_STEPS OUT_DIR``; options in ``RESTART_TEST``
(JSON): ``storage_options``; ``kills``, ``{"ATTEMPT": [RANK, STEP]}``: that rank
SIGKILLs itself right after starting the save of that step in that attempt (torchrun's
``TORCHELASTIC_RESTART_COUNT``); ``one_cpu``: each rank runs on one CPU, so the loader
forks its workers, which read through the fsspec client; ``pid_dir``: each rank
writes its pid to ``rank-R.pid`` there; ``signals``: the manager's
``preemption_signals`` (names). Nothing else: torchrun's
defaults, ``dist.init_process_group("gloo")``, the manager, the dataset and the loader.

Each rank appends JSON lines to ``OUT_DIR/rank-R.jsonl``: ``{"attempt", "restored"}``
when it starts, ``{"attempt", "step", "ids"}`` per step, ``{"attempt", "weights"}`` at
the end; the killing rank writes ``{"attempt", "killed_at"}`` (wall time) first.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

OPTS = json.loads(os.environ.get("RESTART_TEST", "{}"))
if OPTS.get("one_cpu"):  # before torch: its thread pools size by the CPUs it sees
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset  # noqa: E402
from testkit.training import data_parallel_step  # noqa: E402
from tests.test_data_support import read_id  # noqa: E402


def main(data_url: str, root: str, total: int, out_dir: str) -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = open(os.path.join(out_dir, f"rank-{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def record(**fields: object) -> None:
        log.write(json.dumps({"attempt": attempt, **fields}) + "\n")

    if OPTS.get("pid_dir"):
        with open(os.path.join(OPTS["pid_dir"], f"rank-{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))

    options = OPTS.get("storage_options")
    dataset = VolumeDataset(data_url, cache_dir=os.path.join(out_dir, f"cache-{rank}"),
                            shuffle=True, seed=3, transform=read_id, storage_options=options)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, timeout=60,
                        generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.001)
    kill = OPTS.get("kills", {}).get(str(attempt))
    signals = tuple(getattr(signal, name) for name in OPTS.get("signals", []))
    with CheckpointManager(root, keep_last=2, storage_options=options,
                           preemption_signals=signals) as mgr:
        state = {"model": model, "optim": optim, "data": loader}
        step = mgr.restore(state) or 0
        record(restored=step)
        batches = iter(loader)
        while step < total:
            try:
                ids = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                continue
            step += 1
            record(step=step, ids=ids.tolist())
            data_parallel_step(model, optim, ids)
            if step % 3 == 0:
                mgr.save(step, state)
            if kill == [rank, step]:
                record(killed_at=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
    record(weights=[p.detach().flatten().tolist() for p in model.parameters()])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])

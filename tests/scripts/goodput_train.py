"""A torchrun job of known step times whose goodput is checked (tests/test_goodput_torchrun.py).

``goodput_train.py DATA_URL ROOT TOTAL_STEPS OUT_DIR``; options in ``GOODPUT_TEST`` (JSON):
``storage_options``; ``launch`` (which torchrun launch of the job this is); ``kill``,
``[LAUNCH, ATTEMPT, RANK, STEP]``: that rank SIGKILLs itself after the boundary of that
step (``TORCHELASTIC_RESTART_COUNT`` is the attempt); ``preempt``, ``[LAUNCH, STEP]``:
rank 0 sends itself SIGTERM at that step (the manager's ``preemption_signals``; the job
saves, leaves the loop and exits 0); ``step_s`` (a step's sleep), ``sample_s`` (each
sample's transform sleeps that long: the input wait), ``interval`` (save every N steps).

The loop is a user's: ``VolumeDataset`` + ``DataLoader``, ``should_save``/``save``,
``reached_preemption``; it calls nothing for goodput. What it measured itself goes to
``OUT_DIR/truth-R.jsonl``: per step ``launch``, ``attempt``, ``step``, ``ask`` (asks for
the batch), ``got`` (has it), ``done`` (step computed), ``save`` ([t0, t1] of the save
call or null); ``restored`` once per attempt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset
from testkit.training import data_parallel_step
from tests.test_data_support import read_id

OPTS = json.loads(os.environ.get("GOODPUT_TEST", "{}"))


def slow_read(path: str) -> int:
    time.sleep(OPTS.get("sample_s", 0.0))
    return read_id(path)


def main(data_url: str, root: str, total: int, out_dir: str) -> None:
    launch, attempt = OPTS.get("launch", 0), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    truth = open(os.path.join(out_dir, f"truth-{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def record(**fields: object) -> None:
        truth.write(json.dumps({"launch": launch, "attempt": attempt, **fields}) + "\n")

    options = OPTS.get("storage_options")
    dataset = VolumeDataset(data_url, cache_dir=os.path.join(out_dir, f"cache-{rank}"),
                            shuffle=True, seed=3, transform=slow_read, storage_options=options)
    loader = DataLoader(dataset, batch_size=2, num_workers=0)
    model = torch.nn.Linear(1, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.001)
    kill, preempt = OPTS.get("kill"), OPTS.get("preempt")
    with CheckpointManager(root, keep_last=2, storage_options=options,
                           staging_dir=os.path.join(out_dir, "staging"),
                           save_interval_steps=OPTS.get("interval", 4),
                           preemption_signals=(signal.SIGTERM,)) as mgr:
        state = {"model": model, "optim": optim, "data": loader}
        step = mgr.restore(state) or 0
        record(restored=step)
        batches = iter(loader)
        while step < total:
            ask = time.time()
            try:
                ids = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                continue
            got = time.time()
            step += 1
            data_parallel_step(model, optim, ids)
            time.sleep(OPTS.get("step_s", 0.0))
            done = time.time()
            if preempt == [launch, step] and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            save = None
            if mgr.should_save(step):
                t0 = time.time()
                mgr.save(step, state)
                save = [t0, time.time()]
            record(step=step, ask=ask, got=got, done=done, save=save)
            if kill == [launch, attempt, rank, step]:
                os.kill(os.getpid(), signal.SIGKILL)
            if mgr.reached_preemption(step):
                record(preempted=step)
                break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])

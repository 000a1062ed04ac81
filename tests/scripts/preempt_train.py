"""A torchrun training job that follows the preemption pattern (run by tests/test_preemption.py).

Usage: ``preempt_train.py ROOT TOTAL_STEPS OUT_DIR``; options in the
``PREEMPT_TEST`` environment variable (JSON): ``storage_options``,
``signals`` (signal names; empty: no preemption handling), ``grace_s``,
``interval``, ``state_kib`` (size of the extra state tensor), ``step_s``
(seconds a step takes). Each rank writes ``OUT_DIR/rank-R.json`` as it
goes: its pid, the last step done, the steps it saved, how it ended, and at
the end a checksum of its weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from dcp_volumes import CheckpointManager


class Training(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, extra: torch.Tensor):
        self.model, self.optim, self.extra, self.step = model, optim, extra, 0

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(),
                "extra": self.extra, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])
        self.extra.copy_(sd["extra"])
        self.step = sd["step"]


def main(root: str, total: int, out_dir: str) -> None:
    opts = json.loads(os.environ.get("PREEMPT_TEST", "{}"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    extra = torch.zeros(opts.get("state_kib", 4) * 256)
    training = Training(model, optim, extra)
    report: dict = {"pid": os.getpid(), "saved": [], "ended": "running", "step": 0}
    path = os.path.join(out_dir, f"rank-{rank}.json")

    def write() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)

    signals = tuple(getattr(signal, name) for name in opts.get("signals", ["SIGTERM"]))
    with CheckpointManager(root, keep_last=3, storage_options=opts.get("storage_options"),
                           save_interval_steps=opts.get("interval", 4),
                           preemption_signals=signals,
                           preemption_grace_s=opts.get("grace_s", 25.0)) as mgr:
        restored = mgr.restore({"training": training})
        report["restored"] = restored
        write()
        while training.step < total:
            g = torch.Generator().manual_seed(training.step * 100 + rank)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            for p in model.parameters():  # data parallel by hand: average the gradients
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            optim.step()
            extra += 1
            training.step += 1
            time.sleep(opts.get("step_s", 0.05))
            step = training.step
            if mgr.should_save(step):
                mgr.save(step, {"training": training})
                report["saved"].append(step)
            report["step"] = step
            write()
            if mgr.reached_preemption(step):
                report["ended"] = "preempted"
                break
        else:
            report["ended"] = "finished"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    report["weights"] = flat.tolist()
    report["extra0"] = float(extra[0])
    write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

"""The fault-tolerant training demo behind ``dcp-volumes demo``.

The launcher (``run_demo``) puts a small training set on a volume (by default
an embedded S3 server, moto, on 127.0.0.1), then trains a small model twice
with ``torchrun``, both times reading inputs through ``VolumeDataset`` and
saving model, optimiser and data position through ``CheckpointManager``:

1. a reference run that is never interrupted;
2. a run in which one rank is killed with SIGKILL part-way through; torchrun
   (``--max-restarts``) restarts the job, which resumes by itself from the
   newest complete checkpoint.

It then checks that both runs saw the same samples at every step and ended
with bit-identical weights. Restarting ranks is torchrun's job; this module
only starts torchrun and reads what the ranks wrote.

The training side (``train``) runs in each rank, started as
``python -m dcp_volumes._demo train ...`` by torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dcp_volumes._exceptions import DcpVolumesError
from dcp_volumes._volume import Volume

logger = logging.getLogger(__name__)

FEATURES = 16
CLASSES = 4


@dataclass(frozen=True)
class DemoResult:
    """What the demo found; ``ok`` when the crashed run matched the reference."""

    ok: bool
    steps: int
    crash_step: int
    resumed_from: int | None
    reference_digest: str
    crashed_digest: str
    mismatched_steps: list[int]
    seconds: float


# -- the training side (one process per rank, started by torchrun) ---------------------------


class _Trainable:
    """Model + optimiser as one DCP ``Stateful`` (sharding-aware state dict helpers)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _load_sample(path: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    sample = torch.load(path, weights_only=True)
    return sample["x"], sample["y"], os.path.basename(path)


def _params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(args: argparse.Namespace) -> None:
    """One rank of the demo job (run by torchrun)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset

    logging.basicConfig(level=logging.INFO, format="[rank %(rank)s] %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **kw: Any) -> logging.LogRecord:
        record = old_factory(*a, **kw)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    options = json.loads(os.environ.get("DCP_VOLUMES_DEMO_OPTIONS", "{}"))

    torch.manual_seed(1234)  # same initial weights on every rank and every attempt
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, CLASSES))
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    dataset = VolumeDataset(args.data_url, cache_dir=os.path.join(args.workdir, "cache"),
                            cache_limit="1GB", shuffle=True, seed=7, transform=_load_sample,
                            storage_options=options)
    loader = DataLoader(dataset, global_batch_size=args.global_batch, num_workers=1)
    state = {"app": _Trainable(model, optim), "data": loader}
    log_path = os.path.join(args.workdir, f"{args.job}.samples.jsonl")
    staging = os.path.join(args.workdir, "staging")
    os.makedirs(staging, exist_ok=True)
    with CheckpointManager(args.ckpt_url, keep_last=2, storage_options=options,
                           staging_dir=staging) as mgr:
        resumed = mgr.restore(state)
        step = resumed or 0
        if rank == 0:
            logger.info("attempt %d: %s", restart,
                        f"resumed from step {resumed}" if resumed else "starting fresh")
            with open(os.path.join(args.workdir, f"{args.job}.resumed.{restart}"), "w") as f:
                f.write(str(resumed))
        while step < args.steps:
            for x, y, names in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optim.zero_grad()
                loss.backward()
                optim.step()
                step += 1
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, list(names))
                if rank == 0:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": step, "samples": gathered,
                                            "loss": round(loss.item(), 6)}) + "\n")
                    if step % 5 == 0:
                        logger.info("step %d/%d loss %.4f fetch %.1f ms", step, args.steps,
                                    loss.item(), 1e3 * loader.metrics.fetch_seconds[-1])
                if step % args.save_every == 0:
                    mgr.save(step, state)
                if restart == 0 and step == args.crash_at and rank == world - 1:
                    logger.info("simulating a node failure: SIGKILL at step %d", step)
                    os.kill(os.getpid(), signal.SIGKILL)
                if step >= args.steps:
                    break
        mgr.wait()
    if rank == 0:
        with open(os.path.join(args.workdir, f"{args.job}.digest"), "w") as f:
            f.write(_params_digest(model.module))
    dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_volume(workdir: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """An S3 volume served by moto on 127.0.0.1, else a local directory."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        path = os.path.join(workdir, "volume")
        os.makedirs(path, exist_ok=True)
        logger.info("moto is not installed: using the local directory %s as the volume", path)
        yield path, {}
        return
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo",
                     aws_secret_access_key="demo", region_name="us-east-1"
                     ).create_bucket(Bucket="demo")
        yield "s3://demo", {"key": "demo", "secret": "demo",
                            "client_kwargs": {"endpoint_url": endpoint}}
    finally:
        server.stop()


def write_training_set(url: str, options: Mapping[str, Any], files: int, workdir: str) -> None:
    """``files`` small samples (features + label) under ``url``."""
    volume = Volume(url, storage_options=options)
    volume.check_root(create=True)
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=gen) * 2
    local = os.path.join(workdir, "sample.pt")
    for i in range(files):
        y = int(torch.randint(CLASSES, (1,), generator=gen))
        x = centers[y] + torch.randn(FEATURES, generator=gen)
        torch.save({"x": x, "y": torch.tensor(y)}, local)
        volume.put_file(local, f"sample-{i:05d}.pt", verify_size=False)


def _torchrun(args: argparse.Namespace, run: str, ckpt_url: str, data_url: str,
              options: Mapping[str, Any], workdir: str) -> None:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the rendezvous store shared (the default),
    # gloo ranks of a restarted attempt find the killed attempt's addresses and fail to
    # connect (seen with torch 2.13); a fresh store per attempt makes restarts work.
    env = dict(os.environ, DCP_VOLUMES_DEMO_OPTIONS=json.dumps(dict(options)),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "--max-restarts=1", "--monitor-interval=0.5",
           "-m", "dcp_volumes._demo", "train", "--job", run, "--workdir", workdir,
           "--data-url", data_url, "--ckpt-url", ckpt_url, "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--global-batch", str(args.global_batch),
           "--crash-at", str(args.crash_at if run == "crashed" else -1)]
    proc = subprocess.run(cmd, env=env, cwd=workdir)
    if proc.returncode != 0:
        raise DcpVolumesError(f"the {run} training run failed (torchrun exit {proc.returncode}); "
                           "see the log above")


def _read_steps(path: str) -> dict[int, Any]:
    steps: dict[int, Any] = {}
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            steps[doc["step"]] = doc["samples"]  # a re-done step overwrites the lost one
    return steps


def run_demo(args: argparse.Namespace, say: Callable[[str], None]) -> DemoResult:
    """Run the reference and the crashed job and compare them."""
    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="dcp_volumes-demo-")
    os.makedirs(workdir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.volume:
            root, options = args.volume.rstrip("/"), dict(args.storage_options or {})
        else:
            root, options = stack.enter_context(embedded_volume(workdir))
        shown = Volume(root, storage_options=options).display_url
        say(f"volume: {shown}  (workdir {workdir})")
        say(f"writing {args.files} training files to {shown}/train ...")
        write_training_set(f"{root}/train", options, args.files, workdir)
        for run in ("reference", "crashed"):
            note = "" if run == "reference" else f" (one rank is killed at step {args.crash_at})"
            say(f"\n== {run} run: {args.nproc} ranks, {args.steps} steps{note}")
            _torchrun(args, run, f"{root}/ckpt-{run}", f"{root}/train", options, workdir)
    ref = _read_steps(os.path.join(workdir, "reference.samples.jsonl"))
    crashed = _read_steps(os.path.join(workdir, "crashed.samples.jsonl"))
    mismatched = sorted(s for s in set(ref) | set(crashed) if ref.get(s) != crashed.get(s))
    digests = []
    for run in ("reference", "crashed"):
        with open(os.path.join(workdir, f"{run}.digest")) as f:
            digests.append(f.read().strip())
    resumed_path = os.path.join(workdir, "crashed.resumed.1")
    resumed = None
    if os.path.exists(resumed_path):
        with open(resumed_path) as f:
            text = f.read().strip()
            resumed = None if text == "None" else int(text)
    ok = not mismatched and digests[0] == digests[1] and resumed is not None
    return DemoResult(ok=ok, steps=args.steps, crash_step=args.crash_at, resumed_from=resumed,
                      reference_digest=digests[0], crashed_digest=digests[1],
                      mismatched_steps=mismatched, seconds=time.perf_counter() - started)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dcp-volumes demo``."""
    p.add_argument("--volume", default=None,
                   help="volume URL for data and checkpoints (default: an embedded S3 server)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) to train with")
    p.add_argument("--steps", type=int, default=40, help="training steps")
    p.add_argument("--save-every", type=int, default=8, help="checkpoint every N steps")
    p.add_argument("--crash-at", type=int, default=21, help="step at which a rank is killed")
    p.add_argument("--files", type=int, default=96, help="training files to create")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, all ranks")
    p.add_argument("--workdir", default=None, help="local work directory (default: a temp dir)")


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m dcp_volumes._demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    for name in ("--job", "--workdir", "--data-url", "--ckpt-url"):
        t.add_argument(name, required=True)
    for name in ("--steps", "--save-every", "--global-batch", "--crash-at"):
        t.add_argument(name, type=int, required=True)
    train(p.parse_args(argv))


if __name__ == "__main__":
    _main(sys.argv[1:])

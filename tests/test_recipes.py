"""The recipes of docs/recipes.md, run exactly as written (torchrun, gloo, CPU).

Each ``# recipe: NAME`` code block is written to a file and run in a fresh
process; a resumed run must end where an uninterrupted one ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from tests.checkpoint_helpers import assert_same
from tests.doc_blocks import REPO, code_blocks
from tests.doc_blocks import run as _run

RECIPES = REPO / "docs" / "recipes.md"
_RECIPE = "# recipe: "


def recipes() -> dict[str, str]:
    return {
        block.first_line.removeprefix(_RECIPE).strip(): block.code
        for block in code_blocks(RECIPES)
        if block.lang == "python" and block.first_line.startswith(_RECIPE)
    }


def _write(tmp_path: Path, *names: str) -> dict[str, Path]:
    found = recipes()
    out = {}
    for name in names:
        assert name in found, f"docs/recipes.md has no '# recipe: {name}' block"
        (tmp_path / name).write_text(found[name])
        out[name] = tmp_path / name
    return out


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]


def _free_port() -> int:
    from testkit.ports import free_port

    return free_port()


def _as_torch(ckpt: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{uuid.uuid4().hex}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def test_every_recipe_block_is_tested() -> None:
    assert set(recipes()) == {"ddp_train.py", "fsdp_train.py", "titan_style.py", "titan_loop.py",
                              "lightning_train.py", "preemptible_train.py", "hf_export.py"}


def test_ddp_recipe_resumes_where_an_uninterrupted_run_ends(tmp_path: Path) -> None:
    script = _write(tmp_path, "ddp_train.py")["ddp_train.py"]
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    _run(_torchrun(str(script), str(resumed), "6"), cwd=tmp_path)
    out = _run(_torchrun(str(script), str(resumed), "10"), cwd=tmp_path)
    assert "rank 0: resumed at step 6" in out and "rank 1: resumed at step 6" in out
    _run(_torchrun(str(script), str(straight), "10"), cwd=tmp_path)
    # keep_last=2: steps 8 and 10 remain in each root (beside the job's goodput records).
    assert sorted(p.name for p in resumed.iterdir()) == [
        "goodput", "step-00000008", "step-00000010"]
    a = _as_torch(resumed / "step-00000010", tmp_path)
    b = _as_torch(straight / "step-00000010", tmp_path)
    assert a["training"]["step"] == 10
    assert_same(a, b)
    assert (resumed / "step-00000010" / MANIFEST_NAME).exists()


@pytest.mark.emulator
def test_fsdp_recipe_unchanged_code_routed_to_s3_by_torchrun(
    moto_server: Any, tmp_path: Path
) -> None:
    script = _write(tmp_path, "fsdp_train.py")["fsdp_train.py"]
    bucket = f"recipe-fsdp-{uuid.uuid4().hex[:8]}"
    url = moto_server.create_bucket(bucket)
    config = tmp_path / "routes.json"
    config.write_text(json.dumps({"routes": {url + "/": {
        "storage_options": moto_server.storage_options()}}}))
    env = {"DCP_VOLUMES_ROUTE_CONFIG": str(config)}
    ckpt = f"{url}/run1/step-1"
    try:
        _run(_torchrun("-m", "dcp_volumes.run", str(script), ckpt, "save"), cwd=tmp_path,
             env={**env, "RECIPE_OUT": str(tmp_path / "saved.pt")})
        keys = {o["Key"] for o in
                moto_server.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]}
        # VolumeWriter wrote it: the manifest sits beside .metadata.
        assert {f"run1/step-1/{MANIFEST_NAME}", f"run1/step-1/{METADATA_NAME}"} <= keys
        _run(_torchrun("-m", "dcp_volumes.run", str(script), ckpt, "load"), cwd=tmp_path,
             env={**env, "RECIPE_OUT": str(tmp_path / "loaded.pt")})
    finally:
        moto_server.reset()
    saved = torch.load(tmp_path / "saved.pt")
    loaded = torch.load(tmp_path / "loaded.pt")
    assert set(saved) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert_same(loaded, saved)
    init = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    assert not torch.equal(saved["0.weight"], init.state_dict()["0.weight"])  # it trained


def test_titan_style_recipe_resumes_and_keeps_latest_k(tmp_path: Path) -> None:
    files = _write(tmp_path, "titan_style.py", "titan_loop.py")
    loop = str(files["titan_loop.py"])
    root, straight = tmp_path / "titan", tmp_path / "titan-straight"
    _run([sys.executable, loop, str(root), "4", str(tmp_path / "a4.pt")], cwd=tmp_path)
    out = _run([sys.executable, loop, str(root), "8", str(tmp_path / "a8.pt")], cwd=tmp_path)
    assert "resumed at step 4" in out
    _run([sys.executable, loop, str(straight), "8", str(tmp_path / "b8.pt")], cwd=tmp_path)
    assert_same(torch.load(tmp_path / "a8.pt"), torch.load(tmp_path / "b8.pt"))
    # interval=3 and last steps: 3, 4, 6, 8 were saved; keep_latest_k=2 keeps 6 and 8.
    assert sorted(p.name for p in root.iterdir()) == ["goodput", "step-00000006",
                                                      "step-00000008"]


def test_lightning_recipe_saves_and_resumes_through_volume_classes(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    script = _write(tmp_path, "lightning_train.py")["lightning_train.py"]
    root = tmp_path / "lt"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(Path(pl.__file__).parents[1])])}
    _run(_torchrun(str(script), str(root), "4", "step-4"), cwd=tmp_path, env=env)
    assert (root / "step-4" / MANIFEST_NAME).exists()  # VolumeWriter wrote it
    # Resumed at step 4 with max_steps=4: nothing trains, the restored state is saved again.
    _run(_torchrun(str(script), str(root), "4", "again", str(root / "step-4")), cwd=tmp_path,
         env=env)
    assert (root / "again" / MANIFEST_NAME).exists()
    a, b = _as_torch(root / "step-4", tmp_path), _as_torch(root / "again", tmp_path)
    assert_same(a["state_dict"], b["state_dict"])
    meta = torch.load(root / "again" / "meta.pt", weights_only=False)
    assert meta["global_step"] == 4


def _preempt(tmp_path: Path, deliver: Callable[[subprocess.Popen[str], Path], None]) -> None:
    """Run the preemptible recipe, stop it with ``deliver`` once it saved, requeue it."""
    script = _write(tmp_path, "preemptible_train.py")["preemptible_train.py"]
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_torchrun(str(script), str(root), "10000000"), cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (root / "step-00000050" / METADATA_NAME).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        deliver(proc, tmp_path)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stops = sorted(set(re.findall(r"rank \d: preempted at step (\d+)", out)))
    assert len(stops) == 1 and out.count("preempted at step") == 2, out[-4000:]
    stopped = int(stops[0])
    assert (root / f"step-{stopped:08d}" / METADATA_NAME).exists()  # 0 steps lost
    assert not any(int(p.name[5:]) > stopped for p in root.iterdir() if p.name != "goodput")
    out = _run(_torchrun(str(script), str(root), str(stopped + 7)), cwd=tmp_path, env=env)
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step {stopped}" in out


def test_preemptible_recipe_on_kubernetes_sigterm_saves_the_step_and_resumes(
    tmp_path: Path,
) -> None:
    # The kubelet signals the container's main process, torchrun, which forwards it.
    _preempt(tmp_path, lambda proc, _: proc.send_signal(signal.SIGTERM))


def test_preemptible_recipe_on_slurm_usr1_saves_the_step_and_resumes(tmp_path: Path) -> None:
    # --signal=USR1@120 reaches every task of the step: here the two workers.
    def usr1_to_workers(proc: subprocess.Popen[str], _: Path) -> None:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            if "preemptible_train.py" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGUSR1)

    _preempt(tmp_path, usr1_to_workers)


def test_hf_export_recipe_gives_what_from_pretrained_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    script = _write(tmp_path, "hf_export.py")["hf_export.py"]
    ckpt, hf = tmp_path / "run1" / "step-1", tmp_path / "run1" / "hf-1"
    _run(_torchrun(str(script), str(ckpt), str(hf)), cwd=tmp_path,
         env={"HF_HUB_OFFLINE": "1"})
    saved = _as_torch(ckpt, tmp_path)["model"]
    files = sorted(hf.glob("*.safetensors"))
    assert (hf / "model.safetensors.index.json").exists() and files
    exported = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert set(exported) == set(saved)
    model = LlamaForCausalLM.from_pretrained(str(hf), dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name

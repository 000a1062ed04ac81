"""Hugging Face safetensors on volumes: export_safetensors, SafetensorsReader,
SafetensorsWriter and ``dcp-volumes export`` (issue 46).

One FSDP2 run on 2 gloo ranks (a tiny Llama trained one step) saves with
VolumeWriter and SafetensorsWriter to moto; the rest is checked against
``transformers`` (``from_pretrained``, ``save_pretrained``) and ``safetensors``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    SafetensorsReader,
    SafetensorsWriter,
    VolumeWriter,
    export_safetensors,
    storage_error,
)
from dcp_volumes._volume import Volume
from dcp_volumes.cli import main
from dcp_volumes.safetensors import SafetensorsLoadPlanner
from dcp_volumes.safetensors._format import layout
from dcp_volumes.safetensors._index import INDEX_NAME
from testkit.models import TOKENS, tiny_llama, train_one_step_fsdp2
from testkit.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
os.environ["HF_HUB_OFFLINE"] = "1"

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")

SHARD = 24_000  # bytes: the tiny Llama (~100 KB) spans several files


def _download(url: str, opts: dict[str, Any], to: Path) -> Path:
    vol = Volume(url, storage_options=opts)
    to.mkdir(parents=True, exist_ok=True)
    for f in vol.list(""):
        vol.get_file(f.path, to / f.path)
    return to


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(f)))
    return out


# -- the FSDP2 run (rank bodies at module level: pickled into the ranks) --------------------


def _fsdp2_run(rank: int, world: int, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    warnings.simplefilter("ignore")
    model = tiny_llama()
    optim = train_one_step_fsdp2(model)
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd, "optim": get_optimizer_state_dict(model, optim), "step": 1}
    dcp.save(state, storage_writer=VolumeWriter(f"{url}/step-1", storage_options=opts))
    # The same sharded state saved straight into the HF layout from both ranks.
    dcp.save(model_sd, storage_writer=SafetensorsWriter(
        f"{url}/hf-writer", storage_options=opts, max_shard_size=SHARD))
    # Rank 0 exports; then both ranks load the export into fresh FSDP2 shards.
    if rank == 0:
        export_safetensors(f"{url}/step-1", f"{url}/hf", dtype=None, max_shard_size=SHARD,
                           storage_options=opts,
                           extra_files={"config.json": model.config.to_json_string()})
    torch.distributed.barrier()
    fresh = tiny_llama(seed=1)
    train_one_step_fsdp2(fresh)
    target = get_model_state_dict(fresh)
    reader = SafetensorsReader(f"{url}/hf", storage_options=opts)
    dcp.load(target, storage_reader=reader)
    same = all(torch.equal(target[k].full_tensor(), model_sd[k].full_tensor()) for k in model_sd)
    local = sum(v.to_local().numel() * v.element_size() for v in target.values())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {"same": same, "read": reader.stats.data_bytes, "local": local,
            "full": {k: v.clone() for k, v in full.items()} if rank == 0 else None}


@pytest.fixture(scope="module")
def fsdp2_run(moto_server: Any) -> Any:
    url = moto_server.create_bucket("safetensors-fsdp2")
    opts = moto_server.storage_options()
    results = run_ranks(_fsdp2_run, 2, url, opts, timeout=240)
    return url, opts, results


@pytest.mark.emulator
def test_fsdp2_checkpoint_exports_to_what_from_pretrained_loads(
        fsdp2_run: Any, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    url, opts, results = fsdp2_run
    full = results[0]["full"]
    # Exported by rank 0 to moto (dtype kept): every tensor bit-identical.
    moto_copy = _download(f"{url}/hf", opts, tmp_path / "moto")
    got = _tensors(moto_copy)
    assert sorted(got) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name
    # Exported here to a local directory with the default bfloat16: the cast, bit for bit.
    local = tmp_path / "local"
    export_safetensors(f"{url}/step-1", str(local), storage_options=opts, max_shard_size=SHARD)
    cast = _tensors(local)
    for name, tensor in full.items():
        assert cast[name].dtype == torch.bfloat16
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name
    # transformers loads it; its logits on a fixed input are the trained model's.
    reference = tiny_llama()
    reference.load_state_dict(full)
    loaded = LlamaForCausalLM.from_pretrained(str(moto_copy), dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, reference(TOKENS).logits)
    # Both ranks loaded the export into FSDP2 shards exactly, reading only their rows.
    for r in results:
        assert r["same"]
        assert r["read"] == r["local"]


@pytest.mark.emulator
def test_safetensors_writer_from_two_ranks_writes_what_save_pretrained_writes(
        fsdp2_run: Any, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    url, opts, results = fsdp2_run
    reference = tiny_llama()
    reference.load_state_dict(results[0]["full"])
    reference.save_pretrained(str(tmp_path / "ref"), max_shard_size=SHARD)
    ours = _download(f"{url}/hf-writer", opts, tmp_path / "ours")
    ref_files = sorted(p.name for p in (tmp_path / "ref").glob("*.safetensors"))
    assert sorted(p.name for p in ours.glob("*.safetensors")) == ref_files
    assert len(ref_files) > 1
    ref_index = json.loads((tmp_path / "ref" / INDEX_NAME).read_text())
    our_index = json.loads((ours / INDEX_NAME).read_text())
    assert our_index["weight_map"] == ref_index["weight_map"]
    assert our_index["metadata"]["total_size"] == ref_index["metadata"]["total_size"]
    for name in ref_files:  # the same tensors, names, shapes, dtypes and bytes
        assert (ours / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert not Volume(f"{url}/hf-writer", storage_options=opts).exists(".dcp-parts/.metadata")
    reference.config.save_pretrained(str(ours))  # the config is the user's to add
    loaded = LlamaForCausalLM.from_pretrained(str(ours), dtype=torch.float32)
    assert all(torch.equal(v, results[0]["full"][k]) for k, v in loaded.state_dict().items())


# -- SafetensorsReader: resharding, request counts ------------------------------------------


ROWS, COLS = 10, 6  # uneven over 4 ranks: rows 3,3,3,1; columns 2,2,2,0


def _plain_model(directory: Path) -> dict[str, torch.Tensor]:
    """A model written by the safetensors library itself, in two files with an index."""
    tensors = {
        "w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
        "v": torch.arange(ROWS * COLS, dtype=torch.bfloat16).reshape(ROWS, COLS) / 7,
        "b": torch.arange(ROWS, dtype=torch.int64),
    }
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file({"w": tensors["w"]}, str(directory / "a.safetensors"))
    safetensors_torch.save_file({"v": tensors["v"], "b": tensors["b"]},
                                str(directory / "b.safetensors"))
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
        "w": "a.safetensors", "v": "b.safetensors", "b": "b.safetensors"}}))
    return tensors


def _sharded_load(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    target = {
        "w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
        "v": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),  # cast to float32
        "b": distribute_tensor(torch.zeros(ROWS, dtype=torch.int64), mesh, [Shard(0)]),
    }
    reader = SafetensorsReader(directory)
    dcp.load(target, storage_reader=reader)
    return {"full": {k: v.full_tensor() for k, v in target.items()},
            "read": reader.stats.data_bytes, "requests": reader.stats.data_requests,
            "header_requests": reader.stats.header_requests,
            "w_rows": target["w"].to_local().shape[0],
            "b_rows": target["b"].to_local().shape[0],
            "v_cols": target["v"].to_local().shape[1]}


def test_reader_reshards_onto_one_and_four_ranks_reading_only_its_spans(tmp_path: Path) -> None:
    tensors = _plain_model(tmp_path / "m")
    # One process: plain targets, v cast from bfloat16 to float32.
    target = {"w": torch.zeros(ROWS, COLS), "v": torch.zeros(ROWS, COLS),
              "b": torch.zeros(ROWS, dtype=torch.int64)}
    reader = SafetensorsReader(str(tmp_path / "m"))
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in tensors.items():
        assert torch.equal(target[k], v.to(target[k].dtype)), k
    assert reader.stats.data_bytes == sum(v.numel() * v.element_size() for v in tensors.values())
    # Four ranks: w and b row-sharded (each rank reads its rows), v column-sharded
    # (whole rows are read, then narrowed).
    for r in run_ranks(_sharded_load, 4, str(tmp_path / "m"), timeout=120):
        for k, v in tensors.items():
            assert torch.equal(r["full"][k], v.to(r["full"][k].dtype)), k
        v_rows = ROWS * COLS * 2 if r["v_cols"] else 0  # whole rows, unless its part is empty
        assert r["read"] == r["w_rows"] * COLS * 4 + r["b_rows"] * 8 + v_rows
        assert r["requests"] == 1 + (r["v_cols"] > 0) + (r["b_rows"] > 0)
        assert r["header_requests"] == 1 + 2 * 2  # the index; per file its size and header


# -- crash, refusal, hostile input ----------------------------------------------------------


def _small_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    dcp.save({"model": model, "step": 3, "note": b"bytes"},
             storage_writer=VolumeWriter(str(path)), no_dist=True)
    return model


_KILL_BEFORE_COMMIT = """
import os, signal, sys
from dcp_volumes.safetensors import _export
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
_export._commit = die
_export.export_safetensors(sys.argv[1], sys.argv[2], dtype=None, max_shard_size=20000)
"""


def test_sigkill_mid_export_leaves_no_index_and_a_rerun_completes(tmp_path: Path) -> None:
    model = _small_checkpoint(tmp_path / "ck")
    dest = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-c", _KILL_BEFORE_COMMIT, str(tmp_path / "ck"),
                           str(dest)], env={**os.environ, "PYTHONPATH": os.getcwd()},
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert len(list(dest.glob("model-*.safetensors"))) == 6  # every file, and no index
    assert not (dest / INDEX_NAME).exists()
    with pytest.raises(BaseException, match="index is written last") as info:
        dcp.load({"layer0.weight": torch.zeros(64, 64)},
                 storage_reader=SafetensorsReader(str(dest)), no_dist=True)
    assert isinstance(storage_error(info.value), CheckpointNotFoundError)
    export_safetensors(str(tmp_path / "ck"), str(dest), dtype=None, max_shard_size=20000)
    assert _tensors(dest).keys() == model.keys()
    assert all(torch.equal(_tensors(dest)[k], v) for k, v in model.items())


def test_cli_export_and_refusal_to_overwrite(tmp_path: Path, capsys: Any) -> None:
    model = _small_checkpoint(tmp_path / "ck")
    args = ["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--max-shard-size", "40KiB"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_size"] == 6 * 64 * 64 * 2  # bfloat16 by default
    got = _tensors(tmp_path / "hf")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in model.items())
    assert main(args) == 1
    assert "overwrite" in capsys.readouterr().err
    with pytest.raises(CheckpointExistsError):
        export_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert main([*args, "--overwrite", "--dtype", "keep", "--max-shard-size", "1MiB"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors",
                                                                  INDEX_NAME]
    assert torch.equal(_tensors(tmp_path / "hf")["layer5.weight"], model["layer5.weight"])


def _file(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _hostile(directory: Path, case: str) -> dict[str, torch.Tensor]:
    directory.mkdir()
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    files = {"model.safetensors": ({"a": entry, "b": entry}, bytes(16))}  # overlap
    if case == "past the end":
        files = {"model.safetensors": ({"a": entry}, bytes(8))}
    elif case == "unknown dtype":
        files = {"model.safetensors": ({"a": {**entry, "dtype": "F17"}}, bytes(16))}
    elif case == "header length":
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
        files = {}
    elif case in ("missing file", "escaping index"):
        _file(directory / "a.safetensors", {"a": entry}, bytes(16))
        other = "b.safetensors" if case == "missing file" else "../b.safetensors"
        (directory / INDEX_NAME).write_text(json.dumps(
            {"weight_map": {"a": "a.safetensors", "b": other}}))
        files = {}
    elif case == "shape":
        files = {"model.safetensors": ({"a": entry}, bytes(16))}
    for name, (header, data) in files.items():
        _file(directory / name, header, data)
    return {"a": torch.zeros(3, 2) if case == "shape" else torch.zeros(2, 2)}


@pytest.mark.parametrize("case,says", [
    ("overlap", "overlap"), ("past the end", "truncated"), ("unknown dtype", "F17"),
    ("header length", "header length"), ("missing file", "b.safetensors is missing"),
    ("escaping index", "not a file name"), ("shape", "Size mismatch"),
    ("shape+planner", "model.safetensors: tensor 'a' has shape [2, 2]"),
    ("missing+planner", "in no file of"),
])
def test_hostile_files_are_refused_naming_file_and_tensor(
        tmp_path: Path, case: str, says: str) -> None:
    case, planner = case.partition("+")[0], SafetensorsLoadPlanner() if "+" in case else None
    target = _hostile(tmp_path / "m", case if case != "missing" else "shape")
    if case == "missing":
        target = {"a": torch.zeros(2, 2), "c": torch.zeros(1)}
    with pytest.raises(BaseException) as info:  # DCP wraps every rank's error
        dcp.load(target, storage_reader=SafetensorsReader(str(tmp_path / "m")), no_dist=True,
                 planner=planner)
    text = str(info.value)
    assert says in text
    if case != "header length":
        assert "'a'" in text or "'b'" in text or "for a" in text
    if planner is not None:  # the file, both shapes (or the missing name), the fix
        assert str(tmp_path / "m") in text and "Fix:" in text
        assert ("the target's is [3, 2]" if case == "shape" else "['c']") in text
    if case != "shape" or planner is not None:  # (DCP's planner refuses the shape itself)
        assert isinstance(storage_error(info.value), CheckpointCorruptError)


def test_header_bytes_are_what_the_safetensors_library_writes() -> None:
    tensors = {"z": torch.zeros(0, 3), "h": torch.ones(3, dtype=torch.float16),
               "a": torch.ones(2, dtype=torch.bfloat16), "c": torch.ones(1, dtype=torch.float64),
               "i": torch.arange(3), "u": torch.ones(5, dtype=torch.uint8),
               "ok": torch.ones(3, dtype=torch.bool), "é": torch.randn(2, 2)}
    head, entries = layout([(k, v.dtype, v.shape) for k, v in tensors.items()], {"format": "pt"})
    body = b"".join(tensors[e.name].reshape(-1).view(torch.uint8).numpy().tobytes()
                    for e in entries)
    assert head + body == safetensors_torch.save(tensors, metadata={"format": "pt"})


def test_export_then_reader_on_every_volume(conformance_url: Any, tmp_path: Path) -> None:
    """The conformance run: local, file://, moto, radosgw, Azurite, GCS and the in-memory store."""
    url, opts = conformance_url
    torch.manual_seed(0)
    model = {"a.weight": torch.randn(16, 8), "b.weight": torch.randn(8), "n": torch.arange(5)}
    dcp.save({"model": model}, storage_writer=VolumeWriter(str(tmp_path / "ck")), no_dist=True)
    dest = f"{url.rstrip('/')}/hf"
    export_safetensors(str(tmp_path / "ck"), dest, dtype=None, max_shard_size=600,
                       dest_storage_options=opts)
    with pytest.raises(CheckpointExistsError):
        export_safetensors(str(tmp_path / "ck"), dest, dest_storage_options=opts)
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    dcp.load(target, storage_reader=SafetensorsReader(dest, storage_options=opts), no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in model.items())


def test_a_stock_dcp_checkpoint_exports_too(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    torch.manual_seed(0)
    model = {"w": torch.randn(32, 4), "b": torch.randn(4).half()}
    dcp.save({"model": model, "optim": {"step": torch.tensor(3)}},
             storage_writer=FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
    export_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="float32")
    got = _tensors(tmp_path / "hf")
    assert got.keys() == {"w", "b"}
    assert torch.equal(got["w"], model["w"]) and torch.equal(got["b"], model["b"].float())


def test_tied_weights_export_as_save_pretrained_writes_them(tmp_path: Path) -> None:
    """GPT-2 (tie_word_embeddings=True): lm_head.weight is written once, as its embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    state = model.state_dict()
    assert "lm_head.weight" in state  # a DCP checkpoint holds the tied tensor twice
    dcp.save({"model": state}, storage_writer=VolumeWriter(str(tmp_path / "ck")), no_dist=True)
    model.save_pretrained(str(tmp_path / "ref"), max_shard_size=SHARD)
    export_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype=None,
                       max_shard_size=SHARD, extra_files={"config.json": config.to_json_string()})
    ref = json.loads((tmp_path / "ref" / INDEX_NAME).read_text())
    ours = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert "lm_head.weight" not in ours["weight_map"]
    assert ours["weight_map"] == ref["weight_map"]
    assert ours["metadata"]["total_size"] == ref["metadata"]["total_size"]
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, model(TOKENS).logits)
    # Kept (drop_tied=False, the CLI's --keep-tied): both names written.
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "both"), "--keep-tied"]) == 0
    assert "lm_head.weight" in _tensors(tmp_path / "both")


def _rank_local_save(rank: int, world: int, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # every rank the same full tensors; each saves its shards
    state = {"w": distribute_tensor(torch.randn(7, 3), mesh, [Shard(0)]),
             "v": distribute_tensor(torch.randn(4, 5), mesh, [Shard(1)]), "b": torch.arange(3)}
    dcp.save({"model": state}, storage_writer=VolumeWriter(ckpt), use_collectives=False)


def test_a_rank_local_checkpoint_exports_whole_tensors(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ck")
    run_ranks(_rank_local_save, 2, ckpt, timeout=120)
    assert not (tmp_path / "ck" / ".metadata").exists()
    torch.manual_seed(0)
    expected = {"w": torch.randn(7, 3), "v": torch.randn(4, 5), "b": torch.arange(3)}
    export_safetensors(ckpt, str(tmp_path / "hf"), dtype=None)
    got = _tensors(tmp_path / "hf")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    # A rank's marker gone: refused, naming the rank, never a tensor with holes.
    (tmp_path / "ck" / "__1.metadata").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"ranks \[1\] committed no"):
        export_safetensors(ckpt, str(tmp_path / "hf2"), dtype=None)


def test_reader_part_size_and_concurrency_bound_its_gets(tmp_path: Path) -> None:
    tensors = _plain_model(tmp_path / "m")
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    reader = SafetensorsReader(str(tmp_path / "m"), read_concurrency=1, part_size=64)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in tensors.items())
    spans = [v.numel() * v.element_size() for v in tensors.values()]  # 240, 120, 80 bytes
    assert reader.stats.data_requests == sum(-(-n // 64) for n in spans) == 4 + 2 + 2
    with pytest.raises(ConfigurationError, match="part_size"):
        SafetensorsReader(str(tmp_path / "m"), part_size=0)


def test_rank_local_chunks_that_leave_a_hole_are_refused() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_volumes.safetensors._export import _merged

    def rank(offset: int) -> Metadata:
        chunk = ChunkStorageMetadata(torch.Size([offset, 0]), torch.Size([2, 3]))
        return Metadata({"w": TensorStorageMetadata(TensorProperties(torch.float32),
                                                    torch.Size([6, 3]), [chunk])})

    assert len(_merged([rank(0), rank(2), rank(4)], "ck").state_dict_metadata["w"].chunks) == 3
    with pytest.raises(CheckpointCorruptError, match="'w' hold 12 of its 18 elements"):
        _merged([rank(0), rank(4)], "ck")


def test_where_ranges_cost_the_whole_object_each_file_is_read_once(
    tmp_path: Path, memory_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_volumes.safetensors import _reader as safetensors_reader

    tensors = _plain_model(tmp_path / "m")
    url = f"{memory_bucket[0]}/m"
    volume = Volume(url)
    for f in sorted((tmp_path / "m").iterdir()):
        volume.publish(f.name, f.read_bytes())
    target = {"w": torch.zeros(ROWS, COLS), "v": torch.zeros(ROWS, COLS, dtype=torch.bfloat16),
              "b": torch.zeros(ROWS, dtype=torch.float64)}  # b is cast from int64
    reader = SafetensorsReader(url, storage_options={"ranged_reads_cost_whole_object": True})
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in tensors.items():
        assert torch.equal(target[k], v.to(target[k].dtype)), k
    # One GET per file (v and b share one), where parts would make one per span.
    assert reader.stats.data_requests == 2
    assert reader.stats.data_bytes == sum(v.numel() * v.element_size() for v in tensors.values())
    # Runs end at _RUN_BYTES: v (120 bytes) and b (80) no longer share one.
    monkeypatch.setattr(safetensors_reader, "_RUN_BYTES", 150)
    again = {k: torch.zeros_like(t) for k, t in target.items()}
    dcp.load(again, storage_reader=reader, no_dist=True)
    assert all(torch.equal(again[k], target[k]) for k in target)
    assert reader.stats.data_requests == 3

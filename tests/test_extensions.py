"""Stream extensions and compression: stock DCP's on-disk format, both ways, local and S3."""

from __future__ import annotations

import importlib
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

from dcp_volumes import (
    CheckpointCorruptError,
    ConfigurationError,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._compression import ZstdCompression
from dcp_volumes.checkpoint._extensions import (
    TensorPlacement,
    TensorPlacingExtension,
    TensorPlacingStream,
)
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._manifest import Manifest, checksum_bytes
from tests.checkpoint_helpers import (
    assert_same,
    blank_like,
    failure_of,
    join,
    sample_state,
    stock_reader,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _compressible_state() -> dict[str, Any]:
    """``sample_state`` plus tensors zstd shrinks a lot (zeros, small integers)."""
    state = sample_state(big_mib=1)
    state["zeros"] = torch.zeros(256 * 1024)
    state["ids"] = torch.arange(200_000, dtype=torch.int64) % 7
    state["blob"] = b"abc" * 10_000  # a bytes item (BYTE_IO)
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    out = blank_like(state)
    out["blob"] = b""
    return out


def _metadata(url: str, opts: dict[str, Any]) -> Any:
    return VolumeReader(url, storage_options=opts).read_metadata()


def _stored(url: str, opts: dict[str, Any], info: Any) -> bytes:
    vol = Volume(url, storage_options=opts)
    return vol.read_bytes(info.relative_path)[info.offset : info.offset + info.length]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.emulator)])
def location(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh checkpoint location: a local directory, or a bucket on moto."""
    if request.param == "local":
        yield str(tmp_path / "ck"), {}
    else:
        url, opts = request.getfixturevalue("s3_bucket")
        yield join(url, "ck"), opts


def _stock_writer(url: str, opts: dict[str, Any], extensions: list[Any]) -> Any:
    if url.startswith("s3://"):
        return FsspecWriter(url, _extensions=extensions, **opts)
    return FileSystemWriter(url, _extensions=extensions)


# -- VolumeWriter with extensions: stock readers load it -------------------------------------


@pytest.mark.parametrize("how", ["ZStandard", "compression"])
def test_compressed_volume_checkpoint_loads_with_stock_and_volume_readers(
    location: tuple[str, dict[str, Any]], how: str
) -> None:
    url, opts = location
    state = _compressible_state()
    kwargs: dict[str, Any] = (
        {"_extensions": [ZStandard()]} if how == "ZStandard" else {"compression": "zstd"}
    )
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=opts, **kwargs))

    md = _metadata(url, opts)
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {
        ("stream.zstd/1",)
    }
    for reader in (
        stock_reader(url, opts),
        VolumeReader(url, storage_options=opts),
        VolumeReader(url, storage_options=opts, verify=True),
    ):
        out = _blank(state)
        dcp.load(out, storage_reader=reader)
        assert_same(out, state)


def test_manifest_describes_the_stored_compressed_bytes(tmp_path: Path) -> None:
    state = _compressible_state()
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    dcp.save(state, storage_writer=VolumeWriter(plain))
    dcp.save(state, storage_writer=VolumeWriter(packed, compression=ZstdCompression(level=9)))

    def files(url: str) -> tuple[Manifest, dict[str, bytes]]:
        vol = Volume(url)
        manifest = Manifest.from_json(vol.read_bytes(MANIFEST_NAME))
        return manifest, {rel: vol.read_bytes(rel) for rel in manifest.files}

    plain_manifest, _ = files(plain)
    manifest, stored = files(packed)
    for rel, record in manifest.files.items():
        assert record.size == len(stored[rel])
        assert record.checksum == checksum_bytes(stored[rel])
        # No direct-read offsets: compressed tensors do not lie in the file as in memory.
        assert not record.tensors
    assert manifest.total_bytes < plain_manifest.total_bytes / 2
    # Each item's recorded length is its stored (compressed) length, as stock records it.
    md = _metadata(packed, {})
    zeros = next(i for k, i in md.storage_data.items() if k.fqn == "zeros")
    assert zeros.length < 64 * 1024 < 256 * 1024 * 4


def test_items_stored_byte_for_byte_as_stock_writes_them(tmp_path: Path) -> None:
    """Same extension, same state: every item's stored bytes equal stock's (stock
    writing, as ours does, no zip CRC-32: torch.save's public switch)."""
    state = _compressible_state()
    ours, stock = str(tmp_path / "ours"), str(tmp_path / "stock")
    dcp.save(state, storage_writer=VolumeWriter(ours, _extensions=[ZStandard()]))
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(stock, _extensions=[ZStandard()]))
    finally:
        torch.serialization.set_crc32_options(True)
    md_ours, md_stock = _metadata(ours, {}), _metadata(stock, {})
    assert set(md_ours.storage_data) == set(md_stock.storage_data)
    for index, info in md_stock.storage_data.items():
        mine = md_ours.storage_data[index]
        assert mine.transform_descriptors == info.transform_descriptors
        assert _stored(ours, {}, mine) == _stored(stock, {}, info), index.fqn


def test_rot13_extension_both_ways(location: tuple[str, dict[str, Any]]) -> None:
    url, opts = location
    state = _compressible_state()
    ours, stock = join(url, "ours"), join(url, "stock")
    dcp.save(state, storage_writer=VolumeWriter(ours, storage_options=opts,
                                                _extensions=[Rot13Example()]))
    dcp.save(state, storage_writer=_stock_writer(stock, opts, [Rot13Example()]))
    registry = get_test_extension_registry()
    for reader in (
        stock_reader(ours, opts, registry),
        VolumeReader(ours, storage_options=opts, _extension_registry=registry),
        VolumeReader(stock, storage_options=opts, _extension_registry=registry),
    ):
        out = _blank(state)
        dcp.load(out, storage_reader=reader)
        assert_same(out, state)
    # The bytes really are transformed: the zip magic of torch.save ("PK") is rot13'd.
    for info in _metadata(ours, opts).storage_data.values():
        stored = _stored(ours, opts, info)
        assert stored.startswith(b"pk\x03\x04") and b"PK\x03\x04" not in stored


# The addresses of the targets _PlacingCopy decoded straight into.
_placed: list[int] = []


class _PlacingCopy(TensorPlacingExtension, StreamTransformExtension):
    """Stores each item as it is; its writer notes where a small tensor's data lies
    (``;OFFSET:NBYTES:DTYPE:SHAPE``): the seam's types alone, nothing of encryption."""

    def __init__(self, field: str = "") -> None:
        super().__init__()
        self._field = field

    @staticmethod
    def registry_name() -> str:
        return "tests.placing_copy"

    @staticmethod
    def from_descriptor(version: str) -> _PlacingCopy:
        return _PlacingCopy(version.partition(";")[2])

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _PlacingWriter(output, self.get_descriptor()))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input

    def tensor_placement(self) -> TensorPlacement | None:
        if not self._field:
            return None
        at, nbytes, dtype, shape = self._field.split(":")
        dims = tuple(int(d) for d in shape.split("x") if d)
        return TensorPlacement(int(at), int(nbytes), getattr(torch, dtype), dims)

    def decode_tensor_into(self, input: IO[bytes], target: memoryview) -> bool:
        placement = self.tensor_placement()
        assert placement is not None
        target[:] = input.read()[placement.offset:placement.offset + len(target)]
        _placed.append(int(np.frombuffer(target, dtype=np.uint8).ctypes.data))
        return True


class _PlacingWriter(io.RawIOBase, TensorPlacingStream):
    def __init__(self, output: IO[bytes], descriptor: str) -> None:
        super().__init__()
        self._out, self._pos, self._kind = output, 0, ""
        self.descriptor = descriptor

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self._out.write(b)
        self._pos += n
        return n

    def expect_tensor(self, tensor: torch.Tensor) -> None:
        shape = "x".join(str(d) for d in tensor.shape)
        self._kind = f"{str(tensor.dtype).removeprefix('torch.')}:{shape}"

    def write_framed(self, head: bytes, data: memoryview, tail: bytes) -> None:
        self.write(head)
        self.descriptor += f";{self._pos}:{data.nbytes}:{self._kind}"
        self.write(data)
        self.write(tail)

    def close(self) -> None:
        if not self.closed:
            self._out.close()  # torch's wrapper: flushes, leaves the file open
            super().close()


def test_a_transform_that_places_tensors_is_decoded_into_the_targets(tmp_path: Path) -> None:
    """Any transform of the seam's types, not only encryption: small tensors' data is
    decoded straight into the targets' memory; a big one (written by torch.save, nothing
    noted) is undone whole; the stock reader undoes every item whole."""
    state = {"small": torch.arange(1000, dtype=torch.float32),
             "ids": torch.arange(64).reshape(8, 8), "big": torch.rand(512 * 1024),
             "blob": b"abc" * 100}
    ck = str(tmp_path / "ck")
    dcp.save(state, storage_writer=VolumeWriter(ck, _extensions=[_PlacingCopy()]))
    descriptors = {index.fqn: info.transform_descriptors
                   for index, info in _metadata(ck, {}).storage_data.items()}
    assert ";" in descriptors["small"][0] and descriptors["big"] == ["tests.placing_copy/1"]
    registry = ExtensionRegistry()
    registry.register(_PlacingCopy)
    _placed.clear()
    out = _blank(state)
    dcp.load(out, storage_reader=VolumeReader(ck, _extension_registry=registry))
    assert_same(out, state)
    assert sorted(_placed) == sorted([out["small"].data_ptr(), out["ids"].data_ptr()])
    out = _blank(state)
    dcp.load(out, storage_reader=FileSystemReader(ck, _extension_registry=registry))
    assert_same(out, state)


def test_volume_reader_loads_stock_compressed_checkpoint(
    location: tuple[str, dict[str, Any]],
) -> None:
    url, opts = location
    state = _compressible_state()
    dcp.save(state, storage_writer=_stock_writer(url, opts, [ZStandard()]))
    out = _blank(state)
    dcp.load(out, storage_reader=VolumeReader(url, storage_options=opts))
    assert_same(out, state)


def test_partial_load_of_a_compressed_checkpoint(tmp_path: Path) -> None:
    state = _compressible_state()
    ck = str(tmp_path / "ck")
    dcp.save(state, storage_writer=VolumeWriter(ck, compression="zstd", file_size="1MiB"))
    out = {"ids": torch.zeros(200_000, dtype=torch.int64), "nested": {"step": 0}}
    dcp.load(out, storage_reader=VolumeReader(ck))
    assert torch.equal(out["ids"], state["ids"]) and out["nested"]["step"] == 12


# -- errors -----------------------------------------------------------------------------------


def test_unknown_extension_on_load_names_the_fix(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    state = {"t": torch.arange(10.0)}
    dcp.save(state, storage_writer=VolumeWriter(ck, _extensions=[Rot13Example()]))
    with pytest.raises(BaseException) as info:
        dcp.load({"t": torch.zeros(10)}, storage_reader=VolumeReader(ck))
    err = storage_error(info.value)
    assert isinstance(err, ConfigurationError)
    assert "stream.rot13" in str(err) and "_extension_registry" in str(err)


def test_damaged_compressed_item_is_reported_as_damage(tmp_path: Path) -> None:
    ck = tmp_path / "stock"  # stock: no manifest, so only the decoder can notice
    dcp.save({"t": torch.zeros(100_000)}, storage_writer=FileSystemWriter(ck,
                                                                           _extensions=[ZStandard()]))
    data_file = next(ck.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 16] = b"\xff" * 16
    data_file.write_bytes(bytes(raw))
    with pytest.raises(BaseException) as info:
        dcp.load({"t": torch.zeros(100_000)}, storage_reader=VolumeReader(ck))
    err = storage_error(info.value)
    assert isinstance(err, CheckpointCorruptError), failure_of(info.value)
    assert str(err).startswith("t in ") and "cannot be decoded" in str(err)
    assert "stream.zstd/1" in str(err)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"compression": "lz4"}, "'zstd'"),
        ({"compression": ZstdCompression, "_extensions": None}, "'zstd'"),
        ({"_extensions": [object()]}, "StreamTransformExtension"),
        ({"_extensions": [Rot13Example()], "compression": "zstd"}, "Use one"),
        ({"_extensions": [ZStandard(), ZStandard()]}, "Use one"),
        ({"serialization_format": SerializationFormat.SAFETENSORS}, "HuggingFaceStorageWriter"),
        ({"serialization_format": "parquet"}, "TORCH_SAVE"),
    ],
)
def test_unsupported_writer_options_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigurationError, match=words):
        VolumeWriter(tmp_path / "ck", **kwargs)


@pytest.mark.parametrize(("level", "threads"), [(23, 0), (-8, 0), (3, -2), (True, 0), (3.0, 0)])
def test_bad_zstd_settings_are_refused(level: Any, threads: Any) -> None:
    with pytest.raises(ConfigurationError):
        ZstdCompression(level=level, threads=threads)


def test_torch_save_serialization_format_is_accepted(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    writer = VolumeWriter(ck, serialization_format=SerializationFormat.TORCH_SAVE)
    dcp.save({"t": torch.arange(4.0)}, storage_writer=writer)
    out = {"t": torch.zeros(4)}
    dcp.load(out, storage_reader=FileSystemReader(ck))
    assert torch.equal(out["t"], torch.arange(4.0))


def test_zstd_threads_and_levels_write_the_same_readable_format(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    # Low-entropy bytes: fast (negative) levels skip the entropy coder, so sizes differ.
    state = {"w": torch.randn(100_000, generator=g).bfloat16(),
             "codes": torch.randint(0, 4, (600_000,), dtype=torch.uint8, generator=g)}
    sizes = {}
    for level, threads in [(1, 0), (19, 2), (-3, -1)]:
        ck = str(tmp_path / f"l{level}t{threads}")
        dcp.save(state, storage_writer=VolumeWriter(
            ck, compression=ZstdCompression(level=level, threads=threads)))
        out = blank_like(state)
        dcp.load(out, storage_reader=FileSystemReader(ck))  # torch's own ZStandard decoder
        assert_same(out, state)
        sizes[level] = Manifest.from_json(Volume(ck).read_bytes(MANIFEST_NAME)).total_bytes
    assert sizes[19] <= sizes[1] < sizes[-3]


# -- compression in the background part of an async save -------------------------------------


class _Gate(StreamTransformExtension):
    """Passes bytes through, but the first item's transform waits for ``opened``."""

    opened = threading.Event()
    entered = threading.Event()

    @staticmethod
    def registry_name() -> str:
        return "stream.test-gate"

    @staticmethod
    def from_descriptor(version: str) -> _Gate:
        return _Gate()

    def get_descriptor(self) -> str:
        return "stream.test-gate/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        _Gate.entered.set()
        if not _Gate.opened.wait(timeout=60):
            raise TimeoutError("the gate was never opened")
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(input.read())


def test_transforms_run_after_async_save_returns(tmp_path: Path) -> None:
    _Gate.opened.clear()
    _Gate.entered.clear()
    ck = str(tmp_path / "ck")
    state = {"t": torch.arange(1000.0)}
    fut = dcp.async_save(state, storage_writer=VolumeWriter(ck, _extensions=[_Gate()]))
    # async_save returned while the transform had not been let through: it runs in
    # the background save, not in the blocking staging.
    assert _Gate.entered.wait(timeout=60)
    assert not fut.done()
    _Gate.opened.set()
    fut.result(timeout=60)
    registry = ExtensionRegistry()
    registry.register(_Gate)
    out = {"t": torch.zeros(1000)}
    dcp.load(out, storage_reader=VolumeReader(ck, _extension_registry=registry))
    assert torch.equal(out["t"], state["t"])
    assert (Path(ck) / METADATA_NAME).exists()


def test_bad_registry_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="ExtensionRegistry"):
        VolumeReader("/tmp/x", _extension_registry={"stream.zstd": ZStandard})


def test_checkpoint_manager_saves_compressed_through_writer_options(tmp_path: Path) -> None:
    from dcp_volumes import CheckpointManager

    state = _compressible_state()
    root = str(tmp_path / "run")
    with CheckpointManager(root, writer_options={"compression": "zstd"}) as mgr:
        mgr.save(5, state)
        mgr.wait()
        latest = mgr.latest()
    assert latest is not None and latest.complete
    md = _metadata(latest.url, {})
    assert all(i.transform_descriptors == ["stream.zstd/1"] for i in md.storage_data.values())
    out = _blank(state)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(out) == 5
    assert_same(out, state)


def test_writer_and_reader_with_extensions_pickle(tmp_path: Path) -> None:
    """The PROCESS async checkpointer pickles the writer on every save."""
    import pickle

    ck = str(tmp_path / "ck")
    # The original stays alive, as the checkpointer's does: it owns the staging dir.
    original = VolumeWriter(ck, compression=ZstdCompression(level=5, threads=1))
    writer = pickle.loads(pickle.dumps(original))
    state = _compressible_state()
    dcp.save(state, storage_writer=writer)
    assert all(i.transform_descriptors == ["stream.zstd/1"]
               for i in _metadata(ck, {}).storage_data.values())
    reader = pickle.loads(pickle.dumps(
        VolumeReader(ck, _extension_registry=get_test_extension_registry())))
    out = _blank(state)
    dcp.load(out, storage_reader=reader)
    assert_same(out, state)


@pytest.fixture
def stdlib_zstd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Our zstd code on the standard library's API (compression.zstd, or its backport)."""
    from dcp_volumes.checkpoint import _compression

    for name in ("compression.zstd", "backports.zstd"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        monkeypatch.setattr(_compression, "_BACKEND", (name, module))
        yield
        return
    pytest.skip("neither compression.zstd (Python 3.14+) nor backports.zstd is installed")


@pytest.mark.usefixtures("stdlib_zstd")
@pytest.mark.parametrize("threads", [0, 2])
def test_standard_library_zstd_writes_what_torch_reads(tmp_path: Path, threads: int) -> None:
    from dcp_volumes.checkpoint._compression import zstd_library

    assert zstd_library() in ("compression.zstd", "backports.zstd")
    state = _compressible_state()
    ck = str(tmp_path / "ck")
    dcp.save(state, storage_writer=VolumeWriter(
        ck, compression=ZstdCompression(level=3, threads=threads)))
    for reader in (FileSystemReader(ck), VolumeReader(ck, verify=True)):  # zstandard, stdlib
        out = _blank(state)
        dcp.load(out, storage_reader=reader)
        assert_same(out, state)
    plain = sum(t.numel() * t.element_size() for t in state.values()
                if isinstance(t, torch.Tensor))
    assert Manifest.from_json(Volume(ck).read_bytes(MANIFEST_NAME)).total_bytes < plain / 2


def test_missing_zstd_library_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_volumes import BackendNotInstalledError
    from dcp_volumes.checkpoint import _compression

    monkeypatch.setattr(_compression, "_BACKEND", None)
    with pytest.raises(BackendNotInstalledError, match=r"dcp_volumes\[zstd\]"):
        VolumeWriter(tmp_path / "ck", compression="zstd")
    # Reading falls back to torch's own decoder (which finds zstandard or pyzstd itself).
    assert isinstance(ZstdCompression.from_descriptor("1"), ZStandard)


def test_local_tier_holds_the_compressed_files(tmp_path: Path) -> None:
    """The local copy is the stored (compressed) bytes: its checksums match the manifest."""
    state = _compressible_state()
    ck, tier = str(tmp_path / "vol" / "step-1"), tmp_path / "tier"
    dcp.save(state, storage_writer=VolumeWriter(ck, compression="zstd", local_copy_dir=tier))
    manifest = Manifest.from_json(Volume(ck).read_bytes(MANIFEST_NAME))
    for rel, record in manifest.files.items():
        assert checksum_bytes((tier / "step-1" / rel).read_bytes()) == record.checksum
    out = _blank(state)
    dcp.load(out, storage_reader=VolumeReader(ck, local_copy_dir=tier))
    assert_same(out, state)


def test_decoding_ahead_within_a_byte_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a budget below one item, items are decoded one at a time, in order."""
    from dcp_volumes.checkpoint import _reader

    ck = str(tmp_path / "ck")
    state = _compressible_state()
    dcp.save(state, storage_writer=VolumeWriter(ck, compression="zstd"))
    monkeypatch.setattr(_reader, "_DECODE_AHEAD_BYTES", 1)
    out = _blank(state)
    dcp.load(out, storage_reader=VolumeReader(ck))
    assert_same(out, state)


def test_cli_inspect_shows_stored_bytes_and_transforms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dcp_volumes.cli import main

    state = _compressible_state()
    root = tmp_path / "run"
    dcp.save(state, storage_writer=VolumeWriter(root / "step-00000001", compression="zstd"))
    dcp.save(state, storage_writer=VolumeWriter(root / "step-00000002"))
    capsys.readouterr()
    assert main(["inspect", str(root / "step-00000001"), "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(root / "step-00000002"), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert packed["transforms"] == ["stream.zstd/1"] and plain["transforms"] == []
    assert packed["tensor_bytes"] == plain["tensor_bytes"]
    assert packed["stored_bytes"] < plain["tensor_bytes"] / 2 < plain["stored_bytes"]
    assert main(["inspect", str(root / "step-00000001")]) == 0
    assert "stored (stream.zstd/1)" in capsys.readouterr().out.splitlines()[0]


def test_zstd_compression_is_a_stock_extension_too(tmp_path: Path) -> None:
    """ZstdCompression in stock FileSystemWriter's _extensions: stock's reader decodes it."""
    state = _compressible_state()
    ck = tmp_path / "ck"
    dcp.save(state, storage_writer=FileSystemWriter(
        ck, _extensions=[ZstdCompression(level=5, threads=2)]))
    out = _blank(state)
    dcp.load(out, storage_reader=FileSystemReader(ck))  # torch's default registry
    assert_same(out, state)
    assert sum(f.stat().st_size for f in ck.glob("*.distcp")) < raw_size(state) / 2


def raw_size(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))

"""Client-side encryption (``Encryption``): AES-256-GCM frames as a DCP stream extension.

What is proved here, once each: round trips (local, moto, stock readers with the
extension, with and without zstd, 2 gloo ranks resharded to 1, the manager with
its local tier and a peer replica); no plaintext on the store, the staging area,
the local tier or a replica; key rotation; a missing, unknown or wrong key and
each kind of tampering refused with a typed error naming the file, never a key
in a message or log; kill trials with encryption on.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_volumes import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointTamperedError,
    ConfigurationError,
    Encryption,
    EncryptionKeyError,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._encryption_stream import FRAME_SIZE, EncryptedStreams
from dcp_volumes.checkpoint._extensions import TensorPlacingStream
from testkit.ranks import run_ranks
from tests.checkpoint_helpers import assert_same, blank_like, failure_of, stock_reader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KEY = bytes(range(32))
OLD_KEY = bytes(range(100, 132))
MARKER = b"PLAINTEXT-MARKER"  # 16 bytes that must never be stored in the clear


def _state() -> dict[str, Any]:
    return {
        "marked": torch.frombuffer(bytearray(MARKER * 4096), dtype=torch.uint8).clone(),
        "big": torch.arange(3 * FRAME_SIZE // 4 + 123, dtype=torch.float32),  # 3+ frames
        "small": torch.full((3, 3), 7.0),
        "empty": torch.zeros(0),
        "note": "a note holding " + MARKER.decode(),
        "step": 5,
    }


def _key_texts(*keys: bytes) -> list[str]:
    return [t for k in keys for t in (repr(k), k.hex(), base64.b64encode(k).decode())]


def _no_marker_under(*dirs: Path) -> None:
    for d in dirs:
        files = [p for p in d.rglob("*") if p.is_file()]
        assert files, d
        for p in files:
            assert MARKER not in p.read_bytes(), f"plaintext in {p}"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip_stock_reader_and_no_plaintext_anywhere(
        tmp_path: Path, compression: str | None, memory_bucket: tuple[str, dict[str, Any]]) -> None:
    enc = Encryption(key=KEY, key_id="2026-12")
    ck, staging, local = tmp_path / "ck", tmp_path / "staging", tmp_path / "local"
    state = _state()
    dcp.save(state, storage_writer=VolumeWriter(ck, encryption=enc, compression=compression))
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, encryption=enc))
    assert_same(out, state)
    # A stock reader with our extension in its registry loads it too.
    stock = blank_like(state)
    registry = enc.extension_registry()
    dcp.load(stock, storage_reader=FileSystemReader(ck, _extension_registry=registry))
    assert_same(stock, state)
    _no_marker_under(ck)
    meta = (ck / ".metadata").read_bytes()
    assert b"key=2026-12" in meta and not any(t.encode() in meta for t in _key_texts(KEY))
    # A remote volume: the staged files (kept) and the store hold ciphertext only; and
    # with a local tier, so does the tier.
    url = memory_bucket[0] + "/ck"
    staging.mkdir()
    dcp.save(state, storage_writer=VolumeWriter(url, encryption=enc, compression=compression,
                                                staging_dir=staging, keep_staging=True))
    dcp.save(state, storage_writer=VolumeWriter(url + "2", encryption=enc, local_copy_dir=local))
    _no_marker_under(staging, local)
    for where in (url, url + "2"):
        volume = Volume(where)
        names = volume.list()
        assert names and all(MARKER not in volume.read_bytes(n.path) for n in names)


def test_moto_round_trip_with_fsspec_stock_reader(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_bucket
    enc = Encryption(key=KEY, key_id="k1")
    state = _state()
    ck = url + "/ck"
    dcp.save(state, storage_writer=VolumeWriter(ck, storage_options=opts, encryption=enc,
                                                compression="zstd"))
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts, encryption=enc))
    assert_same(out, state)
    stock = blank_like(state)
    dcp.load(stock, storage_reader=stock_reader(ck, opts, enc.extension_registry()))
    assert_same(stock, state)
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    for path in fs.find(ck.removeprefix("s3://")):
        assert MARKER not in fs.cat_file(path), path


def _save_sharded(rank: int, world: int, plain: str, sealed: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(2 * FRAME_SIZE, dtype=torch.float32).reshape(1024, -1)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.arange(10.0)}
    dcp.save(state, storage_writer=VolumeWriter(plain))
    dcp.save(state, storage_writer=VolumeWriter(sealed, encryption=Encryption(key=KEY, key_id="k")))


def test_two_ranks_save_a_resharded_load_reads_at_most_a_few_frames_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, sealed = str(tmp_path / "plain"), str(tmp_path / "sealed")
    run_ranks(_save_sharded, 2, plain, sealed)
    full = torch.arange(2 * FRAME_SIZE, dtype=torch.float32).reshape(1024, -1)
    read = {}
    for url, enc in ((plain, None), (sealed, Encryption(key=KEY, key_id="k"))):
        # One process loads the whole tensor (both ranks' shards), then only "b".
        out = {"w": torch.zeros_like(full), "b": torch.zeros(10)}
        reader = VolumeReader(url, encryption=enc)
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], full) and torch.equal(out["b"], torch.arange(10.0))
        whole = sum(reader.sources.values())
        part = {"b": torch.zeros(10)}
        reader = VolumeReader(url, encryption=enc)
        dcp.load(part, storage_reader=reader)
        read[url] = (whole, sum(reader.sources.values()))
    (plain_whole, plain_part), (sealed_whole, sealed_part) = read[plain], read[sealed]
    assert sealed_whole <= plain_whole * 1.02
    # Two items a rank: a header and a tag per frame beyond the plain bytes, no more.
    assert sealed_part - plain_part <= 4 * (2**20 + 64)
    _check_direct_decryption(sealed, monkeypatch)


def test_key_rotation_reads_both_and_refuses_a_key_it_lacks(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    old = Encryption(key=OLD_KEY, key_id="2026-11")
    new = Encryption(key=KEY, key_id="2026-12", previous={"2026-11": OLD_KEY})
    with CheckpointManager(root, encryption=old, keep_last=None) as mgr:
        mgr.save(1, {"t": torch.full((8,), 1.0)})
    with CheckpointManager(root, encryption=new, keep_last=None) as mgr:
        mgr.save(2, {"t": torch.full((8,), 2.0)})
    for step in (1, 2):
        out = {"t": torch.zeros(8)}
        dcp.load(out, storage_reader=VolumeReader(f"{root}/step-{step:08d}", encryption=new))
        assert torch.equal(out["t"], torch.full((8,), float(step)))
    out = {"t": torch.zeros(8)}
    with pytest.raises(BaseException) as info:
        dcp.load(out, storage_reader=VolumeReader(f"{root}/step-00000001",
                                                  encryption=Encryption(key=KEY, key_id="2026-12")))
    err = failure_of(info.value)
    assert isinstance(err, EncryptionKeyError) and "2026-11" in str(err)


def _load_error(ck: Path, enc: Encryption | None, caplog: pytest.LogCaptureFixture,
                stock: bool = False) -> BaseException:
    out = blank_like(_state())
    reader = (FileSystemReader(ck, _extension_registry=enc.extension_registry()) if stock and enc
              else VolumeReader(ck, encryption=enc))
    with caplog.at_level(logging.DEBUG), pytest.raises(BaseException) as info:
        dcp.load(out, storage_reader=reader)
    err = failure_of(info.value)
    logged = caplog.text + str(err) + repr(err)
    assert not any(t in logged for t in _key_texts(KEY, OLD_KEY)), "a key leaked"
    return err


def test_missing_unknown_and_wrong_keys_are_refused_naming_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_VOLUMES_ENCRYPTION_KEY", raising=False)
    ck = tmp_path / "ck"
    dcp.save(_state(), storage_writer=VolumeWriter(ck, encryption=Encryption(key=KEY, key_id="a")))
    data_file = next(ck.glob("*.distcp")).name
    for enc, says in ((None, "no key was given"),
                      (Encryption(key=KEY, key_id="b"), "key id 'a'"),
                      (Encryption(key=OLD_KEY, key_id="a"), "is not the key")):
        err = _load_error(ck, enc, caplog)
        assert isinstance(err, EncryptionKeyError), err
        assert says in str(err) and data_file in str(err), str(err)
    # The environment's key is the fallback of a reader given none.
    monkeypatch.setenv("DCP_VOLUMES_ENCRYPTION_KEY", base64.b64encode(KEY).decode())
    monkeypatch.setenv("DCP_VOLUMES_ENCRYPTION_KEY_ID", "a")
    out = blank_like(_state())
    dcp.load(out, storage_reader=VolumeReader(ck))
    assert_same(out, _state())


def _item(enc: Encryption, data: bytes) -> tuple[bytes, str]:
    ext = EncryptedStreams(enc)
    buf = io.BytesIO()
    with ext.transform_to(buf) as w:
        w.write(data)
    return buf.getvalue(), ext.get_descriptor()


def _open(enc: Encryption, blob: bytes, descriptor: str) -> bytes:
    cls = type("Bound", (EncryptedStreams,), {"encryption": enc})
    ext = cls.from_descriptor(descriptor.partition("/")[2])
    return ext.transform_from(io.BytesIO(blob)).read()


def test_each_kind_of_tampering_fails_authentication() -> None:
    enc = Encryption(key=KEY, key_id="k")
    data = os.urandom(3 * FRAME_SIZE + 1000)
    blob, desc = _item(enc, data)
    other, other_desc = _item(enc, os.urandom(len(data)))
    assert _open(enc, blob, desc) == data
    header = len(blob) - len(data) - 4 * 28
    rec = FRAME_SIZE + 28
    frame = [blob[header + i * rec: header + (i + 1) * rec] for i in range(4)]
    head = blob[:header]
    flipped = bytearray(blob)
    flipped[header + rec + 5000] ^= 1
    tampered = {
        "flipped byte": bytes(flipped),
        "flipped header byte": bytes([blob[0] ^ 1]) + blob[1:],
        "swapped frames": head + frame[1] + frame[0] + frame[2] + frame[3],
        "dropped frame": head + frame[0] + frame[2] + frame[3],
        "truncated at a frame boundary": head + frame[0] + frame[1] + frame[2],
        "truncated mid-frame": blob[:-100],
        "frame from another item": head + frame[0]
        + other[header + rec: header + 2 * rec] + frame[2] + frame[3],
    }
    for kind, bad in tampered.items():
        with pytest.raises(CheckpointTamperedError, match="authentication failed"):
            _open(enc, bad, desc)
        assert kind
    # A tensor's place in the plaintext (what the direct path decrypts into the target by)
    # is bound into the final frame: an altered tensor field in .metadata is refused.
    ext = EncryptedStreams(enc)
    buf = io.BytesIO()
    tensor = torch.arange(3 * FRAME_SIZE // 8 + 5, dtype=torch.float64)
    with ext.transform_to(buf) as w:
        assert isinstance(w, TensorPlacingStream)  # what the writer's byte format asks for
        w.expect_tensor(tensor)
        torch.save(tensor, w)
    tdesc = w.descriptor
    assert ";tensor=" in tdesc and tdesc.startswith("dcp_volumes.aes256gcm/2;")
    assert torch.equal(torch.load(io.BytesIO(_open(enc, buf.getvalue(), tdesc))), tensor)
    at = int(tdesc.rpartition("tensor=")[2].split(":")[0])
    for bad_desc in (tdesc.replace(f"tensor={at}:", f"tensor={at + 8}:"),
                     tdesc.replace(":float64:", ":int64:"), tdesc.rpartition(";")[0]):
        with pytest.raises(CheckpointTamperedError, match="authentication failed"):
            _open(enc, buf.getvalue(), bad_desc)
    # A whole item swapped for another (same length) does not match its .metadata entry.
    with pytest.raises(CheckpointTamperedError):
        _open(enc, other, desc)
    assert _open(enc, other, other_desc) != data


def test_tampered_files_on_disk_are_refused_by_both_readers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    enc = Encryption(key=KEY, key_id="k")
    ck = tmp_path / "ck"
    dcp.save(_state(), storage_writer=VolumeWriter(ck, encryption=enc))
    data_file = next(ck.glob("*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    data_file.write_bytes(blob)
    err = _load_error(ck, enc, caplog)  # the manifest's checksum, or authentication
    assert isinstance(err, CheckpointCorruptError) and data_file.name in str(err)
    err = _load_error(ck, enc, caplog, stock=True)  # stock: authentication alone
    assert isinstance(err, CheckpointTamperedError), err


def test_a_remote_load_decrypts_frames_as_their_gets_return_and_refuses_tampering(
        memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """From a remote volume a tensor is decrypted into its target from the client's
    buffers as its GETs return, cut at frame bounds; no file is then hashed, and every
    kind of damage is still refused, typed, naming the file."""
    from dcp_volumes.checkpoint._encryption_stream import _FrameDecoder

    enc = Encryption(key=KEY, key_id="k")
    url, state = memory_bucket[0] + "/ck", _state()
    dcp.save(state, storage_writer=VolumeWriter(url, encryption=enc))
    fed: dict[int, list[tuple[int, int]]] = {}
    real_feed = _FrameDecoder.feed

    def feed(self: _FrameDecoder, at: int, data: memoryview) -> None:
        fed.setdefault(id(self), []).append((at, len(data)))
        real_feed(self, at, data)

    monkeypatch.setattr(_FrameDecoder, "feed", feed)
    whole = _spy_direct(monkeypatch)

    def load(key: Encryption = enc) -> BaseException | None:
        out = blank_like(state)
        reader = VolumeReader(url, encryption=key, part_size="1MiB")
        with caplog.at_level(logging.DEBUG):
            try:
                dcp.load(out, storage_reader=reader)
            except BaseException as exc:  # the rank's error is asserted below
                err = failure_of(exc)
                logged = caplog.text + str(err) + repr(err)
                assert not any(t in logged for t in _key_texts(KEY, OLD_KEY)), "a key leaked"
                return err
        assert_same(out, state)
        return None

    assert load() is None and whole == []
    # The 3-MiB tensor arrived in several GETs, each a run of whole frames.
    assert max(len(pieces) for pieces in fed.values()) >= 3
    volume = Volume(url)
    md = VolumeReader(url, encryption=enc).read_metadata()
    big = next(info for index, info in md.storage_data.items() if index.fqn == "big")
    rel, at = big.relative_path, big.offset
    original = volume.read_bytes(rel)
    header_len = len(b"DCPVENC1") + 1 + 4 + 8 + 16 + 1 + 1  # key id "k"
    frame0 = at + header_len

    def altered(*changes: tuple[int, bytes]) -> bytes:
        blob = bytearray(original)
        for pos, data in changes:
            blob[pos:pos + len(data)] = data
        return bytes(blob)

    rec = FRAME_SIZE + 28
    flip = lambda pos: (pos, bytes([original[pos] ^ 1]))  # noqa: E731
    cases = [
        ("authentication of frame 1 of 4", altered(flip(frame0 + rec + 500))),
        ("header does not match", altered(flip(at))),
        ("key check was altered", altered(flip(at + 13))),
        ("authentication of frame ", altered(  # frames 0 and 1 swapped: either fails first
            (frame0, original[frame0 + rec:frame0 + 2 * rec]),
            (frame0 + rec, original[frame0:frame0 + rec]))),
    ]
    for says, blob in cases:
        volume.publish(rel, blob)
        err = load()
        assert isinstance(err, CheckpointTamperedError) and says in str(err), (says, err)
        assert rel in str(err) and "big" in str(err), err
    volume.publish(rel, original)
    err = load(Encryption(key=OLD_KEY, key_id="k"))
    assert isinstance(err, EncryptionKeyError) and "is not the key" in str(err), err
    assert load() is None


def test_bad_keys_are_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="32 bytes"):
        Encryption(key=b"short", key_id="k")
    with pytest.raises(ConfigurationError, match="key id"):
        Encryption(key=KEY, key_id="has space")
    with pytest.raises(ConfigurationError, match="each key id names one key"):
        Encryption(key=KEY, key_id="k", previous={"k": OLD_KEY})
    monkeypatch.setenv("DCP_VOLUMES_ENCRYPTION_KEY", "not base64!")
    with pytest.raises(ConfigurationError, match="base64") as info:
        Encryption.from_env()
    assert "not base64!" not in str(info.value)
    enc = Encryption(key=KEY, key_id="k", previous={"old": OLD_KEY})
    assert not any(t in repr(enc) + str(enc) for t in _key_texts(KEY, OLD_KEY))
    with pytest.raises(ConfigurationError, match="_extensions"):
        from torch.distributed.checkpoint._extension import ZStandard

        VolumeWriter("/tmp/x", encryption=enc, _extensions=[ZStandard()])


def test_manager_local_tier_and_peer_replica_hold_ciphertext_and_restore(
        moto_server: Any, tmp_path: Path) -> None:
    from tests.scripts.peer_train import entry
    from tests.test_peer_tier import _agents, _finish, _reports

    root = moto_server.create_bucket(f"enc-peer-{os.urandom(4).hex()}") + "/run"
    options = moto_server.storage_options()
    dirs = [tmp_path / "node-a", tmp_path / "node-b"]
    _finish(_agents(root, tmp_path / "save", "save", dirs, options, encryption_key=KEY),
            tmp_path / "save")
    assert [r["saved"] for r in _reports(tmp_path / "save")] == [2, 2]
    # Both nodes' tiers (own files and the replica of the other's) hold no plaintext.
    pattern = entry(2, 1).numpy().tobytes()[4096:4160]
    replicas = list(dirs[0].glob("replicas/node-*/step-00000002/*.distcp"))
    assert replicas
    for p in [*dirs[0].rglob("*.distcp"), *dirs[1].rglob("*.distcp")]:
        assert pattern not in p.read_bytes(), p
    shutil.rmtree(dirs[1])  # node b is lost: its rank restores from node a's replica
    out = tmp_path / "restore"
    _finish(_agents(root, out, "restore", dirs, options, encryption_key=KEY), out)
    reports = _reports(out)
    assert all(r["step"] == 2 and r["exact"] for r in reports), reports
    by_dir = {Path(r["local_dir"]).name: r["sources"] for r in reports}
    assert by_dir["node-b"]["peer"] > 0


@pytest.mark.parametrize(
    ("trials", "seed"),
    [pytest.param(8, 44, id="quick"), pytest.param(100, 45, marks=pytest.mark.soak, id="many")],
)
def test_kill_trials_with_encryption_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, trials: int,
                                        seed: int) -> None:
    from tests.test_crash_injection import _report, run_trials

    # The parent's checks read with the environment's key (a reader given none falls back to it).
    monkeypatch.setenv("DCP_VOLUMES_ENCRYPTION_KEY", base64.b64encode(KEY).decode())
    monkeypatch.setenv("DCP_VOLUMES_ENCRYPTION_KEY_ID", "crash")
    tally = run_trials(str(tmp_path / "run"), {}, {}, trials=trials, keep_last=2,
                       max_delay_s=0.5, seed=seed, encryption_key=KEY)
    _report(tally, f"local, encrypted, {trials} trials", capsys)


def test_cli_inspect_and_verify_say_encrypted_and_authenticate_given_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_cli import run_cli

    monkeypatch.delenv("DCP_VOLUMES_ENCRYPTION_KEY", raising=False)
    ck = tmp_path / "ck"
    dcp.save(_state(), storage_writer=VolumeWriter(ck, encryption=Encryption(key=KEY, key_id="k7"),
                                                   compression="zstd"))
    shown = run_cli("inspect", str(ck))
    assert shown.returncode == 0 and "encrypted, key id k7 (no key given" in shown.stdout
    assert "stream=" not in shown.stdout and "marked" in shown.stdout  # names stay visible
    plain = run_cli("verify", str(ck))
    assert plain.returncode == 0 and "no key given" in plain.stdout
    key_file = tmp_path / "key"
    key_file.write_text(base64.b64encode(KEY).decode() + "\n")
    given = run_cli("verify", str(ck), "--encryption-key-file", str(key_file))
    assert given.returncode == 0 and "every item authenticated" in given.stdout, given
    key_file.write_bytes(OLD_KEY)  # 32 raw bytes: the wrong key
    wrong = run_cli("verify", str(ck), "--encryption-key-file", str(key_file))
    assert wrong.returncode == 1 and "is not the key" in wrong.stdout, wrong
    for result in (shown, plain, given, wrong):
        assert not any(t in result.stdout + result.stderr for t in _key_texts(KEY, OLD_KEY))


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Spy: (size, address) of each target decrypted straight into (``decode_tensor_into``)."""
    import numpy as np

    done: list[tuple[int, int]] = []
    real = EncryptedStreams.decode_tensor_into

    def spy(self: EncryptedStreams, stream: Any, target: memoryview) -> bool:
        ok = real(self, stream, target)
        if ok:
            done.append((len(target), int(np.frombuffer(target, dtype=np.uint8).ctypes.data)))
        return ok

    monkeypatch.setattr(EncryptedStreams, "decode_tensor_into", spy)
    return done


def _check_direct_decryption(sealed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors decrypt straight into their targets, resharded too; partial loads and other
    dtypes go the whole way; a flipped byte on the direct path is refused."""
    enc = Encryption(key=KEY, key_id="k")
    full = torch.arange(2 * FRAME_SIZE, dtype=torch.float32).reshape(1024, -1)
    direct = _spy_direct(monkeypatch)
    # Resharded: both ranks' row shards land in one process's full tensor, each decrypted
    # straight into its rows (the targets' own memory, no buffer between).
    out = {"w": torch.zeros_like(full), "b": torch.zeros(10)}
    dcp.load(out, storage_reader=VolumeReader(sealed, encryption=enc))
    assert torch.equal(out["w"], full) and torch.equal(out["b"], torch.arange(10.0))
    w_at, half = out["w"].data_ptr(), 4 * FRAME_SIZE
    assert sorted(direct) == sorted([(40, out["b"].data_ptr()), (half, w_at),
                                     (half, w_at + half)])
    # Partial ("b" not asked for) into another dtype: decrypted whole, then converted.
    direct.clear()
    part = {"w": torch.zeros(full.shape, dtype=torch.float64)}
    dcp.load(part, storage_reader=VolumeReader(sealed, encryption=enc),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["w"], full.double()) and direct == []
    # The stock reader with the extension loads the same bytes.
    out = {"w": torch.zeros_like(full), "b": torch.zeros(10)}
    stock = FileSystemReader(sealed, _extension_registry=enc.extension_registry())
    dcp.load(out, storage_reader=stock)
    assert torch.equal(out["w"], full)
    # A flipped byte inside a tensor's data, read on the direct path: refused.
    data_file = next(Path(sealed).glob("__1_*.distcp"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data_file.write_bytes(blob)
    direct.clear()
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros_like(full)}, storage_reader=VolumeReader(sealed, encryption=enc))
    err = failure_of(info.value)
    assert isinstance(err, CheckpointTamperedError) and data_file.name in str(err), err

"""What the CLI says about an encrypted checkpoint: its key ids, and every item authenticated.

Without the key a checkpoint's ``.metadata`` still names the key ids its items
were written with (``inspect``), and the manifest's checksums still cover the
stored (encrypted) bytes (``verify``). With the key, ``verify`` also decrypts
every item, so a file altered before its checksum was taken, or a wrong key,
is reported too.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from dcp_volumes._exceptions import ConfigurationError, EncryptionError
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._encryption import Encryption, decode_key

__all__ = ["authenticate", "encryption_for", "key_ids", "transform_name"]


def transform_name(descriptor: str) -> str:
    """A transform descriptor without what is particular to one item (an encrypted
    item's stream id), so that a checkpoint's transforms list each kind once."""
    return ";".join(p for p in descriptor.split(";") if not p.startswith("stream="))


def key_ids(metadata: Any) -> list[str]:
    """The key ids of a checkpoint's encrypted items (empty: not encrypted by us)."""
    from dcp_volumes.checkpoint._encryption_stream import describe

    found = {
        describe(getattr(info, "transform_descriptors", None))
        for info in (getattr(metadata, "storage_data", None) or {}).values()
    }
    return sorted(k for k in found if k is not None)


def encryption_for(key_file: str | None, ids: list[str]) -> Encryption | None:
    """The keys the CLI was given: ``--encryption-key-file`` (32 raw bytes or base64 text;
    its id is the checkpoint's), else ``DCP_VOLUMES_ENCRYPTION_KEY``, else None."""
    if key_file is None:
        try:
            return Encryption.from_env()
        except ConfigurationError:
            return None
    try:
        with open(key_file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigurationError(
            f"--encryption-key-file {key_file}: cannot read it ({exc.strerror}). Fix: pass "
            "the file holding the key (32 bytes, or their base64)."
        ) from None
    key = raw if len(raw) == 32 else decode_key(raw.decode("ascii", "replace"),
                                                f"--encryption-key-file {key_file}")
    return Encryption(key=key, key_id=ids[0] if len(ids) == 1 else "default",
                      previous={i: key for i in ids[1:]} if len(ids) > 1 else {})


def authenticate(
    volume: Volume, metadata: Any, encryption: Encryption,
    progress: Callable[[int], Any] | None = None,
) -> list[str]:
    """Decrypt every encrypted item of the checkpoint on ``volume`` (nothing is kept):
    the problems found, one line each (empty: every item authenticated)."""
    from dcp_volumes.checkpoint._encryption_stream import describe, registry_for

    registry = registry_for(encryption)
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if describe(getattr(info, "transform_descriptors", None)) is not None:
            by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    problems: list[str] = []
    for rel, items in sorted(by_file.items()):
        data = memoryview(volume.read_bytes(rel))
        for fqn, info in items:
            try:
                stream: Any = io.BytesIO(data[info.offset:info.offset + info.length])
                for ext in registry.from_descriptor_list(info.transform_descriptors):
                    stream = ext.transform_from(stream)
                stream.read()
            except EncryptionError as exc:
                problems.append(f"{rel}: {fqn}: {exc}")
        if progress is not None:
            progress(len(data))
    return problems

"""``Encryption``: the keys of client-side checkpoint encryption (AES-256-GCM).

One current key (with the id recorded beside every item it encrypts) and,
for rotation, previous keys by id: a checkpoint is written with the current
key and read with whichever key its items name. The key never leaves this
object except into the cipher: not into ``repr``, ``.metadata``, messages or
logs. The format and the DCP extension live in ``_encryption_stream``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import _env
from dcp_volumes._exceptions import BackendNotInstalledError, ConfigurationError

__all__ = ["DEFAULT_KEY_ID", "KEY_BYTES", "Encryption"]

KEY_BYTES = 32  # AES-256
DEFAULT_KEY_ID = "default"
# Key ids go into descriptors ("name/version;key=ID;...") and file headers.
_KEY_ID = re.compile(r"[A-Za-z0-9._:@+-]{1,64}")
_KEY_CHECK_LABEL = b"dcp_volumes key check v1"


def _check_key(key: object, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(bytes(key)) != KEY_BYTES:
        size = len(bytes(key)) if isinstance(key, (bytes, bytearray, memoryview)) else None
        raise ConfigurationError(
            f"{what} must be {KEY_BYTES} bytes (AES-256), got "
            f"{'a ' + type(key).__name__ if size is None else f'{size} bytes'}. Fix: pass "
            "os.urandom(32) or a key from your secret store (base64-decode it first)."
        )
    return bytes(key)


def _check_key_id(key_id: object, what: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ConfigurationError(
            f"{what}={key_id!r} is not a key id: use 1 to 64 letters, digits or . _ : @ + - "
            "(e.g. '2026-12'); it is recorded in .metadata beside every item."
        )
    return key_id


def key_check(key: bytes) -> bytes:
    """8 bytes that tell a wrong key from a damaged file (an HMAC of a constant, not the key)."""
    return hmac.new(key, _KEY_CHECK_LABEL, hashlib.sha256).digest()[:8]


@dataclass(frozen=True, repr=False, eq=False)
class Encryption:
    """Client-side authenticated encryption of checkpoints (AES-256-GCM).

    Pass it as ``VolumeWriter(url, encryption=enc)``, ``VolumeReader(url,
    encryption=enc)`` or ``CheckpointManager(root, encryption=enc)``. Every
    stored item is encrypted in frames; ``.metadata`` records the key id,
    never the key.

    Args:
        key: the current 32-byte key: new checkpoints are written with it.
        key_id: its name, recorded with every item (1-64 of ``A-Za-z0-9._:@+-``).
        previous: older keys by id, for reading checkpoints written before a
            rotation (``{"2026-11": old_key}``).
    """

    key: bytes = field(compare=False)
    key_id: str = DEFAULT_KEY_ID
    previous: Mapping[str, bytes] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _check_key(self.key, "Encryption(key=...)"))
        _check_key_id(self.key_id, "key_id")
        if not isinstance(self.previous, Mapping):
            raise ConfigurationError(
                "previous= must map key ids to 32-byte keys, e.g. {'2026-11': old_key}."
            )
        older: dict[str, bytes] = {}
        for kid, key in self.previous.items():
            _check_key_id(kid, "a key id in previous")
            if kid == self.key_id:
                raise ConfigurationError(
                    f"previous= names key id {kid!r}, the current key's id: each key id "
                    "names one key. Give the new key a new id."
                )
            older[kid] = _check_key(key, f"previous[{kid!r}]")
        object.__setattr__(self, "previous", older)
        require_cipher()

    def __repr__(self) -> str:
        return f"Encryption(key_id={self.key_id!r}, previous={sorted(self.previous)!r})"

    @classmethod
    def from_env(cls) -> Encryption:
        """The key in ``DCP_VOLUMES_ENCRYPTION_KEY`` (base64 of 32 bytes) with the id in
        ``DCP_VOLUMES_ENCRYPTION_KEY_ID`` (default ``"default"``)."""
        found = _env.encryption_key()
        if found is None:
            raise ConfigurationError(
                f"Encryption.from_env() found no key: {_env.ENCRYPTION_KEY} is not set. Fix: "
                f"export {_env.ENCRYPTION_KEY}=$(head -c 32 /dev/urandom | base64) (keep it "
                f"in your secret store) and {_env.ENCRYPTION_KEY_ID}=<its id>."
            )
        text, key_id = found
        return cls(key=decode_key(text, _env.ENCRYPTION_KEY), key_id=key_id or DEFAULT_KEY_ID)

    @property
    def key_ids(self) -> list[str]:
        """The ids of every key held: the current one first."""
        return [self.key_id, *self.previous]

    def key_for(self, key_id: str) -> bytes | None:
        """The key named ``key_id``, or ``None`` when this object does not hold it."""
        if key_id == self.key_id:
            return self.key
        return self.previous.get(key_id)

    def extension_registry(self) -> Any:
        """A torch ``ExtensionRegistry`` that decrypts with these keys (and decompresses
        zstd): pass it to a stock ``FileSystemReader(path, _extension_registry=...)``."""
        from dcp_volumes.checkpoint._encryption_stream import registry_for

        return registry_for(self)


def decode_key(text: str, source: str) -> bytes:
    """The 32-byte key written as base64 in ``text`` (``source`` names where it came from)."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(
            f"{source} is not base64 text: write the 32-byte key as base64 "
            "(head -c 32 /dev/urandom | base64)."
        ) from None
    if len(key) != KEY_BYTES:
        raise ConfigurationError(
            f"{source} decodes to {len(key)} bytes; an AES-256 key is {KEY_BYTES} bytes "
            "(head -c 32 /dev/urandom | base64)."
        )
    return key


def require_cipher() -> Any:
    """``cryptography``'s ``AESGCM`` class, or a message saying how to install it."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - the encryption extra is not installed
        raise BackendNotInstalledError(
            "Encryption needs the cryptography library, which is not installed. Fix: "
            "pip install 'dcp_volumes[encryption]'."
        ) from None
    return AESGCM

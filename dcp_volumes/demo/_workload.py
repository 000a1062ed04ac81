"""The demo's training job: synthetic images, their augmentation, the model.

Samples are Tiny-ImageNet-sized records, one file each: a label byte
followed by a 3x64x64 uint8 image (12,289 bytes). The image is a
class-dependent pattern plus noise, so the loss falls and a wrong resume
shows up in the weights. Both setups (the library's and the naive one) train
exactly this.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch

CLASSES = 10
SIDE = 64
RECORD_BYTES = 1 + 3 * SIDE * SIDE


def sample_name(i: int) -> str:
    """File name of sample ``i``."""
    return f"sample-{i:05d}.bin"


def make_samples(count: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` records as ``(file name, bytes)``, the same for a given seed."""
    gen = np.random.default_rng(seed)
    patterns = gen.integers(0, 256, size=(CLASSES, 3, SIDE, SIDE)).astype(np.int16)
    out = []
    for i in range(count):
        label = int(gen.integers(CLASSES))
        noise = gen.integers(-60, 61, size=(3, SIDE, SIDE))
        image = np.clip(patterns[label] + noise, 0, 255).astype(np.uint8)
        out.append((sample_name(i), bytes([label]) + image.tobytes()))
    return out


def decode(data: bytes) -> tuple[torch.Tensor, int]:
    """A record's image (float, 3x32x32, in [0, 1]) and label."""
    if len(data) != RECORD_BYTES:
        raise ValueError(f"a sample has {len(data)} bytes, expected {RECORD_BYTES}")
    image = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(3, SIDE, SIDE)
    return torch.from_numpy(image.astype(np.float32) / 255.0), data[0]


def augment(image: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
    """Random crop (8-pixel padding) and horizontal flip, drawn from ``rng``."""
    padded = torch.nn.functional.pad(image, (8, 8, 8, 8), mode="reflect")
    dx, dy, flip = torch.randint(0, 17, (3,), generator=rng).tolist()
    out = padded[:, dy : dy + SIDE, dx : dx + SIDE]
    return out.flip(2) if flip % 2 else out


def load_sample(local_path: str, rng: torch.Generator) -> tuple[torch.Tensor, int, str]:
    """VolumeDataset transform: the augmented image, its label and its file name."""
    with open(local_path, "rb") as f:
        image, label = decode(f.read())
    return augment(image, rng), label, os.path.basename(local_path)


def build_model(hidden: int) -> torch.nn.Module:
    """A small CNN (three conv blocks, then an MLP head of width ``hidden``)."""

    def block(cin: int, cout: int) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]

    return torch.nn.Sequential(
        *block(3, 64), *block(64, 128), *block(128, 256),  # 64x64 -> 8x8
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
        torch.nn.Linear(256 * 4 * 4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, CLASSES),
    )


def state_bytes(hidden: int) -> int:
    """Bytes of model + Adam state (parameters, two moments) for ``hidden``."""
    params = sum(p.numel() for p in build_model(hidden).parameters())
    return 3 * 4 * params


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer, by name: equal iff bit-identical."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def capture_rngs() -> dict[str, Any]:
    """This process's torch, numpy and ``random`` states (picklable)."""
    import random

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }


def restore_rngs(states: dict[str, Any]) -> None:
    """Put back what ``capture_rngs`` returned."""
    import random

    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["random"])

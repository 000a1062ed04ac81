"""Reproducible augmentation: each sample's transform runs under its own seed.

The seed comes from ``(seed, epoch, global stream position)``, so a sample is
augmented the same way whichever rank or worker reads it, and again after a
resume. The transform gets it two ways:

* explicitly: a transform with a parameter named ``rng`` (or a second
  positional parameter without a default) receives a ``torch.Generator``
  seeded for the sample;
* implicitly: the global torch (CPU), numpy and ``random`` generators are
  seeded for the call and restored afterwards, so transforms that draw from
  them (torchvision, albumentations...) are reproducible too, and the
  caller's own random streams are left as they were (this matters with
  ``num_workers=0``, where transforms run in the training process). Inside a
  DataLoader worker nothing else draws from them between samples, so they are
  only seeded there: saving and restoring numpy's state alone costs more than
  reading a 100 KiB file.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

_MASK63 = (1 << 63) - 1
# The CPU generator only: torch.manual_seed would also reseed CUDA generators.
_seed_torch_cpu = torch.default_generator.manual_seed


def _rng_mode(fn: Callable[..., Any]) -> str:
    """'kw' (pass rng=), 'pos' (pass it second) or '' (do not pass it)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return ""
    if any(p.name == "rng" and p.kind is not p.POSITIONAL_ONLY for p in params):
        return "kw"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 and positional[1].default is inspect.Parameter.empty:
        return "pos"
    return ""


class SampleTransform:
    """Calls ``fn(local_path[, rng])`` with per-sample seeding; ``fn=None`` returns the path."""

    def __init__(self, fn: Callable[..., Any] | None, *, seed_rngs: bool = True) -> None:
        self.fn = fn
        self.seed_rngs = seed_rngs
        self.mode = _rng_mode(fn) if fn is not None else ""

    @property
    def uses_seed(self) -> bool:
        """Whether calls need the sample's seed (else any int will do)."""
        return self.fn is not None and (bool(self.mode) or self.seed_rngs)

    def __call__(self, path: str, seed: int) -> Any:
        fn = self.fn
        if fn is None:
            return path
        if not self.mode and not self.seed_rngs:
            return fn(path)
        gen = None
        if self.mode:
            gen = torch.Generator()
            gen.manual_seed(seed & _MASK63)
        if not self.seed_rngs:
            return self._call(fn, path, gen)
        if get_worker_info() is not None:
            # A worker process: no caller's streams to protect (see the module doc).
            _seed_global(seed)
            return self._call(fn, path, gen)
        torch_state = torch.get_rng_state()
        np_state = np.random.get_state()
        py_state = random.getstate()
        try:
            _seed_global(seed)
            return self._call(fn, path, gen)
        finally:
            torch.set_rng_state(torch_state)
            np.random.set_state(np_state)
            random.setstate(py_state)

    def _call(self, fn: Callable[..., Any], path: str, gen: torch.Generator | None) -> Any:
        if self.mode == "kw":
            return fn(path, rng=gen)
        if self.mode == "pos":
            return fn(path, gen)
        return fn(path)


def _seed_global(seed: int) -> None:
    """Seed the global torch (CPU), numpy and ``random`` generators for one sample."""
    _seed_torch_cpu(seed & _MASK63)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)

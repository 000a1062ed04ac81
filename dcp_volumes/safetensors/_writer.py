"""``SafetensorsWriter``: ``dcp.save`` from N ranks straight into the Hugging Face layout.

The ranks save as ``VolumeWriter`` does (each its own shards, staged and uploaded
in parallel) into a hidden DCP checkpoint beside the model (``.dcp-parts/``);
the coordinator, at ``finish``, commits it and then runs ``export_safetensors``
on it: whole tensors, each output file written once, by one process, the index
last (create-only), and removes the parts. One owner of how shards become
whole tensors (the export); the price is the parts' bytes going up and down
once more (see benchmarks/README.md, "Hugging Face export").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes._exceptions import CheckpointExistsError
from dcp_volumes._sizes import parse_size
from dcp_volumes._volume import RetryPolicy, Volume, redact_url
from dcp_volumes.checkpoint._writer import VolumeWriter
from dcp_volumes.safetensors._export import DEFAULT_MAX_SHARD_SIZE, export_safetensors, parse_dtype
from dcp_volumes.safetensors._index import INDEX_NAME

logger = logging.getLogger("dcp_volumes.safetensors")

#: The hidden DCP checkpoint of a save in flight, inside the model's directory.
PARTS_DIR = ".dcp-parts"


def _parts_url(url: str | os.PathLike[str]) -> str:
    return os.fspath(url).rstrip("/") + "/" + PARTS_DIR


class SafetensorsWriter(VolumeWriter):
    """DCP storage writer that saves a model's state dict as Hugging Face safetensors.

    Pass it to ``dcp.save`` (or ``dcp.async_save``) on every rank, with the
    model's state dict (plain tensors, DTensor/FSDP2 shards, ShardedTensor):
    the output is ``model-0000i-of-0000N.safetensors`` files of whole tensors and
    ``model.safetensors.index.json`` as ``save_pretrained`` writes them.
    Non-tensor items are not saved.

    DCP calls (see ``VolumeWriter`` for each step): all ranks stage and upload
    their shards to ``<url>/.dcp-parts``; the coordinator's ``finish`` commits
    those, exports them to ``url`` (index last) and deletes them.

    Args:
        url: the model's directory (any volume URL or path).
        storage_options: client options (``None``: ``DCP_VOLUMES_STORAGE_OPTIONS``).
        max_shard_size: the largest output file (bytes or e.g. ``"5GB"``).
        dtype: cast floating tensors to it (e.g. ``torch.bfloat16``); ``None`` keeps theirs.
        overwrite: replace a complete model at ``url`` (otherwise refused before
            anything is written).
        staging_dir: local directory for staged files.
        retry: retry policy for transient volume errors.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
        staging_dir: str | os.PathLike[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        parse_size(max_shard_size, what="max_shard_size")
        self.dtype = parse_dtype(dtype)
        self.max_shard_size = max_shard_size
        self.model_url = os.fspath(url)
        self._overwrite_model = overwrite
        self._model_options = dict(storage_options) if storage_options is not None else None
        # The parts are this writer's own: a crashed save's parts are replaced.
        super().__init__(_parts_url(url), storage_options=storage_options, overwrite=True,
                         staging_dir=staging_dir, retry=retry)

    def __repr__(self) -> str:
        return f"SafetensorsWriter({redact_url(self.model_url)!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` (a URL or path) replaces the model's directory."""
        if checkpoint_id is not None:
            self.model_url = os.fspath(checkpoint_id)
            checkpoint_id = _parts_url(checkpoint_id)
        super().reset(checkpoint_id)

    def _model(self) -> Volume:
        return Volume(self.model_url, storage_options=self._model_options, retry=self.volume.retry)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Refuse to replace a complete model unless ``overwrite`` before any byte is
        written, then plan the parts as ``VolumeWriter`` does (coordinator)."""
        model = self._model()
        if not self._overwrite_model and model.exists(INDEX_NAME):
            raise CheckpointExistsError(
                f"{redact_url(model.url_of(INDEX_NAME))} exists: {model.display_url} holds a "
                "complete model. Fix: save elsewhere, or pass overwrite=True to replace it."
            )
        return super().prepare_global_plan(plans)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the parts, export them to the model's directory, delete them (coordinator)."""
        super().finish(metadata, results)
        model = self._model()
        export_safetensors(
            self.volume.url, self.model_url, prefix="", dtype=self.dtype,
            max_shard_size=self.max_shard_size, storage_options=self._model_options,
            overwrite=self._overwrite_model, staging_dir=self.options.staging_dir,
        )
        self.volume.delete_prefix("")
        logger.info("saved the model as safetensors at %s", model.display_url)

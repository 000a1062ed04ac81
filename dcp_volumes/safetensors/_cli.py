"""``dcp-volumes export SRC DEST``: the body of the CLI's subcommand (cli.py registers it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from dcp_volumes._sizes import format_size


def configure(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (``--storage-options``, ``--json`` are the CLI's own)."""
    p.add_argument("src", help="a committed checkpoint (ROOT/step-00005000, ours or stock DCP)")
    p.add_argument("dest", help="the model's directory (s3://b/run1/hf-5000, /mnt/models/x)")
    p.add_argument("--prefix", default="model.",
                   help="export the tensors whose names start with it, without it "
                        "(default: %(default)s; '' for every tensor)")
    p.add_argument("--dtype", default="bfloat16",
                   help="cast floating tensors to it: bfloat16, float16, float32, or 'keep' "
                        "(default: %(default)s)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest output file (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a complete export at DEST (refused otherwise)")
    p.add_argument("--keep-tied", action="store_true",
                   help="write lm_head.weight even when it is identical to the input "
                        "embedding (by default it is left out, as save_pretrained does "
                        "for tie_word_embeddings=True)")
    p.add_argument("--staging-dir", default=None, metavar="DIR",
                   help="local directory for output files on their way out "
                        "(default: $DCP_VOLUMES_STAGING or a temp dir)")


def run(args: argparse.Namespace, storage_options: dict[str, Any],
        bar: Callable[..., Any]) -> dict[str, Any]:
    """Export ``args.src`` to ``args.dest`` with a progress bar; returns the JSON document."""
    from dcp_volumes.safetensors._export import export_safetensors

    with bar(total=0, desc="export") as progress:
        def update(written: int, total: int) -> None:
            if progress.total != total:
                progress.total = total
                progress.refresh()
            progress.update(written)

        result = export_safetensors(
            args.src, args.dest, prefix=args.prefix, dtype=args.dtype,
            max_shard_size=args.max_shard_size, storage_options=storage_options,
            overwrite=args.overwrite, staging_dir=args.staging_dir, progress=update,
            drop_tied=not args.keep_tied,
        )
    return {
        "src": args.src, "dest": args.dest, "index": result.index_url,
        "total_size": result.total_size, "files": result.files,
        "summary": f"{sum(len(t) for t in result.files.values())} tensors, "
                   f"{format_size(result.total_size)} in {len(result.files)} file(s)",
    }

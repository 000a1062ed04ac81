"""Goodput of the user's own job: the manager and the loader record where the time went,
per attempt and rank, under ``ROOT/goodput/``; ``goodput_report`` (and ``dcp-volumes
goodput ROOT``) says how much of the wall time was useful compute.

Torch-free: the CLI and the report import it without torch.
"""

from dcp_volumes.goodput._model import GoodputModel
from dcp_volumes.goodput._records import GOODPUT_DIR, RankRecord
from dcp_volumes.goodput._report import (
    AttemptReport,
    Breakdown,
    GoodputReport,
    SaveInterval,
    goodput_report,
)

__all__ = ["GOODPUT_DIR", "AttemptReport", "Breakdown", "GoodputModel", "GoodputReport",
           "RankRecord", "SaveInterval", "goodput_report"]

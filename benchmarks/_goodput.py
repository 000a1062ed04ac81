"""The goodput model, from the library (``dcp_volumes.goodput._model``): one definition for
the benchmarks, the demo and ``dcp-volumes goodput``."""

from dcp_volumes.goodput._model import (
    DEFAULT_FAILURES_PER_DAY,
    DEFAULT_RESTART_S,
    SECONDS_PER_DAY,
    GoodputModel,
)

__all__ = ["DEFAULT_FAILURES_PER_DAY", "DEFAULT_RESTART_S", "SECONDS_PER_DAY", "GoodputModel"]

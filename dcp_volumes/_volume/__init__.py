"""The volume layer: ``Volume`` and the backends behind it (local, obstore, fsspec).

``checkpoint/`` and ``data/`` import from here only; which backend serves a
URL, and how each one talks to its store, stays inside this package.
"""

from dcp_volumes._volume._backend import Capabilities, FileInfo
from dcp_volumes._volume._client_watchdog import STUCK_EXIT_CODE, stop_when_stuck
from dcp_volumes._volume._lag import LAG_DELAYS_S, LAG_TOTAL_S, despite_lag, until_shown
from dcp_volumes._volume._local import WRITE_PIECE, pieces, write_all
from dcp_volumes._volume._memory import MEMORY_PROTOCOL, MemoryStore
from dcp_volumes._volume._obstore import used_here as obstore_used_here
from dcp_volumes._volume._retry import RetryPolicy
from dcp_volumes._volume._secrets import redact_options
from dcp_volumes._volume._select import LOCAL_PROTOCOLS, choose_fsspec_after_fork
from dcp_volumes._volume._urls import common_root, file_location, redact_url, split_url
from dcp_volumes._volume._volume import Volume, refuse_url_credentials

__all__ = [
    "LAG_DELAYS_S",
    "LAG_TOTAL_S",
    "LOCAL_PROTOCOLS",
    "MEMORY_PROTOCOL",
    "STUCK_EXIT_CODE",
    "WRITE_PIECE",
    "Capabilities",
    "FileInfo",
    "MemoryStore",
    "RetryPolicy",
    "Volume",
    "choose_fsspec_after_fork",
    "common_root",
    "despite_lag",
    "file_location",
    "obstore_used_here",
    "pieces",
    "redact_options",
    "redact_url",
    "refuse_url_credentials",
    "split_url",
    "stop_when_stuck",
    "until_shown",
    "write_all",
]

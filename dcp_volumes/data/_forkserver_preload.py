"""Preloaded by the DataLoader's forkserver (and imported nowhere else).

Starts torch_shm_manager in the server process, so the workers it forks
share that one instead of each starting its own (a libtorch process per
worker; see ``_batch_sharing``).
"""

from dcp_volumes.data import _batch_sharing

_batch_sharing.start_manager_here()

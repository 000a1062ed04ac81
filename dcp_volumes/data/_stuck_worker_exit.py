"""A DataLoader worker stuck creating its object-store client exits instead of hanging.

The volume layer's watchdog (``_volume/_client_watchdog.py``) finds a client
creation that will never end (a lock inherited at fork), logs it, and ends the
process where the layer above names it. This module names DataLoader workers:
one that exits fails the training loop at once ("worker exited unexpectedly",
exit status ``STUCK_EXIT_CODE``) and a restart can resume, where waiting would
hang the job. It registers when the data package is imported, so every
worker has it, forked or started fresh (the dataset it unpickles imports it).
"""

from __future__ import annotations

from torch.utils.data import get_worker_info

from dcp_volumes._volume import stop_when_stuck


def _dataloader_worker() -> str | None:
    """What this process is, where the watchdog should end it: a DataLoader worker."""
    return "DataLoader worker" if get_worker_info() is not None else None


stop_when_stuck(_dataloader_worker)

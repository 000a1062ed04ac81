"""Preloaded by the DataLoader's forkserver (and imported nowhere else).

Leaves the training process's group (``_worker_exit``: a SIGTERM for the
training process is not the server's, nor its workers', which it forks into
its own group), then starts torch_shm_manager in the server process, so the
workers it forks share that one instead of each starting its own (a libtorch
process per worker; see ``_batch_sharing``). The server exits when its
training process is gone, on the CPUs the next attempt starts on: without the
interpreter's last full collection (``_prompt_exit``).
"""

from dcp_volumes._prompt_exit import skip_final_collection
from dcp_volumes.data import _batch_sharing
from dcp_volumes.data._worker_exit import leave_training_group

leave_training_group()
_batch_sharing.start_manager_here()
skip_final_collection()

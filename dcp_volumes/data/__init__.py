"""The training-input side: a node-local file cache, a resumable dataset and a stateful loader.

``FileCache`` keeps local copies of remote files (read-through, atomic fills,
one download per file across processes, bounded size with Belady eviction);
``VolumeDataset`` lists a volume once and streams its files in a deterministic
global order split over ranks and workers; ``DataLoader`` delivers batches,
records exactly what it delivered (a global, world-size independent state)
and reports how long the training loop waited for input.
"""

# Imported for its registration: DataLoader workers stuck creating a client exit.
from dcp_volumes.data import _stuck_worker_exit as _stuck_worker_exit

"""A training process whose process group gets SIGTERM while its DataLoader workers run.

``python -m tests.scripts.signalled_loader SRC CACHE CONTEXT``: like a torchrun
rank (its own session; the agent ``killpg``s it), it handles SIGTERM itself,
prints "ready" after the first batch, and after the signal reads on to the
end of the epoch, then prints "delivered N" and exits 0. Workers that died of
the group's signal would end the epoch early with an error instead.
"""

from __future__ import annotations

import signal
import sys
import time


def main(src: str, cache: str, context: str) -> None:
    from dcp_volumes import DataLoader, VolumeDataset
    from tests.test_data_support import read_id

    noticed: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: noticed.append(signum))
    dataset = VolumeDataset(src, cache_dir=cache, transform=read_id, shuffle=False)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context=context,
                        timeout=60)
    delivered = 0
    for batch in loader:
        delivered += len(batch)
        if delivered == 2:
            print("ready", flush=True)
            deadline = time.monotonic() + 30
            while not noticed and time.monotonic() < deadline:
                time.sleep(0.01)
            print(f"noticed {len(noticed)}", flush=True)
    print(f"delivered {delivered}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""The obstore stores one backend holds: made on first use, reused, at most a few.

Each store is a client with its own connection pool, and its timeouts are
fixed when it is made (reqwest), so the stall detector asks for one per bucket
and request class (``_stall.py``): reads at the current deadline, uploads per
size class at theirs, the server's work. Deadlines change as the detector
learns, and one backend may serve any number of buckets, so the stores are
kept in a small LRU rather than one per class ever asked for: those in use
stay and are reused; one not asked for while ``bound`` others were is dropped
(a request still running on it holds it until it ends).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

# Room for a busy bucket's classes (reads, server work, the upload sizes up to a
# part) at two deadlines at once, or for two such buckets.
MAX_STORES = 16


class Stores:
    """At most ``bound`` stores by key, the least recently used dropped first."""

    def __init__(self, bound: int = MAX_STORES) -> None:
        self.bound = bound
        # An OrderedDict, not functools.lru_cache: a miss makes the store under the
        # lock, so threads that start together share one client instead of each
        # making its own.
        self._stores: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The store for ``key``: the one held, else ``make()``'s, held from now on."""
        with self._lock:
            store = self._stores.get(key)
            if store is not None:
                self._stores.move_to_end(key)
                return store
            store = self._stores[key] = make()
            if len(self._stores) > self.bound:
                self._stores.popitem(last=False)
            return store

    def __len__(self) -> int:
        return len(self._stores)

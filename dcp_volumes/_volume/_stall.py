"""Stalled requests: found in seconds, without cutting a transfer that still moves.

A request that the server (or a proxy on the way) takes and never answers,
or whose response stops part-way while the connection stays open, used to
cost the client's whole request timeout (30 s) and then a retry. A job on a
thousand ranks makes ~10,000 requests per save and waits for the slowest, so
one such stall anywhere stalled everyone for half a minute.

Design (obstore; its client is reqwest):

- **Reads** (GET, HEAD) get an idle timeout: reqwest's ``read_timeout``,
  which waits ``stall_s`` for the response headers and then ``stall_s`` for
  each next piece of the body, restarting on every piece. A GET sends no
  body, so the first wait is the server's first-byte time alone; a slow
  download that moves is never cut, however long it takes, and a stall costs
  ``stall_s`` plus one retry.
- **Uploads** cannot use the idle timeout alone: reqwest's read timer runs
  from the request's start, while the body is still being sent
  (reqwest#2784), so a body that takes longer than ``stall_s`` to send would
  be cut. An upload's deadline is therefore ``stall_s`` plus its size over a
  floor throughput (``min_rate``, per stream). Requests are bounded in size
  (multipart parts of ``part_size``, single PUTs up to ``part_size``, small
  control files), and sizes are rounded up to a power of two, so a few
  request classes cover them, each with its own store (reqwest fixes its
  timeouts per client; the stores are reused and bounded,
  ``_obstore_stores.py``).
- **Work the server does before it answers**, in proportion to what was
  asked (a listing page, a server-side copy, a batch delete), keeps the
  request timeout alone: such requests are few (one listing per commit or
  restore), and an idle timeout would cut a slow store's honest answer.
- **A slow store or link is learnt, not cut forever**: a request that timed
  out doubles every later request's time in this process (up to 2**6
  times): what its peers get is the best guide to what the next one gets.
  Once per wave: requests sent under the time that is already doubled do
  not double it again (hundreds in flight time out together on an
  overloaded store). When no request timed out for ``_SETTLE_S``, the time
  halves again, so random stalls do not ratchet it up for good. A stall
  costs one deadline; a store slower than the guess costs a cut or two,
  after which everyone waits longer.
- **No retry storm**: the retried request is the client's own retry
  (``retry_config``: exponential backoff with full jitter) beneath the
  volume's bounded retries (``RetryPolicy.attempts``, the same backoff). The
  stores of reads and uploads retry once inside the client (a 503 on one
  part does not restart the file), so a request that keeps timing out soon
  comes back to the volume's loop, whose next try gets the learnt, longer
  time. Nothing is sent twice at once.

Hedged reads (a second GET after a deadline, the first answer wins) were the
alternative for reads: they cost a second request on every slow read, run
beside a stalled one rather than after it (more load on a store that is
already slow, which is when stalls happen), and need the async API for each
ranged read. The idle timeout gives a read the same bound with one request.

fsspec backends take their own options and keep them (nothing here changes
them): s3fs ``config_kwargs={"read_timeout": s, "connect_timeout": s}``
(botocore's names; aiohttp's ``sock_read`` beneath, a wait for each next piece
of the response, which detects a stalled read; keep it above the slowest
part's sending time, as aiohttp may start it with the request); gcsfs only
``requests_timeout``, a whole-request timeout that must allow for the slowest
transfer. Neither learns a slow link; the volume's retries apply to both.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

# Uploads below this size get this size's deadline (a few classes for small files).
_SMALLEST_CLASS = 2**20
# How far the deadlines may grow after timeouts (2**6 = 64 times the first).
_MAX_LEVEL = 6
# Seconds without a timeout after which a grown deadline halves again.
_SETTLE_S = 30.0


@dataclass
class StallGuard:
    """The deadlines of one backend's requests (see the module docstring).

    Attributes:
        stall_s: seconds without a byte after which a read is stalled; also the
            wait for an upload's answer beyond its sending time.
        min_rate: bytes per second per stream an upload is given at least.
    """

    stall_s: float
    min_rate: float
    _level: int = 0
    _changed: float = 0.0  # time.monotonic() of the last change of the level
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read_timeout_s(self) -> float:
        """Seconds a read waits for each next piece of its answer."""
        return float(self.stall_s * 2**self._level)

    def upload_deadline_s(self, nbytes: int) -> float:
        """Seconds an upload request of ``nbytes`` may take before it counts as stalled.

        Sizes round up to a power of two, so the answer is one of a few values.
        """
        size = max(_SMALLEST_CLASS, 1 << max(0, math.ceil(math.log2(max(1, nbytes)))))
        return float(self.stall_s + size / self.min_rate * (2**self._level))

    def saw_timeout(self, level: int) -> None:
        """A request sent at ``level`` (``level`` then) timed out: unless the time
        was doubled since it was sent, give every later request twice the time."""
        with self._lock:
            if level == self._level < _MAX_LEVEL:
                self._level += 1
                self._changed = time.monotonic()

    def saw_success(self) -> None:
        """A request succeeded: with no timeout for ``_SETTLE_S``, a grown time halves."""
        if not self._level or time.monotonic() - self._changed < _SETTLE_S:
            return
        with self._lock:
            if self._level and time.monotonic() - self._changed >= _SETTLE_S:
                self._level -= 1
                self._changed = time.monotonic()

    @property
    def level(self) -> int:
        """How often the time was doubled (net): 0 at first."""
        return self._level

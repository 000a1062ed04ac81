"""Retries of volume calls: the policy and the one loop every backend call runs in.

Transient failures (throttling, 5xx, resets, timeouts) are retried with
exponential backoff and full jitter; everything else, and the last transient
failure, becomes a ``dcp_volumes`` exception (``_errors.translate_error``).
Whether a failure is transient is read only from the neutral kind the backend
raised (``_errors.py``: each backend maps its own client's exceptions there),
never from a client's types, codes or message text; messages never carry
credentials (``_secrets.py``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume._errors import client_detail, from_builtin, translate_error

logger = logging.getLogger("dcp_volumes._volume")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient errors.

    Attributes:
        attempts: tries per request, the first included.
        base_delay_s, max_delay_s: exponential backoff between tries (full jitter).
        timeout_s: a request with no complete answer after this long (a hung
            server, a stalled proxy) is abandoned and tried again. Applies to
            S3 and Azure (obstore's client; ``storage_options={"timeout": ...}``
            overrides it); ``None``: the client's default (30 s). fsspec clients
            take their own timeout options in ``storage_options``.
        stall_s: a request that receives nothing for this long is stalled, and
            abandoned and tried again (S3 and Azure): a read waits this long for
            each next piece of its answer, so a slow read that moves is never
            cut; an upload waits this long beyond its sending time at
            ``min_rate`` (``_stall.py``). ``None``: only ``timeout_s`` applies.
        min_rate: bytes per second per stream an upload is given before it
            counts as stalled; a timed-out upload doubles the time given to later
            ones (a slow link is learnt, not cut forever).
    """

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 8.0
    timeout_s: float | None = None
    stall_s: float | None = 3.0
    min_rate: float = 16 * 2**20

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigurationError(f"RetryPolicy.attempts={self.attempts} must be >= 1.")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ConfigurationError("RetryPolicy delays must be >= 0 seconds.")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigurationError(
                f"RetryPolicy.timeout_s={self.timeout_s} must be > 0 seconds (or None for the "
                "client's default)."
            )
        if self.stall_s is not None and not self.stall_s > 0:
            raise ConfigurationError(
                f"RetryPolicy.stall_s={self.stall_s} must be > 0 seconds (or None to detect "
                "stalls by timeout_s alone)."
            )
        if not self.min_rate > 0:
            raise ConfigurationError(
                f"RetryPolicy.min_rate={self.min_rate} must be > 0 bytes per second."
            )

    def delay(self, attempt: int) -> float:
        """Backoff before retry number ``attempt`` (1-based): exponential, full jitter."""
        cap = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return random.uniform(0.0, cap)

def _is_transient(exc: BaseException) -> bool:
    """Whether retrying the request that failed with ``exc`` may succeed."""
    kind = from_builtin(exc)
    return kind is not None and kind.transient


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    op: str,
    where: Callable[[], str],
    scrub: Callable[[str], str],
    create_only: bool = False,
    encryption: str | None = None,
) -> T:
    """Run ``fn``; retry transient errors per ``policy``; translate the final failure
    (``create_only``, ``encryption``: see ``translate_error``)."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt < policy.attempts and _is_transient(exc):
                delay = policy.delay(attempt)
                logger.warning(
                    "transient error on %s %s (attempt %d/%d, retrying in %.2fs): %s",
                    op,
                    where(),
                    attempt,
                    policy.attempts,
                    delay,
                    client_detail(exc, scrub),
                )
                time.sleep(delay)
                continue
            raise translate_error(exc, op, where(), scrub, create_only=create_only,
                                  encryption=encryption) from exc
    raise AssertionError("unreachable")  # pragma: no cover

"""Stores whose answers lag their writes: ask again for a moment before calling a file missing.

Some S3-compatible servers, caching gateways and NFS attribute caches list (or
even find) an object only a moment after it was written. Whoever expects a file
(a manifest names it, a listing showed it, a commit marker should follow its
manifest) asks again over ``LAG_DELAYS_S`` before concluding; these two
functions are the one way the package does that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from dcp_volumes._exceptions import BucketNotFoundError, VolumeNotFoundError

T = TypeVar("T")

logger = logging.getLogger(__name__)

# The waits between asking again: a file missing from a listing, or not found
# although a manifest or listing says it exists, is looked for again after each
# before it is called missing (about 4 s in all).
LAG_DELAYS_S = (0.25, 0.5, 1.0, 2.0)
LAG_TOTAL_S = sum(LAG_DELAYS_S)


def until_shown(attempt: Callable[[], T], shown: Callable[[T], bool], *, what: str) -> T:
    """``attempt()``, called again over the lag window while ``shown(result)`` is false.

    Returns the first result the store shows, else the last one (the caller
    decides what a result that never showed means). ``what`` names the wait in
    the log.
    """
    result = attempt()
    for delay in LAG_DELAYS_S:
        if shown(result):
            break
        logger.info("%s not shown yet; asking again in %.2fs", what, delay)
        time.sleep(delay)
        result = attempt()
    return result


def despite_lag(call: Callable[[], T], *, what: str, expected: bool = True) -> T:
    """``call()``, asked again over the lag window while it raises ``VolumeNotFoundError``.

    Only for a file that should exist (``expected``; otherwise the first "not
    found" is the answer). A missing bucket is never a lag. The last
    ``VolumeNotFoundError`` is raised when the window passes.
    """
    delays = list(LAG_DELAYS_S) if expected else []
    while True:
        try:
            return call()
        except BucketNotFoundError:
            raise
        except VolumeNotFoundError:
            if not delays:
                raise
            delay = delays.pop(0)
            logger.info("%s not found; asking again in %.2fs", what, delay)
            time.sleep(delay)

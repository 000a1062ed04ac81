"""What a job that torchrun restarts needs and torch does not do: a rendezvous store
without the killed attempt's addresses.

Since torch 2.5 torchrun's agent hosts the store that every attempt's ranks use
(``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts. Each process
group publishes its ranks' addresses there under keys that repeat in every attempt
(``default_pg/0/...`` for the default group, ``default_pg/1/...`` for the next one),
and a key that is already there is read at once. So a restarted rank that connects
before its peer has published reads the killed attempt's address: gloo fails with
"connectFullMesh failed ... Connection refused", NCCL gets a stale unique id
(pytorch/pytorch#135712, #167288). The user's ``init_process_group`` meets it as
often as our groups do.

``forget_stale_addresses`` deletes those keys once every rank of this attempt is
connected, before the library makes its own groups: this attempt's new groups then
find only fresh addresses, and so does the next attempt's ``init_process_group``.
Written by hand: torch has no call that clears a group's rendezvous keys.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

logger = logging.getLogger(__name__)

# The prefix init_process_group gives every key of every group when it makes the store
# itself (the env:// rendezvous that torchrun's workers use); the agent's own keys
# (torch.rendezvous.*, torchelastic/*) lie outside it.
_GROUP_KEYS = "default_pg/"
_CONNECT_TIMEOUT = timedelta(seconds=30)


def uses_shared_store() -> bool:
    """Whether this process's ranks meet in torchrun's agent store, kept across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and bool(
        os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    )


def forget_stale_addresses() -> int:
    """Every rank (collective on the default group): delete the process groups' address
    keys from torchrun's shared store; how many rank 0 deleted (other ranks return 0).

    A barrier before (every rank has finished connecting the groups it has) and after
    (no rank publishes a new group's address while rank 0 deletes). Nothing to do
    outside torchrun's shared store. Never fails the caller: a store that cannot be
    reached or listed leaves the keys, as torch would.
    """
    import torch.distributed as dist

    if not uses_shared_store() or not (dist.is_available() and dist.is_initialized()):
        return 0
    dist.barrier()
    deleted = 0
    if dist.get_rank() == 0:
        try:
            deleted = _delete_group_keys()
        except Exception as exc:  # best effort: what torch would leave, left
            logger.debug("could not clear torchrun's store of group addresses: %s", exc)
    dist.barrier()
    return deleted


def _delete_group_keys() -> int:
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, re-exported untyped
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=_CONNECT_TIMEOUT,
    )
    if not hasattr(store, "list_keys"):  # torch < 2.7 cannot list a store
        return 0
    keys = [key for key in store.list_keys() if key.startswith(_GROUP_KEYS)]
    for key in keys:
        store.delete_key(key)
    logger.debug("deleted %d process-group address keys from torchrun's store", len(keys))
    return len(keys)

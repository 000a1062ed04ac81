"""CPU staging for ``dcp.async_save``: copy the state dict into buffers training cannot touch.

Uses the helpers behind DCP's own ``BlockingAsyncStager`` (pinned CPU copies
when CUDA is present, in-place refresh of cached buffers). The buffers are
allocated on the first save and reused while the state dict keeps its
structure, shapes and dtypes, so steady-state staging is one copy into
preallocated memory. Once a save has serialised them, the buffers go back to
a process-wide pool, so a new writer per save (how most training code calls
DCP) also stages into warm memory instead of allocating and faulting in a
fresh copy of the state every time.

A model's state is hundreds to thousands of tensors, most of them a few KiB:
those are staged as views into one buffer (``SmallTensors``), one allocation
(one pinned, shared region with CUDA) and one copy call for all of them.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor

from dcp_volumes._torch.checkpoint import copy_state_dict, copy_tensors, create_cpu_state_dict

# A state dict as DCP's stagers take and return it (DCP's STATE_DICT_TYPE, parametrised).
StateDict = dict[str, Any]

# Tensors up to this size share one staging buffer; larger ones get their own.
_SMALL_TENSOR_BYTES = 1 << 20
# Each view in the shared buffer starts on this boundary (any dtype's alignment).
_VIEW_ALIGN = 64

# Where a tensor lies in a state dict: the keys and list indices down to it.
Path = tuple[Any, ...]


def signature(obj: Any) -> Any:
    """Structure, shapes and dtypes of a state dict: equal signatures can share buffers."""
    if isinstance(obj, torch.Tensor):
        shards = getattr(obj, "local_shards", None)  # ShardedTensor
        extra: Any = None
        if isinstance(obj, DTensor):  # the shard this rank holds
            extra = tuple(obj.to_local().shape)
        elif callable(shards):
            extra = tuple(tuple(s.tensor.shape) for s in shards())
        return (type(obj), tuple(obj.shape), obj.dtype, extra)
    if isinstance(obj, Mapping):
        return (type(obj), tuple((k, signature(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(signature(v) for v in obj))
    return type(obj)


def _small(obj: Any) -> bool:
    """A plain CPU-able tensor small enough to share the staging buffer."""
    return (
        type(obj) is torch.Tensor
        and obj.layout == torch.strided
        and not obj.is_quantized
        and 0 < obj.numel() * obj.element_size() <= _SMALL_TENSOR_BYTES
    )


def split_small(
    state_dict: StateDict,
) -> tuple[StateDict, list[Path], list[torch.Tensor], Any]:
    """``state_dict`` without its small tensors (in dicts; in lists None stands in),
    their paths and the tensors in one order, and the state's ``signature``: one walk."""
    paths: list[Path] = []
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: Path) -> tuple[Any, Any]:
        sigs: list[Any] = []
        if type(obj) is dict:
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if _small(value):
                    paths.append((*path, key))
                    tensors.append(value)
                    sigs.append((key, (torch.Tensor, tuple(value.shape), value.dtype, None)))
                else:
                    out[key], sig = walk(value, (*path, key))
                    sigs.append((key, sig))
            return out, (dict, tuple(sigs))
        if type(obj) is list:
            items: list[Any] = []
            for i, value in enumerate(obj):
                if _small(value):
                    paths.append((*path, i))
                    tensors.append(value)
                    items.append(None)
                    sigs.append((torch.Tensor, tuple(value.shape), value.dtype, None))
                else:
                    item, sig = walk(value, (*path, i))
                    items.append(item)
                    sigs.append(sig)
            return items, (list, tuple(sigs))
        return obj, signature(obj)

    rest, sig = walk(state_dict, ())
    return rest, paths, tensors, sig


def _put(tree: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


class SmallTensors:
    """A state dict's small tensors staged as views into one buffer, copied in one call.

    One allocation instead of one per tensor: with CUDA one pinned region (shared
    too when ``share``, so the PROCESS checkpointer maps it) where registering each
    tensor would cost more than its copy.
    """

    def __init__(self, tensors: list[torch.Tensor], *, pin: bool, share: bool) -> None:
        offsets = []
        total = 0
        for t in tensors:
            offsets.append(total)
            nbytes = t.numel() * t.element_size()
            total += -(-nbytes // _VIEW_ALIGN) * _VIEW_ALIGN
        self.buffer = _buffer(total, pin=pin, share=share)
        self.views = [
            self.buffer[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for at, t in zip(offsets, tensors, strict=True)
        ]

    def copy_from(self, tensors: list[torch.Tensor], *, non_blocking: bool) -> None:
        with torch.no_grad():  # parameters copied, not recorded
            if non_blocking:  # from a device: each copy queued on the stream
                for view, t in zip(self.views, tensors, strict=True):
                    view.copy_(t, non_blocking=True)
            elif self.views:
                copy_tensors(self.views, tensors)

    def place(self, staged: StateDict, paths: list[Path]) -> None:
        """Put the views where the tensors were in ``staged`` (a copy of the state's tree;
        in a dict the small tensors' keys come after the others')."""
        for path, view in zip(paths, self.views, strict=True):
            _put(staged, path, view)


def _buffer(nbytes: int, *, pin: bool, share: bool) -> torch.Tensor:
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    if not share:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer: torch.Tensor = torch.empty(nbytes, dtype=torch.uint8)
    buffer.share_memory_()  # type: ignore[no-untyped-call]
    if nbytes:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


class _BufferPool:
    """Staging buffers that no save is using, kept for the next save of the same shapes.

    Holds the buffers of the last ``keep`` signatures (a model and, say, a
    separately saved optimizer); older ones are freed.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: OrderedDict[Any, StateDict] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, sig: Any) -> StateDict | None:
        with self._lock:
            return self._free.pop(sig, None)

    def give(self, sig: Any, buffers: StateDict) -> None:
        with self._lock:
            self._free.pop(sig, None)
            self._free[sig] = buffers
            while len(self._free) > self._keep:
                self._free.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_POOL = _BufferPool(keep=2)


def free_pooled_buffers() -> None:
    """Free the staging buffers kept for later saves (the end of a training job)."""
    _POOL.clear()


def _staging_buffers(
    rest: StateDict, small: list[torch.Tensor], *, pin: bool, share: bool
) -> StateDict:
    """Buffers for a state split by ``split_small``: its small tensors' shared buffer,
    and DCP's CPU copy of the rest."""
    return {
        "rest": create_cpu_state_dict(rest, pin_memory=pin, share_memory=share),
        "small": SmallTensors(small, pin=pin, share=share),
    }


class CpuStager:
    """Copy of a state dict to CPU, into cached buffers when ``cache`` is set.

    ``background``: ``stage`` returns a future at once and copies in a thread
    of its own (with CUDA, on a stream of its own that first waits for the
    work queued before ``stage``); the state must not change until the future
    is done. Otherwise ``stage`` returns once the copy is complete.

    Not picklable on purpose: it holds the buffers, which must stay in the
    training process.
    """

    def __init__(self, *, cache: bool, background: bool = False) -> None:
        self.cache = cache
        self.background = background
        self._buffers: StateDict | None = None
        self._signature: Any = None
        self._fallback: BlockingAsyncStager | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cuda_stream: Any = None

    def stage(self, state_dict: StateDict) -> StateDict | Future[StateDict]:
        """A copy of ``state_dict`` on CPU, or (``background``) a future of it."""
        if not self.background:
            return self._copy(state_dict)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpv-stage")
        ready = None
        if torch.cuda.is_available():
            # The copy must see the state as of this call: its stream waits for
            # what the caller's stream has queued so far, and nothing later.
            if self._cuda_stream is None:
                self._cuda_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        return self._executor.submit(self._copy_on_stream, state_dict, ready)

    def _copy_on_stream(self, state_dict: StateDict, ready: Any) -> StateDict:
        if ready is None:
            return self._copy(state_dict)
        stream = self._cuda_stream
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            staged = self._copy(state_dict, sync=stream.synchronize)
        return staged

    def _copy(
        self, state_dict: StateDict, sync: Callable[[], None] | None = None
    ) -> StateDict:
        """A copy of ``state_dict`` on CPU; returns once the copy is complete."""
        if copy_state_dict is None or create_cpu_state_dict is None:  # pragma: no cover
            if self._fallback is None:
                self._fallback = BlockingAsyncStager(cache_staged_state_dict=self.cache)
            return self._fallback.stage(state_dict)
        # With CUDA: pinned buffers for fast device-to-host copies; cached ones
        # also in shared memory so the PROCESS checkpointer can map them
        # (DefaultStager's defaults). Without CUDA, plain buffers; a PROCESS
        # save moves them to shared memory in place on its first pickle.
        pin = torch.cuda.is_available()
        rest, paths, small, sig = split_small(state_dict)
        if self.cache:
            if self._buffers is None or sig != self._signature:
                self._buffers = None  # free the old buffers before allocating new ones
                self._buffers = _POOL.take(sig) or _staging_buffers(
                    rest, small, pin=pin, share=pin
                )
                self._signature = sig
            target = self._buffers
        else:
            # One-off buffers: registering shared memory as pinned costs more than it saves.
            target = _staging_buffers(rest, small, pin=pin, share=False)
        # type_check=False: objects other than tensors are deep-copied, whatever their type.
        staged = cast(StateDict, copy_state_dict(rest, target["rest"], non_blocking=pin,
                                                 type_check=False))
        views: SmallTensors = target["small"]
        views.copy_from(small, non_blocking=pin)
        views.place(staged, paths)
        if pin:
            # Non-blocking device-to-host copies must land first.
            (sync or torch.cuda.synchronize)()
        return staged

    def release(self) -> None:
        """The staged copy is serialised: its buffers may serve the next save (any writer)."""
        if self._buffers is not None:
            _POOL.give(self._signature, self._buffers)
        self._buffers = None
        self._signature = None

    def close(self) -> None:
        """Give the buffers back to the pool (after a background copy in flight)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.release()
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None

    def __getstate__(self) -> dict[str, Any]:
        # A pickled writer (PROCESS async checkpointer) gets an empty stager.
        return {"cache": self.cache, "background": self.background}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            cache=state["cache"], background=state.get("background", False)
        )

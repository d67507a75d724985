"""Peak memory of one call, measured two ways: every storage torch allocates, and the CPU allocator's own events.

:class:`LiveStorageBytes` is a ``TorchDispatchMode``: every aten op's outputs
whose storage is not one of the op's inputs' (views and in-place results are
not allocations) are new storages; each is held by a weak reference and
counted until it is freed. The peak is the largest sum of live storages right
after an op returned. It runs on any device, the meta device too (shapes
without data: a K2-sized call costs no memory and no time), and sees only what
the dispatcher allocates (not a BLAS library's internal scratch).

:func:`allocator_peak` reads the CPU allocator itself: ``torch.profiler`` with
``profile_memory=True`` records every allocation and free of c10's CPU
allocator; the peak is the running sum of its memory timeline (allocations
alive before the call are left out). A test runs both on the same real CPU
call to show the first measures what the second does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside this mode and alive at once: ``peak`` (and ``allocations``)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.allocations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.allocations += 1
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out


def tracked_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(peak live bytes allocated inside fn, fn's result)``."""
    with LiveStorageBytes() as mode:
        result = fn()
    return mode.peak, result


def allocator_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(peak bytes the CPU allocator held for fn's allocations, fn's result)``, from the profiler's memory
    timeline (its ``CREATE`` / ``DESTROY`` events; storages alive before the call are ``PREEXISTING``)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        result = fn()
    current = peak = 0
    for _, action, _, size in sorted(prof._memory_profile().timeline, key=lambda e: e[0]):
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak, result

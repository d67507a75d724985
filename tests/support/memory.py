"""Leak checks and sizes shared by the multi-process memory tests."""

from __future__ import annotations

import gc

from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver

#: Small logical granularity: multi-process tests stay fast while every alignment rule still applies.
GRAN = 64 << 10


def leaks(driver: HostDriver, before) -> dict[str, int]:
    """What this rank still holds compared with ``before``: the driver's live objects and,
    from the OS, open memfds and memfd mappings. Empty when nothing leaked."""
    gc.collect()
    after = snapshot(driver.rank)
    out = {k: v for k, v in driver.live_objects().items() if v}
    if after.open_memfds != before.open_memfds:
        out["open_memfds"] = after.open_memfds - before.open_memfds
    if after.memfd_mappings != before.memfd_mappings:
        out["memfd_mappings"] = after.memfd_mappings - before.memfd_mappings
    return out

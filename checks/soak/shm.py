"""What `/dev/shm` holds and who holds it: the leak scans of the soak, `serve_check` and `multihost_check`.

An entry counts as left behind when it is new since a scan before the run, no live process holds it (open fd
or mapping), and it stays so for a few seconds: under ``make test``'s two workers the other worker's tests
create and remove their own entries while a server stops (vLLM's message queues, multiprocessing's
semaphores), and one removed between the listing and the ``/proc`` walk would otherwise read as unheld.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Iterable, Optional

DEV_SHM = "/dev/shm"
#: How long a new unheld entry must stay to count as left behind (another process's teardown takes < 1 s).
SETTLE_S = 5.0


def _listing() -> set[str]:
    return set(os.listdir(DEV_SHM)) if os.path.isdir(DEV_SHM) else set()


def held_by(pids: Optional[Iterable[int]] = None) -> set[str]:
    """``/dev/shm`` entries the processes ``pids`` (every process when None) hold open or mapped."""
    held: set[str] = set()
    roots = [f"/proc/{p}" for p in pids] if pids is not None else glob.glob("/proc/[0-9]*")
    for root in roots:
        for link in glob.glob(f"{root}/fd/*"):
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(DEV_SHM + "/"):
                held.add(target[len(DEV_SHM) + 1:].removesuffix(" (deleted)"))
        try:
            with open(f"{root}/maps") as f:
                text = f.read()
        except OSError:
            continue
        held.update(line.split(DEV_SHM + "/", 1)[1].strip().removesuffix(" (deleted)")
                    for line in text.splitlines() if DEV_SHM + "/" in line)
    return held


def dev_shm_scan() -> dict[str, list[str]]:
    """The entries present both before and after the walk of ``/proc`` (one made or removed meanwhile is
    another process's work in progress), and those of them some live process holds."""
    first = _listing()
    held = held_by()
    present = first & _listing()
    return {"dev_shm": sorted(present), "dev_shm_held": sorted(held & present)}


def orphaned_dev_shm(before: list[str], after: dict[str, Any]) -> list[str]:
    """Entries new since ``before`` that no live process held at ``after`` (a :func:`dev_shm_scan`)."""
    return sorted(set(after["dev_shm"]) - set(before) - set(after["dev_shm_held"]))


def settled_orphans(before: list[str], settle_s: float = SETTLE_S) -> list[str]:
    """:func:`orphaned_dev_shm` of scans over ``settle_s`` seconds: only the entries orphaned in every scan."""
    orphans = set(orphaned_dev_shm(before, dev_shm_scan()))
    deadline = time.monotonic() + settle_s
    while orphans and time.monotonic() < deadline:
        time.sleep(0.5)
        orphans &= set(orphaned_dev_shm(before, dev_shm_scan()))
    return sorted(orphans)

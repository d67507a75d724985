"""Whether FABRIC handles really work across this group: a collective trial.

``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`` says the GPU and driver
can; it does not say that this process has an IMEX channel (without one,
``cuMemCreate`` fails ``CUDA_ERROR_NOT_PERMITTED``), nor that exporter and
importer share an IMEX domain (with a node-local channel but no IMEX daemon,
a process re-imports its own handle while a peer's import fails, e.g.
``CUDA_ERROR_INVALID_HANDLE``). TensorRT-LLM (``_mnnvl_utils.py``,
``ipcNvlsMemory.cu``) and torchcomms therefore try an export and import
before committing; MoonEP probes with a ``cuMemCreate``. Here every rank
creates one page of FABRIC memory and exports it, then imports its *next*
rank's handle and maps it -- the peer import is the step a self-trial misses.
Any failure on any rank means "no fabric" on every rank (they all see the
same failures), and everything the trial acquired is released on every path.
"""

from __future__ import annotations

import contextlib

from ..errors import CollectiveError, PeerLostError
from .driver import HandleType, MemoryDriver
from .group import GroupComm


def fabric_trial(comm: GroupComm, driver: MemoryDriver) -> dict[int, str]:
    """Collective. ``{}`` when every rank could create, export, import a peer's and map
    FABRIC memory; otherwise each failing rank's message (the same dict on every rank)."""
    rank, world = comm.rank, comm.world_size
    with contextlib.ExitStack() as undo:
        try:
            with comm.step("fabric trial: create and export") as made:
                gran = driver.granularity(HandleType.FABRIC)
                handle = driver.create(gran, HandleType.FABRIC, tag="fabric-trial")
                undo.callback(driver.release, handle)
                made.share((driver.export(handle, HandleType.FABRIC), gran))
            with comm.step("fabric trial: import a peer's handle and map it"):
                peer_handle, peer_gran = made.gathered[(rank + 1) % world]
                imported = driver.import_handle(peer_handle, HandleType.FABRIC, size=peer_gran)
                undo.callback(driver.release, imported)
                base = driver.reserve(peer_gran, peer_gran)
                undo.callback(driver.free_reservation, base, peer_gran)
                driver.map(base, peer_gran, imported, 0)
                undo.callback(driver.unmap, base, peer_gran)
                driver.set_access(base, peer_gran)
        except PeerLostError:
            raise
        except CollectiveError as exc:
            return dict(exc.failures)
    return {}

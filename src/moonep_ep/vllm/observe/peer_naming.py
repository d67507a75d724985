"""A lost peer named in vLLM's own DP collectives: which rank, on which host.

When a host dies, every survivor meets the loss in whichever collective it is
in at that moment, and gloo reports only a transport address ("Read error
[10.0.0.2]:62091: Connection reset by peer"). moonep_ep's own steps (the
store's metadata rounds, capacity padding, dispatch, prefetch, combine) turn
that into a :class:`~moonep_ep.errors.PeerLostError` naming the lost rank and
host from the peer table the store registered (``memory.group``). Two vLLM
collectives run beside them, one per process:

========================= ============================================ =============================
process                   vLLM collective                              peer table
========================= ============================================ =============================
worker                    ``dp_utils._run_ar``: the per-step DP batch  the store's (EP ranks)
                          synchronization
engine core (per DP rank) ``DPEngineCoreProc``'s DP state all-reduce   published here (DP ranks)
                          (``sync_dp_state`` every ``dp_sync_interval``
                          steps, ``has_unfinished_dp`` on resume)
========================= ============================================ =============================

The engine core holds no store, so it gets its own table: at the start of its
busy loop each DP rank's engine core writes ``(hostname, gloo address)`` into
vLLM's DP TCPStore (the one its DP group was created with) and waits, at most
``MOONEP_EP_TIMEOUT_S``, for every rank's entry. Every rank reaches its busy
loop only after the workers' expert-parallel start-up, which spans all ranks,
so the wait is short; if it times out (a rank died at start-up), a later loss
is reported by vLLM unchanged. A transport error that names none of the
table's addresses is vLLM's own and stays as it was.

Both patches are declared in :data:`PATCHES` (``plugin.py``'s convention).
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
from types import ModuleType
from typing import Any, Optional

from ..hooks import Install, Mark, Note, Patch, is_wrapped

logger = logging.getLogger("vllm.moonep_ep")

MOD_DP_UTILS = "vllm.v1.worker.dp_utils"
MOD_ENGINE_CORE = "vllm.v1.engine.core"
#: Key of DP rank ``rank``'s entry in vLLM's DP TCPStore.
PEER_KEY = "moonep_ep/dp_peer/{rank}"


def _already_named(exc: BaseException) -> bool:
    """A worker's PeerLostError travels to the engine core as text inside vLLM's RuntimeError."""
    return "lost contact with a peer" in str(exc)


def named_loss(step: str, rank: Optional[int], group: Any, exc: BaseException) -> Optional[Exception]:
    """The PeerLostError for ``exc`` when it names a registered peer's address, else None."""
    from ...memory.group import lost_peers, peer_lost_error

    if _already_named(exc) or not lost_peers(group, f"{type(exc).__name__}: {exc}", -1 if rank is None else rank):
        return None
    return peer_lost_error(step, rank, group, exc)


# -- worker: the per-step DP batch synchronization ------------------------------------------------

def patch_dp_batch_sync(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``dp_utils._run_ar`` (an all-reduce over the DP group, every step): the store's table names the peer."""
    orig = getattr(module, "_run_ar", None)
    if orig is None or is_wrapped(orig):
        return
    # Imported here, once (vLLM's module has loaded torch by now), not by the plugin nor on each step.
    from ...memory.group import TRANSPORT_ERRORS

    def _run_ar(*args: Any, **kwargs: Any) -> Any:
        try:
            return orig(*args, **kwargs)
        except TRANSPORT_ERRORS as exc:
            try:
                from vllm.distributed import get_ep_group

                rank: Optional[int] = get_ep_group().rank_in_group
            except Exception:  # noqa: BLE001 - no EP group in this process: name the peer only
                rank = None
            named = named_loss("DP batch synchronization", rank, None, exc)
            if named is None:
                raise
            raise named from exc

    install(module, "_run_ar", _run_ar, orig, "dp_utils._run_ar (a lost peer named)")


# -- engine core: the DP state synchronization ----------------------------------------------------

def publish_dp_peers(store: Any, rank: int, size: int, timeout_s: float) -> Optional[list[tuple[str, str]]]:
    """Write this DP rank's ``(hostname, gloo address)`` into ``store``; return every rank's, in rank order,
    or None when some rank's entry did not arrive within ``timeout_s``."""
    from ...memory.group import TRANSPORT_ERRORS, transport_address

    store.set(PEER_KEY.format(rank=rank), json.dumps([socket.gethostname(), transport_address()]))
    keys = [PEER_KEY.format(rank=r) for r in range(size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except TRANSPORT_ERRORS:
        return None
    return [tuple(json.loads(store.get(key))) for key in keys]  # type: ignore[misc]


def _serves_moonep(engine: Any) -> bool:
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    return getattr(parallel, "all2all_backend", None) == "moonep" and getattr(engine, "dp_store", None) is not None


def patch_engine_core(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``DPEngineCoreProc.run_busy_loop``: publish the DP peer table first; a loss met in the loop's own DP
    all-reduce is raised as a PeerLostError naming the DP rank and host (MoonEP engines only)."""
    cls = getattr(module, "DPEngineCoreProc", None)
    orig = getattr(cls, "run_busy_loop", None)
    if orig is None or is_wrapped(orig):
        return

    def run_busy_loop(self: Any) -> Any:
        if not _serves_moonep(self):
            return orig(self)
        from ...memory.group import TRANSPORT_ERRORS, default_timeout_s, register_peers
        from ..gc_heap import freeze_heap_at_exit

        # Why: this core's exit waits for its worker, then runs finalization's full GC passes (gc_heap.py).
        freeze_heap_at_exit()

        try:
            table = publish_dp_peers(self.dp_store, self.dp_rank, self.dp_size, default_timeout_s())
        except TRANSPORT_ERRORS as exc:  # the store's own server is gone: vLLM will meet that too
            logger.warning("moonep_ep: DP rank %s could not publish its peer entry (%s); a lost peer will be "
                           "reported by vLLM unnamed", self.dp_rank, exc)
            table = []  # warned here; neither branch below applies
        if table:
            register_peers(self.dp_group, table)
            logger.info("moonep_ep: engine core of DP rank %s knows every DP rank's host %s (a lost one is named)",
                        self.dp_rank, [h for h, _ in table])
        elif table is None:
            logger.warning("moonep_ep: DP rank %s: not every DP rank published its host within MOONEP_EP_TIMEOUT_S; "
                           "a lost peer will be reported by vLLM unnamed", self.dp_rank)
        try:
            return orig(self)
        except TRANSPORT_ERRORS as exc:
            named = named_loss(f"DP state synchronization (engine core of DP rank {self.dp_rank})", self.dp_rank,
                               self.dp_group, exc)
            if named is None:
                raise
            raise named from exc

    install(cls, "run_busy_loop", run_busy_loop, orig, "DPEngineCoreProc.run_busy_loop (a lost peer named)")


PATCHES: tuple[Patch, ...] = (Patch(MOD_DP_UTILS, patch_dp_batch_sync), Patch(MOD_ENGINE_CORE, patch_engine_core))

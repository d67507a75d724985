"""Per-process instrumentation of the plugin, for tests and the demo.

Off unless ``MOONEP_EP_VLLM_STATS_DIR`` names a directory. Each process that
builds the MoonEP store writes ``rank<ep_rank>-<pid>.json`` there (atomically
replaced after each update, so a reader that kills the engine mid-run still
finds the last complete object). Contents:

* ``store``: L, E, B, H, I, driver, granularity, layer names, physical
  bytes by category (measured from the driver's handles), the bytes vLLM
  0.33.0's replicated layout would hold, and the collective rounds the store
  took (``handle_exchange`` must be 1 for the whole model);
* ``load``: layers converted, every ``torch.distributed`` collective issued
  from the store's allocation to the end of the initial weight pass (by op:
  calls, bytes, expert-weight bytes, detected by alias or content against
  every expert tensor the loader received —
  :class:`moonep_ep.ops.moonep.instrument.CollectiveRecorder`), and calls of
  vLLM's all-gathering ``gather_moonep_weight_layout``;
* ``forward``: prefetch calls, slots filled, and how many of those came from
  a remote owner (``owner(e) = e // epn != ep_rank``), by owner; per
  ``(owner, expert)``: fills, fills that serve only vLLM's capacity-padding
  rows (``ops/moonep/padding.py``; ``padding_only``), entries from real tokens, the
  bytes the copies read (counted at the copy by the reference buffer:
  ``PrefetchStats.bytes_by_expert``), fills a plan of the real entries alone
  would not make (``absent_without_padding``) and, apart, the fills that
  plan makes (``without_padding_by_owner_expert``) — recorded only where the
  plan is the reference buffer's (``global_plan``) and vLLM's forward context
  gives every DP rank's real token count, else ``unclassified_fills``. The MoE op only snapshots each
  prefetch (:meth:`Stats.defer_prefetch`); the analysis runs after the step (``deferred.py``);
* ``load_memory`` / ``update_memory``: the peak of this rank's expert bytes
  while the model loads (until the initial pass settled) and during later
  weight updates, sampled at every expert ``weight_loader`` call, when the
  store is allocated and inside vLLM's all-gather (replicated layout). Each
  sample is measured from the OS: on the host, the sizes of this rank's
  memfds (``fstat``) plus the ``mincore``-resident bytes of every live expert
  tensor (vLLM's expert parameters, its gathered copies, a materialized
  layer during a reload); on CUDA, the device memory gone since the first
  sample outside torch (``cuMemGetInfo`` delta minus torch's reserved delta:
  the store) plus the bytes of the live expert tensors;
* ``passes``: every settled weight pass (rows written, refusals, seconds);
* ``replicated``: with ``MOONEP_EP_LAYOUT=replicated``, the bytes of vLLM's
  gathered ``[E+B]`` tensors and of one layer's local parameters, measured
  from their storages.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from ... import envs

#: Reentrant: a reader holding it (``host_syncs.py``) may read ``data``, which may drain (and take it again).
_lock = threading.RLock()


def stats_dir() -> str | None:
    return envs.MOONEP_EP_VLLM_STATS_DIR


class Stats:
    def __init__(self) -> None:
        self._data: dict[str, Any] = {
            "pid": os.getpid(), "ep_rank": None, "ep_size": None, "buffer": None, "device": None,
            "store": None,
            "load": {"layers_converted": 0, "collectives": {}, "collective_weight_bytes": 0,
                     "vllm_gather_calls": 0, "expert_tensors_loaded": 0},
            "forward": {"prefetch_calls": 0, "slots_filled": 0, "remote_prefetched": 0, "local_prefetched": 0,
                        "remote_by_owner": {}, "remote_experts": [], "fills_by_owner_expert": {},
                        "without_padding_by_owner_expert": {}, "unclassified_fills": 0, "bytes_at_copy": 0,
                        "remote_bytes_at_copy": 0, "copies_counted": 0,
                        # Multi-host: remote fills by the owner's host, those from another host apart.
                        "remote_by_owner_host": {}, "cross_host_fills": 0, "same_host_remote_fills": 0},
        }
        self._recorder: Any = None
        self._remote_set: set[int] = set()
        self._last_write = 0.0
        self.memory = ExpertMemorySampler()
        self._pending: collections.deque[PrefetchRecord] = collections.deque()  # taken in the MoE op

    @property
    def data(self) -> dict[str, Any]:
        """Every record so far: a read outside a step of vLLM's runner first analyses the prefetch snapshots
        waiting (inside one they wait for its end: ``deferred.py``)."""
        if self._pending and not in_step():
            self.drain()
        return self._data

    @data.setter
    def data(self, value: dict[str, Any]) -> None:
        self._data = value

    # -- updates ----------------------------------------------------------------------------
    def set(self, **fields: Any) -> None:
        with _lock:
            self._data.update(fields)
        self.flush()

    def add_collectives(self, by_op: dict[str, dict[str, int]]) -> None:
        with _lock:
            agg = self._data["load"]["collectives"]
            for op, entry in by_op.items():
                dst = agg.setdefault(op, {"calls": 0, "bytes": 0, "weight_bytes": 0})
                for k in dst:
                    dst[k] += int(entry.get(k, 0))
            self._data["load"]["collective_weight_bytes"] = sum(e["weight_bytes"] for e in agg.values())

    def count_vllm_gather(self, w13_local: Any, w2_local: Any) -> None:
        """vLLM's all-gather of one layer (replicated layout) starts, with its local parameters alive."""
        with _lock:
            self._data["load"]["vllm_gather_calls"] += 1
            if stats_dir() is not None:
                rep = self._data.setdefault("replicated", {"layers": 0, "layout_bytes": 0,
                                                          "one_layer_local_bytes": None})
                if rep["one_layer_local_bytes"] is None:
                    rep["one_layer_local_bytes"] = sum(t.untyped_storage().nbytes() for t in (w13_local, w2_local))
        self.watch_expert_tensor(w13_local, "vLLM local parameters")
        self.watch_expert_tensor(w2_local, "vLLM local parameters")
        self.flush()

    # -- collectives during the load (sharded layout) ---------------------------------------
    def start_load_recording(self) -> None:
        """Record every collective from the store's allocation to the end of the initial pass."""
        if stats_dir() is None or self._recorder is not None:
            return
        from ...ops.moonep.instrument import CollectiveRecorder

        self._recorder = CollectiveRecorder()
        self._recorder.__enter__()

    def register_loaded_weight(self, tensor: Any) -> None:
        """An expert tensor the loader received: a collective carrying its bytes would be counted."""
        if self._recorder is not None:
            self._recorder.register(tensor)
            self._data["load"]["expert_tensors_loaded"] += 1

    def stop_load_recording(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        recorder.__exit__(None, None, None)
        self.add_collectives(recorder.by_op())

    def record_prefetch(self, plan: Any, ep_rank: int, epn: int, copied: Any = None,
                        real_tokens: Optional[list[int]] = None, hosts: Optional[list[str]] = None) -> None:
        """One ``prefetch_weight`` call of this rank: its slot fills, classified (see ``forward`` above), now.

        ``copied``: the buffer's :class:`~moonep_ep.ops.moonep.commplan.PrefetchStats`
        (bytes counted at the copy), None for a buffer that does not count.
        ``real_tokens``: every DP rank's real token count this step.
        ``hosts``: every EP rank's host (the store's), to count remote fills by the owner's host.
        Reads the plan from the device: inside a MoE op use :meth:`defer_prefetch`."""
        self._analyse_prefetch(plan, ep_rank, epn, copied, real_tokens, hosts, last_padding())
        self.flush()

    def defer_prefetch(self, plan: Any, ep_rank: int, epn: int, copied: Any = None, real_tokens: Any = None,
                       hosts: Optional[list[str]] = None, counts: Optional[Callable[[], None]] = None) -> None:
        """:meth:`record_prefetch` for the MoE op: a snapshot of what its analysis reads, this step's padding
        included, analysed by :meth:`drain` (when: ``deferred.py``). Reads no value from the device, except
        once per :data:`BOUND` calls. ``real_tokens``: a list, or a tensor read at the analysis. ``counts``:
        called first at the analysis (the caller's own counting, e.g. a quantized fill's bytes, which reads
        the fill's device table)."""
        record = _snapshot(plan, ep_rank, epn, copied, real_tokens, hosts, last_padding())._replace(counts=counts)
        with _lock:
            self._pending.append(record)
            full = len(self._pending) >= BOUND
        if full:
            self.drain()  # the bound: a read inside the op, once per BOUND prefetches

    def drain(self) -> int:
        """Analyse the prefetch snapshots waiting, in order (the same analysis as :meth:`record_prefetch`), then
        write the stats file; returns how many."""
        with _lock:
            records = list(self._pending)
            self._pending.clear()
        for r in records:
            tokens = r.real_tokens
            if tokens is not None and not isinstance(tokens, list):
                tokens = [int(n) for n in tokens.tolist()]  # vLLM's counts, read here
            if r.counts is not None:
                r.counts()
            self._analyse_prefetch(r.plan, r.ep_rank, r.epn, r.copied, tokens, r.hosts, r.padding)
        if records:
            self.flush()
        return len(records)

    def _analyse_prefetch(self, plan: Any, ep_rank: int, epn: int, copied: Any, real_tokens: Optional[list[int]],
                          hosts: Optional[list[str]], padding: Optional[dict[str, Any]]) -> None:
        """The analysis of one prefetch; ``padding``: the plugin's padding state of its step (``LAST_PADDING``)."""
        from ...ops.moonep.padding import classify_slot_fills, real_entries, replan_without_padding

        global_plan = getattr(plan, "global_plan", None)
        real, replanned, classification_error = None, None, None
        if global_plan is not None and real_tokens is not None:
            try:
                pads = _step_padding(global_plan, real_tokens, padding)
                real = real_entries(global_plan, pads)
                replanned = replan_without_padding(global_plan, pads)
            except ValueError as exc:  # counts that do not fit the plan: report, never break a forward
                real, replanned, classification_error = None, None, str(exc)
        if global_plan is not None:
            fills = [(f.expert, f) for f in classify_slot_fills(global_plan, ep_rank, real)]
        else:  # a plan without the global tables (the real library): the experts only
            fills = [(int(e), None) for e in plan.experts_to_copy[ep_rank].tolist() if e >= 0]
        classified = real is not None
        replanned_row = set(replanned.experts_to_copy[ep_rank].tolist()) if replanned is not None else None
        by_expert = dict(getattr(copied, "bytes_by_expert", None) or {}) if copied is not None else None
        with _lock:
            fwd = self._data["forward"]
            fwd["prefetch_calls"] += 1
            for expert, fill in fills:
                owner = expert // epn
                fwd["slots_filled"] += 1
                entry = fwd["fills_by_owner_expert"].setdefault(str(owner), {}).setdefault(
                    str(expert), {"fills": 0, "padding_only": 0, "real_entries": 0, "bytes_at_copy": 0,
                                  "absent_without_padding": 0})
                entry["fills"] += 1
                if replanned_row is not None and expert not in replanned_row:
                    entry["absent_without_padding"] += 1
                if classified and fill is not None:
                    entry["padding_only"] += int(fill.padding_only)
                    entry["real_entries"] += fill.real_entries
                else:
                    fwd["unclassified_fills"] += 1
                if by_expert is not None:
                    nbytes = int(by_expert.get(expert, 0))
                    entry["bytes_at_copy"] += nbytes
                    fwd["bytes_at_copy"] += nbytes
                    if owner != ep_rank:
                        fwd["remote_bytes_at_copy"] += nbytes
                if owner != ep_rank:
                    fwd["remote_prefetched"] += 1
                    fwd["remote_by_owner"][str(owner)] = fwd["remote_by_owner"].get(str(owner), 0) + 1
                    self._remote_set.add(expert)
                    if hosts is not None and owner < len(hosts):
                        by_host = fwd["remote_by_owner_host"]
                        by_host[hosts[owner]] = by_host.get(hosts[owner], 0) + 1
                        fwd["cross_host_fills" if hosts[owner] != hosts[ep_rank] else "same_host_remote_fills"] += 1
                else:
                    fwd["local_prefetched"] += 1
            if by_expert is not None:
                fwd["copies_counted"] += 1
            if getattr(copied, "api", None) == "push":
                # The push is counted at its copies, on the owner that pushes: by own expert and by tensor
                # (weights and scales apart); every pushed byte lands in another rank's slot.
                pushed = fwd.setdefault("pushed_bytes_by_expert", {})
                for expert, nbytes in (by_expert or {}).items():
                    pushed[str(expert)] = pushed.get(str(expert), 0) + int(nbytes)
                    fwd["bytes_at_copy"] += int(nbytes)
                    fwd["remote_bytes_at_copy"] += int(nbytes)
                by_tensor = fwd.setdefault("pushed_bytes_by_tensor", {})
                for name, nbytes in (getattr(copied, "bytes_by_tensor", None) or {}).items():
                    by_tensor[name] = by_tensor.get(name, 0) + int(nbytes)
            if replanned_row is not None:
                for expert in sorted(replanned_row):
                    if expert >= 0:
                        per_owner = fwd["without_padding_by_owner_expert"].setdefault(str(expert // epn), {})
                        per_owner[str(expert)] = per_owner.get(str(expert), 0) + 1
            fwd["remote_experts"] = sorted(self._remote_set)
            if classification_error and "classification_error" not in fwd:
                fwd["classification_error"] = classification_error

    def record_quantized_fill(self, weight_bytes: int, scale_bytes: int, remote_weight: int, remote_scale: int
                              ) -> None:
        """Quantized slot fills: weight and scale bytes counted apart at the copy (all, and from remote owners)."""
        with _lock:
            q = self._data["forward"].setdefault("quantized_bytes_at_copy", {
                "weight_bytes": 0, "scale_bytes": 0, "remote_weight_bytes": 0, "remote_scale_bytes": 0})
            q["weight_bytes"] += weight_bytes
            q["scale_bytes"] += scale_bytes
            q["remote_weight_bytes"] += remote_weight
            q["remote_scale_bytes"] += remote_scale

    def record_experts_call(self, seconds: float, rows: int) -> None:
        """One quantized experts call: host wall seconds and ``[NvS, H]`` rows (no-op with stats off, as this
        runs once per MoE layer and step). Written at once, as every record is: an engine process may leave
        with ``os._exit`` after its last step, and a write left to a later flush was lost there (17 of 18
        calls reported)."""
        if stats_dir() is None:
            return
        with _lock:
            c = self._data.setdefault("experts_compute", {"calls": 0, "seconds": 0.0, "rows": 0})
            c["calls"] += 1
            c["seconds"] = round(c["seconds"] + seconds, 3)
            c["rows"] += int(rows)
        self.flush()

    def watch_expert_tensor(self, tensor: Any, label: str) -> None:
        """Count ``tensor``'s storage as expert memory while it lives (no-op with stats off)."""
        if stats_dir() is not None:
            self.memory.watch(tensor, label)

    def sample_expert_memory(self, where: str) -> None:
        """One peak sample (no-op with stats off); see ``load_memory`` in the module docstring."""
        if stats_dir() is None:
            return
        phase = "update_memory" if self.memory.loaded else "load_memory"
        sample = self.memory.sample(self._data.get("ep_rank"), self._data.get("device"), where)
        with _lock:
            peak = self._data.setdefault(phase, {"peak_expert_bytes": 0, "samples": 0,
                                                "method": self.memory.method(self._data.get("device"))})
            peak["samples"] += 1
            if sample["total"] >= peak["peak_expert_bytes"]:
                peak.update(peak_expert_bytes=sample["total"], peak_at=where, store_bytes_at_peak=sample["store"],
                            tensor_bytes_at_peak=sample["tensors"], tensors_at_peak=sample["labels"])

    def record_pass(self, store: Any) -> None:
        """After a store's pass settled (or failed): its summary, and the end of the load phase."""
        if store.ready:
            self.memory.loaded = True
        if stats_dir() is None:
            return
        with _lock:
            self._data["passes"] = list(store.settled)
            self._data["store"] = store.describe()
        self.flush()

    def record_replicated_layout(self, gathered: tuple[Any, ...], layout: Any) -> None:
        """vLLM's all-gather built one layer's ``[E+B]`` copy: count its bytes, sample the peak inside."""
        if stats_dir() is None:
            return
        for t in gathered:
            self.watch_expert_tensor(t, "vLLM all_gather output")
        tensors = (layout.full_gate_weight, layout.full_up_weight, layout.full_down_weight)
        for t in tensors:
            self.watch_expert_tensor(t, "vLLM [E+B] layout")
        self.sample_expert_memory("vLLM all-gather (replicated layout)")
        with _lock:
            rep = self._data.setdefault("replicated", {"layers": 0, "layout_bytes": 0,
                                                      "one_layer_local_bytes": None})
            rep["layers"] += 1
            rep["layout_bytes"] += sum(t.untyped_storage().nbytes() for t in tensors)
        self.flush()

    # -- output -----------------------------------------------------------------------------
    def flush(self) -> None:
        d = stats_dir()
        if d is None:
            return
        with _lock:
            rank = self._data.get("ep_rank")
            text = json.dumps(self._data, indent=1, default=str)
            self._last_write = time.monotonic()
        os.makedirs(d, exist_ok=True)
        name = f"rank{rank if rank is not None else 'x'}-{os.getpid()}.json"
        tmp = os.path.join(d, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(d, name))


class ExpertMemorySampler:
    """This rank's expert bytes now, measured from the OS (see ``load_memory`` above)."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[Any, int, int, str, str]] = {}  # storage ptr -> (weak, ptr, n, dev, label)
        self._cuda_base: tuple[int, int] | None = None
        self.loaded = False

    def watch(self, tensor: Any, label: str) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        if tensor is None or tensor.is_meta:
            return  # a placeholder holds no memory
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        with _lock:
            self._tensors[ptr] = (StorageWeakRef(storage), ptr, storage.nbytes(), tensor.device.type, label)

    @staticmethod
    def method(device: Any) -> str:
        if str(device).startswith("cuda"):
            return ("cuMemGetInfo delta minus torch reserved delta since the first sample (the store) + bytes of "
                    "live expert tensors")
        return "fstat sizes of this rank's memfds (the store) + mincore-resident bytes of live expert tensors"

    def sample(self, rank: Any, device: Any, where: str) -> dict[str, Any]:
        from ...memory.accounting import resident_bytes

        tensors, labels = 0, {}
        with _lock:
            live = [v for v in self._tensors.values() if not v[0].expired()]
            self._tensors = {v[1]: v for v in live}
        for _, ptr, nbytes, dev, label in live:
            n = resident_bytes(ptr, nbytes) if dev == "cpu" else nbytes
            tensors += n
            labels[label] = labels.get(label, 0) + n
        store = self._store_bytes(rank, device)
        return {"store": store, "tensors": tensors, "labels": labels, "total": store + tensors}

    def _store_bytes(self, rank: Any, device: Any) -> int:
        if str(device).startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info()
            reserved = torch.cuda.memory_reserved()
            if self._cuda_base is None:
                self._cuda_base = (free, reserved)
            return max(0, (self._cuda_base[0] - free) - (reserved - self._cuda_base[1]))
        from ...memory.accounting import own_memfd_bytes

        return own_memfd_bytes(rank) if isinstance(rank, int) else 0


STATS = Stats()


#: Prefetch snapshots kept before a prefetch analyses them itself (``deferred.py``: when they are analysed).
BOUND = 1024
#: Nesting of vLLM's runner step methods in this process (``deferred.py`` wraps them and drains at the end).
STEP_DEPTH = [0]


def in_step() -> bool:
    """Inside a step of vLLM's runner: a read of ``STATS.data`` leaves the step's snapshots for its end."""
    return STEP_DEPTH[0] > 0


class PrefetchRecord(NamedTuple):
    """What :meth:`Stats.record_prefetch`'s analysis reads of one prefetch, taken without reading a value."""

    plan: Any
    ep_rank: int
    epn: int
    copied: Any
    real_tokens: Any  # a list, a tensor (a clone of vLLM's counts) or None
    hosts: Optional[list[str]]
    padding: Optional[dict[str, Any]]
    counts: Optional[Callable[[], None]] = None   # the caller's own counting, run at the analysis


def _clone(value: Any) -> Any:
    import torch

    return value.clone() if isinstance(value, torch.Tensor) else value


def _snapshot(plan: Any, ep_rank: int, epn: int, copied: Any, real_tokens: Any, hosts: Optional[list[str]],
              padding: Optional[dict[str, Any]]) -> PrefetchRecord:
    """One prefetch's snapshot. The global plan by reference: frozen and built anew by every dispatch (a clone
    would copy its ``[R, E, R]`` routes per layer); ``experts_to_copy`` cloned: a buffer may refill its own
    table in place; the padding state's tensors cloned (cheap, ``[R, E]``), the dict copied."""
    import types

    kept = types.SimpleNamespace(global_plan=getattr(plan, "global_plan", None),
                                 experts_to_copy=_clone(plan.experts_to_copy))
    state = None if padding is None else {k: _clone(v) for k, v in padding.items()}
    tokens = list(real_tokens) if isinstance(real_tokens, (list, tuple)) else _clone(real_tokens)
    return PrefetchRecord(kept, ep_rank, epn, copied, tokens, list(hosts) if hosts is not None else None, state)


def read_stats(directory: str) -> list[dict[str, Any]]:
    """Every stats object written into ``directory`` (sorted by EP rank)."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json") and name.startswith("rank"):
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda s: (s.get("ep_rank") is None, s.get("ep_rank") or 0))


#: ``{"policy", "real_tokens", "pad", "S"}`` of this thread's last prepare (``pad``: ``[R, E]`` or None),
#: written by the plugin's padding (``prepare_finalize/padding.py``); kept here so that stats only records and
#: reads, and imports none of the plugin's other modules.
LAST_PADDING = threading.local()


def last_padding() -> dict[str, Any] | None:
    return getattr(LAST_PADDING, "state", None)


def _step_padding(global_plan: Any, real_tokens: list[int], state: dict[str, Any] | None) -> Any:
    """This step's padding entries: the ``[R, E]`` matrix the plugin's padding routed
    (``prepare_finalize/padding.py``; ``state``: its :data:`LAST_PADDING` state of the plan's step), or vLLM's
    per-source counts on expert 0 (``MOONEP_EP_PADDING=vllm``)."""
    from ...ops.moonep.padding import padding_entries

    if state is not None and state.get("S") != global_plan.S:
        state = None  # not this plan's step (a prepare step of another buffer ran in between)
    if state is not None and state.get("pad") is not None:
        # built on the device (the padding reads nothing back); the plan's tables may sit elsewhere (the host)
        pad = state["pad"]
        return pad.to(global_plan.tokens_per_expert.device) if hasattr(pad, "to") else pad
    if state is not None and state.get("policy") not in (None, "vllm"):
        raise ValueError("the plugin's padding of this step is not known on this rank (no per-rank real token "
                         "counts): its fills are not classified")
    return padding_entries(global_plan, real_tokens)

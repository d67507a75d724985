"""Per-process instrumentation of the plugin, for tests and the demo.

Off unless ``MOONEP_EP_VLLM_STATS_DIR`` names a directory. Each process that
builds the MoonEP store writes ``rank<ep_rank>-<pid>.json`` there (atomically
replaced after each update, so a reader that kills the engine mid-run still
finds the last complete object). Contents:

* ``store``: L, E, B, H, I, driver, granularity, layer names, physical
  bytes by category (measured from the driver's handles), the bytes vLLM
  0.33.0's replicated layout would hold, and the collective rounds the store
  took (``handle_exchange`` must be 1 for the whole model);
* ``load``: layers adopted, every ``torch.distributed`` collective issued
  while converting the MoE layers (by op: calls, bytes, expert-weight bytes,
  detected by alias or content — :class:`moonep_ep.ops.instrument.CollectiveRecorder`),
  calls of vLLM's all-gathering ``gather_moonep_weight_layout``, and whether
  the original local ``w13``/``w2`` storages were freed;
* ``forward``: prefetch calls, slots filled, and how many of those came from
  a remote owner (``owner(e) = e // epn != ep_rank``), by owner.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from .. import envs

_lock = threading.Lock()


def stats_dir() -> str | None:
    return envs.MOONEP_EP_VLLM_STATS_DIR


class Stats:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "pid": os.getpid(), "ep_rank": None, "ep_size": None, "buffer": None, "device": None,
            "store": None,
            "load": {"layers_adopted": 0, "collectives": {}, "collective_weight_bytes": 0,
                     "vllm_gather_calls": 0, "original_storages": 0, "original_storages_freed": None,
                     "original_bytes": 0, "seconds": 0.0},
            "forward": {"prefetch_calls": 0, "slots_filled": 0, "remote_prefetched": 0, "local_prefetched": 0,
                        "remote_by_owner": {}, "remote_experts": []},
        }
        self._weak: list[Any] = []
        self._remote_set: set[int] = set()
        self._last_write = 0.0

    # -- updates ----------------------------------------------------------------------------
    def set(self, **fields: Any) -> None:
        with _lock:
            self.data.update(fields)
        self.flush()

    def add_collectives(self, by_op: dict[str, dict[str, int]]) -> None:
        with _lock:
            agg = self.data["load"]["collectives"]
            for op, entry in by_op.items():
                dst = agg.setdefault(op, {"calls": 0, "bytes": 0, "weight_bytes": 0})
                for k in dst:
                    dst[k] += int(entry.get(k, 0))
            self.data["load"]["collective_weight_bytes"] = sum(e["weight_bytes"] for e in agg.values())

    def count_vllm_gather(self) -> None:
        with _lock:
            self.data["load"]["vllm_gather_calls"] += 1
        self.flush()

    def watch_original(self, *tensors: Any) -> None:
        """Remember the storages of the loaded local parameters, to check later that they were freed."""
        from torch.multiprocessing.reductions import StorageWeakRef

        with _lock:
            for t in tensors:
                storage = t.untyped_storage()
                self._weak.append(StorageWeakRef(storage))
                self.data["load"]["original_storages"] += 1
                self.data["load"]["original_bytes"] += storage.nbytes()

    def check_freed(self) -> bool | None:
        with _lock:
            if not self._weak:
                return None
            freed = all(w.expired() for w in self._weak)
            self.data["load"]["original_storages_freed"] = freed
            return freed

    def record_prefetch(self, experts_row: list[int], epn: int, ep_rank: int) -> None:
        with _lock:
            fwd = self.data["forward"]
            fwd["prefetch_calls"] += 1
            for e in experts_row:
                if e < 0:
                    continue
                fwd["slots_filled"] += 1
                owner = e // epn
                if owner != ep_rank:
                    fwd["remote_prefetched"] += 1
                    key = str(owner)
                    fwd["remote_by_owner"][key] = fwd["remote_by_owner"].get(key, 0) + 1
                    self._remote_set.add(e)
                else:
                    fwd["local_prefetched"] += 1
            fwd["remote_experts"] = sorted(self._remote_set)
        self.flush()

    # -- output -----------------------------------------------------------------------------
    def flush(self) -> None:
        d = stats_dir()
        if d is None:
            return
        self.check_freed()
        with _lock:
            rank = self.data.get("ep_rank")
            text = json.dumps(self.data, indent=1, default=str)
            self._last_write = time.monotonic()
        os.makedirs(d, exist_ok=True)
        name = f"rank{rank if rank is not None else 'x'}-{os.getpid()}.json"
        tmp = os.path.join(d, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(d, name))


STATS = Stats()


def read_stats(directory: str) -> list[dict[str, Any]]:
    """Every stats object written into ``directory`` (sorted by EP rank)."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json") and name.startswith("rank"):
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda s: (s.get("ep_rank") is None, s.get("ep_rank") or 0))

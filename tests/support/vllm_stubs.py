"""Stand-ins for the few vLLM names a moonep_ep function imports, for tests that run in this process.

The main environment has no vLLM, and a test that runs in the vLLM environment
runs in a subprocess, where mutation testing's stats pass cannot see which
functions it reached. The decision code of ``vllm/experts/gpu.py``,
``vllm/quantized/engine.py`` and ``vllm/quantized/hooks.py`` imports vLLM
names inside its functions, so a test here puts a module of stand-ins under
each imported name (``monkeypatch``: removed after the test) and records what
moonep_ep hands them. The stand-ins decide nothing: they keep their arguments
and return what the test gives them. The tiers that run real vLLM
(``test_gpu_experts.py``, ``test_gpu_experts_engine.py``,
``test_quantized_checkpoints.py``) check the same calls against vLLM itself.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def install(monkeypatch: Any, modules: dict[str, dict[str, Any]]) -> dict[str, types.ModuleType]:
    """``{dotted name: {attribute: value}}`` as modules in ``sys.modules`` for this test; a module whose
    parent is also given is an attribute of it too (``from package import module`` reads that)."""
    made = {}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        made[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    for name, module in made.items():
        parent, _, leaf = name.rpartition(".")
        if parent in made:
            setattr(made[parent], leaf, module)
    return made


class Calls:
    """A callable that records ``(args, kwargs)`` of every call and returns ``result`` (or ``result(*args,
    **kwargs)`` when ``compute`` is set)."""

    def __init__(self, result: Any = None, compute: bool = False):
        self.calls: list[tuple[tuple, dict]] = []
        self.result, self.compute = result, compute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs) if self.compute else self.result

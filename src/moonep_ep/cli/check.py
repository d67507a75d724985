"""``moonep-ep check``: probe every capability moonep_ep can use here, with the reason when absent."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("check", help="report drivers, VMM, handle types, multicast, moonep and vLLM")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    """Every probe, never raising: a missing capability is data, not an error."""
    report: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    from ..memory.host import HostDriver

    try:
        report["host"] = HostDriver().capabilities().to_json()
    except Exception as exc:  # noqa: BLE001
        report["host"] = {"driver": "host", "available": False, "reasons": {"driver": str(exc)}}

    from ..memory.cuda import CudaDriver
    from ..memory.cuda_probe import versions

    try:
        with CudaDriver() as cuda:
            report["cuda"] = cuda.capabilities().to_json()
            # Driver CUDA version vs the bindings' build: a mismatch names itself and its fix.
            report["cuda"]["versions"] = versions(cuda.api)
            if report["cuda"]["versions"].get("fix"):
                report["cuda"]["reasons"]["versions"] = report["cuda"]["versions"]["fix"]
    except Exception as exc:  # noqa: BLE001
        report["cuda"] = {"driver": "cuda", "available": False, "reasons": {"driver": f"{type(exc).__name__}: {exc}"}}

    try:
        import torch

        report["torch"] = {"version": torch.__version__, "cuda_available": torch.cuda.is_available(),
                           "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    except Exception as exc:  # noqa: BLE001
        report["torch"] = {"version": None, "reason": str(exc)}

    report["cuda_bindings"] = _version("cuda-bindings")
    moonep = importlib.util.find_spec("moonep") is not None
    report["moonep"] = {"importable": moonep,
                        "reason": None if moonep else "the MoonEP CUDA library is not installed (it is built from "
                        "source); the reference buffer serves instead"}
    from ..vllm.buffers import select_buffer

    try:  # which Buffer the vLLM plugin would serve with in this process, and why
        device = "cuda" if report.get("torch", {}).get("cuda_available") else "cpu"
        choice = select_buffer(device)
        report["buffer"] = {"serves": choice.kind, "device": device, "reason": choice.reason}
    except Exception as exc:  # noqa: BLE001 - e.g. MOONEP_EP_BUFFER=moonep without the library
        report["buffer"] = {"serves": None, "reason": f"{type(exc).__name__}: {exc}"}
    from ..vllm.compat import check_vllm

    vllm = check_vllm()  # files only: does not import vLLM
    report["vllm"] = {"version": vllm.version, "distribution": vllm.distribution, "supported": vllm.supported,
                      "moonep_files_match_0_33_0": vllm.moonep_files_match,
                      "reason": vllm.message if vllm.distribution else
                      "vLLM is not installed (pip install 'moonep_ep[vllm]')"}
    return report


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    def line(name: str, ok: Any, reason: str | None = None) -> None:
        mark = "yes" if ok else "no "
        print(f"  {name:<22} {mark}" + (f"   ({reason})" if not ok and reason else ""))
    for key in ("host", "cuda"):
        caps = report[key]
        reasons = caps.get("reasons", {})
        print(f"{key} driver" + (" (emulated: MOONEP_EP_CUDA_EMULATOR=1)" if caps.get("emulated") else "") + ":")
        line("available", caps.get("available"), reasons.get("driver"))
        ver = caps.get("versions") or {}
        if ver.get("driver_cuda"):
            line(f"driver CUDA {ver.get('driver_cuda')} / bindings {ver.get('bindings_cuda_major')}.x",
                 ver.get("compatible") is not False, ver.get("fix"))
        if not caps.get("available"):
            continue
        for cap in ("vmm", "posix_fd", "fabric", "multicast", "peer_access"):
            if cap in caps:
                line(cap, caps.get(cap), reasons.get(cap))
        if caps.get("granularity"):
            print(f"  {'granularity':<22} {caps['granularity']} bytes")
    print(f"torch: {report['torch'].get('version')}  cuda-bindings: {report['cuda_bindings']}")
    line("moonep importable", report["moonep"]["importable"], report["moonep"]["reason"])
    buf = report["buffer"]
    print(f"  {'buffer that serves':<22} {buf['serves']}   ({buf['reason']})")
    v = report["vllm"]
    line(f"vLLM {v['version'] or ''}".strip(), v["version"], v["reason"])
    return 0

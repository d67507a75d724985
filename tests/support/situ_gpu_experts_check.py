"""The GPU experts (``vllm/experts/gpu.gpu_grouped_ffn``) with SiTU, on CPU under the Triton interpreter.

``python -m tests.support.situ_gpu_experts_check`` runs in the vllm==0.33.0 environment, one process, no store:
for INT4 g32, FP8 block and MXFP4 it calls the format's kernels over ``[E]`` views drawn as codes and scales
(``tests/support/situ_experts.py``), in bf16 with the interpreter mended (MoonEP's dtype), with SiTU (beta 4,
linear_beta 25) and the two controls (SiLU; SiTU without linear_beta), each judged against the dense fp32
SiTU reference written in ``situ_experts.py`` (FP8: activations of both GEMMs quantized per 1x128 there, as the
path does). It also records what vLLM itself declares: ``MoEActivation``'s SILU/SITU values, the SiTU betas'
fields on ``FusedMoEConfig``, and ``MoonEPExperts._supports_activation`` before and after
``overlap.patch_experts``. Prints one JSON document.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import types

from moonep_ep.testing.triton_interpreter import enter_interpreter

FORMATS = ("int4-g32", "fp8-block", "mxfp4")


def vllm_facts() -> dict:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.experts import moonep_experts

    from moonep_ep.vllm.experts import overlap
    from moonep_ep.vllm.experts.activation import activation_of

    cls = moonep_experts.MoonEPExperts
    before = {a.value: bool(cls._supports_activation(a)) for a in (MoEActivation.SILU, MoEActivation.SITU,
                                                                   MoEActivation.GELU)}
    patched = overlap.patch_experts(moonep_experts)
    after = {a.value: bool(cls._supports_activation(a)) for a in (MoEActivation.SILU, MoEActivation.SITU,
                                                                  MoEActivation.GELU)}
    cfg = types.SimpleNamespace(activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    act = activation_of(MoEActivation.SITU, cfg)
    try:
        activation_of(MoEActivation.GELU, cfg)
        gelu = "accepted"
    except ValueError as exc:
        gelu = str(exc)
    return {"values": {"SILU": MoEActivation.SILU.value, "SITU": MoEActivation.SITU.value},
            "config_fields": sorted(f.name for f in dataclasses.fields(FusedMoEConfig) if "situ" in f.name),
            "supports_before_patch": before, "patched": patched, "supports_after_patch": after,
            "situ_of_enum": [act.name, act.beta, act.linear_beta], "gelu_refusal": gelu}


def main() -> int:
    enter_interpreter()
    import torch

    from moonep_ep.ops.experts.activation import SILU, GatedActivation
    from moonep_ep.testing.triton_interpreter import mend_interpreter
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn
    from tests.support import situ_experts as S

    mend_interpreter()
    t0 = time.perf_counter()
    runs = {"situ": GatedActivation("situ", beta=S.BETA, linear_beta=S.LINEAR_BETA), "silu": SILU,
            "situ_without_linear_beta": GatedActivation("situ", beta=S.BETA)}
    hidden, route, cu, groups = S.inputs()
    out: dict = {"formats": {}, "vllm": vllm_facts()}
    for fmt in FORMATS:
        views, dense = S.experts(fmt)
        ref = S.reference(hidden, route, groups, dense, fp8=fmt == "fp8-block")
        res: dict = {"saturation": S.saturation(hidden, groups, dense), "errors": {}, "seconds": {}}
        for name, act in runs.items():
            t = time.perf_counter()
            y = torch.full(hidden.shape, 7.0, dtype=hidden.dtype)   # written in place; the tail keeps the 7s
            gpu_grouped_ffn(fmt, hidden, views, cu, route, token_padding=S.TOKEN_PADDING, native_act_quant=True,
                            activation=act, out=y)
            res["seconds"][name] = round(time.perf_counter() - t, 2)
            res["errors"][name] = S.row_error(y, ref, groups)
            if name == "situ":
                res["tail_untouched"] = bool((y[int(cu[-1]):] == 7.0).all())
                res["dtype"] = str(y.dtype).rsplit(".", 1)[-1]
        out["formats"][fmt] = res
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["torch"] = torch.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

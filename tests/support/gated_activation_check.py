"""The fused gated activation kernel (``ops/experts/gated_activation_kernel.py``) under Triton's interpreter.

``python -m tests.support.gated_activation_check`` runs in the vllm==0.33.0 environment (Triton), the interpreter
mended (bf16 dot, downcasts). Against the eager chain (``GatedActivation`` then ``act.mul_(route.to(dtype))``) and
vLLM's ``per_token_group_quant_fp8``: how many results are bit-equal, the largest difference, and which rows the
kernel writes (a sentinel in the output: blocks of padding only and blocks past ``cu_seqlens[-1]`` keep it).
Prints one JSON document.
"""

from __future__ import annotations

import json
import sys

from moonep_ep.testing.triton_interpreter import enter_interpreter


def main() -> int:
    enter_interpreter()
    import warnings

    import torch

    from moonep_ep.ops.experts import gated_activation_kernel as gk
    from moonep_ep.ops.experts.activation import SILU, GatedActivation
    from moonep_ep.ops.experts.grouped_blocks import grouped_blocks, skip_zero_weight_blocks
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mend_interpreter()
    warnings.filterwarnings("ignore", "overflow encountered in exp")   # exp(-g) for g << 0: sigmoid 0, as meant
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    gen = torch.Generator().manual_seed(0)
    M, I, live = 96, 256, 48            # groups: rows 0-31, empty, 32-63 (48-63 padding only); 64-95 the tail
    cu = torch.tensor([32, 32, 64], dtype=torch.int32)
    route = torch.rand(M, generator=gen) + 0.1
    route[48:] = 0
    blocks = skip_zero_weight_blocks(grouped_blocks(cu, M, 16), route)
    scale = torch.tensor([1.0, 10.0, 40.0])[torch.randint(0, 3, (M, 2 * I), generator=gen)]
    out: dict = {"expert_ids": blocks.expert_ids.tolist(), "runs": {}}
    acts = {"silu": SILU, "situ": GatedActivation("situ", beta=4.0, linear_beta=25.0),
            "situ_without_linear_beta": GatedActivation("situ", beta=4.0)}
    for dtype in (torch.bfloat16, torch.float16):
        gu = (torch.randn(M, 2 * I, generator=gen) * scale).to(dtype)
        for name, act in acts.items():
            got = torch.full((M, I), 7.0, dtype=dtype)
            gk.launch(gu[:, :I], gu[:, I:], got, route, blocks, act)
            ref = act(gu[:, :I], gu[:, I:]).mul_(route.to(dtype).unsqueeze(-1))
            d = (got[:live].float() - ref[:live].float()).abs()
            ulp = ref[:live].float().abs().clamp_min(1e-30) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
            out["runs"][f"{name}/{str(dtype)[6:]}"] = {
                "equal_share": float((got[:live] == ref[:live]).float().mean()),
                "max_ulps": float((d / ulp).max()), "untouched_rows": int((got == 7.0).all(dim=1).sum())}
    # 64-row blocks, computed in two 32-row slices each (SUB_M)
    cu64 = torch.tensor([64, 64, 128], dtype=torch.int32)
    route64 = torch.rand(192, generator=gen) + 0.1
    route64[100:] = 0
    blocks64 = skip_zero_weight_blocks(grouped_blocks(cu64, 192, 64), route64)
    gu = (torch.randn(192, 2 * I, generator=gen) * 10).to(torch.bfloat16)
    got = torch.full((192, I), 7.0, dtype=torch.bfloat16)
    gk.launch(gu[:, :I], gu[:, I:], got, route64, blocks64, acts["situ"])
    ref = acts["situ"](gu[:, :I], gu[:, I:]).mul_(route64.to(torch.bfloat16).unsqueeze(-1))
    out["block64"] = {"expert_ids": blocks64.expert_ids.tolist(),
                      "equal_share": float((got[:128] == ref[:128]).float().mean()),
                      "untouched_rows": int((got == 7.0).all(dim=1).sum())}
    gu = (torch.randn(M, 2 * I, generator=gen) * scale).to(torch.bfloat16)
    lim = (-448.0, 448.0, torch.float8_e4m3fn)
    q, s = gk.fused_quantize_fp8(gu, blocks, lim)
    rq, rs = per_token_group_quant_fp8(gu, 128, use_ue8m0=False)
    out["quant_equal"] = bool(torch.equal(q[:live].float(), rq[:live].float()) and torch.equal(s[:live], rs[:live]))
    act = acts["situ"]
    q, s = gk.fused_gated_activation(gu[:, :I], gu[:, I:], route, blocks, act, quant=lim)
    ref = act(gu[:, :I], gu[:, I:]).mul_(route.to(torch.bfloat16).unsqueeze(-1))
    rq, rs = per_token_group_quant_fp8(ref.contiguous(), 128, use_ue8m0=False)
    out["fused_quant_equal_share"] = float((q[:live].float() == rq[:live].float()).float().mean())
    out["fused_scale_equal_share"] = float((s[:live] == rs[:live]).float().mean())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

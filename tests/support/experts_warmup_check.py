"""The quantized experts' warm-up against vLLM 0.33.0 itself, under Triton's interpreter (the vLLM environment).

``python -m tests.support.experts_warmup_check`` prints one JSON document:

* ``listing``: at Kimi K2's FP8/INT4/MXFP4 expert shapes (H 7168, I 2048, top-8, padding 128) with vLLM's device
  name read as an H200's (``gpu_experts_tiles.py``'s way: EP 12 has a tuned FP8 file, EP 8 none), whether
  ``kernel_variants`` over 1..8192 tokens equals the distinct ``kernel_config`` of every token count, and how many
  lookups each took;
* ``launch``: per format, the warm-up's launches through the Triton experts' real ``grouped_ffn`` and kernels
  (``gpu_grouped_ffn``, vLLM's INT4/FP8 kernels, the MXFP4 kernel; a tiny layer) on its dummy inputs, the
  configs they used, and the configs a forward at every token count uses (all must be warmed).

The interpreter compiles nothing, so the experts are told they are not interpreted (``interpreter`` False), which
is what makes the warm-up launch.
"""

from __future__ import annotations

import json
import sys
import types

from moonep_ep.testing.triton_interpreter import enter_interpreter

MAX_TOKENS = 8192


def main() -> int:
    enter_interpreter()
    import torch
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    from moonep_ep.testing.triton_interpreter import mend_interpreter
    from moonep_ep.vllm.experts import gpu as ge, warmup as wu
    from moonep_ep.vllm.quantized import engine as qe
    from tests.support.gpu_experts_check import quantized_experts

    mend_interpreter()
    fm.get_device_name_as_file_name = lambda: "NVIDIA_H200"
    fm.get_moe_configs.cache_clear()
    asked: list[int] = []
    lookup = fm.try_get_optimal_moe_config
    fm.try_get_optimal_moe_config = lambda *a, **kw: asked.append(1) or lookup(*a, **kw)
    out: dict = {"listing": {}, "launch": {}}
    for fmt in ("fp8-block", "int4-g32", "mxfp4"):
        for local in (32, 48):
            shape = dict(local_experts=local, hidden=7168, intermediate=2048, top_k=8, token_padding=128,
                         interpreter=False)
            asked.clear()
            got = wu.kernel_variants(fmt, max_tokens=MAX_TOKENS, **shape)
            n = len(asked)
            brute = {wu.config_key(ge.kernel_config(fmt, tokens=t, **shape)) for t in range(1, MAX_TOKENS + 1)}
            out["listing"][f"{fmt} E={local}"] = {
                "exact": brute == {wu.config_key(c) for _, c in got}, "variants": len(got), "lookups": n,
                "tuned_keys": wu.tuned_m_keys(fmt, local_experts=local, intermediate=2048) is not None}
    fm.try_get_optimal_moe_config = lookup

    cls = qe.experts_class("triton")
    used: list[tuple] = []
    real = ge.gpu_grouped_ffn

    def spy(*args, **kwargs):
        used.append(wu.config_key(kwargs["config"]))
        return real(*args, **kwargs)

    ge.gpu_grouped_ffn = spy
    for fmt in ("mxfp4", "int4-g32", "fp8-block"):
        store, _ = quantized_experts(fmt, h=256, i=128, experts=4)
        views = {n: torch.cat([v, v[:2]]) for n, v in store.items()}          # [E+B] rows: 2 slots
        moe = types.SimpleNamespace(num_local_experts=2, hidden_dim=256, intermediate_size_per_partition=128,
                                    experts_per_token=2, in_dtype=torch.bfloat16, activation=None)
        ex = types.SimpleNamespace(moe_config=moe, token_padding=32, interpreter=False, _configs={},
                                   _weight_layout=types.SimpleNamespace(format=fmt, views=views),
                                   experts_kind="triton")
        ex.grouped_ffn = types.MethodType(cls.grouped_ffn, ex)
        used.clear()
        done = wu.warm_up_experts(ex, max_tokens=64)
        warmed = set(used)
        used.clear()
        hidden = torch.randn(64, 256).to(torch.bfloat16)
        cu = torch.tensor([32, 32, 64, 64, 64, 64], dtype=torch.int32)
        finite = True
        for t in (1, 2, 3, 5, 9, 17, 21, 33, 41, 64):
            res = ex.grouped_ffn(ex._weight_layout, hidden, cu, torch.ones(64),
                                 torch.empty(t, 2, device="meta"), activation=qe.SILU)
            finite &= bool(torch.isfinite(res.float()).all())
        out["launch"][fmt] = {"variants": len(done), "warmed": len(warmed),
                              "forward_configs": len(set(used)), "forward_warmed": set(used) <= warmed,
                              "finite": finite}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

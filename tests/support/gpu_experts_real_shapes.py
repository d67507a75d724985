"""Real shapes through the GPU experts under the Triton interpreter (run in the vllm==0.33.0 environment).

``python -m tests.support.gpu_experts_real_shapes --json``: for each format one
expert of the real checkpoint's shape (K2-Thinking INT4 and K2 FP8 block: H
7168, I 2048; K3 MXFP4: ``models.py``'s H and I) goes into a store holding
the model's real expert count (one rank, host driver: the memfd is sparse,
only the pages written are memory), as its **last** expert, so its rows
start past 2^31 bytes of the ``[E+B]`` view for every weight tensor (one K2
layer's FP8 ``w13`` over ``[E+B]`` rows is 11.3 GB). A slot fill (ops' pull)
copies it into slot 0, after byte E·row. 16 rows go to the owner's row and 16
to the slot row, in fp16 and in bf16 (MoonEP's dtype; the interpreter's bf16
dot and downcasts mended), through ``gpu_grouped_ffn``, judged against the
decompressed expert (compressed-tensors' decompressor; FP8 block formula)
with the real-shape bounds (``gpu_experts_check.BOUNDS["real"]``). Negative
controls, fp16 on the owner's 16 rows, each must exceed the fp16 bound:
MXFP4 with one E8M0 scale of one w2 row one step up (that group doubled),
INT4 with one bf16 scale of one w2 row doubled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moonep_ep.testing.triton_interpreter import INTERPRETER_ENV, enter_interpreter

MODELS = {"int4-g32": "kimi-k2-thinking", "fp8-block": "kimi-k2", "mxfp4": "kimi-k3"}
ROWS = 16
#: wide tiles: the interpreter's cost is per program and per K step, not per element
REAL_SHAPE_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 512, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
#: negative controls (fp16, the owner's rows): w2 scale group CONTROL_GROUP of output row CONTROL_ROW changed —
#: MXFP4's E8M0 exponent one up (that group's weights doubled), INT4's bf16 scale doubled (exact)
CONTROLS = {"mxfp4": ("e8m0_group_plus_one", lambda s: s + 1),
            "int4-g32": ("int4_group_scale_doubled", lambda s: s * 2)}
CONTROL_ROW, CONTROL_GROUP = 0, 0


def check_format(fmt: str, dtypes: list[str], controls: bool) -> dict[str, Any]:
    import torch

    from moonep_ep.layout.formats import expert_projections
    from moonep_ep.layout.store import ShardedExpertStore
    from moonep_ep.memory.host import HostDriver
    from moonep_ep.models import get_model
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn
    from tests.support.gpu_experts_check import bound, oracle_rows, quantized_experts, row_errors

    model = get_model(MODELS[fmt])
    H, I, E = model.hidden_size, model.moe_intermediate_size, model.num_experts
    t0 = time.perf_counter()
    tensors, oracle = quantized_experts(fmt, H, I, 1)
    t_quant = time.perf_counter() - t0
    projs = expert_projections(fmt, H, I)
    driver = HostDriver(rank=0)
    last = E - 1
    res: dict[str, Any] = {"model": model.name, "H": H, "I": I, "E": E}
    try:
        store = ShardedExpertStore(num_layers=1, num_experts=E, projections=projs, num_slots=1, driver=driver)
        try:
            for p in projs:  # only the last expert's pages are ever touched
                store.owner_view(0, p.name)[last].copy_(tensors[p.name][0])
            store.finish_loading()
            views = {p.name: store.pull_view(0, p.name) for p in projs}
            res["view_bytes"] = {n: v.numel() * v.element_size() for n, v in views.items()}
            res["owner_row_offset"] = {n: v[last].data_ptr() - v.data_ptr() for n, v in views.items()}
            res["slot_row_offset"] = {n: v[E].data_ptr() - v.data_ptr() for n, v in views.items()}
            wait_for_slots(pull_slots(views, [last], E)[2])
            res["slot_equals_owner"] = all(torch.equal(v[E], v[last]) for v in views.values())
            cu = torch.zeros(E + 1, dtype=torch.int32)
            cu[last:] = ROWS
            cu[E] = 2 * ROWS
            gen = torch.Generator().manual_seed(5)
            hidden32 = torch.randn(2 * ROWS, H, generator=gen)
            route = torch.rand(2 * ROWS, generator=gen) + 0.1
            res["dtypes"] = {}
            for dtype in dtypes:
                hidden = hidden32.to(getattr(torch, dtype))
                t1 = time.perf_counter()
                out = gpu_grouped_ffn(fmt, hidden, views, cu, route, token_padding=ROWS, config=REAL_SHAPE_CONFIG)
                seconds = round(time.perf_counter() - t1, 2)
                ref = oracle_rows(fmt, hidden, route, [0] * (2 * ROWS), oracle)
                res["dtypes"][dtype] = {"max_row_rel_err": row_errors(out, ref, [0] * (2 * ROWS)),
                                        "max_row_rel_err_slot_rows": row_errors(out[ROWS:], ref[ROWS:], [0] * ROWS),
                                        "bound": bound(fmt, dtype, "real"), "kernel_seconds": seconds}
            if fmt in CONTROLS and controls:
                # the owner's rows only (the slot group empty): one w2 scale group of one output row changed in place
                name, change = CONTROLS[fmt]
                scale = views["w2_weight_scale"][last]
                saved = scale[CONTROL_ROW, CONTROL_GROUP].clone()
                scale[CONTROL_ROW, CONTROL_GROUP] = change(saved)
                owner_only = cu.clone()
                owner_only[E] = ROWS
                hidden = hidden32[:ROWS].to(torch.float16)
                try:
                    out = gpu_grouped_ffn(fmt, hidden, views, owner_only, route[:ROWS], token_padding=ROWS,
                                          config=REAL_SHAPE_CONFIG)
                finally:
                    scale[CONTROL_ROW, CONTROL_GROUP] = saved
                ref = oracle_rows(fmt, hidden, route[:ROWS], [0] * ROWS, oracle)
                res["controls"] = {name: row_errors(out, ref, [0] * ROWS)}
                res["control_bound"] = bound(fmt, "float16", "real")
            del views
        finally:
            store.close()
    finally:
        driver.close()
    res["quantize_seconds"] = round(t_quant, 2)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def rank_main(ctx: Any, formats: list[str], dtypes: list[str], controls: bool) -> dict[str, Any]:
    enter_interpreter()
    from moonep_ep.testing.triton_interpreter import mend_bf16_dot, mend_downcasts

    mend_downcasts()  # FP8: vLLM's activation quant casts fp32 -> e4m3; bf16 outputs are rounded to nearest even
    mend_bf16_dot()   # bf16 runs (MoonEP's dtype); fp16 dots are the interpreter's own
    return {fmt: check_format(fmt, dtypes, controls) for fmt in formats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="int4-g32,fp8-block,mxfp4")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    enter_interpreter()
    from moonep_ep.launch import run_ranks

    t0 = time.perf_counter()
    [res] = run_ranks(rank_main, 1, args=(args.formats.split(","), args.dtypes.split(","), not args.no_controls),
                      timeout_s=900, group_timeout_s=900, env={"MOONEP_EP_TIMEOUT_S": "900", **INTERPRETER_ENV})
    out = {"formats": res, "seconds": round(time.perf_counter() - t0, 1)}
    out["ok"] = all(d["max_row_rel_err"] <= d["bound"] and d["max_row_rel_err_slot_rows"] <= d["bound"]
                    and r["slot_equals_owner"]
                    and min(r["owner_row_offset"][n] for n in r["owner_row_offset"] if "scale" not in n) >= 2 ** 31
                    and all(err > r["control_bound"] for err in r.get("controls", {}).values())
                    for r in res.values() for d in r["dtypes"].values())
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton quantized experts' own-first split gives one pass's bits, under Triton's interpreter (issue 45).

``python -m tests.support.quantized_own_first_check --json`` (the vllm==0.33.0 environment, one process, no
ranks): for each format, over ``[E+B]`` views (pull) and ``[2*epn]`` views with gate and up apart (push), the
``MoonEPTritonQuantizedExperts.grouped_ffn`` of the engine over every group (what ``apply`` computed before
the split) against ``engine.own_then_slots`` (the own groups, then the slot groups, each over its own rows and
weight rows). Every kernel computes one ``BLOCK_SIZE_M`` block with one weight row, and every group starts on a
block, so each row's bits should not depend on the split: the check is ``torch.equal``. Weights are random
bytes of each format (every INT4 and E2M1 code is a value; FP8 from normal samples), not a checkpoint: the
claim is equality, not accuracy (``gpu_experts_check.py`` judges accuracy).

:func:`quantized_views` (pure torch) also feeds ``tests/vllm/test_quantized_own_first.py``'s dequantize runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from typing import Any

H, I = 256, 128
TOKEN_PADDING = 16
#: (own groups, group lengths: multiples of TOKEN_PADDING, an empty group in each part), 16 tail rows after
LAYOUTS = {"pull": (4, [16, 0, 32, 16, 16, 32]), "push": (3, [16, 0, 32, 16, 32, 0])}
TAIL = 16
SPLIT = ("gate", "gate_scale", "up", "up_scale", "down", "down_scale")


def _rows(fmt: str, n: int, out: int, inp: int, gen: Any) -> tuple[Any, Any]:
    """``n`` experts' ``[out, inp]`` weight in ``fmt`` and its scales, as vLLM's layers hold them."""
    import torch

    if fmt == "int4-g32":   # int32 words of 8 nibbles (every nibble a value), bf16 scales per 32
        words = torch.randint(-2**31, 2**31 - 1, (n, out, inp // 8), generator=gen, dtype=torch.int64)
        return words.to(torch.int32), (torch.rand(n, out, inp // 32, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    if fmt == "mxfp4":      # two E2M1 codes a byte (every code a value), E8M0 scales per 32
        codes = torch.randint(0, 256, (n, out, inp // 2), generator=gen).to(torch.uint8)
        return codes, torch.randint(120, 127, (n, out, inp // 32), generator=gen).to(torch.uint8)
    weight = (torch.randn(n, out, inp, generator=gen) * 4).to(torch.float8_e4m3fn)
    return weight, torch.rand(n, -(-out // 128), -(-inp // 128), generator=gen) * 0.01


def quantized_views(fmt: str, rows: int, split: bool, seed: int = 11) -> dict[str, Any]:
    """``rows`` experts of ``fmt``: vLLM's names (``w13_*``/``w2_*``, pull) or gate, up, down apart (push)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    w13, s13 = _rows(fmt, rows, 2 * I, H, gen)
    w2, s2 = _rows(fmt, rows, H, I, gen)
    if not split:
        weight, scale = ("weight", "weight_scale_inv") if fmt == "fp8-block" else ("weight_packed", "weight_scale")
        return {f"w13_{weight}": w13, f"w13_{scale}": s13, f"w2_{weight}": w2, f"w2_{scale}": s2}
    srows = s13.shape[1] // 2
    return dict(zip(SPLIT, (w13[:, :I].contiguous(), s13[:, :srows].contiguous(), w13[:, I:].contiguous(),
                            s13[:, srows:].contiguous(), w2, s2)))


def _triton_experts() -> Any:
    """``MoonEPTritonQuantizedExperts`` as the engine builds it, without vLLM's FusedMoEConfig (not needed here:
    ``grouped_ffn`` reads the local expert count and the intermediate size)."""
    from moonep_ep.vllm.quantized import engine as qe

    cls = qe.experts_class("triton")
    experts = cls.__new__(cls)
    experts.interpreter = qe._check_triton_here()   # mends the interpreter's bf16 dot and downcasts
    experts.token_padding, experts._configs = TOKEN_PADDING, {}
    experts.moe_config = types.SimpleNamespace(num_local_experts=4, intermediate_size_per_partition=I)
    return experts


def check(fmt: str, api: str, experts: Any) -> dict[str, Any]:
    import torch

    from moonep_ep.ops.experts.activation import SILU
    from moonep_ep.vllm.quantized.engine import own_then_slots

    own, lengths = LAYOUTS[api]
    layout = types.SimpleNamespace(format=fmt, views=quantized_views(fmt, len(lengths), split=api == "push"))
    gen = torch.Generator().manual_seed(5)
    live = sum(lengths)
    hidden = torch.randn(live + TAIL, H, generator=gen).to(torch.bfloat16)
    route = torch.rand(live + TAIL, generator=gen)
    route[live:] = float("nan")
    cu = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32)
    topk_ids = torch.zeros(32, 2, dtype=torch.int64)
    t0 = time.perf_counter()
    one_pass = experts.grouped_ffn(layout, hidden, cu, route, topk_ids, activation=SILU)
    t1 = time.perf_counter()
    split = torch.full_like(one_pass, 7.0)
    written: list[bool] = []   # per part: the result is the output's own rows (gpu_grouped_ffn's out=)
    ffn = experts.grouped_ffn

    def recorded(*args: Any, out: Any = None, **kwargs: Any) -> Any:
        got = ffn(*args, out=out, **kwargs)
        written.append(out is not None and got.data_ptr() == out.data_ptr())
        return got

    experts.grouped_ffn = recorded
    try:
        own_then_slots(experts, layout, split, hidden, cu, route, topk_ids, SILU, own, None)
    finally:
        del experts.grouped_ffn
    t2 = time.perf_counter()
    in_place = written == [True, True]
    # rows past the last group are written by neither (gpu_grouped_ffn leaves them; combine never reads them)
    return {"equal": bool(torch.equal(split[:live], one_pass[:live])),
            "live_nonzero": bool(one_pass[:live].ne(0).any()),
            "finite": bool(one_pass[:live].isfinite().all()), "tail_untouched": bool(split[live:].eq(7).all()),
            "in_place": in_place, "seconds": [round(t1 - t0, 2), round(t2 - t1, 2)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(f"{f}/{a}" for f in ("int4-g32", "fp8-block", "mxfp4")
                                               for a in LAYOUTS), help="format/api, comma-separated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.testing.triton_interpreter import enter_interpreter

    enter_interpreter()
    t0 = time.perf_counter()
    experts = _triton_experts()
    results = {case: check(*case.split("/"), experts) for case in args.cases.split(",")}
    out = {"results": results, "seconds": round(time.perf_counter() - t0, 1),
           "ok": all(r["equal"] and r["live_nonzero"] and r["finite"] and r["tail_untouched"] and r["in_place"]
                     for r in results.values())}
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

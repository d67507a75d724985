"""The MXFP4 kernel compiled for Hopper (sm_90a) on the CPU: registers, spills and shared memory per config.

``python -m tests.support.mxfp4_ptxas_check --json '[[BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, "bf16"|"fp16"],
...]'`` (vllm==0.33.0 environment: its Triton 3.8 and the ``ptxas`` that ships in Triton's wheel; no GPU). Each
config is compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the launch's specializations
(unit strides constant, pointers and the other strides divisible by 16), and its PTX is assembled again with
``ptxas -v --gpu-name sm_90a`` for the register and spill report; ``shared`` is Triton's own figure, what the
driver checks at launch. Prints one JSON list: ``{"cfg", "registers", "spill_stores", "spill_loads", "shared"}``.
About 2-8 s a config on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

UNIT_STRIDES = ("stride_ak", "stride_bk", "stride_sk", "stride_cn")
CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SCALE_BEFORE_DOT", "compute_type")


def compile_one(block_m: int, block_n: int, block_k: int, warps: int, stages: int, dtype: str) -> dict[str, Any]:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from moonep_ep.ops.experts.mxfp4_kernel import _kernel

    fn = _kernel()
    names = list(fn.arg_names)
    values = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SCALE_BEFORE_DOT": dtype == "bf16",
              "compute_type": tl.bfloat16 if dtype == "bf16" else tl.float16, **{s: 1 for s in UNIT_STRIDES}}
    ptr = {"a_ptr": "*" + dtype, "c_ptr": "*" + dtype, "b_ptr": "*u8", "s_ptr": "*u8", "expert_ids_ptr": "*i32",
           "ntpp_ptr": "*i32"}
    signature = {n: "constexpr" if n in values else ptr.get(n, "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in values.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or (n.startswith("stride_") and n not in UNIT_STRIDES) or n in ("N", "K")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"cfg": [block_m, block_n, block_k, warps, stages, dtype],
            "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "shared": int(kernel.metadata.shared)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("configs", help="JSON list of [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, dtype]")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = [compile_one(*c) for c in json.loads(args.configs)]
    print(json.dumps({"configs": out, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

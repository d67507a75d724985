"""The checks of ``gpu_check.sh`` part 6 (``checks.gpu.mxfp4``) on CPU, under the Triton interpreter.

``python -m tests.support.gpu_mxfp4_interpreted --json`` (run in the vllm==0.33.0 environment: it has Triton;
nothing here imports vLLM, so ``CUDA_VISIBLE_DEVICES`` stays as it is and the CUDA driver emulator sees its
GPU). At a tiny shape (H 256, I 128, E 16, top-k 2, 8 slots) over the emulated store's ``[E+B]`` views (one
rank), the same functions the GPU part runs: the experts against the reference with the stale-scale control,
the kernel against dense bf16, and the race with the CPU's deferred slot fills
(``MOONEP_EP_CPU_DEFERRED_COPIES``: a reader that did not wait sees the old bytes) and, as the control, with
copies made at issue. Also how a compiled kernel is described (``describe_compiled``), on a stand-in of
Triton 3.8's compiled-kernel object, since the interpreter compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import namedtuple
from types import SimpleNamespace
from typing import Any

SHAPE = ("tiny", 256, 128, 16, 2)


def _describe_a_stand_in() -> dict[str, Any]:
    from checks.gpu.mxfp4 import describe_compiled

    meta = namedtuple("KernelMetadata", "num_warps num_stages shared name")(8, 3, 65536, "k")
    fn = SimpleNamespace(arg_names=["a_ptr", "M", "stride_bk", "BLOCK_M", "BLOCK_N", "compute_type"])
    # Triton 3.8's ASTSource.constants: {(argument index,): value}; stride_bk == 1 is a specialization
    src = SimpleNamespace(fn=fn, constants={(2,): 1, (3,): 128, (4,): 64, (5,): "bf16"})
    kernel = SimpleNamespace(metadata=meta, src=src, n_regs=255, n_spills=40, _init_handles=lambda: None)
    return describe_compiled(kernel)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mended = mend_interpreter()  # the interpreter's bf16 dot and downcasts (its own bugs, not the kernel's)
    import torch

    from checks.gpu import mxfp4 as g

    shape = g.Shape(*SHAPE)
    cpu = torch.device("cpu")
    out: dict[str, Any] = {"mended": mended, "shape": SHAPE}
    t0 = time.perf_counter()
    with g.expert_views(shape, cpu) as (views, info):
        out["views"] = info
        out["experts"] = g.check_experts(views, shape)
        out["kernel"] = g.measure_kernel(views, shape, loads={"decode": 16}, trials=1)
        out["race_deferred"] = g.run_race(views, shape, trials=2)
        os.environ["MOONEP_EP_CPU_DEFERRED_COPIES"] = "0"
        out["race_at_issue"] = g.run_race(views, shape, trials=1)
    with g.expert_views(shape, cpu, vmm=False) as (views, info):
        out["plain_views"] = info
    out["described"] = _describe_a_stand_in()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

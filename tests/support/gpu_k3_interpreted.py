"""``gpu_check.sh`` part 7 (``checks.gpu.k3``) on CPU, under the Triton interpreter, at a tiny shape.

``python -m tests.support.gpu_k3_interpreted --json`` (run in the vllm==0.33.0 environment: it has Triton;
nothing here imports vLLM). The same functions the GPU part runs — the K3 layer through the project's MXFP4
Triton experts with SiTU, its four controls, the dense fp32 reference — at widths that are multiples of 128
(model 256, latent 128, experts 128, shared 256), 8 experts, top-4, 16 tokens, with the interpreter's block
config; the interpreter's bf16 dot and downcasts mended (``testing/triton_interpreter.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TINY = {"hidden": 256, "latent": 128, "inter": 128, "shared": 256, "experts": 8, "top_k": 4, "tokens": 16,
        "padding": 16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mended = mend_interpreter()
    import torch

    from checks.gpu import k3
    from moonep_ep.vllm.experts.gpu import INTERPRETER_CONFIG

    dims = k3.K3Dims(**TINY)
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    out = {"mended": mended, **k3.run_layer(dims, k3._views(dims, cpu), cpu, dict(INTERPRETER_CONFIG))}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

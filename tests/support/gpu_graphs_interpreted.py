"""``gpu_check.sh`` part 8 (``checks.gpu.graphs``) on CPU: the capture-and-replay emulator for CUDA graphs, Triton's
interpreter for the MXFP4 kernel, at a tiny shape.

``python -m tests.support.gpu_graphs_interpreted --json`` (in the vllm==0.33.0 environment: it has Triton; nothing
here imports vLLM). The same functions the GPU part runs (the slot fill from the table on the device, the wait,
the experts; capture, replays against eager; the step without the wait refused at capture's end) with
``moonep_ep.testing.cuda_capture.CapturedGraph`` in place of ``torch.cuda.graph``, plain tensors in place of the
VMM store, widths 256 and 128, 8 experts, 2 slots, top-4, the interpreter's block config, at 1 and 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TINY = {"hidden": 256, "inter": 128, "experts": 8, "slots": 2, "top_k": 4, "padding": 16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mended = mend_interpreter()
    import torch

    from checks.gpu import graphs
    from moonep_ep.testing.cuda_capture import CapturedGraph
    from moonep_ep.vllm.experts.gpu import INTERPRETER_CONFIG

    t0 = time.perf_counter()
    out = {"mended": mended, **graphs.run_all(graphs.Dims(**TINY), torch.device("cpu"), CapturedGraph,
                                              dict(INTERPRETER_CONFIG), sizes=(1, 8), vmm=False)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

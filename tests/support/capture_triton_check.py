"""An interpreted Triton launch under the capture-and-replay emulator (``src/moonep_ep/testing/cuda_capture.py``).

``python -m tests.support.capture_triton_check`` runs in the vllm==0.33.0 environment (it has Triton; nothing
here imports vLLM), in Triton's interpreter. A step of aten ops around one launch (``y = 2x * alpha + 1``
into a ``torch.empty_like``) is captured once and replayed with three inputs:

* each replay equals an eager run bit for bit; the launch is one recorded item (kernel, grid, arguments);
* the control: the same recording with its launch items taken out disagrees (the launch is what computes);
* an ``item()`` for a launch's scalar argument is refused, named at this file.

Prints one JSON document.
"""

from __future__ import annotations

import json
import sys

from moonep_ep.testing.triton_interpreter import enter_interpreter


def main() -> int:
    enter_interpreter()
    import torch
    import triton
    import triton.language as tl

    from moonep_ep.testing.cuda_capture import CaptureRefused, _Launch, capture
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mend_interpreter()

    @triton.jit
    def scale_add(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha + 1.0, mask=mask)

    def step(x):
        h = x * 2
        y = torch.empty_like(h)
        scale_add[(2,)](h, y, 64, 3.0, BLOCK=32)
        return y + y.sum()

    def with_item(x):
        y = torch.empty_like(x)
        scale_add[(2,)](x, y, 64, x[0].item(), BLOCK=32)
        return y

    static = torch.zeros(64)
    step(static)   # compiled (interpreted) once, before capture, as warm-up does
    graph, out = capture(step, static)
    result = {"launch_items": sum(isinstance(i, _Launch) for i in graph.items),
              "poisoned_after_capture": bool(out.isnan().all()), "replays_equal": [], "ops": graph.op_names()}
    for seed in (1, 2, 3):
        x = torch.randn(64, generator=torch.Generator().manual_seed(seed))
        static.copy_(x)
        graph.replay()
        result["replays_equal"].append(bool(torch.equal(out, step(x))))
    graph.items = [i for i in graph.items if not isinstance(i, _Launch)]
    static.copy_(torch.randn(64, generator=torch.Generator().manual_seed(4)))   # y keeps seed 3's values
    graph.replay()
    result["control_without_launch_equal"] = bool(torch.equal(out, step(static)))
    try:
        capture(with_item, static)
        result["item_refused"] = None
    except CaptureRefused as err:
        result["item_refused"] = [err.kind, err.site]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

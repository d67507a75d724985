"""An interpreted Triton launch is device work for the host-read counter; the reads around it are not.

``python -m tests.support.host_syncs_interpreter_check`` runs in the vllm==0.33.0 environment (it has Triton;
nothing here imports vLLM), in Triton's interpreter. One kernel, ``y[i] = bf16(x[i] * 2)`` (the interpreter's mended bf16 cast reads through numpy), launched inside
``count_host_syncs()``:

* the launch alone: 0 reads (on a GPU it is queued; the interpreter's copies to and from the host are the CPU
  standing in for the device);
* an ``item()`` for a scalar argument before the launch: 1 read, named at this file (the caller's read stays
  counted);
* the control: the same launch with the exemption taken away counts the interpreter's own copies (more than 0),
  so the 0 above is the exemption's doing, not a counter that saw nothing.

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

    from moonep_ep.testing import host_syncs
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mend_interpreter()   # as the CPU engine's Triton experts run: its bf16 cast goes through torch and numpy

    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, (tl.load(x_ptr + offs, mask=mask) * 2).to(tl.bfloat16), mask=mask)

    x = torch.arange(64, dtype=torch.float32)
    y = torch.zeros(64, dtype=torch.bfloat16)
    n = torch.tensor(64)
    double[(2,)](x, y, 64, BLOCK=32)   # compiled (interpreted) once, outside any counter
    out = {}
    with host_syncs.count_host_syncs() as syncs:
        double[(2,)](x, y, 64, BLOCK=32)
    out["launch"] = syncs.total
    out["launch_result_ok"] = bool(torch.equal(y, (x * 2).to(torch.bfloat16)))
    with host_syncs.count_host_syncs() as syncs:
        double[(2,)](x, y, n.item(), BLOCK=32)
    out["item_then_launch"] = syncs.total
    out["item_site"] = sorted(syncs.by_function())
    targets = host_syncs._sync_targets

    def without_interpreter():
        for owner, name, kind in targets():
            if name != "__call__":
                yield owner, name, kind
    host_syncs._sync_targets = without_interpreter
    try:
        with host_syncs.count_host_syncs() as syncs:
            double[(2,)](x, y, 64, BLOCK=32)
        out["control_launch_without_exemption"] = syncs.total
    finally:
        host_syncs._sync_targets = targets
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

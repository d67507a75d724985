"""The BF16 experts' CUDA branch (``vllm/experts/overlap.apply`` -> ``bf16_gpu.py``) on CPU under the Triton
interpreter, against a dense reference written here.

``python -m tests.support.bf16_gpu_experts_check`` runs in the vllm==0.33.0 environment, one process, no store.
``overlap.apply`` is called as vLLM's modular kernel calls ``MoonEPExperts.apply``, with ``bf16_gpu.runs_here``
answering for CUDA (the rows are on the CPU here), so the code that runs is the GPU's: vLLM's unquantized
``fused_moe_kernel`` and the fused activation kernel, interpreted. Layout: ``E`` own groups and ``B`` slots
(:data:`COUNTS`, groups padded to :data:`TOKEN_PADDING` with zero-weight rows, one 16-row block of padding
only, an empty group), stale rows past ``cu_seqlens[-1]``, an output prefilled with :data:`SENTINEL`. The slot
weights are stale until the slot fill's event is waited on (its ``wait()`` copies the right rows in), so a slot
row computed before the wait misses.

Reference: per live row, fp32 math on the dense weights (``x @ W.T``), rounded to the dtype where the path
stores (the GEMM outputs, the activation, the route product, the output); SiLU rounded then times ``up``
rounded (vLLM's two steps), SiTU (vLLM's ``SituAndMul`` formula, beta 4, linear_beta 25) rounded once. Judged
per row: ``max|out - ref| / max|ref|``. The CPU engine's branch (``torch._grouped_mm``) is judged on the same
inputs too. Controls: a block metadata whose expert ids are off by one row, and the
split run without the slot fill's wait; each must miss the bound. fp16 runs as the interpreter computes it;
bf16 (MoonEP's dtype) after ``mend_interpreter`` (its bf16 dot and downcasts are wrong unmended).
Prints one JSON document.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import types

from moonep_ep.testing.triton_interpreter import enter_interpreter

H, I, E, B = 128, 128, 4, 2
TOKEN_PADDING = 16
#: rows per [E+B] group (multiples of TOKEN_PADDING) and the live (token, expert) rows at each group's start
COUNTS = [16, 0, 32, 16, 16, 32]
LIVE = [11, 0, 12, 16, 5, 16]      # the second 16-row blocks of groups 2 and 5 are padding only
TAIL = 16
SLOT_EXPERTS = [3, 0]              # slot e -> the expert whose weights it holds once filled
SENTINEL = 7.0
BETA, LINEAR_BETA = 4.0, 25.0


def inputs(dtype):
    import torch

    gen = torch.Generator().manual_seed(5)
    rows = sum(COUNTS) + TAIL
    hidden = torch.randn(rows, H, generator=gen).to(dtype)
    route = torch.zeros(rows)
    start = 0
    for n, live in zip(COUNTS, LIVE):
        route[start:start + live] = torch.rand(live, generator=gen) * 0.9 + 0.1
        start += n
    route[start:] = float("nan")   # stale rows past the groups: never read
    dense = {"gate": torch.randn(E, I, H, generator=gen) * 0.25 / H ** 0.5 * 4,
             "up": torch.randn(E, I, H, generator=gen) * 1.25 / H ** 0.5 * 16,
             "down": torch.randn(E, H, I, generator=gen) / I ** 0.5}
    dense = {k: v.to(dtype) for k, v in dense.items()}
    stale = {k: torch.randn(B, *v.shape[1:], generator=gen).to(dtype) for k, v in dense.items()}
    filled = {k: v[SLOT_EXPERTS] for k, v in dense.items()}
    store = {k: torch.cat([v, stale[k]]).contiguous() for k, v in dense.items()}
    counts = torch.tensor(COUNTS, dtype=torch.int64)
    return hidden, route, counts, store, filled


def reference(hidden, route, counts, store, filled, act):
    """``[rows, H]`` fp32, NaN where not judged (padding, tail)."""
    import torch

    dtype = hidden.dtype
    weights = {k: torch.cat([v[:E], filled[k]]).float() for k, v in store.items()}
    out = torch.full((hidden.shape[0], H), float("nan"))
    start = 0
    for g, (n, live) in enumerate(zip(COUNTS, LIVE)):
        x = hidden[start:start + live].float()
        gate = (x @ weights["gate"][g].T).to(dtype).double()
        up = (x @ weights["up"][g].T).to(dtype).double()
        if act == "silu":
            a = (torch.nn.functional.silu(gate).to(dtype).double() * up.to(dtype).double()).to(dtype)
        else:
            t = BETA * torch.tanh(gate / BETA) * torch.sigmoid(gate)
            a = (t * (LINEAR_BETA * torch.tanh(up / LINEAR_BETA))).to(dtype)
        w = route[start:start + live].to(dtype).double()
        a = (a.double() * w[:, None]).to(dtype).float()
        out[start:start + live] = (a @ weights["down"][g].T).to(dtype).float()
        start += n
    return out


def row_error(y, ref) -> float:
    import torch

    judged = ~torch.isnan(ref[:, 0])
    err = (y.float()[judged] - ref[judged]).abs().amax(dim=1) / ref[judged].abs().amax(dim=1)
    return float(err.max())


class SlotFill:
    """The slot fill's event: the right weights land in the slot rows when it is waited on."""

    def __init__(self, store, filled, trace):
        self.store, self.filled, self.trace = store, filled, trace

    def wait(self):
        for k, v in self.filled.items():
            self.store[k][E:].copy_(v)
        self.trace.append("filled")


def run(dtype, act_name: str, *, one_pass: bool, wait: bool = True, corrupt: bool = False,
        gpu_branch: bool = True) -> dict:
    import torch

    from moonep_ep.vllm.experts import bf16_gpu, overlap

    hidden, route, counts, store, filled = inputs(dtype)
    ref = reference(hidden, route, counts, store, filled, act_name)
    layout = types.SimpleNamespace(own_groups=E, full_gate_weight=store["gate"], full_up_weight=store["up"],
                                   full_down_weight=store["down"])
    moe = types.SimpleNamespace(activation_situ_beta=BETA, activation_situ_linear_beta=LINEAR_BETA,
                                num_local_experts=E, intermediate_size_per_partition=I)
    experts = types.SimpleNamespace(_weight_layout=layout, moe_config=moe)
    gpu = bf16_gpu.gpu_experts(experts, token_padding=TOKEN_PADDING, interpreter=True)
    if corrupt:   # every computed block reads the next weight row: the negative control of the block metadata
        real = gpu.blocks

        def off_by_one(*args, **kwargs):
            b = real(*args, **kwargs)
            ids = torch.where(b.expert_ids >= 0, (b.expert_ids + 1) % (E + B), b.expert_ids)
            return dataclasses.replace(b, expert_ids=ids)

        gpu.blocks = off_by_one
    trace: list = []
    overlap.TRACE.events = trace
    overlap.SLOT_FILL_HANDOFF.event = SlotFill(store, filled, trace) if wait else None
    overlap.SLOT_FILL_HANDOFF.one_pass = one_pass
    y = torch.full((hidden.shape[0], H), SENTINEL, dtype=dtype)
    topk_ids = torch.empty(8, 2, dtype=torch.int64, device="meta")   # the step's tokens: only its shape is read
    runs_here = bf16_gpu.runs_here
    bf16_gpu.runs_here = lambda t: gpu_branch
    t0 = time.perf_counter()
    try:
        overlap.apply(experts, y, hidden, store["gate"], store["down"], route, topk_ids, act_name, E, None, None,
                      None, None, None, types.SimpleNamespace(expert_num_tokens=counts), False)
    finally:
        bf16_gpu.runs_here = runs_here
        overlap.TRACE.events = None
    end = int(counts.sum())
    blocks = gpu.blocks(hidden, torch.cumsum(counts, 0).to(torch.int32), route, topk_ids)
    skipped = (blocks.expert_ids < 0) & (torch.arange(blocks.num_blocks) * blocks.block_m < end)
    return {"error": row_error(y, ref), "trace": trace, "tail_untouched": bool((y[end:] == SENTINEL).all()),
            "block_m": blocks.block_m, "padding_blocks_skipped": int(skipped.sum()),
            "seconds": round(time.perf_counter() - t0, 2)}


def main() -> int:
    enter_interpreter()
    import torch

    from moonep_ep.testing.triton_interpreter import mend_interpreter

    t0 = time.perf_counter()
    out: dict = {"runs": {}}
    for dtype in (torch.float16, torch.bfloat16):
        if dtype == torch.bfloat16:
            mend_interpreter()
        name = str(dtype).rsplit(".", 1)[-1]
        for act in ("silu", "situ"):
            for one_pass in (False, True):
                out["runs"][f"{name} {act} {'one pass' if one_pass else 'split'}"] = run(dtype, act,
                                                                                      one_pass=one_pass)
        out["runs"][f"{name} control off-by-one blocks"] = run(dtype, "silu", one_pass=False, corrupt=True)
        out["runs"][f"{name} control no wait"] = run(dtype, "silu", one_pass=False, wait=False)
        for act in ("silu", "situ"):   # the CPU engine's branch (torch._grouped_mm) on the same inputs
            out["runs"][f"{name} {act} cpu branch"] = run(dtype, act, one_pass=False, gpu_branch=False)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

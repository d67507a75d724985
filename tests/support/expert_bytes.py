"""Bytes written by the non-GEMM ops of one MoE layer's experts, at Kimi K3's decode shapes, on ``meta`` tensors.

``tests/ops/test_expert_bytes.py`` runs it. What is measured and how:

* **torch ops** (fills, masks, casts, the activation's elementwise passes, copies): a ``TorchDispatchMode``
  records every aten op and the bytes of the tensors it writes: a functional op's outputs, an in-place or
  ``out=`` op's mutated argument (its view's bytes, not its base's). Allocations (``empty*``) and views write
  nothing and count 0. Measured, on meta tensors, so the figure holds for any values.
* **Triton launches** cannot run on meta (nor without a GPU), so each is a stand-in that counts what the
  kernel writes by its launch: its grid, the programs that exit at once (a row block at or past
  ``num_tokens_post_padded`` = ``cu_seqlens[-1]``, or whose ``expert_ids`` entry is ``-1``), and each other
  program's ``BLOCK_M`` rows times its output width. That needs the block metadata's values, which meta
  tensors lack: the stand-ins read the same metadata built on the CPU from the scenario's ``cu_seqlens`` and
  route weights (:func:`scenario`). A documented model, not a measurement; the kernels' early exits are
  checked under the interpreter (``tests/vllm/test_gated_activation.py``) and ``mxfp4_kernel``'s tests.
  The grouped GEMMs' writes are counted apart (``gemm``); the non-GEMM kernels (the fused gated activation,
  FP8's activation quantization) count as non-GEMM. A launch limited to the own groups or the slots (the BF16
  experts on CUDA, ``restrict_to_groups``) is counted from that function applied to the CPU metadata.

The scenario: Kimi K3 (``models.py``: latent H 3584, I 3072, E 896, top-k 16) at EP 8, capacity S 128,
MoonEP's decode ``token_padding`` 128 (vLLM 0.33.0's ``MOONEP_DEFAULT_TOKEN_PADDING``), ``NvS = S·K +
(tp-1)·2·E/R`` = 30496 rows (``ops/moonep/limits.nvs_rows``). The rank's live rows are its share of the
step's ``S·K`` = 2048 (token, expert) rows, drawn uniformly over its 112 experts (seeded), each group padded
to 128 rows; padding rows carry route weight 0 (MoonEP's dispatch), so ``skip_zero_weight_blocks`` marks
blocks of padding only ``-1``.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moonep_ep.models import get_model
from moonep_ep.ops.experts.grouped_blocks import grouped_blocks, skip_zero_weight_blocks
from moonep_ep.ops.moonep.limits import nvs_rows
from tests.support.vllm_stubs import install

EP, CAPACITY, TOKEN_PADDING, SLOTS = 8, 128, 128, 8
FUSED = "vllm.model_executor.layers.fused_moe"
FP8_UTILS = "vllm.model_executor.layers.quantization.utils.fp8_utils"
#: ops that allocate or alias: they write no bytes
_NO_WRITE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh"}


@dataclasses.dataclass
class Scenario:
    H: int
    I: int
    E: int
    K: int
    nvs: int
    live_rows: int
    cu: torch.Tensor          # [E+B] int32, CPU
    route: torch.Tensor       # [NvS] fp32, CPU
    block_m: int

    @property
    def live_activation_bytes(self) -> int:
        """The live rows' ``[rows, I]`` bf16 activation: the yardstick of the bound."""
        return self.live_rows * self.I * 2

    def blocks(self, block_m: int | None = None) -> Any:
        """The CPU block metadata the kernels' stand-ins read (the FFN builds the same on meta); ``block_m``:
        another block height than the GEMMs' (the fused activation's 16-row blocks)."""
        return skip_zero_weight_blocks(grouped_blocks(self.cu, self.nvs, block_m or self.block_m), self.route)

    def computed_rows(self, block_m: int | None = None) -> int:
        """Rows of the blocks a bounded kernel computes: below ``cu_seqlens[-1]`` and not ``-1``."""
        b = self.blocks(block_m)
        starts = torch.arange(b.num_blocks) * b.block_m
        return int(((b.expert_ids >= 0) & (starts < int(self.cu[-1]))).sum()) * b.block_m


def scenario(block_m: int = 16, seed: int = 0, slot_groups: int = 0) -> Scenario:
    """``slot_groups``: the live rows drawn over the rank's experts and that many of its prefetch slots (rows
    ``[E, E + slot_groups)``, after every expert's), as when the rank computes remote experts it prefetched."""
    k3 = get_model("kimi-k3")
    E, K, H, I = k3.num_experts, k3.top_k, k3.hidden_size, k3.moe_intermediate_size
    epn = E // EP
    nvs = nvs_rows(CAPACITY, K, E, EP, TOKEN_PADDING)
    live = CAPACITY * K
    gen = torch.Generator().manual_seed(seed)
    groups = list(range(epn)) + list(range(E, E + slot_groups))
    drawn = torch.bincount(torch.randint(0, len(groups), (live,), generator=gen), minlength=len(groups))
    counts = torch.zeros(E + SLOTS, dtype=torch.int64)
    counts[groups] = drawn
    padded = (counts + TOKEN_PADDING - 1) // TOKEN_PADDING * TOKEN_PADDING
    cu = padded.cumsum(0).to(torch.int32)
    route = torch.zeros(nvs)
    for g in groups:
        start = int(cu[g] - padded[g])
        route[start:start + int(counts[g])] = torch.rand(int(counts[g]), generator=gen) * 0.9 + 0.1
    return Scenario(H=H, I=I, E=E, K=K, nvs=nvs, live_rows=live, cu=cu, route=route, block_m=block_m)


class WriteCounter(TorchDispatchMode):
    """Bytes each aten op writes (see the module docstring), summed per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        written = 0
        if name not in _NO_WRITE:
            rets = func._schema.returns
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for ret, t in zip(rets, outs):
                alias = ret.alias_info
                if not isinstance(t, torch.Tensor) or (alias is not None and not alias.is_write):
                    continue  # a view, or not a tensor
                written += t.numel() * t.element_size()
        if written:
            self.by_op[name] = self.by_op.get(name, 0) + written
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


class KernelModel:
    """Stand-ins for the Triton launches, each counting its modeled writes (module docstring).

    A launch limited to a part of the weight rows (the BF16 experts' own groups, then slots:
    ``restrict_to_groups``) is told apart by its ``num_tokens_post_padded`` tensor, recorded when the code
    makes it (:meth:`record_part`); its rows are counted from the same function applied to the CPU metadata."""

    BLOCK_MS = (16, 32, 64, 128)

    def __init__(self, sc: Scenario, parts: tuple = ()) -> None:
        self.sc = sc
        self.gemm = 0
        self.non_gemm: dict[str, int] = {}
        self.made: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}   # id(ntpp) -> (ntpp, part)
        # (block_m, part) -> (rows a bounded kernel computes, rows a GEMM writes): counted here, outside the
        # write counter (inside a launch it would count the counting)
        self.rows = {(m, part): self._rows(m, part) for m in self.BLOCK_MS for part in (None, *parts)}

    def _rows(self, block_m: int, part: tuple[int, int] | None) -> tuple[int, int]:
        from moonep_ep.ops.experts.grouped_blocks import restrict_to_groups

        b = self.sc.blocks(block_m)
        if part is not None:
            b = restrict_to_groups(b, self.sc.cu, *part)
        starts = torch.arange(b.num_blocks) * block_m
        live = starts < int(b.num_tokens_post_padded)
        computed = int((live & (b.expert_ids >= 0)).sum()) * block_m
        # computed blocks, and zeros for -1 ones at their valid row ids (vLLM's write_zeros_to_output)
        ids = b.sorted_token_ids.view(-1, block_m)
        written = int((live[:, None] & (ids < self.sc.nvs)).sum())
        return computed, written

    def record_part(self, blocks: Any, part: tuple[int, int]) -> None:
        self.made[id(blocks.num_tokens_post_padded)] = (blocks.num_tokens_post_padded, part)

    def part_of(self, ntpp: Any) -> tuple[int, int] | None:
        made = self.made.get(id(ntpp))
        return made[1] if made is not None and made[0] is ntpp else None

    def add(self, name: str, n: int) -> None:
        self.non_gemm[name] = self.non_gemm.get(name, 0) + n

    def gemm_out(self, c: torch.Tensor, ntpp: Any = None) -> None:
        """A grouped GEMM writes every block below ``num_tokens_post_padded``: computed ones, and zeros for
        ``-1`` ones (vLLM's ``write_zeros_to_output``, the MXFP4 kernel's own) at their valid row ids."""
        rows = self.rows[(self.sc.block_m, self.part_of(ntpp))][1]
        self.gemm += rows * c.shape[-1] * c.element_size()


def _vllm_stubs(monkeypatch: Any, model: KernelModel) -> None:
    def wna16(A, B, C, *args, **kwargs):
        model.gemm_out(C)

    def fused(A, B, C, *args, **kwargs):   # vLLM's fused_moe_kernel: FP8 block, and BF16 unquantized
        model.gemm_out(C, kwargs.get("num_tokens_post_padded"))

    def per_token_group_quant_fp8(a, group, use_ue8m0=False, **kwargs):
        # vLLM's kernel: one program per (row, group) over every row of a
        q = torch.empty(a.shape, dtype=torch.float8_e4m3fn, device=a.device)
        s = torch.empty(a.shape[0], a.shape[1] // group, dtype=torch.float32, device=a.device)
        model.add("vllm per_token_group_quant_fp8", q.numel() + s.numel() * 4)
        return q, s

    fused = types.SimpleNamespace(invoke_fused_moe_wna16_triton_kernel=wna16, invoke_fused_moe_triton_kernel=fused)
    tl = types.SimpleNamespace(bfloat16="tl.bfloat16", float16="tl.float16")
    platform = types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)
    install(monkeypatch, {"vllm": {}, "vllm.triton_utils": {"tl": tl}, "vllm.platforms": {"current_platform": platform},
                          FUSED: {"fused_moe": fused}, f"{FUSED}.fused_moe": vars(fused),
                          FP8_UTILS: {"per_token_group_quant_fp8": per_token_group_quant_fp8,
                                      "get_fp8_min_max": lambda: (-448.0, 448.0)},
                          "triton": {}, "triton.language": {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}})


def _mxfp4_stub(monkeypatch: Any, model: KernelModel) -> None:
    from moonep_ep.ops.experts import mxfp4_kernel as mk

    class Launch:
        def __getitem__(self, grid):
            return lambda a, b, s, c, *args, **kwargs: model.gemm_out(c)

    monkeypatch.setattr(mk, "_kernel", lambda: Launch())


def _activation_stub(monkeypatch: Any, model: KernelModel, fused: bool) -> bool:
    """The fused gated activation (when the code has it): its launch counted by the model."""
    try:
        from moonep_ep.ops.experts import gated_activation_kernel as gk
    except ImportError:
        return False
    def launch(x, y, out, route, blocks, activation, quant=None, **kwargs):
        # the blocks this launch was given (on meta: their height, and the part they were limited to)
        rows = model.rows[(blocks.block_m, model.part_of(blocks.num_tokens_post_padded))][0]
        width = out.shape[1]
        model.add("fused gated activation" if activation is not None else "fused fp8 quantization",
                  rows * width * out.element_size() + (rows * (width // quant[2]) * 4 if quant is not None else 0))

    monkeypatch.setattr(gk, "launch", launch)
    monkeypatch.setattr(gk, "use_triton", lambda t: fused)
    return fused


def meta_views(fmt: str, sc: Scenario, split: bool = False) -> dict[str, torch.Tensor]:
    G, H, I = sc.E + SLOTS, sc.H, sc.I
    m = lambda *shape, dtype=torch.uint8: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    if fmt == "mxfp4":
        return {"w13_weight_packed": m(G, 2 * I, H // 2), "w13_weight_scale": m(G, 2 * I, H // 32),
                "w2_weight_packed": m(G, H, I // 2), "w2_weight_scale": m(G, H, I // 32)}
    if fmt == "int4-g32":
        return {"w13_weight_packed": m(G, 2 * I, H // 8, dtype=torch.int32),
                "w13_weight_scale": m(G, 2 * I, H // 32, dtype=torch.bfloat16),
                "w2_weight_packed": m(G, H, I // 8, dtype=torch.int32),
                "w2_weight_scale": m(G, H, I // 32, dtype=torch.bfloat16)}
    e4m3 = torch.float8_e4m3fn
    return {"w13_weight": m(G, 2 * I, H, dtype=e4m3), "w13_weight_scale_inv": m(G, 2 * I // 128, H // 128,
                                                                                  dtype=torch.float32),
            "w2_weight": m(G, H, I, dtype=e4m3), "w2_weight_scale_inv": m(G, H // 128, I // 128, dtype=torch.float32)}


def measure_ffn(fmt: str, activation: Any, sc: Scenario, monkeypatch: Any, fused: bool = True) -> dict[str, Any]:
    """Bytes the non-GEMM ops of ``gpu_grouped_ffn`` write for one layer, and the GEMMs' apart; ``fused=False``:
    as where the kernel cannot run (the eager chain over every row, the control)."""
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    # torch imports its compiler at the first device-side assert on meta, and that import probes triton: done
    # before the triton stand-in goes in
    grouped_blocks(torch.empty(1, dtype=torch.int32, device="meta"), 16, 16)
    with monkeypatch.context() as mp:
        model = KernelModel(sc)
        _vllm_stubs(mp, model)
        _mxfp4_stub(mp, model)
        fused = _activation_stub(mp, model, fused)
        meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
        hidden = torch.empty(sc.nvs, sc.H, dtype=torch.bfloat16, device="meta")
        cfg = {"BLOCK_SIZE_M": sc.block_m, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
        counter = WriteCounter()
        with counter:
            out = gpu_grouped_ffn(fmt, hidden, meta_views(fmt, sc), meta(sc.cu), meta(sc.route),
                                  token_padding=TOKEN_PADDING, config=cfg, activation=activation)
        assert out.device.type == "meta" and tuple(out.shape) == (sc.nvs, sc.H)
    return {"torch_ops": dict(counter.by_op), "kernels": dict(model.non_gemm), "gemm": model.gemm,
            "non_gemm": counter.total + sum(model.non_gemm.values()), "fused_activation": fused}


def measure_bf16(activation: Any, sc: Scenario, monkeypatch: Any, *, one_pass: bool = True,
                 gpu_path: bool = True) -> dict[str, Any]:
    """Bytes the non-GEMM ops of the BF16 experts on a GPU write (``vllm/experts/overlap.apply``'s CUDA branch,
    ``bf16_gpu.py``): ``one_pass`` a decode-sized step (wait, every group at once), else own groups, wait, slot
    groups. The code runs as on CUDA on meta tensors (``runs_here`` answers for CUDA), its launches are the
    stand-ins of :func:`measure_ffn` (vLLM's ``fused_moe_kernel`` for the GEMMs, counted apart), and the tiles
    are ``sc.block_m`` rows (the config lookup answers with them). ``gpu_path`` False (with ``one_pass``: the
    other branch reads the split row on the host): the CPU engine's branch, ``torch._grouped_mm`` (a stand-in
    counted apart) and the eager activation over every row, the control."""
    from moonep_ep.vllm.experts import bf16_gpu, gpu, overlap

    G, H, I = sc.E + SLOTS, sc.H, sc.I
    m = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    layout = types.SimpleNamespace(own_groups=sc.E, full_gate_weight=m(G, I, H), full_up_weight=m(G, I, H),
                                   full_down_weight=m(G, H, I))
    moe = types.SimpleNamespace(activation_situ_beta=activation.beta,
                                activation_situ_linear_beta=activation.linear_beta, num_local_experts=sc.E // EP,
                                intermediate_size_per_partition=I)
    fake = types.SimpleNamespace(_weight_layout=layout, moe_config=moe)
    bf16_gpu.gpu_experts(fake, token_padding=TOKEN_PADDING)
    cfg = {"BLOCK_SIZE_M": sc.block_m, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
    grouped_blocks(torch.empty(1, dtype=torch.int32, device="meta"), 16, 16)   # torch's compiler import first
    output = m(sc.nvs, H)
    counter = WriteCounter()
    with monkeypatch.context() as mp:
        model = KernelModel(sc, parts=((0, sc.E), (sc.E, G)))
        _vllm_stubs(mp, model)
        _activation_stub(mp, model, True)
        mp.setattr(bf16_gpu, "runs_here", lambda t: gpu_path)

        def grouped(a, w, offs):   # the CPU branch's torch._grouped_mm: its output, counted as GEMM bytes
            y = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
            model.gemm += y.numel() * y.element_size()
            return y

        mp.setattr(overlap, "_grouped", grouped)
        mp.setattr(gpu, "kernel_config", lambda fmt, **kwargs: dict(cfg))
        restrict = overlap.restrict_to_groups

        def restrict_recorded(blocks, cu, lo, hi):
            out = restrict(blocks, cu, lo, hi)
            model.record_part(out, (lo, hi))
            return out

        mp.setattr(overlap, "restrict_to_groups", restrict_recorded)
        overlap.SLOT_FILL_HANDOFF.one_pass = one_pass
        trace = overlap.TRACE.events = []
        try:
            with counter:
                overlap.apply(fake, output, m(sc.nvs, H), layout.full_gate_weight, layout.full_down_weight,
                              m(sc.nvs, dtype=torch.float32), m(CAPACITY, sc.K, dtype=torch.int64),
                              activation.name, sc.E, None, None, None, None, None,
                              types.SimpleNamespace(expert_num_tokens=m(G, dtype=torch.int64)), False)
        finally:
            overlap.TRACE.events = None
            overlap.SLOT_FILL_HANDOFF.one_pass = False
    return {"torch_ops": dict(counter.by_op), "kernels": dict(model.non_gemm), "gemm": model.gemm,
            "non_gemm": counter.total + sum(model.non_gemm.values()), "trace": trace}

"""MXFP4 experts on one GPU at Kimi K2 and K3 shapes (``scripts/gpu_check.sh`` part 6).

``python -m checks.gpu.mxfp4 --check experts|kernel|race --json``, from the repository root, prints one JSON
object. It needs a machine with one GPU (compute capability 8.0+), torch, Triton and moonep_ep importable
(installed, or ``src`` on ``PYTHONPATH`` as ``gpu_check.sh`` sets it); not vLLM (the MXFP4 path of
``vllm.experts.gpu`` imports none). Where a precondition is missing (no GPU, the CUDA emulator, Triton missing
or interpreting) it prints ``{"not_applicable": reason, "ok": null}`` and exits 0.

**Weights.** One layer's ``[E+B]`` views of ``w13``/``w2`` weights and E8M0 scales at the model's real shape
(``models.py``: K2 H 7168, I 2048, E 384; K3 H 3584 (latent), I 3072, E 896) and ``B`` = 8 slots: the store over
CUDA VMM on one rank where the driver allows it, else plain device tensors of the same shape (``"views"``
says which and why). Only the rows used are written: random bytes (two E2M1 codes each) and exponents drawn
from ``EXPONENTS`` (values of order 1 in every output, fp16 included).

**The reference** is built here from the bytes, not from the library: each nibble's E2M1 value from its bit
fields (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0; OCP MX v1.0), the E8M0 byte as
``2^(e-127)``, products in fp32, rounded to the activation dtype where the path rounds (gate/up, the SiLU
product, the route weight, the output). What it cannot place is fp32 summation order, so a row's error is a
few ulps of the dtype at the row's scale: ``BOUND``.

* ``experts``: rows of expert 0, of expert ``E-1`` (its weight rows start past 2^31 bytes of their views) and
  of slot 0 (after every owner row; filled from expert 1 by ``ops.moonep.prefetch.pull_slots`` and waited for with
  ``wait_for_slots``), an empty group between, through ``vllm.experts.gpu.gpu_grouped_ffn`` in bf16 and fp16.
  Negative control: one E8M0 byte of the slot's down-projection scales one higher (32 weights doubled); the
  slot rows must then exceed the bound and no other row may move.
* ``kernel``: the MXFP4 grouped GEMM (``gpu_grouped_gemm``) against a dense bf16 grouped GEMM
  (``ops.experts.grouped_mm``) of the same weights dequantized by the reference, at a decode and a prefill
  load, with vLLM 0.33.0's default block config for each (:func:`vllm_default_config`); time ratio from each
  side's fastest of interleaved trials (CUDA events; ``moonep_ep.tools.bench.timing``), and the compiled
  kernels' registers and spills as Triton reports them (``n_regs``, ``n_spills``).
* ``race``: every slot filled by ``pull_slots`` (a side stream) from other experts while it holds a stale
  expert, then the experts, trial after trial: without a wait (on a GPU the copies may still be in flight:
  what was read is reported, not judged) and after ``wait_for_slots`` (must equal, bitwise, the output of
  a run after a full synchronize). The current stream is held busy before each trial so that the copies and
  the experts are all queued before either starts (as in a forward, where the prefetch is issued behind
  earlier work).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

__all__ = ["Shape", "shape_of", "e2m1_from_bits", "dequantize_reference", "reference_ffn", "row_rel_errors",
           "vllm_default_config", "missing_preconditions", "expert_views", "fill_rows", "check_experts",
           "measure_kernel", "run_race", "compiled_kernels", "describe_compiled", "BOUND", "MODELS", "main"]

MODELS = ("kimi-k2", "kimi-k3")
SLOTS = 8
#: E8M0 exponents drawn for the scales, 2^-10 .. 2^-6: with E2M1 values up to 6, outputs of order 10 at K2 and K3
#: widths (fp16 is far from its range)
EXPONENTS = (117, 121)
#: Per-row bound on ``max|out - ref| / max|ref|``: the reference rounds where the path rounds and both take exact
#: products, so what is left is fp32 summation order (a 16-bit rounding of gate/up flips by one ulp) and the final
#: rounding: a few ulps (bf16 2^-8, fp16 2^-11) at the row's scale
BOUND = {"bfloat16": 2.0 ** -6, "float16": 2.0 ** -8}
#: rows per group in ``experts`` (also the token padding: every group starts on a block boundary)
ROWS = 64
#: rows per expert group of the kernel timing: a decode step and a prefill chunk, 8 groups each
LOADS = {"decode": 16, "prefill": 1024}
#: GPU cycles the current stream is held before each race trial (about 5 ms at 2 GHz)
HOLD_CYCLES = 10_000_000


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    H: int
    I: int  # noqa: E741 - the model table's name
    E: int
    top_k: int
    B: int = SLOTS


def shape_of(model: str, slots: int = SLOTS) -> Shape:
    from moonep_ep.models import get_model

    m = get_model(model)
    return Shape(m.name, m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, slots)


# ---------------------------------------------------------------------------
# the reference: from the bytes, independent of the library


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (0..15) from their bit fields: sign bit 3; exponent bits 2-1, bias 1;
    mantissa bit 0; exponent 0 is subnormal (``0.5 · m``)."""
    c = codes.to(torch.int32)
    sign = 1.0 - 2.0 * ((c >> 3) & 1).to(torch.float32)
    exponent = ((c >> 1) & 3).to(torch.float32)
    mantissa = (c & 1).to(torch.float32)
    normal = torch.exp2(exponent - 1.0) * (1.0 + 0.5 * mantissa)
    return sign * torch.where(exponent == 0, 0.5 * mantissa, normal)


def dequantize_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` fp32 from ``packed [..., N, K/2]`` (the even ``k`` in the low nibble) and E8M0
    ``scale [..., N, K/32]`` (``2^(e - 127)``)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    values = e2m1_from_bits(codes)
    powers = torch.exp2(scale.to(torch.float32) - 127.0)
    K = values.shape[-1]
    return (values.unflatten(-1, (K // 32, 32)) * powers.unsqueeze(-1)).flatten(-2)


def reference_ffn(x: torch.Tensor, route: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The expert FFN of rows ``x`` ``[n, H]`` with dense fp32 ``w13 [2I, H]``, ``w2 [H, I]``, rounded to
    ``x``'s dtype where the path rounds."""
    dtype, inter = x.dtype, w13.shape[0] // 2
    gate_up = (x.float() @ w13.T).to(dtype)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    act = act * route.to(dtype).unsqueeze(-1)
    return (act.float() @ w2.T).to(dtype)


def row_rel_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row ``max|out - ref| / max|ref|`` (fp32)."""
    diff = (out.float() - ref.float()).abs().amax(dim=-1)
    return diff / ref.float().abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------------
# configuration and preconditions


def vllm_default_config(tokens: int, experts: int) -> dict[str, int]:
    """The block config vLLM 0.33.0 gives a 16-bit MoE layer of ``tokens`` tokens and ``experts`` experts when
    no tuned file matches (``fused_moe.py`` ``get_default_config``, dtype ``None``, which is what
    ``vllm.experts.gpu.kernel_config`` asks for MXFP4): M tiles of 16 / 32 / 64 / 128 up to 32 / 96 / 512 tokens
    and beyond; N tiles of 64 up to 64 tokens, else 128, and K tiles of 128, else 64; M groups of 16 above 128
    tokens per expert; 4 warps up to 128 tokens, else 8; 4 stages up to 32 tokens, else 3. A machine with one GPU
    need not have vLLM to ask (its tuned files are not read)."""
    block_m = 16 if tokens <= 32 else 32 if tokens <= 96 else 64 if tokens <= 512 else 128
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if tokens <= 64 else 128,
            "BLOCK_SIZE_K": 128 if tokens <= 64 else 64, "GROUP_SIZE_M": 16 if tokens // max(experts, 1) > 128 else 1,
            "SPLIT_K": 1, "num_warps": 4 if tokens <= 128 else 8, "num_stages": 4 if tokens <= 32 else 3}


def _config(shape: Shape, rows: int, token_padding: int) -> dict[str, int]:
    """The config for ``rows`` grouped rows (``rows / top_k`` tokens), M tiles brought to divide the padding."""
    from moonep_ep.vllm.experts.gpu import fit_block_m

    cfg = vllm_default_config(max(1, rows // shape.top_k), shape.E)
    cfg["BLOCK_SIZE_M"] = fit_block_m(cfg["BLOCK_SIZE_M"], token_padding)
    return cfg


def missing_preconditions() -> list[str]:
    """Why this machine cannot run the checks ([] = it can)."""
    from moonep_ep import envs

    why = []
    if envs.MOONEP_EP_CUDA_EMULATOR:
        why.append("MOONEP_EP_CUDA_EMULATOR=1: the emulated CUDA driver runs no GPU kernels")
    if os.environ.get("TRITON_INTERPRET") == "1":
        why.append("TRITON_INTERPRET=1: Triton would run the kernels on the CPU")
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton here
        why.append(f"Triton is not importable ({type(exc).__name__}: {exc})")
    if not torch.cuda.is_available():
        why.append("torch sees no CUDA GPU")
    elif torch.cuda.get_device_capability(0) < (8, 0):
        why.append(f"bf16 tensor-core dots need compute capability 8.0+, GPU 0 is "
                   f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))}")
    return why


# ---------------------------------------------------------------------------
# weights


def _store_views(shape: Shape, fmt: str) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The store of ``fmt`` over CUDA VMM on one rank (a one-process gloo group): ``(views, store, driver)``."""
    import torch.distributed as dist

    from moonep_ep.layout.formats import expert_projections
    from moonep_ep.layout.store import ShardedExpertStore
    from moonep_ep.memory import make_driver

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    driver = make_driver("cuda", rank=0)
    try:
        projs = expert_projections(fmt, shape.H, shape.I)
        store = ShardedExpertStore(num_layers=1, num_experts=shape.E, projections=projs, num_slots=shape.B,
                                   driver=driver)
    except BaseException:
        driver.close()
        raise
    return {p.name: store.pull_view(0, p.name) for p in projs}, store, driver


@contextlib.contextmanager
def expert_views(shape: Shape, device: torch.device, vmm: bool = True, fmt: str = "mxfp4"
                 ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """``({name: [E+B, ...] view}, info)`` of format ``fmt``: the VMM store's views (``vmm``, when the driver
    allows), else plain tensors on ``device``; ``info["views"]`` says which, and why not the store."""
    from moonep_ep.layout.formats import expert_projections

    store = driver = None
    info: dict[str, Any] = {}
    views: dict[str, torch.Tensor] = {}
    if vmm:
        try:
            views, store, driver = _store_views(shape, fmt)
            info["views"] = "store over CUDA VMM, one rank"
        except Exception as exc:  # noqa: BLE001 - a sandbox refusing VMM calls: plain tensors instead
            info["views"] = "plain device tensors"
            info["vmm_not_applicable"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if store is None:
        info.setdefault("views", "plain device tensors")
        views = {p.name: torch.empty((shape.E + shape.B, *p.shape), dtype=p.dtype, device=device)
                 for p in expert_projections(fmt, shape.H, shape.I)}
    try:
        yield views, info
    finally:
        views.clear()
        if store is not None:
            store.close()
            driver.close()


def fill_rows(views: dict[str, torch.Tensor], rows: list[int], seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Write random codes and E8M0 exponents into ``rows`` of every view; returns what was written."""
    device = next(iter(views.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    written: dict[int, dict[str, torch.Tensor]] = {}
    for row in rows:
        written[row] = {}
        for name, view in views.items():
            lo, hi = EXPONENTS if name.endswith("scale") else (0, 255)
            t = torch.randint(lo, hi + 1, tuple(view.shape[1:]), generator=gen, device=device, dtype=torch.uint8)
            view[row].copy_(t)
            written[row][name] = t
    return written


def _dense(written: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    return dequantize_reference(written[f"{proj}_weight_packed"], written[f"{proj}_weight_scale"])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cu(shape: Shape, counts: dict[int, int], device: torch.device) -> torch.Tensor:
    per_row = torch.zeros(shape.E + shape.B, dtype=torch.int64)
    for row, n in counts.items():
        per_row[row] = n
    return torch.cumsum(per_row, 0).to(torch.int32).to(device)


def _offsets(views: dict[str, torch.Tensor], row: int) -> dict[str, int]:
    return {name: v[row].data_ptr() - v.data_ptr() for name, v in views.items()}


# ---------------------------------------------------------------------------
# experts


def check_experts(views: dict[str, torch.Tensor], shape: Shape, dtypes: tuple[torch.dtype, ...] =
                  (torch.bfloat16, torch.float16), rows: int = ROWS, seed: int = 0) -> dict[str, Any]:
    """Expert 0, expert ``E-1`` and slot 0 (filled from expert 1) through ``gpu_grouped_ffn`` against the
    reference, per dtype; then the negative control (see the module docstring)."""
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    E, last = shape.E, shape.E - 1
    device = next(iter(views.values())).device
    written = fill_rows(views, [0, 1, last], seed)
    _, _, event = pull_slots(views, [1], E)  # slot 0 <- expert 1
    wait_for_slots(event)
    groups = {"expert_0": 0, "expert_last": last, "slot_0": E}   # expert 1 has no rows: an empty group between
    source = {"expert_0": 0, "expert_last": last, "slot_0": 1}
    cu = _cu(shape, {row: rows for row in groups.values()}, device)
    M = rows * len(groups)
    cfg = _config(shape, M, rows)
    res: dict[str, Any] = {"model": shape.name, "H": shape.H, "I": shape.I, "E": shape.E, "B": shape.B,
                           "rows_per_group": rows, "config": cfg,
                           "expert_last_offsets": _offsets(views, last), "slot_0_offsets": _offsets(views, E)}
    weights = [n for n in views if not n.endswith("scale")]
    res["past_2_31"] = all(res[k][n] >= 2 ** 31 for k in ("expert_last_offsets", "slot_0_offsets") for n in weights)
    dense = {e: (_dense(written[e], "w13"), _dense(written[e], "w2")) for e in set(source.values())}
    gen = torch.Generator().manual_seed(seed + 1)
    x32 = torch.randn(M, shape.H, generator=gen)
    route = (torch.rand(M, generator=gen) + 0.1).to(device)
    ok = res["past_2_31"]
    outputs: dict[torch.dtype, torch.Tensor] = {}
    for dtype in dtypes:
        x = x32.to(device=device, dtype=dtype)
        out = gpu_grouped_ffn("mxfp4", x, views, cu, route, token_padding=rows, config=cfg)
        outputs[dtype] = out
        ref = torch.cat([reference_ffn(x[i * rows:(i + 1) * rows], route[i * rows:(i + 1) * rows], *dense[source[g]])
                         for i, g in enumerate(groups)])
        errs = row_rel_errors(out, ref)
        name = str(dtype).replace("torch.", "")
        by_group = {g: float(errs[i * rows:(i + 1) * rows].max()) for i, g in enumerate(groups)}
        res[name] = {"max_row_rel_err": by_group, "bound": BOUND[name],
                     "within": all(v <= BOUND[name] for v in by_group.values())}
        ok = ok and res[name]["within"]
    # Negative control: one E8M0 byte of the slot's w2 scales one higher: output row 0's group of 32 with the
    # largest exponent (a group of small scale moves the output less than the rounding does).
    dtype = dtypes[0]
    name = str(dtype).replace("torch.", "")
    scale = views["w2_weight_scale"]
    group = int(written[1]["w2_weight_scale"][0].argmax())
    saved = scale[E, 0, group].clone()
    scale[E, 0, group] += 1
    try:
        x = x32.to(device=device, dtype=dtype)
        out = gpu_grouped_ffn("mxfp4", x, views, cu, route, token_padding=rows, config=cfg)
        ref = reference_ffn(x[2 * rows:], route[2 * rows:], *dense[1])
        control = float(row_rel_errors(out[2 * rows:], ref).max())
        others_unmoved = torch.equal(out[:2 * rows], outputs[dtype][:2 * rows])
    finally:
        scale[E, 0, group] = saved
    res["control_slot_scale_plus_one"] = {"dtype": name, "group": group, "max_row_rel_err": control,
                                          "bound": BOUND[name], "exceeds": control > BOUND[name],
                                          "other_rows_unmoved": others_unmoved}
    res["ok"] = bool(ok and control > BOUND[name] and others_unmoved)
    return res


# ---------------------------------------------------------------------------
# kernel: time against dense bf16, registers and spills


def describe_compiled(kernel: Any) -> dict[str, Any]:
    """One compiled Triton kernel: its constexprs (by argument name), warps, stages, shared memory, and the
    registers and spills Triton's loader reports (``n_regs``, ``n_spills``: set when the binary is loaded)."""
    with contextlib.suppress(Exception):
        kernel._init_handles()  # loaded at its first launch already: a no-op then
    meta = kernel.metadata
    src = getattr(kernel, "src", None)
    names = list(getattr(getattr(src, "fn", None), "arg_names", []))
    constexprs = {}
    for key, value in (getattr(src, "constants", None) or {}).items():
        idx = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        label = names[idx] if isinstance(idx, int) and idx < len(names) else str(key)
        if label.isupper() or label.endswith("_type"):  # the kernel's constexprs, not specialized integers
            constexprs[label] = value if isinstance(value, (int, float)) else str(value)
    return {"constexprs": constexprs, "num_warps": getattr(meta, "num_warps", None),
            "num_stages": getattr(meta, "num_stages", None), "shared_bytes": getattr(meta, "shared", None),
            "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)}


def compiled_kernels(kernel_name: str) -> list[dict[str, Any]]:
    """Every compiled variant of the Triton kernel named ``kernel_name`` in this process
    (:func:`describe_compiled`; a variant Triton's internals do not let us read says why)."""
    import gc

    from triton.runtime.jit import JITFunction

    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, JITFunction) or getattr(getattr(obj, "fn", None), "__name__", "") != kernel_name:
            continue
        # Triton 3.x: device_caches[device] = (kernel_cache, ...); earlier: cache[device] = kernel_cache
        caches = [c[0] for c in getattr(obj, "device_caches", {}).values()] or list(getattr(obj, "cache", {}).values())
        for cache in caches:
            for kernel in cache.values():
                try:
                    found.append(describe_compiled(kernel))
                except Exception as exc:  # noqa: BLE001 - another Triton's layout: say so, keep the rest
                    found.append({"error": f"{type(exc).__name__}: {exc}"})
    return found


def measure_kernel(views: dict[str, torch.Tensor], shape: Shape, loads: dict[str, int] = LOADS, trials: int = 20,
                   seed: int = 0) -> dict[str, Any]:
    """The MXFP4 grouped GEMM (both projections) against a dense bf16 grouped GEMM of the same weights."""
    from moonep_ep.ops.experts.grouped import grouped_mm, grouped_mm_supported
    from moonep_ep.ops.experts.grouped_blocks import grouped_blocks
    from moonep_ep.vllm.experts.gpu import gpu_grouped_gemm
    from moonep_ep.tools.bench.timing import fastest_ratio, interleaved_trials, timer_for

    device = next(iter(views.values())).device
    experts = list(range(7)) + [shape.E - 1]
    written = fill_rows(views, experts, seed)
    dense = {p: torch.stack([_dense(written[e], p).to(torch.bfloat16) for e in experts]) for p in ("w13", "w2")}
    gen = torch.Generator().manual_seed(seed + 2)
    res: dict[str, Any] = {"model": shape.name, "groups": len(experts),
                           "dense": "torch._grouped_mm" if grouped_mm_supported(device, torch.bfloat16)
                           else "matmul per group"}
    timer = timer_for(device)
    ok = True
    for load, rows in loads.items():
        M = rows * len(experts)
        cfg = _config(shape, M, rows)
        cu = _cu(shape, {e: rows for e in experts}, device)
        cu_dense = (torch.arange(1, len(experts) + 1, dtype=torch.int32) * rows).to(device)
        blocks = grouped_blocks(cu, M, cfg["BLOCK_SIZE_M"])
        entry: dict[str, Any] = {"rows": M, "config": cfg}
        for proj, K in (("w13", shape.H), ("w2", shape.I)):
            a = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
            weight, scale, w_dense = views[f"{proj}_weight_packed"], views[f"{proj}_weight_scale"], dense[proj]

            def mxfp4() -> torch.Tensor:
                return gpu_grouped_gemm("mxfp4", a, weight, scale, blocks, cfg)

            def dense_bf16() -> torch.Tensor:
                return grouped_mm(a, w_dense, cu_dense)

            agree = float(row_rel_errors(mxfp4(), dense_bf16()).max())  # also the warm-up (compiles)
            _synchronize(device)
            seconds = interleaved_trials({"mxfp4": mxfp4, "dense_bf16": dense_bf16}, trials, timer)
            rates = fastest_ratio(seconds["mxfp4"], seconds["dense_bf16"])
            N = w_dense.shape[1]
            flops = 2 * M * N * K
            mx_bytes = len(experts) * (weight[0].numel() + scale[0].numel())
            entry[proj] = {"N": N, "K": K, "mxfp4_over_dense_seconds": rates["ratio"],
                           "mxfp4_fastest_s": rates["numerator_fastest_s"],
                           "dense_fastest_s": rates["denominator_fastest_s"],
                           "ratio_of_medians": rates["ratio_of_medians"], "trials": rates["trials"],
                           "derived_mxfp4_tflops": flops / rates["numerator_fastest_s"] / 1e12,
                           "derived_dense_tflops": flops / rates["denominator_fastest_s"] / 1e12,
                           "derived_mxfp4_weight_gbps": mx_bytes / rates["numerator_fastest_s"] / 1e9,
                           "derived_dense_weight_gbps": w_dense.numel() * 2 / rates["denominator_fastest_s"] / 1e9,
                           "max_row_rel_diff_to_dense": agree, "bound": BOUND["bfloat16"]}
            ok = ok and agree <= BOUND["bfloat16"]
        res[load] = entry
    res["ok"] = ok
    return res


# ---------------------------------------------------------------------------
# the race


def run_race(views: dict[str, torch.Tensor], shape: Shape, trials: int = 20, rows: int = 16, seed: int = 0,
             hold_cycles: int = HOLD_CYCLES) -> dict[str, Any]:
    """Slot fills then the experts, without a wait and with ``wait_for_slots``, trial after trial (alternating)."""
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    E, B = shape.E, shape.B
    device = next(iter(views.values())).device
    stale = 7
    sources = [shape.E - 1] + list(range(B - 1))   # every slot gets another expert than the stale one it holds
    written = fill_rows(views, sorted(set(sources + [stale])), seed)
    cu = _cu(shape, {E + b: rows for b in range(B)}, device)
    M = rows * B
    cfg = _config(shape, M, rows)
    gen = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(M, shape.H, generator=gen).to(device=device, dtype=torch.bfloat16)
    route = (torch.rand(M, generator=gen) + 0.1).to(device)

    def make_stale() -> None:
        for view in views.values():
            view[E:E + B].copy_(view[stale].expand_as(view[E:E + B]))
        _synchronize(device)

    def experts() -> torch.Tensor:
        return gpu_grouped_ffn("mxfp4", x, views, cu, route, token_padding=rows, config=cfg)

    # The output every trial must give: the fills complete (device synchronized) before the experts run.
    make_stale()
    _, _, event = pull_slots(views, sources, E)
    wait_for_slots(event)
    _synchronize(device)
    expected = experts()
    _synchronize(device)
    dense = {e: (_dense(written[e], "w13"), _dense(written[e], "w2")) for e in set(sources)}
    ref = torch.cat([reference_ffn(x[b * rows:(b + 1) * rows], route[b * rows:(b + 1) * rows], *dense[sources[b]])
                     for b in range(B)])
    ref_err = float(row_rel_errors(expected, ref).max())
    hold = getattr(torch.cuda, "_sleep", None) if device.type == "cuda" else None
    seen: dict[str, list[dict[str, Any]]] = {"no_wait": [], "wait": []}
    for trial in range(2 * trials):
        mode = ("no_wait", "wait")[trial % 2]
        make_stale()
        held = None
        if hold is not None:
            hold(hold_cycles)  # the current stream is busy: what follows is queued before any of it starts
            held = torch.cuda.Event()
            held.record()
        _, _, event = pull_slots(views, sources, E)
        if mode == "wait":
            wait_for_slots(event)
        out = experts()
        queued_before_start = None if held is None else not held.query()
        if event is not None and hasattr(event, "synchronize"):
            event.synchronize()  # the fills land (on CPU: the deferred copies) before the next trial
        _synchronize(device)
        differs = (out != expected).any(dim=-1)
        seen[mode].append({"equal": bool(not differs.any()), "rows_differing": int(differs.sum()),
                           "queued_before_start": queued_before_start})
    summary = {}
    for mode, runs in seen.items():
        summary[mode] = {"trials": len(runs), "equal": sum(r["equal"] for r in runs),
                         "differed": sum(not r["equal"] for r in runs),
                         "most_rows_differing": max(r["rows_differing"] for r in runs),
                         "queued_before_start": sum(bool(r["queued_before_start"]) for r in runs)}
    return {"model": shape.name, "slots": B, "rows_per_slot": rows, "config": cfg,
            "slot_bytes_per_trial": sum(v[E].numel() * v.element_size() for v in views.values()) * B,
            "hold_cycles": hold_cycles if hold is not None else None,
            "reference_max_row_rel_err": ref_err, "bound": BOUND["bfloat16"],
            "no_wait": summary["no_wait"], "wait": summary["wait"],
            "ok": ref_err <= BOUND["bfloat16"] and summary["wait"]["differed"] == 0}


# ---------------------------------------------------------------------------
# the command


def run_check(check: str, models: list[str], trials: int, vmm: bool = True) -> dict[str, Any]:
    """One check over each model's views on GPU 0."""
    import triton

    from moonep_ep.vllm.experts.gpu import GPU_KERNELS

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products stay fp32
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out: dict[str, Any] = {"check": check, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                           "triton": triton.__version__, "models": {}}
    for model in models:
        shape = shape_of(model)
        t0 = time.perf_counter()
        with expert_views(shape, device, vmm) as (views, info):
            if check == "experts":
                res = check_experts(views, shape)
            elif check == "kernel":
                res = measure_kernel(views, shape, trials=trials)
            else:
                res = run_race(views, shape, trials=trials)
            res.update(info)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        out["models"][model] = res
        torch.cuda.empty_cache()
    if check == "kernel":
        try:
            out["kernels"] = compiled_kernels(GPU_KERNELS["mxfp4"].split()[-1])
        except Exception as exc:  # noqa: BLE001 - the timings stand without it
            out["kernels"] = [{"error": f"{type(exc).__name__}: {exc}"}]
        # the registers and spills are figures this check owes: none read is a failure, not a pass
        out["kernels_read"] = any(isinstance(k.get("n_regs"), int) and isinstance(k.get("n_spills"), int)
                                  for k in out["kernels"])
    out["ok"] = all(r["ok"] for r in out["models"].values()) and out.get("kernels_read", True)
    import torch.distributed as dist

    if dist.is_initialized():  # the one-rank group of the VMM store
        dist.destroy_process_group()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.gpu.mxfp4", description=__doc__.splitlines()[0])
    p.add_argument("--check", choices=("experts", "kernel", "race"), required=True)
    p.add_argument("--models", default=None,
                   help="comma-separated models.py names (default: kimi-k2,kimi-k3; the race: kimi-k3)")
    p.add_argument("--trials", type=int, default=20, help="timed trials a side (kernel), trials a mode (race)")
    p.add_argument("--no-vmm", action="store_true", help="plain device tensors, not the store over CUDA VMM")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    why = missing_preconditions()
    if why:
        out: dict[str, Any] = {"check": args.check, "not_applicable": "; ".join(why), "ok": None}
    else:
        models = (args.models or ("kimi-k3" if args.check == "race" else ",".join(MODELS))).split(",")
        t0 = time.perf_counter()
        out = run_check(args.check, models, args.trials, vmm=not args.no_vmm)
        out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if out["ok"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())

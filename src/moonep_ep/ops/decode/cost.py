"""When does copying an expert's weights to another rank pay? A per-GPU cost model.

MoonEP's planner evens out *rows*: it moves entries off an overloaded home
group and the receiving rank copies the expert's weights into a slot. The
copy is worth it only when the compute time the moved rows would have added
to the busiest rank exceeds the time to move the weights::

    pays  <=>  rows * flops_per_row / flop_rate  >  expert_bytes / link_bw

with ``flops_per_row = 2 * 3 * H * I`` (gate, up, down). So a copy pays only
for an expert that takes more than ``rows_to_pay = expert_bytes * flop_rate
/ (flops_per_row * link_bw)`` rows off the busiest rank. At decode an
expert on a rank serves a handful of rows, so no copy pays there.

Inputs, each overridable (``envs.py``, the cost-model variables):

* the GPU profile (:data:`PROFILES`, ``MOONEP_EP_GPU_PROFILE``): dense
  tensor-core FLOP rate per weight format, HBM bandwidth, NVLink bandwidth
  per direction, each with its source;
* bytes per expert of the weight format, scales included
  (:func:`expert_bytes_for`, from the store's tensors in ``layout.formats``).

Every time this module returns is **derived** from these inputs, never measured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ... import envs
from ...models import MoEModelConfig

__all__ = ["GpuProfile", "PROFILES", "FORMATS", "expert_bytes_for", "canonical_format", "CostModel", "cost_model",
           "cost_overrides", "detect_profile"]


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    """One GPU's figures. FLOP rates are dense (no sparsity), per GPU."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    fp4_tflops: float          # 0: no FP4 tensor cores (MXFP4 weights run at the BF16 or FP8 rate)
    hbm_gbps: float
    nvlink_gbps: float         # per direction (half the bidirectional figure NVIDIA quotes)
    source: str


_HOPPER_NOTE = ("dense = the datasheet's sparsity figure halved; NVLink 4 900 GB/s bidirectional -> 450 GB/s "
                "per direction (derived)")
_BLACKWELL_NOTE = ("dense = the datasheet's sparsity figure halved; NVLink 5 1.8 TB/s bidirectional -> 900 GB/s "
                   "per direction (derived)")

PROFILES: dict[str, GpuProfile] = {p.name: p for p in [
    GpuProfile("h100", 989.0, 1979.0, 0.0, 3350.0, 450.0,
               f"NVIDIA H100 Tensor Core GPU datasheet, SXM5 column; {_HOPPER_NOTE}"),
    GpuProfile("h200", 989.0, 1979.0, 0.0, 4800.0, 450.0,
               f"NVIDIA H200 Tensor Core GPU datasheet, SXM column; {_HOPPER_NOTE}"),
    GpuProfile("b200", 2250.0, 4500.0, 9000.0, 8000.0, 900.0,
               f"NVIDIA HGX B200 / DGX B200 datasheet, per GPU; {_BLACKWELL_NOTE}"),
    GpuProfile("gb200", 2500.0, 5000.0, 10000.0, 8000.0, 900.0,
               f"NVIDIA GB200 NVL72 datasheet, rack figures / 72 GPUs; {_BLACKWELL_NOTE}"),
]}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    compute: str               # its grouped GEMM's FLOP rate: "bf16", "fp8", or "fp4" (fp8 rate on Blackwell, else bf16)
    notes: str


#: The FLOP rate each format's grouped GEMM runs at; its bytes come from ``layout.formats``.
FORMATS: dict[str, WeightFormat] = {f.name: f for f in [
    WeightFormat("bf16", "bf16", "3*H*I bf16"),
    WeightFormat("fp8-block", "fp8", "3*H*I e4m3 + fp32 scale per 128x128 block (DeepSeek-V3 / Kimi K2 release)"),
    WeightFormat("int4-g32", "bf16", "3*H*I int4 packed + bf16 scale per 32 (K2-Thinking, compressed-tensors "
                 "pack-quantized g32); activations bf16"),
    WeightFormat("mxfp4", "fp4", "3*H*I e2m1 packed + e8m0 scale per 32 (Kimi K3); FP8 activations x FP4 weights "
                 "(DeepGEMM fp8_fp4) where FP4 tensor cores exist, else dequantised to bf16"),
]}


def expert_bytes_for(model: MoEModelConfig, fmt: str) -> int:
    """Bytes of one routed expert (gate, up, down) in ``fmt``, scales included: the store's own
    tensors (``layout.formats``), so the cost model prices exactly what a slot fill moves.

    Kimi K2 (H=7168, I=2048): bf16 88,080,384; fp8-block 44,050,944; int4-g32
    24,772,608; mxfp4 23,396,352. Kimi K3 (H=3584, I=3072) mxfp4: 17,547,264."""
    from ...layout.formats import expert_format_bytes

    return int(expert_format_bytes(canonical_format(fmt), model.hidden_size,
                                   model.moe_intermediate_size)["total_bytes"])


def canonical_format(fmt: str) -> str:
    """The format's name in :data:`FORMATS` (``layout.formats`` aliases accepted); unknown: ValueError."""
    from ...layout.formats import get_format

    try:
        name = get_format(fmt).name
    except Exception as exc:  # noqa: BLE001 - the layout's own error, re-raised with this module's choices
        raise ValueError(f"unknown weight format {fmt!r}: use one of {sorted(FORMATS)}") from exc
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: use one of {sorted(FORMATS)}")
    return name


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The inputs in use (after overrides) and the decisions they give."""

    profile: str
    flop_rate: float           # FLOP/s of this format's grouped GEMM
    link_bw: float             # bytes/s, NVLink per direction
    hbm_bw: float              # bytes/s
    expert_bytes: int
    flops_per_row: int
    overrides: tuple[str, ...]
    source: str

    def copy_seconds(self, experts: int = 1) -> float:
        """Derived: time to move ``experts`` experts' bytes out of one owner over its link."""
        return experts * self.expert_bytes / self.link_bw

    def rows_seconds(self, rows: int) -> float:
        """Derived: compute time of ``rows`` rows of one expert at the format's FLOP rate."""
        return rows * self.flops_per_row / self.flop_rate

    @property
    def rows_to_pay(self) -> int:
        """Smallest number of rows an expert copy must take off the busiest rank to pay."""
        return math.floor(self.expert_bytes * self.flop_rate / (self.flops_per_row * self.link_bw)) + 1

    def copy_pays(self, rows: int) -> bool:
        return self.rows_seconds(rows) > self.copy_seconds(1)

    def slot_budget(self, S: int, K: int, epn: int) -> int:
        """``B`` for a Buffer of capacity ``S``: 0 where no copy can pay (a slot serves at most
        ``S*K`` rows), else ``epn`` (a destination never holds more remote experts)."""
        return epn if self.copy_pays(S * K) else 0

    def describe(self) -> dict[str, Any]:
        return {"profile": self.profile, "flop_rate_tflops": self.flop_rate / 1e12,
                "link_gbps_per_direction": self.link_bw / 1e9, "hbm_gbps": self.hbm_bw / 1e9,
                "expert_bytes": self.expert_bytes, "flops_per_row": self.flops_per_row,
                "rows_to_pay": self.rows_to_pay, "overrides": list(self.overrides), "source": self.source}


def detect_profile() -> str:
    """``MOONEP_EP_GPU_PROFILE``; ``auto``: the visible GPU's name when it matches a profile, else h200."""
    chosen = envs.MOONEP_EP_GPU_PROFILE
    if chosen != "auto":
        return chosen
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name().lower().replace(" ", "")
            for key in ("gb200", "b200", "h200", "h100"):
                if key in name:
                    return key
    except Exception:  # noqa: BLE001 - no usable GPU: the default profile
        pass
    return "h200"


#: The cost-model overrides of ``envs.py``, each replacing one input of the profile.
OVERRIDES = ("MOONEP_EP_COST_TFLOPS", "MOONEP_EP_COST_LINK_GBPS", "MOONEP_EP_COST_HBM_GBPS",
             "MOONEP_EP_COST_EXPERT_BYTES")


def cost_overrides() -> tuple[tuple[str, Any], ...]:
    """The overrides set in this process, ``((variable, value), ...)``: what EP ranks compare before a
    model built from them picks a step's capacity (``vllm/buffers.py``, ``agree_decisions``)."""
    values = ((var, envs.get(var)) for var in OVERRIDES)
    return tuple((var, value) for var, value in values if value is not None)


def cost_model(model: MoEModelConfig, fmt: str = "bf16", profile: str | None = None,
               overrides: tuple[tuple[str, Any], ...] | None = None) -> CostModel:
    """The cost model for one model and weight format on ``profile`` (None: :func:`detect_profile`),
    with ``overrides`` applied (None: this process's, :func:`cost_overrides`)."""
    name = profile or detect_profile()
    if name not in PROFILES:
        raise ValueError(f"unknown GPU profile {name!r}: use one of {sorted(PROFILES)}")
    p = PROFILES[name]
    compute = FORMATS[canonical_format(fmt)].compute
    # MXFP4: FP8 activations x FP4 weights at the FP8 rate where FP4 tensor cores exist (Blackwell),
    # else dequantised to BF16 (Hopper, Marlin-style W4A16).
    rate = {"bf16": p.bf16_tflops, "fp8": p.fp8_tflops,
            "fp4": p.fp8_tflops if p.fp4_tflops else p.bf16_tflops}[compute]
    applied = []
    tflops, link, hbm, nbytes = rate, p.nvlink_gbps, p.hbm_gbps, expert_bytes_for(model, fmt)
    given = dict(cost_overrides() if overrides is None else overrides)
    for var, current in zip(OVERRIDES, ("tflops", "link", "hbm", "nbytes")):
        value = given.get(var)
        if value is not None:
            applied.append(f"{var}={value}")
            if current == "tflops":
                tflops = float(value)
            elif current == "link":
                link = float(value)
            elif current == "hbm":
                hbm = float(value)
            else:
                nbytes = int(value)
    return CostModel(profile=name, flop_rate=tflops * 1e12, link_bw=link * 1e9, hbm_bw=hbm * 1e9,
                     expert_bytes=nbytes, flops_per_row=6 * model.hidden_size * model.moe_intermediate_size,
                     overrides=tuple(applied), source=p.source)

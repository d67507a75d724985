"""Routed-expert storage formats: the per-expert tensors of each, in vLLM 0.33.0's in-memory layout.

A projection is a weight plus, when quantized, its scale tensor. Each tensor
is one ``ProjectionSpec`` of the store, so weight and scales share one row
index (global expert id, then slot id) and each is page-aligned on its own.

Shapes per expert, fused ``w13 = [gate; up]`` (``N = 2I``) and ``w2``, as
vLLM's MoE methods allocate them (parameter names in brackets):

``bf16`` (``UnquantizedFusedMoEMethod``)
    ``w13_weight [2I, H]`` and ``w2_weight [H, I]``, bfloat16.
``fp8-block`` (``Fp8MoEMethod``, ``weight_block_size [128, 128]``; DeepSeek-V3, Kimi K2)
    ``w13_weight [2I, H]`` float8_e4m3fn, ``w13_weight_scale_inv
    [2·ceil(I/128), ceil(H/128)]`` float32; ``w2_weight [H, I]``,
    ``w2_weight_scale_inv [ceil(H/128), ceil(I/128)]``.
``int4-g32`` (``CompressedTensorsWNA16MoEMethod``, pack-quantized, symmetric; Kimi K2-Thinking)
    ``w13_weight_packed [2I, H/8]`` int32 (8 nibbles a word), ``w13_weight_scale
    [2I, H/32]`` bfloat16; ``w2_weight_packed [H, I/8]``, ``w2_weight_scale [H, I/32]``.
``mxfp4`` (``CompressedTensorsW4A4Mxfp4MoEMethod``, mxfp4-pack-quantized; Kimi K3)
    ``w13_weight_packed [2I, H/2]`` uint8 (two E2M1 a byte), ``w13_weight_scale
    [2I, H/32]`` uint8 (E8M0); ``w2_weight_packed [H, I/2]``, ``w2_weight_scale
    [H, I/32]``. gpt-oss's native ``Mxfp4MoEMethod`` holds the same shapes as
    ``w13_weight`` / ``w13_weight_scale`` (pass ``weight_name="weight"``).

Bytes per Kimi K2 expert (H 7168, I 2048), weights + scales: bf16 88,080,384;
fp8-block 44,040,192 + 10,752 = 44,050,944; int4-g32 22,020,096 + 2,752,512 =
24,772,608; mxfp4 22,020,096 + 1,376,256 = 23,396,352 (tests check these).

Backend conversions (Marlin repack, DeepGEMM scale transform) run after
loading and are per expert; they may change a tensor's row shape, which is
then described by a ProjectionSpec of its own. Per-expert metadata that is
not a page's worth (gpt-oss biases, compressed-tensors ``weight_shape``) is
not a store tensor and is not counted here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ..errors import ConfigError
from .store import ProjectionSpec

__all__ = ["ExpertFormat", "FORMATS", "FORMAT_NAMES", "get_format", "expert_projections",
           "store_projections", "expert_format_bytes", "projection_bytes", "PUSH_SCALE_TILE_BYTES",
           "push_projections", "scale_data_view"]

#: MoonEP's release prefetch kernel (the push API) re-tiles every scale tensor to ``[128, nbytes/128]``
#: bytes per expert, so one expert's scale bytes must be a multiple of 128 x 128 = 16 KiB.
PUSH_SCALE_TILE_BYTES = 128 * 128


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How one projection ``[out, in]`` of one expert is stored.

    Attributes:
        name: ``bf16``, ``fp8-block``, ``int4-g32`` or ``mxfp4``.
        label: a short human description (tables, plots).
        weight_dtype: dtype of the stored weight tensor.
        pack: logical values per weight element along ``in`` (int32 INT4: 8; uint8 MXFP4: 2).
        scale_dtype: dtype of the scale tensor, ``None`` when unquantized.
        scale_block: ``(rows, cols)`` of logical weights one scale covers (FP8 block ``(128, 128)``,
            group quantization ``(1, 32)``); the scale tensor is ``[ceil(out/rows), ceil(in/cols)]``.
        weight_name: vLLM parameter suffix of the weight (``w13_<weight_name>``).
        scale_name: vLLM parameter suffix of the scale.
        vllm_method: the vLLM 0.33.0 MoE method that allocates these tensors.
        checkpoint: what a checkpoint in this format stores, in words.
    """

    name: str
    label: str
    weight_dtype: torch.dtype
    pack: int = 1
    scale_dtype: torch.dtype | None = None
    scale_block: tuple[int, int] = (1, 1)
    weight_name: str = "weight"
    scale_name: str | None = None
    vllm_method: str = ""
    checkpoint: str = ""

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    def weight_shape(self, out: int, inn: int) -> tuple[int, int]:
        return (out, inn // self.pack)

    def scale_shape(self, out: int, inn: int) -> tuple[int, int] | None:
        if self.scale_dtype is None:
            return None
        rows, cols = self.scale_block
        return (-(-out // rows), -(-inn // cols))

    def check_dims(self, hidden: int, intermediate: int) -> None:
        """Raise ConfigError unless both expert dims can be stored in this format."""
        for what, dim in (("hidden_size (H)", hidden), ("moe_intermediate_size (I)", intermediate)):
            if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
                raise ConfigError(f"format {self.name}: {what} must be a positive int: got {dim!r}. "
                                  "Fix: pass the model's expert dims")
            need = self.pack
            if self.quantized and self.scale_block[0] == 1:  # group quantization along ``in``
                need = max(need, self.scale_block[1])
            if dim % need:
                raise ConfigError(f"format {self.name}: {what} = {dim} is not a multiple of {need} "
                                  f"({self.label} packs {self.pack} values per "
                                  f"{str(self.weight_dtype).replace('torch.', '')}"
                                  + (f" and groups {self.scale_block[1]} per scale" if need != self.pack else "")
                                  + "). Fix: use a model whose expert dims are multiples of "
                                  f"{need}, or another --format")


FORMATS: dict[str, ExpertFormat] = {f.name: f for f in [
    ExpertFormat("bf16", "BF16", torch.bfloat16, vllm_method="UnquantizedFusedMoEMethod",
                 checkpoint="bfloat16 weight [out, in]"),
    ExpertFormat("fp8-block", "FP8 e4m3, 128x128 block scales (fp32)", torch.float8_e4m3fn,
                 scale_dtype=torch.float32, scale_block=(128, 128), scale_name="weight_scale_inv",
                 vllm_method="Fp8MoEMethod",
                 checkpoint="weight float8_e4m3fn [out, in]; weight_scale_inv float32 "
                            "[ceil(out/128), ceil(in/128)]; quantization_config quant_method fp8, "
                            "weight_block_size [128, 128]"),
    ExpertFormat("int4-g32", "INT4 W4A16, group 32 (bf16 scales)", torch.int32, pack=8,
                 scale_dtype=torch.bfloat16, scale_block=(1, 32), weight_name="weight_packed",
                 scale_name="weight_scale", vllm_method="CompressedTensorsWNA16MoEMethod",
                 checkpoint="compressed-tensors pack-quantized: weight_packed int32 [out, in/8], "
                            "weight_scale bf16 [out, in/32], weight_shape; symmetric (no zero point)"),
    ExpertFormat("mxfp4", "MXFP4 (E2M1, E8M0 scale per 32)", torch.uint8, pack=2,
                 scale_dtype=torch.uint8, scale_block=(1, 32), weight_name="weight_packed",
                 scale_name="weight_scale", vllm_method="CompressedTensorsW4A4Mxfp4MoEMethod",
                 checkpoint="compressed-tensors mxfp4-pack-quantized: weight_packed uint8 [out, in/2], "
                            "weight_scale uint8 E8M0 [out, in/32] (gpt-oss native: *_blocks / *_scales)"),
]}

FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)

_ALIASES = {"bfloat16": "bf16", "fp8": "fp8-block", "fp8block": "fp8-block", "fp8_block": "fp8-block",
            "int4": "int4-g32", "w4a16": "int4-g32", "int4g32": "int4-g32", "int4_g32": "int4-g32",
            "mxfp4a16": "mxfp4"}


def get_format(name: str | ExpertFormat) -> ExpertFormat:
    """A format by name (``bf16``, ``fp8-block``, ``int4-g32``, ``mxfp4``; a few aliases;
    ``int4-g<N>`` for another INT4 group size, N a multiple of 8)."""
    if isinstance(name, ExpertFormat):
        return name
    key = str(name).strip().lower()
    fmt = FORMATS.get(key) or FORMATS.get(_ALIASES.get(key, ""))
    group = re.fullmatch(r"int4[-_]?g(\d+)", key)
    if fmt is None and group and int(group.group(1)) > 0 and int(group.group(1)) % 8 == 0:
        # Other INT4 group sizes (compressed-tensors' W4A16 preset uses 128) size alike.
        fmt = dataclasses.replace(FORMATS["int4-g32"], name=f"int4-g{int(group.group(1))}",
                                  label=f"INT4 W4A16, group {int(group.group(1))} (bf16 scales)",
                                  scale_block=(1, int(group.group(1))))
    if fmt is None:
        raise ConfigError(f"unknown expert format {name!r}. Fix: use one of {', '.join(FORMAT_NAMES)}")
    return fmt


def _tensors(fmt: ExpertFormat, proj: str, out: int, inn: int, weight_name: str,
             scale_name: str | None) -> list[ProjectionSpec]:
    specs = [ProjectionSpec(f"{proj}{weight_name}", fmt.weight_shape(out, inn), fmt.weight_dtype,
                            role="weight", projection=proj.rstrip("_"))]
    shape = fmt.scale_shape(out, inn)
    if shape is not None:
        assert fmt.scale_dtype is not None and scale_name is not None
        specs.append(ProjectionSpec(f"{proj}{scale_name}", shape, fmt.scale_dtype, role="scale",
                                    projection=proj.rstrip("_")))
    return specs


def expert_projections(fmt: str | ExpertFormat, hidden: int, intermediate: int, *, split_w13: bool = False,
                       weight_name: str | None = None) -> list[ProjectionSpec]:
    """The per-expert tensors of ``fmt`` for expert dims ``(H, I)``, as store ``ProjectionSpec``s.

    Default (``split_w13=False``): vLLM's fused layout and parameter names,
    e.g. for ``mxfp4`` ``w13_weight_packed [2I, H/2]``, ``w13_weight_scale
    [2I, H/32]``, ``w2_weight_packed [H, I/2]``, ``w2_weight_scale [H, I/32]``;
    a store built from them hands out ``[E+B, *shape]`` views that are vLLM's
    parameters plus ``B`` slot rows. ``split_w13=True``: ``gate``, ``up``,
    ``down`` (the store's BF16 names) each followed by ``<name>_scale`` when
    quantized; for ``bf16`` exactly ``ffn_projections(H, I)``.

    ``weight_name`` overrides the weight parameter suffix (``"weight"`` for
    gpt-oss's native MXFP4 method). Every spec carries ``role`` (``weight`` or
    ``scale``) and ``projection`` (``w13``/``w2`` or ``gate``/``up``/``down``).
    """
    f = get_format(fmt)
    f.check_dims(hidden, intermediate)
    H, I = hidden, intermediate
    if split_w13:
        specs: list[ProjectionSpec] = []
        for proj, out, inn in (("gate", I, H), ("up", I, H), ("down", H, I)):
            w = ProjectionSpec(proj, f.weight_shape(out, inn), f.weight_dtype, role="weight", projection=proj)
            specs.append(w)
            shape = f.scale_shape(out, inn)
            if shape is not None:
                assert f.scale_dtype is not None
                specs.append(ProjectionSpec(f"{proj}_scale", shape, f.scale_dtype, role="scale", projection=proj))
        return specs
    wname = weight_name or f.weight_name
    if f.quantized and f.scale_block[0] > 1:
        # Block scales of w13 cover gate and up separately: 2·ceil(I/rows) rows, as vLLM allocates them.
        rows, cols = f.scale_block
        w13 = [ProjectionSpec(f"w13_{wname}", f.weight_shape(2 * I, H), f.weight_dtype, role="weight",
                              projection="w13"),
               ProjectionSpec(f"w13_{f.scale_name}", (2 * -(-I // rows), -(-H // cols)), f.scale_dtype,
                              role="scale", projection="w13")]
    else:
        w13 = _tensors(f, "w13_", 2 * I, H, wname, f.scale_name)
    return w13 + _tensors(f, "w2_", H, I, wname, f.scale_name)


def store_projections(fmt: str | ExpertFormat, hidden: int, intermediate: int) -> list[ProjectionSpec]:
    """The tensors the sharded store holds per expert in ``fmt`` (what ``footprint`` sizes).

    BF16: ``gate``, ``up``, ``down`` apart (the plugin's BF16 store; MoonEP's
    experts read gate and up apart). Quantized: vLLM's fused ``w13``/``w2``
    weights and scales (its quantized methods and kernels read ``w13`` whole).
    Fused or split hold the same bytes; only page padding can differ.
    """
    f = get_format(fmt)
    return expert_projections(f, hidden, intermediate, split_w13=not f.quantized)


def projection_bytes(specs: list[ProjectionSpec]) -> dict[str, int]:
    """``weight_bytes``, ``scale_bytes`` and ``total_bytes`` of one expert over ``specs``."""
    weight = sum(p.row_bytes for p in specs if p.role != "scale")
    scale = sum(p.row_bytes for p in specs if p.role == "scale")
    return {"weight_bytes": weight, "scale_bytes": scale, "total_bytes": weight + scale}


def expert_format_bytes(fmt: str | ExpertFormat, hidden: int, intermediate: int) -> dict[str, Any]:
    """Bytes of one expert in ``fmt``: weights and scales apart, plus the format's name."""
    f = get_format(fmt)
    out: dict[str, Any] = {"format": f.name}
    out.update(projection_bytes(expert_projections(f, hidden, intermediate)))
    return out


def push_projections(specs: list[ProjectionSpec]) -> list[ProjectionSpec]:
    """``specs`` in the push layout: every scale row the release's prefetch kernel can move as it is.

    A scale tensor whose per-expert bytes are a multiple of :data:`PUSH_SCALE_TILE_BYTES` keeps its
    spec (K2-Thinking INT4, K3 MXFP4). Any other (FP8 block: K2's 7,168 and 3,584 B) is stored padded
    per expert: a ``uint8 [128, padded/128]`` row, ``padded`` = its bytes rounded up to 16 KiB, data
    first and a zero tail (:func:`scale_data_view` gives the kernels the data part). Weights are
    unchanged. The store, the footprint and the push all use these specs, so the padding is counted.
    """
    out = []
    for p in specs:
        if p.role == "scale" and p.row_bytes % PUSH_SCALE_TILE_BYTES:
            padded = -(-p.row_bytes // PUSH_SCALE_TILE_BYTES) * PUSH_SCALE_TILE_BYTES
            p = ProjectionSpec(p.name, (128, padded // 128), torch.uint8, role="scale", projection=p.projection)
        out.append(p)
    return out


def push_store_projections(fmt: str | ExpertFormat, hidden: int, intermediate: int) -> list[ProjectionSpec]:
    """The tensors the sharded store holds per expert for MoonEP's push API (the release): ``gate``, ``up``,
    ``down`` apart, as its ``prefetch_weight`` takes them, each followed by ``<name>_scale`` when quantized,
    in :func:`push_projections`' layout (scale rows padded per expert to a multiple of 16 KiB where
    needed). vLLM's fused ``w13`` row is the gate rows then the up rows; the push layout keeps them apart
    (the quantized experts dequantize or multiply them in two parts, ``ops.experts.quantized``)."""
    f = get_format(fmt)
    specs = expert_projections(f, hidden, intermediate, split_w13=True)
    return push_projections(specs) if f.quantized else specs


def scale_data_view(rows: torch.Tensor, spec: ProjectionSpec) -> torch.Tensor:
    """The scales of ``spec`` (its unpadded shape and dtype) read from padded push-layout ``rows``
    ``[n, 128, padded/128]`` uint8: a strided view, no copy (each expert's data is its row's head)."""
    flat = rows.reshape(rows.shape[0], -1)
    if flat.dtype != torch.uint8 or flat.shape[1] < spec.row_bytes:
        raise ConfigError(f"scale rows {tuple(rows.shape)} {rows.dtype} cannot hold {spec.name} "
                          f"({spec.row_bytes} B per expert). Fix: pass the push-layout rows of this tensor "
                          "(layout.formats.push_projections)")
    return flat[:, :spec.row_bytes].view(spec.dtype).view(rows.shape[0], *spec.shape)

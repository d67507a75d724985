"""Per-GPU routed-expert memory under four storage schemes: pure arithmetic.

All sizes are bytes per EP rank (one GPU) for the routed experts of the whole
model (every MoE layer, gate + up + down), in one storage format
(``layout.formats``): by default the format the model's checkpoint ships
(Kimi K3 and gpt-oss MXFP4, Kimi K2 and DeepSeek-V3 FP8 block, K2-Thinking
INT4 g32, the others BF16), or the one ``FootprintOptions.expert_format``
forces. Scale tensors are counted apart from weights (``weight_bytes``,
``scale_bytes``) in every figure. ``gb`` values are ``bytes / 1e9``. Nothing
here allocates memory.

Schemes (``R`` EP size, ``E`` routed experts, ``epn = E/R``, ``L`` MoE layers,
``expert_bytes`` = one expert's bytes, weights plus scales, in the format;
``row`` = one per-expert tensor's bytes):

``replicated``
    vLLM 0.33.0 MoonEP backend: every rank all-gathers all ``E`` experts into
    ``[E+B]``-row tensors per projection per layer (rows ``[E, E+B)`` are the
    prefetch slots). ``L*(E+B)*expert_bytes``, independent of ``R``. Default
    ``B = 4`` (vLLM's hard-coded ``num_prefetch_slots=4``,
    ``MOONEP_DEFAULT_NUM_PREFETCH_SLOTS``).
``per_layer_slots``
    Sharded, with a ``B``-slot block per layer next to each layer's own experts
    (SGLang MoonEP's ``[epn + B]`` block per layer). ``L*(epn+B)*expert_bytes``.
    Default ``B = epn`` (SGLang's ``SGLANG_MOONEP_NUM_PREFETCH_SLOTS`` default).
``eplb``
    Sharded with ``N`` redundant physical experts per layer over the whole EP
    group (vLLM ``num_redundant_experts`` / SGLang ``--ep-num-redundant-experts``):
    each rank holds ``ceil((E+N)/R)`` experts per layer, ``L*ceil((E+N)/R)*expert_bytes``
    (the ceil is the most-loaded rank; vLLM requires ``(E+N) % R == 0``).
    Default ``N = R`` (one spare expert per rank per layer), the definition of
    scheme (e) of docs/design/models.md §2; DeepSeek/SGLang/vLLM examples use
    ``N = 32`` (``--eplb-redundant 32``).
``moonep_ep``
    This project: each rank physically allocates only its own expert pages of
    every layer plus one slot pool per tensor shared by all layers
    (``slot_pools`` pools when more than one layer is in flight); each tensor
    (weight or scale, ``formats.store_projections``) has pages of its own.
    Bytes come from ``moonep_ep.layout.plan.predict_rank_bytes``, so they
    include the page padding of the real layout; the reported figure is the
    largest rank's. ``data_bytes`` is the closed form without pages,
    ``(L*epn + pools*B)*expert_bytes``; the page plan differs from it by less
    than one page per boundary (two per (layer, tensor) region — the start and
    end of the rank's run — and one per slot pool: ``page_boundaries``), which
    ``within_one_page_per_boundary`` checks.
    Default ``B = epn`` (MoonEP's ``Buffer`` default ``B=None -> epn``; push
    fixes slots at ``epn``, enough for every remote expert, moonep.md §2.7).
    ``moonep_api="push"`` sizes the push layout (``formats.push_store_projections``: gate, up, down apart):
    scale rows the release's prefetch kernel cannot move as they are (FP8
    block) are padded per expert to a multiple of 16 KiB, in every layer's
    rows and in the slots; the padding counts as ``scale_bytes``. Its pages
    are ``plan.PushRowsPlan``'s: each rank's rows of a (layer, tensor) are a
    run of whole pages of its own (the first slot bytes in the last page's
    tail), so it costs up to one page per (layer, tensor) more than the pull
    plan (``push_page_bytes_over_pull``), and needs ``B = E/R``.

The peer schemes are counted as raw data bytes (their allocator's rounding is
not modelled), so the comparison is conservative against ``moonep_ep``.

**Load peak** (``load_peak_bytes``, derived, per scheme): the most routed-
expert bytes one rank holds at once while the model loads, from each
scheme's load sequence (``row`` = one expert, all projections):

``replicated``
    vLLM 0.33.0 loads every layer's ``E/R`` local experts into parameters,
    then converts layer by layer: its all-gather output (``E`` rows) and the
    new ``[E+B]`` copy exist while that layer's local parameters are alive.
    The last layer is the worst: ``L*(E+B) + E + E/R`` rows.
``per_layer_slots``
    final + one layer's local experts, assuming the load-then-adopt step of
    the public sharded variants (ATOM's ``adopt_weights``: parameters of
    ``E/R`` rows are copied into the ``[E/R+B]`` block layer by layer).
``eplb``
    final: vLLM's loader writes each physical expert into its parameter.
``moonep_ep``
    final: the store is allocated before any weight is read and vLLM's
    loader writes each rank's experts straight into its pages
    (``moonep_ep.vllm.store.loading``). ``copy_in_load_peak_bytes`` keeps the
    figure of the design it replaced (store allocated at the first layer
    while every layer's local parameters were alive: final + ``L*E/R``
    rows), for comparison.

Every scheme needs ``E % R == 0`` (MoonEP's requirement, and vLLM's all-gather
raises otherwise); such EP sizes are reported as unsupported.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from ..models import MoEModelConfig
from .formats import ExpertFormat, get_format, projection_bytes, push_store_projections, store_projections
from .plan import predict_rank_bytes
from .store import plan_store

__all__ = [
    "SCHEMES",
    "GPU_CAPACITY_GB",
    "DEFAULT_GRANULARITY",
    "DEFAULT_RESERVE_GB",
    "DEFAULT_EP_SIZES",
    "VLLM_DEFAULT_NUM_PREFETCH_SLOTS",
    "FootprintOptions",
    "default_slots",
    "scheme_bytes",
    "fits_on",
    "smallest_gpu",
    "ep_footprint",
    "model_footprint",
    "footprint_report",
    "model_format",
    "model_tensors",
]

#: Scheme keys, in report order.
SCHEMES: tuple[str, ...] = ("replicated", "per_layer_slots", "eplb", "moonep_ep")

#: Nominal HBM per GPU in GB (1e9 bytes), docs/design/models.md §2.
GPU_CAPACITY_GB: dict[str, float] = {"H100": 80.0, "H200": 141.0, "B200": 180.0,
                                     "GB200": 186.0, "GB300": 288.0}

#: VMM page size assumed for the sharded layout (2 MiB unless given; the real value is queried at run time).
DEFAULT_GRANULARITY = 2 << 20

#: GB per GPU kept free for everything but routed experts (KV cache, activations,
#: non-expert weights, communication buffers). A floor, not an estimate: Kimi K3's
#: replicated shared experts alone are ~22.6 GiB/rank (vLLM PR 50656; docs/design/models.md §2).
DEFAULT_RESERVE_GB = 20.0

DEFAULT_EP_SIZES: tuple[int, ...] = (8, 16, 32, 64)

#: vLLM 0.33.0 passes ``num_prefetch_slots=4`` to MoonEP (``all2all_utils.py``,
#: ``MOONEP_DEFAULT_NUM_PREFETCH_SLOTS = 4``; docs/design/vllm.md).
VLLM_DEFAULT_NUM_PREFETCH_SLOTS = 4


@dataclasses.dataclass(frozen=True)
class FootprintOptions:
    """Knobs of the arithmetic.

    Attributes:
        num_slots: ``B`` for every slot-carrying scheme; ``None`` = each scheme's
            own default (see ``default_slots``).
        eplb_redundant: ``N`` redundant experts per layer over the EP group;
            ``None`` = ``R`` (one per rank per layer).
        granularity: VMM page size in bytes for ``moonep_ep``.
        slot_pools: number of shared slot pools per projection for ``moonep_ep``
            (2 for async prefetch / two micro-batches in flight).
        reserve_gb: GB (1e9 bytes) per GPU kept for non-expert memory when
            deciding ``fits``.
        gpus: GPU name -> HBM capacity in GB (1e9 bytes).
        expert_format: storage format of every model (``layout.formats`` name);
            ``None`` = each model's published checkpoint format.
        moonep_api: ``pull`` (scales as the format stores them) or
            ``push`` (the release's API: ``moonep_ep`` scale rows padded per
            expert to 16 KiB where needed, ``formats.push_store_projections``).
    """

    num_slots: int | None = None
    eplb_redundant: int | None = None
    granularity: int = DEFAULT_GRANULARITY
    slot_pools: int = 1
    reserve_gb: float = DEFAULT_RESERVE_GB
    gpus: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(GPU_CAPACITY_GB))
    expert_format: str | None = None
    moonep_api: str = "pull"

    def __post_init__(self) -> None:
        if self.moonep_api not in ("pull", "push"):
            raise ConfigError(f"--moonep-api must be pull or push: got {self.moonep_api!r}. "
                              "Fix: pass pull (MoonEP 7745ffa0, vLLM 0.33.0) or push (MoonEP's release)")
        if self.expert_format is not None:
            get_format(self.expert_format)  # a clear error now, not per model
        if self.num_slots is not None and self.num_slots < 0:
            raise ConfigError(f"--slots must be >= 0: got {self.num_slots}. Fix: pass a slot count "
                              f"or 'auto'")
        if self.eplb_redundant is not None and self.eplb_redundant < 0:
            raise ConfigError(f"--eplb-redundant must be >= 0: got {self.eplb_redundant}. "
                              f"Fix: pass a count or 'auto'")
        if self.granularity <= 0:
            raise ConfigError(f"--granularity must be positive: got {self.granularity}. "
                              f"Fix: pass the VMM page size in bytes, e.g. 2097152")
        if self.slot_pools < 1:
            raise ConfigError(f"--slot-pools must be >= 1: got {self.slot_pools}. Fix: pass 1 or 2")
        if self.reserve_gb < 0:
            raise ConfigError(f"--reserve-gb must be >= 0: got {self.reserve_gb}. "
                              f"Fix: pass the GB to keep free per GPU")


def model_format(model: MoEModelConfig, options: "FootprintOptions | None" = None) -> ExpertFormat:
    """The format ``model`` is sized in: ``options.expert_format``, else the checkpoint's."""
    if options is not None and options.expert_format is not None:
        return get_format(options.expert_format)
    if not model.expert_format:
        raise ConfigError(f"model {model.name}: its checkpoint's quantization is not a supported expert format "
                          f"({model.quantization}). Fix: pass --format bf16|fp8-block|int4-g32|mxfp4 to size "
                          "it in one of those")
    return get_format(model.expert_format)


def model_tensors(model: MoEModelConfig, options: "FootprintOptions | None" = None) -> list:
    """The per-expert tensors (``ProjectionSpec``) the store holds for ``model`` in its format."""
    return store_projections(model_format(model, options), model.hidden_size, model.moe_intermediate_size)


def rank_bytes_closed_form(*, num_layers: int, num_experts: int, ep_size: int, num_slots: int,
                           row_bytes: list[int], granularity: int, rank: int, slot_pools: int = 1,
                           roles: list[str] | None = None) -> dict[str, int]:
    """Physical bytes ``rank`` allocates, from a closed form: the prediction that
    ``footprint --measure`` compares the OS against, derived independently of the page
    loop in ``plan.py`` (a test keeps the two equal).

    Per (layer, projection) region of ``W = epn*row`` bytes per rank and lead pad
    ``lead = -E*row mod g``, page ``j`` starts at data byte ``max(j*g - lead, 0)`` and
    belongs to the rank owning that byte, so rank ``r`` allocates
    ``ceil(((r+1)W + lead)/g) - ceil((rW + lead)/g)`` pages (rank 0: the first term
    alone, page 0 included). Each slot pool is ``ceil(B*row/g)`` pages.
    ``roles`` (``"weight"``/``"scale"`` per tensor) split the total into
    ``weight_bytes`` and ``scale_bytes``.
    """
    g, epn = granularity, num_experts // ep_size
    expert = slots = 0
    by_role = {"weight": 0, "scale": 0}
    for rb, role in zip(row_bytes, roles or ["weight"] * len(row_bytes)):
        W, lead = epn * rb, (-num_experts * rb) % g
        upper = -(-((rank + 1) * W + lead) // g)
        lower = 0 if rank == 0 else -(-(rank * W + lead) // g)
        region, pool = num_layers * (upper - lower) * g, slot_pools * -(-num_slots * rb // g) * g
        expert += region
        slots += pool
        by_role[role] += region + pool
    return {"expert_bytes": expert, "slot_bytes": slots, "total_bytes": expert + slots,
            "weight_bytes": by_role["weight"], "scale_bytes": by_role["scale"]}


def default_slots(scheme: str, epn: int) -> int:
    """Each scheme's default slot count ``B`` (rows per projection).

    ``replicated``: 4 (vLLM 0.33.0); ``per_layer_slots``: ``epn`` (SGLang);
    ``moonep_ep``: ``epn`` (MoonEP ``Buffer`` default, push fixed); ``eplb``: 0.
    """
    if scheme == "replicated":
        return VLLM_DEFAULT_NUM_PREFETCH_SLOTS
    if scheme in ("per_layer_slots", "moonep_ep"):
        return epn
    if scheme == "eplb":
        return 0
    raise ConfigError(f"unknown scheme {scheme!r}. Fix: use one of {', '.join(SCHEMES)}")


def fits_on(total_bytes: int, reserve_gb: float,
            gpus: Mapping[str, float] = GPU_CAPACITY_GB) -> dict[str, bool]:
    """GPU name -> whether ``total_bytes`` plus ``reserve_gb`` GB fit its HBM (GB = 1e9 bytes)."""
    return {name: total_bytes + reserve_gb * 1e9 <= cap * 1e9 for name, cap in gpus.items()}


def smallest_gpu(fits: Mapping[str, bool], gpus: Mapping[str, float] = GPU_CAPACITY_GB) -> str | None:
    """The smallest-capacity GPU marked as fitting, or ``None``."""
    ok = [name for name in fits if fits[name]]
    return min(ok, key=lambda n: gpus[n]) if ok else None


def _check_ep(model: MoEModelConfig, ep_size: int) -> str | None:
    """``None`` when ``ep_size`` works for ``model``, else why not."""
    if ep_size <= 0:
        return f"EP size must be positive (got {ep_size})"
    if model.num_experts % ep_size:
        return (f"E={model.num_experts} is not a multiple of EP={ep_size} "
                f"(MoonEP needs E % EP == 0)")
    return None


def scheme_bytes(model: MoEModelConfig, ep_size: int, scheme: str,
                 options: FootprintOptions = FootprintOptions()) -> dict[str, Any]:
    """Bytes per rank of ``model``'s routed experts under ``scheme`` at EP size ``ep_size``.

    Returns a dict with ``bytes`` (int, the largest rank's total), ``gb``
    (float, ``bytes/1e9``), ``expert_bytes``, ``slot_bytes``, ``padding_bytes``
    (ints; padding is modelled only for ``moonep_ep``), scheme parameters
    (``num_slots``, ``redundant_experts`` or ``experts_per_rank_per_layer``),
    ``formula``, ``fits`` (GPU -> bool after ``options.reserve_gb``) and
    ``smallest_gpu``.

    Raises ConfigError if ``E % ep_size != 0`` or ``scheme`` is unknown.
    """
    why = _check_ep(model, ep_size)
    if why:
        raise ConfigError(f"model {model.name}: {why}. Fix: choose an EP size that divides "
                          f"{model.num_experts}")
    E, L, R = model.num_experts, model.num_moe_layers, ep_size
    epn = E // R
    fmt = model_format(model, options)
    tensors = model_tensors(model, options)
    rows, roles = [p.row_bytes for p in tensors], [p.role for p in tensors]
    split = projection_bytes(tensors)
    per_expert = split["total_bytes"]
    B = options.num_slots if options.num_slots is not None else default_slots(scheme, epn)
    out: dict[str, Any]
    if scheme in ("replicated", "per_layer_slots"):
        # Both hold B slots per layer; they differ only in the experts a rank holds: all E, or its E/R.
        held, held_name = (E, "E") if scheme == "replicated" else (epn, "E/R")
        expert, slot = L * held * per_expert, L * B * per_expert
        out = {"num_slots": B, "slots_per": "layer", "experts_per_rank_per_layer": held,
               "formula": f"L*({held_name}+B)*expert_bytes"}
        out.update(expert_bytes=expert, slot_bytes=slot, padding_bytes=0, bytes=expert + slot)
        rows_held = L * (held + B)
    elif scheme == "eplb":
        N = options.eplb_redundant if options.eplb_redundant is not None else R
        per_rank = math.ceil((E + N) / R)
        expert = L * per_rank * per_expert
        out = {"redundant_experts": N, "experts_per_rank_per_layer": per_rank,
               "formula": "L*ceil((E+N)/R)*expert_bytes"}
        out.update(expert_bytes=expert, slot_bytes=0, padding_bytes=0, bytes=expert)
        rows_held = L * per_rank
    elif scheme == "moonep_ep":
        pulled_expert = per_expert
        if options.moonep_api == "push":  # gate/up/down apart, scale rows tiled to 16 KiB (the release's kernel)
            tensors = push_store_projections(fmt, model.hidden_size, model.moe_intermediate_size)
            rows, roles = [p.row_bytes for p in tensors], [p.role for p in tensors]
            split = projection_bytes(tensors)
            per_expert = split["total_bytes"]
        # The store's own page decisions (and refusals): what it would allocate on every rank.
        planned = plan_store(num_layers=L, num_experts=E, ep_size=R, projections=tensors, num_slots=B,
                             granularity=options.granularity, slot_pools=options.slot_pools,
                             api=options.moonep_api)
        best: dict[str, int] | None = None
        best_rank = 0
        for rank in range(R):
            got = planned.rank_bytes(rank)
            if best is None or got["total_bytes"] > best["total_bytes"]:
                best, best_rank = got, rank
        assert best is not None
        if options.moonep_api == "push":  # the push runs' whole pages against the pull plan's shared ones
            pull = predict_rank_bytes(num_layers=L, num_experts=E, ep_size=R, num_slots=B, row_bytes=rows,
                                      granularity=options.granularity, rank=best_rank,
                                      slot_pools=options.slot_pools, roles=roles)
            push_over_pull = best["total_bytes"] - pull["total_bytes"]
        else:
            push_over_pull = 0
        out = {"num_slots": B, "slots_per": "model", "slot_pools": options.slot_pools,
               "moonep_api": options.moonep_api, "expert_bytes_as_stored": per_expert,
               "experts_per_rank_per_layer": epn, "granularity": options.granularity,
               "rank": best_rank,
               "formula": "predict_rank_bytes: own expert pages of every layer + "
                          "slot_pools*B slot rows per tensor, page-padded (largest rank)"}
        out.update(expert_bytes=int(best["expert_bytes"]), slot_bytes=int(best["slot_bytes"]),
                   padding_bytes=int(best["padding_bytes"]), bytes=int(best["total_bytes"]),
                   weight_bytes=int(best["weight_bytes"]), scale_bytes=int(best["scale_bytes"]))
        data = (L * epn + options.slot_pools * B) * per_expert
        # A rank's run of one (layer, tensor) region has two boundaries (start, end), each shifted
        # by less than a page (rank 0's start carries the region's lead pad); a slot pool has one (its tail).
        boundaries = (2 * L + options.slot_pools) * len(tensors)
        # Page-free cost of the push layout's scale padding on one rank (0 for pull or 16 KiB-tiled scales).
        out["push_scale_padding_bytes"] = (L * epn + options.slot_pools * B) * (per_expert - pulled_expert)
        # Page cost of the push layout's whole-page runs on that rank, over the pull page plan of the same tensors.
        out["push_page_bytes_over_pull"] = push_over_pull
        out.update(data_bytes=data, data_formula="(L*E/R + slot_pools*B)*expert_bytes",
                   page_boundaries=boundaries,
                   within_one_page_per_boundary=abs(out["bytes"] - data) <= boundaries * options.granularity)
    else:
        raise ConfigError(f"unknown scheme {scheme!r}. Fix: use one of {', '.join(SCHEMES)}")
    if scheme != "moonep_ep":  # raw rows: weights and scales in the format's proportion, exactly
        out.update(weight_bytes=rows_held * split["weight_bytes"], scale_bytes=rows_held * split["scale_bytes"])
    out["format"] = fmt.name
    out["gb"] = out["bytes"] / 1e9
    out["fits"] = fits_on(out["bytes"], options.reserve_gb, options.gpus)
    out["smallest_gpu"] = smallest_gpu(out["fits"], options.gpus)
    out.update(_load_peak(scheme, out["bytes"], L=L, E=E, B=B, epn=epn, per_expert=per_expert))
    out["load_peak_gb"] = out["load_peak_bytes"] / 1e9
    out["load_peak_fits"] = fits_on(out["load_peak_bytes"], options.reserve_gb, options.gpus)
    out["load_peak_smallest_gpu"] = smallest_gpu(out["load_peak_fits"], options.gpus)
    return out


def _load_peak(scheme: str, final: int, *, L: int, E: int, B: int, epn: int, per_expert: int) -> dict[str, Any]:
    """Derived load peak of one scheme (see the module docstring); ``final`` is its steady-state bytes."""
    if scheme == "replicated":
        return {"load_peak_bytes": (L * (E + B) + E + epn) * per_expert,
                "load_peak_formula": "(L*(E+B) + E + E/R)*expert_bytes: the last layer's all-gather output "
                                     "[E] and local parameters [E/R] alive while its [E+B] copy is built"}
    if scheme == "per_layer_slots":
        return {"load_peak_bytes": final + epn * per_expert,
                "load_peak_formula": "final + (E/R)*expert_bytes (assumed: parameters copied into the "
                                     "[E/R+B] block layer by layer)"}
    if scheme == "eplb":
        return {"load_peak_bytes": final, "load_peak_formula": "final (loaded straight into the parameters)"}
    return {"load_peak_bytes": final,
            "load_peak_formula": "final (store allocated before loading; experts written straight into its pages)",
            "copy_in_load_peak_bytes": final + L * epn * per_expert,
            "copy_in_load_peak_formula": "final + L*(E/R)*expert_bytes (the store allocated at the first "
                                         "layer while every layer's local parameters were alive)"}


def ep_footprint(model: MoEModelConfig, ep_size: int,
                 options: FootprintOptions = FootprintOptions()) -> dict[str, Any]:
    """Every scheme at one EP size.

    Returns ``{"ep_size", "epn", "supported", "reason", "schemes": {scheme: ...},
    "ratio_replicated_over_moonep_ep"}``; ``schemes`` is ``None`` and the ratio
    ``None`` when the EP size does not divide ``E``.
    """
    why = _check_ep(model, ep_size)
    if why:
        return {"ep_size": ep_size, "epn": None, "supported": False, "reason": why,
                "schemes": None, "ratio_replicated_over_moonep_ep": None}
    schemes = {s: scheme_bytes(model, ep_size, s, options) for s in SCHEMES}
    ours = schemes["moonep_ep"]["bytes"]
    return {"ep_size": ep_size, "epn": model.num_experts // ep_size, "supported": True,
            "reason": None, "schemes": schemes,
            "ratio_replicated_over_moonep_ep": (schemes["replicated"]["bytes"] / ours
                                                if ours else None)}


def model_footprint(model: MoEModelConfig, ep_sizes: Iterable[int],
                    options: FootprintOptions = FootprintOptions()) -> dict[str, Any]:
    """One model at every EP size: ``{"config": {...}, "ep": {"<R>": ep_footprint}}``.

    ``config`` carries the format the figures are in (``format``, ``format_label``,
    ``format_source``: ``checkpoint`` or ``--format``), one expert's bytes in it
    (``expert_bytes`` = ``expert_weight_bytes`` + ``expert_scale_bytes``), its
    tensors, and the BF16 size for comparison (``bf16_expert_bytes``)."""
    fmt = model_format(model, options)
    tensors = model_tensors(model, options)
    split = projection_bytes(tensors)
    routed = model.num_moe_layers * model.num_experts * split["total_bytes"]
    cfg = dataclasses.asdict(model)
    cfg.update(format=fmt.name, format_label=fmt.label,
               format_source="--format" if options.expert_format is not None else "checkpoint",
               expert_bytes=split["total_bytes"], expert_weight_bytes=split["weight_bytes"],
               expert_scale_bytes=split["scale_bytes"], expert_gb=split["total_bytes"] / 1e9,
               tensors=[{"name": p.name, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                         "role": p.role, "bytes": p.row_bytes} for p in tensors],
               bf16_expert_bytes=model.expert_bytes,
               routed_bytes=routed, routed_gb=routed / 1e9)
    return {"config": cfg,
            "ep": {str(r): ep_footprint(model, r, options) for r in ep_sizes}}


def footprint_report(models: Iterable[MoEModelConfig], ep_sizes: Iterable[int],
                     options: FootprintOptions = FootprintOptions()) -> dict[str, Any]:
    """The whole JSON-ready report: assumptions plus ``models[name] = model_footprint``."""
    ep_sizes = list(ep_sizes)
    return {
        "units": {"bytes": "bytes per GPU (EP rank), routed experts of all MoE layers",
                  "gb": "1e9 bytes"},
        "assumptions": {
            "schemes": list(SCHEMES),
            "num_slots": ("auto: replicated B=4 (vLLM 0.33.0), per_layer_slots B=E/R (SGLang), "
                          "moonep_ep B=E/R (MoonEP Buffer default)"
                          if options.num_slots is None else options.num_slots),
            "eplb_redundant": ("auto: N=R (one redundant expert per rank per layer)"
                               if options.eplb_redundant is None else options.eplb_redundant),
            "granularity": options.granularity,
            "slot_pools": options.slot_pools,
            "moonep_api": options.moonep_api,
            "reserve_gb": options.reserve_gb,
            "gpu_capacity_gb": dict(options.gpus),
            "format": ("each model's checkpoint format (config.format)" if options.expert_format is None
                       else get_format(options.expert_format).name),
            "scales": "scale tensors counted apart from weights: weight_bytes + scale_bytes = bytes",
            "fits": "bytes + reserve_gb*1e9 <= capacity_gb*1e9",
        },
        "ep_sizes": ep_sizes,
        "models": {m.name: model_footprint(m, ep_sizes, options) for m in models},
    }

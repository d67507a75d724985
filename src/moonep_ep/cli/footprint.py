"""``moonep-ep footprint``: per-GPU routed-expert memory, replicated vs sharded.

Prints, for each model and EP size, the bytes of routed experts one GPU holds
under ``replicated`` (vLLM 0.33.0 MoonEP), ``per_layer_slots`` (SGLang-style),
``eplb`` (vLLM/SGLang redundant experts) and ``moonep_ep`` (this project), and
which GPUs they fit on; then each scheme's load peak (the transient while the
model loads, derived from its load sequence). The arithmetic lives in ``moonep_ep.layout.footprint``; this
module only parses options and formats. ``--measure`` hands over to
``moonep_ep.tools.commands.measure.measure_footprint``, which allocates real memory.

Wiring (done in ``moonep_ep.cli.main``)::

    from moonep_ep.cli import footprint
    footprint.add_parser(subparsers)   # sets defaults run=footprint.run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Sequence

from ..errors import ConfigError
from ..layout.footprint import (DEFAULT_EP_SIZES, DEFAULT_GRANULARITY, DEFAULT_RESERVE_GB,
                         GPU_CAPACITY_GB, SCHEMES, VLLM_DEFAULT_NUM_PREFETCH_SLOTS,
                         FootprintOptions, footprint_report)
from ..layout.formats import FORMAT_NAMES, get_format
from ..layout.graph_buffers import (DEFAULT_CAPTURE_SIZES, DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_SMALL_TOKEN_PADDING,
                                    VLLM_TOKEN_PADDING, capture_size_report)
from ..models import DEFAULT_MODELS, MoEModelConfig, get_model, load_hf_config, model_names
from ..tools.args import add_run_arguments

__all__ = ["add_parser", "run", "format_table", "format_capture_table", "write_plot", "parse_size",
           "parse_int_list"]

_SCHEME_LABEL = {
    "replicated": "replicated (vLLM 0.33.0)",
    "per_layer_slots": "per-layer slots (SGLang)",
    "eplb": "EPLB redundant",
    "moonep_ep": "moonep_ep (ours)",
}
_SCHEME_COLOR = {"replicated": "#c0392b", "per_layer_slots": "#e67e22",
                 "eplb": "#7f8c8d", "moonep_ep": "#2471a3"}
_GPU_COLOR = {"H100": "#1e8449", "H200": "#7d3c98", "B200": "#b9770e", "GB200": "#5d6d7e",
              "GB300": "#000000"}
#: GPUs the table names one by one for moonep_ep (issue 17: what fits on H200, B200, GB200).
_FIT_GPUS = ("H200", "B200", "GB200")
_GPU_STYLE = {"H100": "-", "H200": "--", "B200": "-.", "GB200": ":", "GB300": "-"}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gib": 1 << 30, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3}


def parse_size(text: str) -> int:
    """Bytes from ``2097152``, ``2MiB``, ``2M`` (binary) or ``2MB`` (decimal)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: give bytes as an integer, optionally with K/M/G (binary) or "
            f"KB/MB/GB (decimal), e.g. 2097152 or 2MiB")
    value = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: got {text!r}")
    return value


def parse_int_list(text: str) -> list[int]:
    """Positive ints from ``8,16,32`` (spaces allowed)."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: give comma-separated integers, "
                                         f"e.g. 8,16,32,64") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"bad list {text!r}: every value must be a positive integer")
    return values


def _auto_or_int(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto': got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: got {value}")
    return value


def _format_name(text: str) -> str:
    try:
        return get_format(text).name
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``footprint`` on an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "footprint",
        help="per-GPU routed-expert memory: replicated vs per-layer slots vs EPLB vs moonep_ep",
        description=(
            "Per-GPU bytes of a MoE model's routed experts (all MoE layers, gate+up+down, in the "
            "checkpoint's format unless --format: weights and scales counted apart) "
            "under four schemes: replicated (vLLM 0.33.0 MoonEP: every rank holds all E experts "
            "+ B slots per layer), per_layer_slots (sharded + B slots per layer, SGLang), eplb "
            "(sharded + N redundant experts per layer over the EP group) and moonep_ep (sharded "
            "+ one slot pool per projection shared by all layers, page-padded). GB = 1e9 bytes."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="NAME",
                   help="built-in model name (repeatable or comma-separated); default: all of "
                        + ", ".join(DEFAULT_MODELS) + f"; also: {', '.join(sorted(set(model_names()) - set(DEFAULT_MODELS)))}")
    p.add_argument("--config", action="append", default=None, metavar="PATH",
                   help="HuggingFace config.json (or its directory); repeatable. Its quantization_config "
                        "(compressed-tensors or native fp8/mxfp4) sets the format")
    p.add_argument("--format", dest="expert_format", type=_format_name, default=None, metavar="FMT",
                   help="size every model in this expert format (" + "|".join(FORMAT_NAMES) +
                        "; also int4-g<N>) instead of its checkpoint's (kimi-k3, gpt-oss MXFP4; kimi-k2, "
                        "deepseek-v3 FP8 block; kimi-k2-thinking INT4 g32; others BF16)")
    p.add_argument("--ep", type=parse_int_list, default=",".join(map(str, DEFAULT_EP_SIZES)), metavar="LIST",
                   help="EP sizes, comma-separated")
    p.add_argument("--slots", type=_auto_or_int, default="auto", metavar="B",
                   help=f"prefetch slots B for every slot scheme; 'auto' = replicated "
                        f"{VLLM_DEFAULT_NUM_PREFETCH_SLOTS} (vLLM 0.33.0), per_layer_slots E/R "
                        f"(SGLang default), moonep_ep E/R (MoonEP Buffer default)")
    p.add_argument("--eplb-redundant", type=_auto_or_int, default="auto", metavar="N",
                   help="redundant experts per layer over the whole EP group; each rank holds "
                        "ceil((E+N)/R) per layer; 'auto' = N=R (one per rank per layer)")
    p.add_argument("--granularity", type=parse_size, default=str(DEFAULT_GRANULARITY), metavar="BYTES",
                   help="VMM page size for moonep_ep (e.g. 2097152 or 2MiB)")
    p.add_argument("--moonep-api", choices=("pull", "push"), default="pull",
                   help="moonep_ep layout for MoonEP's pull API (7745ffa0, what vLLM 0.33.0 calls) or its "
                        "release's push API (scale rows padded per expert to 16 KiB where needed: FP8 block)")
    p.add_argument("--slot-pools", type=int, default=1, metavar="P",
                   help="moonep_ep slot pools per projection (2 for two layers in flight)")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB, metavar="X",
                   help="GB per GPU kept for KV cache, activations, non-expert weights and comm "
                        "buffers when deciding what fits")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write a bar chart (per-GPU GB per scheme and EP size, GPU capacities)")
    p.add_argument("--measure", action="store_true",
                   help="allocate the moonep_ep layout for real and measure it "
                        "(moonep_ep.tools.commands.measure)")
    p.add_argument("--ranks", type=int, default=None, metavar="R",
                   help="with --measure: EP ranks to run")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help="with --measure: MoE layers to allocate")
    p.add_argument("--capture-sizes", type=parse_int_list, nargs="?", default=None,
                   const=list(DEFAULT_CAPTURE_SIZES), metavar="LIST",
                   help="also print the MoonEP dispatch buffer's receive-shard bytes per CUDA graph capture size "
                        "(tokens per rank), under vLLM's pool and one buffer per capture size (derived; "
                        "issue 46); without LIST: " + ",".join(map(str, DEFAULT_CAPTURE_SIZES)))
    p.add_argument("--token-padding-small", type=int, default=DEFAULT_SMALL_TOKEN_PADDING, metavar="N",
                   help=f"with --capture-sizes: the small decode token_padding the per-size buffers are also "
                        f"sized at (vLLM's is {VLLM_TOKEN_PADDING})")
    p.add_argument("--max-tokens-per-rank", type=int, default=DEFAULT_MAX_TOKENS_PER_RANK, metavar="N",
                   help="with --capture-sizes: vLLM's pool's largest capacity (max_num_batched_tokens)")
    add_run_arguments(p, driver_default="host",
                      driver_help="with --measure: memory driver (host: memfd sizes from the OS; cuda: device "
                                  "bytes from the driver, over the emulator with MOONEP_EP_CUDA_EMULATOR=1)",
                      json_help="print one JSON object instead of tables")
    # Negative control of the warm-up (tests): read the device-wide figure before any kernel ran.
    p.add_argument("--skip-warm-up", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)
    return p


def _split(values: Sequence[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out.extend(x.strip() for x in v.split(",") if x.strip())
    return out


def _select_models(args: argparse.Namespace) -> list[MoEModelConfig]:
    names = _split(args.model)
    configs = _split(getattr(args, "config", None))
    if not names and not configs:
        names = list(DEFAULT_MODELS)
    models = [get_model(n) for n in names] + [load_hf_config(c) for c in configs]
    seen: set[str] = set()
    unique = []
    for m in models:
        if m.name not in seen:
            seen.add(m.name)
            unique.append(m)
    return unique


def _options(args: argparse.Namespace) -> FootprintOptions:
    return FootprintOptions(num_slots=args.slots, eplb_redundant=args.eplb_redundant,
                            granularity=args.granularity, slot_pools=args.slot_pools,
                            reserve_gb=args.reserve_gb, gpus=dict(GPU_CAPACITY_GB),
                            expert_format=getattr(args, "expert_format", None),
                            moonep_api=getattr(args, "moonep_api", "pull"))


def _fmt_gb(gb: float) -> str:
    if gb >= 100:
        return f"{gb:,.1f}"
    if gb >= 1:
        return f"{gb:.2f}"
    return f"{gb:.3f}"


def format_table(report: dict[str, Any]) -> str:
    """Human-readable tables: one per model, one row per EP size."""
    a = report["assumptions"]
    lines = [
        "Routed-expert GB per GPU (GB = 1e9 bytes); [GPU] = smallest GPU that fits with "
        f"{a['reserve_gb']:g} GB reserved ({', '.join(f'{k} {v:g}' for k, v in a['gpu_capacity_gb'].items())}); "
        "'-' = none fits.",
        f"slots: {a['num_slots']}; eplb N: {a['eplb_redundant']}; moonep_ep page "
        f"{a['granularity']} B, {a['slot_pools']} slot pool(s), {a['moonep_api']} API"
        + (" (scale rows padded per expert to 16 KiB where needed)." if a["moonep_api"] == "push" else "."),
    ]
    cols = list(SCHEMES)
    fit_gpus = [g for g in _FIT_GPUS if g in a["gpu_capacity_gb"]]
    for name, mf in report["models"].items():
        cfg = mf["config"]
        lines += ["", f"{name}: E={cfg['num_experts']} K={cfg['top_k']} H={cfg['hidden_size']} "
                      f"I={cfg['moe_intermediate_size']} L={cfg['num_moe_layers']}",
                  f"  format: {cfg['format']} = {cfg['format_label']} ({'from --format' if cfg['format_source'] == '--format' else 'the checkpoint'}"
                  f"{'; ' + cfg['quantization'] if cfg.get('quantization') and cfg['format_source'] != '--format' else ''}); "
                  f"{cfg['expert_bytes'] / 1e6:.2f} MB/expert = {cfg['expert_weight_bytes'] / 1e6:.2f} weights + "
                  f"{cfg['expert_scale_bytes'] / 1e6:.3f} scales (BF16: {cfg['bf16_expert_bytes'] / 1e6:.1f})"]
        header = ["EP", "E/R"] + cols + ["ours: scales GB", "repl/ours", "ours fits " + "/".join(fit_gpus)]
        rows = [header]
        for ep, entry in mf["ep"].items():
            if not entry["supported"]:
                rows.append([ep, "-"] + ["n/a"] * len(cols) + ["-", "-", "-"])
                continue
            row = [ep, str(entry["epn"])]
            for s in cols:
                d = entry["schemes"][s]
                row.append(f"{_fmt_gb(d['gb'])} [{d['smallest_gpu'] or '-'}]")
            ours = entry["schemes"]["moonep_ep"]
            row.append(_fmt_gb(ours["scale_bytes"] / 1e9))
            ratio = entry["ratio_replicated_over_moonep_ep"]
            row.append(f"{ratio:.1f}x" if ratio else "-")
            row.append("/".join("yes" if ours["fits"][g] else "no" for g in fit_gpus))
            rows.append(row)
        lines += _render(rows)
        unsupported = [e["reason"] for e in mf["ep"].values() if not e["supported"]]
        if unsupported:
            lines.append(f"  n/a: {unsupported[0]}")
        lines += _load_peak_table(mf, cols)
    return "\n".join(lines)


def _load_peak_table(mf: dict[str, Any], cols: list[str]) -> list[str]:
    """The load peak (derived, see ``layout.footprint``) per scheme, same layout as the table above."""
    rows = [["EP"] + [f"{c} load peak" for c in cols]]
    for ep, entry in mf["ep"].items():
        if not entry["supported"]:
            continue
        rows.append([ep] + [f"{_fmt_gb(entry['schemes'][c]['load_peak_gb'])} "
                            f"[{entry['schemes'][c]['load_peak_smallest_gpu'] or '-'}]" for c in cols])
    if len(rows) == 1:
        return []
    return ["  load peak, GB per GPU (derived from each scheme's load sequence; moonep_ep loads zero-copy):",
            *_render(rows)]


def format_capture_table(report: dict[str, Any]) -> str:
    """The ``--capture-sizes`` tables (``layout.graph_buffers.capture_size_report``): one per model and EP size."""
    a, f = report["assumptions"], report["formulas"]
    tp, small = a["token_padding"], a["token_padding_small"]
    lines = [f"MoonEP dispatch buffer per CUDA graph capture size n (tokens per rank), {a['api']} API; derived, "
             f"not measured: {f['rows_' + a['api']]}; bytes = {f['bytes']}; pad = {f['padding_fraction']}; "
             f"MB = 1e6 bytes.",
             f"vLLM pool: S = {f['vllm_pool_S']} with "
             f"max_tokens_per_rank {a['max_tokens_per_rank']} (MoonEPBufferPool.capacity_for), tp {tp}; "
             f"per size: S = {f['per_size_S']}, tp {tp} and tp {small}. Totals: {f['total_bytes']}.",
             "pad counts the rows beyond the buffer's S*K; a capture of n < S tokens fills only n*K rows."]
    for name, mf in report["models"].items():
        cfg = mf["config"]
        for ep, entry in mf["ep"].items():
            head = f"{name} EP{ep}: E={cfg['num_experts']} K={cfg['top_k']} H={cfg['hidden_size']}"
            if not entry["supported"]:
                lines += ["", f"{head}: n/a: {entry['reason']}"]
                continue
            lines += ["", f"{head} epn={entry['epn']}"]
            rows = [["n", "vLLM S", f"NvS tp{tp}", "MB", "pad", "own S", f"NvS tp{tp}", "MB", "pad",
                     f"NvS tp{small}", "MB", "pad"]]
            for r in entry["rows"]:
                v, o, s = r["vllm_pool"], r["per_size"], r["per_size_small_tp"]
                rows.append([str(r["capture_size"]), str(v["S"])]
                            + _capture_cells(v)
                            + [str(o["S"])] + _capture_cells(o) + _capture_cells(s))
            lines += _render(rows)
            t = entry["totals"]
            lines.append("  distinct buffers: " + "; ".join(
                f"{label} S={','.join(map(str, t[k]['S']))}: {t[k]['bytes']:,} B = {t[k]['bytes'] / 1e6:.2f} MB"
                for k, label in (("vllm_pool", f"vLLM pool tp{tp}"), ("per_size", f"per size tp{tp}"),
                                 ("per_size_small_tp", f"per size tp{small}"))))
    return "\n".join(lines)


def _capture_cells(e: dict[str, Any]) -> list[str]:
    return [str(e["rows"]), f"{e['bytes'] / 1e6:.2f}", f"{100 * e['padding_fraction']:.1f}%"]


def _render(rows: list[list[str]]) -> list[str]:
    """Right-aligned columns, indented two spaces, a dash rule under the header row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    out.insert(1, "  " + "  ".join("-" * w for w in widths))
    return out


def write_plot(report: dict[str, Any], path: str) -> dict[str, Any]:
    """Bar chart: one panel per model, bars = per-GPU GB per scheme for each EP size.

    Log y axis when values span more than ~30x; horizontal lines at each GPU's
    HBM capacity; the moonep_ep bars carry their GB value. Returns what was
    drawn: the panels' titles and each panel's series labels.
    """
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = report["assumptions"]
    models = list(report["models"].items())
    n = len(models)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(6.2 * ncols, 8.0), 4.4 * nrows), squeeze=False)
    width = 0.8 / len(SCHEMES)
    caps = a["gpu_capacity_gb"]
    for idx, (name, mf) in enumerate(models):
        ax = axes[idx // ncols][idx % ncols]
        eps = list(mf["ep"])
        values = []
        for j, s in enumerate(SCHEMES):
            ys = [(e["schemes"][s]["gb"] if e["supported"] else 0.0) for e in mf["ep"].values()]
            values += [y for y in ys if y > 0]
            xs = [i + (j - (len(SCHEMES) - 1) / 2) * width for i in range(len(eps))]
            ax.bar(xs, ys, width, color=_SCHEME_COLOR[s], label=_SCHEME_LABEL[s])
        for i, e in enumerate(mf["ep"].values()):
            if not e["supported"]:
                ax.text(i, 0.03, "n/a\n(E % EP != 0)", ha="center", va="bottom", fontsize=8,
                        color="#555555", transform=ax.get_xaxis_transform())
        lo, hi = (min(values), max(values)) if values else (1.0, 1.0)
        log = hi / max(lo, 1e-9) > 30
        if log:
            ax.set_yscale("log")
        top = max(hi, max(caps.values())) * (2.0 if log else 1.15)
        ax.set_ylim(bottom=(lo / 2 if log else 0), top=top)
        for g, cap in caps.items():
            ax.axhline(cap, color=_GPU_COLOR.get(g, "black"), linestyle=_GPU_STYLE.get(g, "-"),
                       linewidth=1.0, alpha=0.8, label=f"{g} HBM {cap:g} GB")
        ours = [(i, e["schemes"]["moonep_ep"]["gb"]) for i, e in enumerate(mf["ep"].values())
                if e["supported"]]
        dx = (len(SCHEMES) - 1) / 2 * width
        for i, y in ours:
            ax.text(i + dx, y, _fmt_gb(y), ha="center", va="bottom", fontsize=6.5,
                    color=_SCHEME_COLOR["moonep_ep"])
        ax.set_xticks(range(len(eps)))
        ax.set_xticklabels([f"EP{ep}" for ep in eps])
        ax.set_xlim(-0.5, len(eps) - 0.5)
        cfg = mf["config"]
        ax.set_title(f"{name}, {cfg['format']}  (E={cfg['num_experts']}, L={cfg['num_moe_layers']}, "
                     f"{cfg['expert_bytes'] / 1e6:.1f} MB/expert incl. scales)", fontsize=9)
        ax.set_ylabel("routed experts per GPU (GB)" + (", log" if log else ""), fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", which="major", alpha=0.25)
    for idx in range(n, nrows * ncols):
        axes[idx // ncols][idx % ncols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    order = [labels.index(_SCHEME_LABEL[s]) for s in SCHEMES] + \
        [k for k, lab in enumerate(labels) if lab not in _SCHEME_LABEL.values()]
    fig_height = fig.get_size_inches()[1]
    formats = sorted({mf["config"]["format"] for _, mf in models})
    fig.suptitle(f"Routed-expert memory per GPU, {'each model in its checkpoint format' if a['format'].startswith('each') else a['format']}"
                 f" ({', '.join(formats)}; weights + scales; GB = 1e9 bytes)\n"
                 f"lines: GPU HBM; fits = below HBM - {a['reserve_gb']:g} GB reserve; "
                 f"numbers: moonep_ep GB", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig_height))
    fig.legend([handles[k] for k in order], [labels[k] for k in order], loc="upper left",
               bbox_to_anchor=(1.0, 1 - 0.5 / fig_height), fontsize=8.5, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    drawn = {"panels": [ax.get_title() for row in axes for ax in row if ax.axison],
             "series": [[h.get_label() for h in ax.get_legend_handles_labels()[0]] for row in axes for ax in row
                        if ax.axison]}
    plt.close(fig)
    return drawn


def run(args: argparse.Namespace) -> int:
    """Run ``moonep-ep footprint``; returns the process exit code.

    0 on success; 2 on a configuration error (message on stderr).
    """
    if getattr(args, "measure", False):
        from ..tools.commands.measure import measure_footprint  # allocates real memory; lazy on purpose

        return int(measure_footprint(args))
    try:
        models = _select_models(args)
        report = footprint_report(models, args.ep, _options(args))
        if getattr(args, "capture_sizes", None):
            report["capture_size_buffers"] = capture_size_report(
                models, args.ep, args.capture_sizes, args.token_padding_small, getattr(args, "moonep_api", "pull"),
                args.max_tokens_per_rank)
    except ConfigError as exc:
        print(f"moonep-ep footprint: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        write_plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
        if "capture_size_buffers" in report:
            print("\n" + format_capture_table(report["capture_size_buffers"]))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0

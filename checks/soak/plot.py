"""One PNG of a soak: RSS and open fds per process, throughput, p50/p99 latency over time, faults marked.

Throughput and latency come from two sources, each labelled: the load client's windows (``vllm bench serve``'s
per-request lists, written only when it ends) and the server's own ``/metrics`` (``server_metrics.py``: one
flat segment per scrape interval, the interval's average, so an interrupted client still leaves a picture).

Drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``, no pyplot), so no display is
needed and no global backend is switched under a caller that uses pyplot itself.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from .bench_client import WindowFigures
from .sampler import Sample

__all__ = ["plot_soak", "soak_figure", "MAX_LEGEND", "SERVER"]

MIB = 1 << 20
#: Processes named in a panel's legend at most (a server has about ten; the rest are drawn unnamed).
MAX_LEGEND = 12
#: The label prefix of what the server's /metrics measured (the client's lines say "client").
SERVER = "server /metrics"
#: The server's latency figures drawn: (key of an interval, name, colour: the client's p50/p99 lines' colours).
SERVER_LATENCIES = (("e2el_mean_ms", "latency mean", "tab:gray"), ("e2el_p50_ms", "latency p50", "C0"),
                    ("e2el_p99_ms", "latency p99", "C1"), ("ttft_mean_ms", "TTFT mean", "tab:brown"),
                    ("ttft_p50_ms", "TTFT p50", "C2"), ("ttft_p99_ms", "TTFT p99", "C3"))


def plot_soak(path: str, samples: Sequence[Sample], windows: Sequence[WindowFigures],
              faults: Sequence[tuple[float, str]], t0: float | None = None, title: str = "soak",
              server: Mapping[str, Any] | None = None) -> str:
    """Write the PNG of :func:`soak_figure` to ``path`` and return it."""
    fig = soak_figure(samples, windows, faults, t0=t0, title=title, server=server)
    fig.savefig(path, dpi=90)
    return path


def _steps(intervals: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """One flat segment per interval at its value (minutes on x), NaN between them: each figure is an average
    over its own span, and a span after a gap is as long as the gap."""
    xs: list[float] = []
    ys: list[float] = []
    for iv in intervals:
        value = iv.get(key)
        y = math.nan if value is None else float(value)
        xs += [iv["t_start_s"] / 60, iv["t_end_s"] / 60, math.nan]
        ys += [y, y, math.nan]
    return xs, ys


def soak_figure(samples: Sequence[Sample], windows: Sequence[WindowFigures], faults: Sequence[tuple[float, str]],
                t0: float | None = None, title: str = "soak", server: Mapping[str, Any] | None = None) -> Any:
    """The soak's matplotlib ``Figure`` (four panels sharing the x axis).

    ``samples``: the sampler's, on the monotonic clock; ``t0``: the soak's start on it (default: the first
    sample's ``t``). ``windows``: load figures whose ``t_s`` (window start, seconds after ``t0``) places
    them, drawn at the window's middle. ``faults``: ``(t_s, kind)``, a dashed vertical line each, one colour
    per kind. ``server``: the soak JSON's ``server_metrics`` (``intervals``, ``gaps``, ``resets``), drawn in the
    throughput and latency panels beside the client's windows; failed scrapes and counter resets marked on the
    throughput panel. The x axis is minutes after ``t0``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    start = (samples[0].t if samples else 0.0) if t0 is None else t0
    fig = Figure(figsize=(11, 12))
    FigureCanvasAgg(fig)
    rss_ax, fd_ax, tput_ax, lat_ax = fig.subplots(4, 1, sharex=True)

    series: dict[tuple[int, int], tuple[str, list[float], list[int], list[int]]] = {}
    for sample in samples:
        for p in sample.processes:
            label, ts, rss, fds = series.setdefault(p.key, (p.label(), [], [], []))
            ts.append((sample.t - start) / 60)
            rss.append(p.rss_bytes)
            fds.append(p.open_fds)
    for i, (label, ts, rss, fds) in enumerate(series.values()):
        name = label if i < MAX_LEGEND else None
        rss_ax.plot(ts, [v / MIB for v in rss], label=name, linewidth=1)
        fd_ax.plot(ts, fds, label=name, linewidth=1)
    rss_ax.set_ylabel("RSS (MiB)")
    fd_ax.set_ylabel("open fds")

    mids = [(w.t_s + w.span_s / 2) / 60 for w in windows]
    tput_ax.plot(mids, [w.output_throughput for w in windows], marker=".", label="client: output tokens/s")
    tput_twin = tput_ax.twinx()
    tput_twin.plot(mids, [w.request_throughput for w in windows], marker=".", color="tab:green",
                   label="client: completed requests/s")
    server = server or {}
    intervals = list(server.get("intervals") or [])
    if intervals:  # drawn (and in the legend) only when the server was read
        tput_ax.plot(*_steps(intervals, "output_tokens_per_s"), color="tab:blue", alpha=0.5, linewidth=2,
                     label=f"{SERVER}: output tokens/s")
        tput_twin.plot(*_steps(intervals, "completed_requests_per_s"), color="tab:olive", alpha=0.6, linewidth=2,
                       label=f"{SERVER}: completed requests/s")
    gaps = [g["t_s"] / 60 for g in server.get("gaps") or []]
    resets = [t / 60 for t in server.get("resets") or []]
    if gaps:
        tput_ax.plot(gaps, [0.0] * len(gaps), "x", color="tab:red", label=f"{SERVER}: scrape failed")
    if resets:
        tput_ax.plot(resets, [0.0] * len(resets), "o", mfc="none", color="tab:purple",
                     label=f"{SERVER}: counters reset (server restarted)")
    tput_ax.set_ylabel("output tokens/s")
    tput_twin.set_ylabel("completed requests/s")

    def latency(values: list[float | None]) -> list[float]:
        return [float("nan") if v is None else v for v in values]

    lat_ax.plot(mids, latency([w.e2el_p50_ms for w in windows]), marker=".", label="client: latency p50")
    lat_ax.plot(mids, latency([w.e2el_p99_ms for w in windows]), marker=".", label="client: latency p99")
    lat_ax.plot(mids, latency([w.ttft_p50_ms for w in windows]), linestyle=":", label="client: TTFT p50")
    lat_ax.plot(mids, latency([w.ttft_p99_ms for w in windows]), linestyle=":", label="client: TTFT p99")
    for key, name, colour in SERVER_LATENCIES if intervals else ():
        lat_ax.plot(*_steps(intervals, key), color=colour, alpha=0.45, linewidth=2, label=f"{SERVER}: {name}")
    lat_ax.set_ylabel("ms")
    lat_ax.set_xlabel("minutes")

    kinds = sorted({kind for _, kind in faults})
    colours = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}
    for ax in (rss_ax, fd_ax, tput_ax, lat_ax):
        for j, (t_s, kind) in enumerate(faults):
            ax.axvline(t_s / 60, color=colours[kind], linestyle="--", linewidth=0.8, alpha=0.7,
                       label=f"fault: {kind}" if ax is lat_ax and all(k != kind for _, k in faults[:j]) else None)
        ax.grid(True, alpha=0.3)
    for ax in (rss_ax, fd_ax):
        if series:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    handles, labels = tput_ax.get_legend_handles_labels()
    twin_handles, twin_labels = tput_twin.get_legend_handles_labels()
    tput_ax.legend(handles + twin_handles, labels + twin_labels, fontsize=6, loc="upper left", ncol=2)
    lat_ax.legend(fontsize=6, loc="upper left", ncol=3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig

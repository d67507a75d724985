"""One PNG of a soak: RSS and open fds per process, throughput, p50/p99 latency over time, faults marked.

Drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``, no pyplot), so no display is
needed and no global backend is switched under a caller that uses pyplot itself.
"""

from __future__ import annotations

from typing import Sequence

from .bench_client import WindowFigures
from .sampler import Sample

__all__ = ["plot_soak", "MAX_LEGEND"]

MIB = 1 << 20
#: Processes named in a panel's legend at most (a server has about ten; the rest are drawn unnamed).
MAX_LEGEND = 12


def plot_soak(path: str, samples: Sequence[Sample], windows: Sequence[WindowFigures],
              faults: Sequence[tuple[float, str]], t0: float | None = None, title: str = "soak") -> str:
    """Write the PNG to ``path`` and return it.

    ``samples``: the sampler's, on the monotonic clock; ``t0``: the soak's start on it (default: the first
    sample's ``t``). ``windows``: load figures whose ``t_s`` (window start, seconds after ``t0``) places
    them, drawn at the window's middle. ``faults``: ``(t_s, kind)``, a dashed vertical line each, one colour
    per kind. The x axis is minutes after ``t0``.
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
    tput_ax.plot(mids, [w.output_throughput for w in windows], marker=".", label="output tokens/s")
    tput_twin = tput_ax.twinx()
    tput_twin.plot(mids, [w.request_throughput for w in windows], marker=".", color="tab:green",
                   label="completed requests/s")
    tput_ax.set_ylabel("output tokens/s")
    tput_twin.set_ylabel("completed requests/s")

    def latency(values: list[float | None]) -> list[float]:
        return [float("nan") if v is None else v for v in values]

    lat_ax.plot(mids, latency([w.e2el_p50_ms for w in windows]), marker=".", label="latency p50")
    lat_ax.plot(mids, latency([w.e2el_p99_ms for w in windows]), marker=".", label="latency p99")
    lat_ax.plot(mids, latency([w.ttft_p50_ms for w in windows]), linestyle=":", label="TTFT p50")
    lat_ax.plot(mids, latency([w.ttft_p99_ms for w in windows]), linestyle=":", label="TTFT p99")
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
    tput_ax.legend(handles + twin_handles, labels + twin_labels, fontsize=7, loc="upper left")
    lat_ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path

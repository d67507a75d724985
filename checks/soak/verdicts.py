"""The soak's verdicts: pure functions over sampled series, each stating its rule and, when it fails, naming
the process, the resource and the minute.

Times: a :class:`~.sampler.Sample` carries ``t``, monotonic seconds; ``t0`` is the soak's start on that clock
(default: the first sample's ``t``). Arguments ending in ``_s`` are seconds after ``t0``. Minute ``m`` is
``[60·m, 60·m + 60)`` seconds after ``t0`` (the first minute is 0). The warm-up (``warmup_s``) is left out of
every resource verdict: start-up allocates, and only what follows it must stay put. ``until_s`` (optional)
ends the judged span, e.g. before a planned SIGKILL.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from .faults import FaultOutcome
from .sampler import ProcessSample, Sample

__all__ = ["Failure", "Verdict", "minute_of", "least_squares_slope", "rss_slope_verdict", "fds_flat_verdict",
           "dev_shm_flat_verdict", "memfd_constant_verdict", "errors_by_class", "failed_requests_verdict",
           "bad_requests_verdict", "summary"]

HOUR_S = 3600.0
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failed check. ``process``: ``pid 1234 (name)``, or what else holds the resource (``the machine``,
    the server's label); ``message``: one sentence that names the three."""

    process: str
    resource: str
    minute: int
    message: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``rule``: the stated bound; ``figures``: what was measured (per process where it applies)."""

    name: str
    rule: str
    failures: tuple[Failure, ...]
    figures: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.failures


def minute_of(t: float, t0: float) -> int:
    """The minute (0-based) of monotonic time ``t`` in a soak that started at ``t0``."""
    return int((t - t0) // 60)


def least_squares_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Slope of the least-squares line through ``(ts[i], ys[i])``: ``Σ(t-t̄)(y-ȳ) / Σ(t-t̄)²`` (units of y per
    unit of t). Needs two distinct times."""
    if len(ts) != len(ys) or len(ts) < 2:
        raise ValueError(f"need two or more points of equal count, got {len(ts)} times, {len(ys)} values")
    tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx == 0:
        raise ValueError("all points at one time: no slope")
    return sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx


def _judged(samples: Sequence[Sample], warmup_s: float, t0: float | None,
            until_s: float | None) -> tuple[float, list[Sample]]:
    """``(t0, the samples inside [t0 + warmup_s, t0 + until_s))``; ValueError if there are none (a run too
    short to judge is not a pass)."""
    if not samples:
        raise ValueError("no samples")
    start = samples[0].t if t0 is None else t0
    end = float("inf") if until_s is None else start + until_s
    judged = [s for s in samples if start + warmup_s <= s.t < end]
    if not judged:
        raise ValueError(f"no sample in [{warmup_s}, {until_s}) s after the start: nothing to judge")
    return start, judged


def _per_process(samples: Sequence[Sample]) -> dict[tuple[int, int], list[tuple[float, ProcessSample]]]:
    """Each process's ``(t, sample)`` series, by ``(pid, start_ticks)``, in sample order."""
    out: dict[tuple[int, int], list[tuple[float, ProcessSample]]] = {}
    for sample in samples:
        for proc in sample.processes:
            out.setdefault(proc.key, []).append((sample.t, proc))
    return out


def rss_slope_verdict(samples: Sequence[Sample], warmup_s: float, bound_bytes_per_hour: float,
                      t0: float | None = None, until_s: float | None = None, min_samples: int = 3) -> Verdict:
    """Each process's RSS slope after the warm-up (least squares, bytes/hour) at most ``bound_bytes_per_hour``.

    A process sampled fewer than ``min_samples`` times after the warm-up is listed, not judged. A failure's
    minute is that of the process's highest RSS in the judged span (where the growth has got to).
    """
    start, judged = _judged(samples, warmup_s, t0, until_s)
    failures, slopes, too_few = [], {}, []
    for series in _per_process(judged).values():
        label = series[-1][1].label()
        if len(series) < min_samples:
            too_few.append(label)
            continue
        slope = least_squares_slope([t for t, _ in series], [p.rss_bytes for _, p in series]) * HOUR_S
        slopes[label] = slope
        if slope > bound_bytes_per_hour:
            t_peak, peak = max(series, key=lambda tp: (tp[1].rss_bytes, -tp[0]))
            first_t, first = series[0]
            minute = minute_of(t_peak, start)
            failures.append(Failure(label, "rss", minute, (
                f"{label} rss: grows {slope / MIB:.1f} MiB/h > bound {bound_bytes_per_hour / MIB:.1f} MiB/h "
                f"(least squares over minutes {minute_of(first_t, start)}-{minute_of(series[-1][0], start)}); "
                f"{first.rss_bytes / MIB:.1f} MiB at minute {minute_of(first_t, start)}, peak "
                f"{peak.rss_bytes / MIB:.1f} MiB at minute {minute}")))
    return Verdict("rss_slope", f"RSS slope of each process after a {warmup_s:.0f} s warm-up <= "
                   f"{bound_bytes_per_hour / MIB:.1f} MiB/h", tuple(failures),
                   {"slope_bytes_per_hour": slopes, "too_few_samples": too_few})


def _first_spread(values: Sequence[tuple[float, int]], tolerance: int) -> tuple[float, int, int] | None:
    """The first ``(t, running min, running max)`` at which ``max - min`` of the values so far exceeds
    ``tolerance``, or None."""
    lo = hi = values[0][1]
    for t, v in values:
        lo, hi = min(lo, v), max(hi, v)
        if hi - lo > tolerance:
            return t, lo, hi
    return None


def fds_flat_verdict(samples: Sequence[Sample], warmup_s: float, tolerance: int, t0: float | None = None,
                     until_s: float | None = None) -> Verdict:
    """Each process's open fds after the warm-up within ``tolerance``: ``max - min <= tolerance``. A failure's
    minute is the first at which the spread so far exceeded it."""
    start, judged = _judged(samples, warmup_s, t0, until_s)
    failures, spread = [], {}
    for series in _per_process(judged).values():
        label = series[-1][1].label()
        values = [(t, p.open_fds) for t, p in series]
        spread[label] = max(v for _, v in values) - min(v for _, v in values)
        broke = _first_spread(values, tolerance)
        if broke is not None:
            t, lo, hi = broke
            minute = minute_of(t, start)
            failures.append(Failure(label, "fds", minute, (
                f"{label} fds: {lo} to {hi} open fds by minute {minute} (spread {hi - lo} > tolerance "
                f"{tolerance})")))
    return Verdict("fds_flat", f"open fds of each process after a {warmup_s:.0f} s warm-up: max - min <= "
                   f"{tolerance}", tuple(failures), {"fd_spread": spread})


def _changed_processes(before: Sample, after: Sample, field: str) -> list[str]:
    """Labels of the processes whose ``field`` differs between two samples, and of those that exited or
    started between them."""
    old, new = before.by_key(), after.by_key()
    out = []
    for key, proc in new.items():
        if key not in old:
            out.append(f"{proc.label()} (started since)")
        elif getattr(proc, field) != getattr(old[key], field):
            out.append(f"{proc.label()} ({getattr(old[key], field)} -> {getattr(proc, field)})")
    out += [f"{proc.label()} (exited since)" for key, proc in old.items() if key not in new]
    return out


def dev_shm_flat_verdict(samples: Sequence[Sample], warmup_s: float, tolerance: int = 0, t0: float | None = None,
                         until_s: float | None = None, scope: str = "machine") -> Verdict:
    """Entries of the shared-memory directory after the warm-up within ``tolerance`` (``max - min``).
    ``scope="machine"``: the directory's entries; ``"tree"``: the files the tree's processes hold open or
    mapped (on a machine where other programs make and remove their own entries, such as a test run's other
    worker; the machine-wide range is still reported). A failure names the tree's processes whose holdings
    changed, or says that none of them holds the change."""
    if scope not in ("machine", "tree"):
        raise ValueError(f"scope must be machine or tree, got {scope!r}")
    start, judged = _judged(samples, warmup_s, t0, until_s)
    machine = [s.dev_shm_entries for s in judged]
    counts = [(s.t, s.dev_shm_entries if scope == "machine" else sum(p.shm_files for p in s.processes))
              for s in judged]
    figures = {"entries_min": min(v for _, v in counts), "entries_max": max(v for _, v in counts)}
    if scope == "tree":
        figures.update(scope="tree", machine_entries_min=min(machine), machine_entries_max=max(machine))
    failures = []
    broke = _first_spread(counts, tolerance)
    if broke is not None:
        t, lo, hi = broke
        minute = minute_of(t, start)
        at = next(s for s in judged if s.t == t)
        holders = _changed_processes(judged[0], at, "shm_files")
        process = "; ".join(holders) if holders else "the machine (no process of the tree holds the change)"
        failures.append(Failure(process, "/dev/shm", minute, (
            f"/dev/shm: {lo} to {hi} entries by minute {minute} (spread {hi - lo} > tolerance {tolerance}); "
            f"processes: {process}")))
    what = "/dev/shm entries" if scope == "machine" else "/dev/shm files the tree holds"
    return Verdict("dev_shm_flat", f"{what} after a {warmup_s:.0f} s warm-up: max - min <= {tolerance}",
                   tuple(failures), figures)


def memfd_constant_verdict(samples: Sequence[Sample], warmup_s: float, tolerance_bytes: int = 0,
                           t0: float | None = None, until_s: float | None = None) -> Verdict:
    """The tree's moonep_ep memfd bytes after the warm-up within ``tolerance_bytes`` of the first judged sample.
    A failure's minute is the first that differs; it names the processes whose holdings changed."""
    start, judged = _judged(samples, warmup_s, t0, until_s)
    base = judged[0]
    failures = []
    for sample in judged:
        if abs(sample.memfd_bytes - base.memfd_bytes) > tolerance_bytes:
            minute = minute_of(sample.t, start)
            holders = _changed_processes(base, sample, "memfd_bytes")
            process = "; ".join(holders) if holders else "the tree"
            failures.append(Failure(process, "memfd bytes", minute, (
                f"memfd bytes: {base.memfd_bytes} at minute {minute_of(base.t, start)}, {sample.memfd_bytes} at "
                f"minute {minute} (tolerance {tolerance_bytes}); processes: {process}")))
            break
    return Verdict("memfd_constant", f"the tree's moonep_ep memfd bytes after a {warmup_s:.0f} s warm-up constant "
                   f"within {tolerance_bytes} bytes", tuple(failures),
                   {"memfd_bytes": base.memfd_bytes,
                    "memfd_bytes_range": [min(s.memfd_bytes for s in judged), max(s.memfd_bytes for s in judged)]})


def errors_by_class(statuses: Iterable[int | None]) -> dict[str, int]:
    """HTTP statuses counted by class: ``"2xx"``, ``"4xx"``, ...; None (no HTTP answer) as ``"no answer"``."""
    out: dict[str, int] = {}
    for status in statuses:
        key = "no answer" if status is None else f"{status // 100}xx"
        out[key] = out.get(key, 0) + 1
    return out


def _excused(t_s: float, span_s: float, excused: Sequence[tuple[float, float]]) -> bool:
    """Whether ``[t_s, t_s + span_s)`` (a point if ``span_s`` is 0) meets one of the ``[a, b)`` spans."""
    return any((a <= t_s < b) if span_s == 0 else (t_s < b and t_s + span_s > a) for a, b in excused)


def failed_requests_verdict(events: Sequence[tuple[float, float, int]], process: str,
                            excused: Sequence[tuple[float, float]] = ()) -> Verdict:
    """No failed valid request outside the ``excused`` spans (``[a_s, b_s)``, e.g. the SIGKILL's).

    ``events``: ``(t_s, span_s, failed)``, a window of load (``WindowFigures``: ``t_s``, ``span_s``,
    ``failed``) or one request (span 0, failed 1). ``process`` names what answered them (the API server).
    One failure per minute with failures, counting them.
    """
    per_minute: dict[int, int] = {}
    excused_count = 0
    for t_s, span_s, failed in events:
        if failed <= 0:
            continue
        if _excused(t_s, span_s, excused):
            excused_count += failed
            continue
        minute = int(t_s // 60)
        per_minute[minute] = per_minute.get(minute, 0) + failed
    failures = tuple(Failure(process, "valid requests", m, f"{process} valid requests: {n} failed in minute {m}")
                     for m, n in sorted(per_minute.items()))
    return Verdict("no_failed_valid_requests", "0 failed valid requests outside the excused spans "
                   f"{[list(span) for span in excused]}", failures,
                   {"failed": sum(per_minute.values()), "failed_excused": excused_count})


def bad_requests_verdict(outcomes: Sequence[tuple[float, FaultOutcome]], process: str) -> Verdict:
    """Every bad request answered as the catalogue says. ``outcomes``: ``(t_s, outcome)`` per request sent."""
    failures = tuple(
        Failure(process, f"bad request '{o.case}'", int(t_s // 60),
                f"{process} bad request '{o.case}' in minute {int(t_s // 60)}: {o.reason}")
        for t_s, o in outcomes if not o.ok)
    by_case: dict[str, list[int]] = {}
    for _, o in outcomes:
        tally = by_case.setdefault(o.case, [0, 0])
        tally[0 if o.ok else 1] += 1
    return Verdict("bad_requests_answered", "every bad request answered with its expected status class and message",
                   failures, {"answered_as_expected": {c: t[0] for c, t in by_case.items()},
                              "not_as_expected": {c: t[1] for c, t in by_case.items()}})


def summary(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """The verdicts as one JSON-ready mapping: each one's ok, rule, failure messages and figures, and ``ok``."""
    return {"ok": all(v.ok for v in verdicts),
            "verdicts": {v.name: {"ok": v.ok, "rule": v.rule, "failures": [f.message for f in v.failures],
                                  "figures": v.figures} for v in verdicts}}

"""Timing two sides of a comparison so that their ratio holds while other processes run.

Another process can only ever slow a trial (a preempted thread, a copy
waiting for a core, a kernel sharing the GPU), never speed one up. So each
side's **fastest** trial estimates what that side itself costs, and the ratio
of the two fastest trials is what the comparison reports. A median is not
such an estimate: on a two-core machine whose other core runs an engine,
most trials of one side can be slowed while the other side's are not (CI read
a median bandwidth ratio of 5.05 for copies whose undisturbed ratio is about
1; ``prefetch.pull_rates`` reads the fastest trials for that reason, and
``timeit`` reports its minimum for the same one). Trials alternate which side
goes first, so neither always runs on a warmer cache. Medians are reported
beside, labelled, for a reader who wants the spread.

On a GPU each trial is timed with CUDA events around the work (the device's
own time, not the host's launch time); on CPU with the wall clock.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["timer_for", "interleaved_trials", "fastest_ratio"]


def timer_for(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call of ``fn`` takes: CUDA events on the current stream on a GPU, the wall clock on CPU."""
    def cuda_seconds(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def wall_seconds(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cuda_seconds if torch.device(device).type == "cuda" else wall_seconds


def interleaved_trials(sides: Mapping[str, Callable[[], Any]], trials: int,
                       timer: Callable[[Callable[[], Any]], float]) -> dict[str, list[float]]:
    """``trials`` timed calls of every side, in rounds whose order alternates (forward, then reversed)."""
    names = list(sides)
    out: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(max(1, trials)):
        for name in (names if rep % 2 == 0 else names[::-1]):
            out[name].append(timer(sides[name]))
    return out


def fastest_ratio(numerator_seconds: Sequence[float], denominator_seconds: Sequence[float]) -> dict[str, Any]:
    """``min(numerator) / min(denominator)``: the ratio of each side's fastest trial (see the module docstring),
    with both fastest times, both medians and the median ratio beside (the latter only for reading)."""
    if not numerator_seconds or not denominator_seconds:
        raise ValueError("fastest_ratio needs at least one trial a side")
    num, den = min(numerator_seconds), min(denominator_seconds)
    num_median, den_median = statistics.median(numerator_seconds), statistics.median(denominator_seconds)
    return {"ratio": num / den, "numerator_fastest_s": num, "denominator_fastest_s": den,
            "numerator_median_s": num_median, "denominator_median_s": den_median,
            "ratio_of_medians": num_median / den_median,
            "trials": min(len(numerator_seconds), len(denominator_seconds))}

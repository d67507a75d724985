"""Timing ratios that hold under load (``tools/bench/timing.py``): each side's fastest of interleaved trials.

Another process on the other core can only slow a trial. The preemption pattern here (most trials of one side
slowed 5x, none of the other's) is what turned a median ratio into 5.05 in CI beside an engine; the fastest
trials read it as 1. The control: a cost the measured side pays in every trial is still read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moonep_ep.tools.bench.store import ffn_views_vs_plain
from moonep_ep.tools.bench.timing import fastest_ratio, interleaved_trials

CLEAN = [1e-3] * 7
PREEMPTED = [5e-3, 1e-3, 5e-3, 5e-3, 1e-3, 5e-3, 1e-3]  # 4 of 7 trials slowed 5x: the median is a slowed one


def test_the_fastest_trials_are_not_fooled_by_preemption_and_still_read_a_real_cost():
    fooled = fastest_ratio(CLEAN, PREEMPTED)
    assert fooled["ratio"] == pytest.approx(1.0) and fooled["trials"] == 7
    assert fooled["ratio_of_medians"] == pytest.approx(0.2)  # what the median read
    assert fooled["numerator_fastest_s"] == 1e-3 and fooled["denominator_median_s"] == 5e-3
    # Control: the numerator costs twice as much in every trial; preemption of the other side hides nothing.
    assert fastest_ratio([2e-3] * 7, PREEMPTED)["ratio"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        fastest_ratio([], CLEAN)


def test_trials_alternate_which_side_goes_first():
    calls = []

    def timer(fn):
        calls.append(fn())
        return 1.0

    seconds = interleaved_trials({"a": lambda: "a", "b": lambda: "b"}, 3, timer)
    assert calls == ["a", "b", "b", "a", "a", "b"] and seconds == {"a": [1.0] * 3, "b": [1.0] * 3}


def _store(groups: int = 2, inter: int = 8, hidden: int = 16) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(0)
    views = {"gate": torch.randn(groups, inter, hidden, generator=gen).to(torch.bfloat16),
             "up": torch.randn(groups, inter, hidden, generator=gen).to(torch.bfloat16),
             "down": torch.randn(groups, hidden, inter, generator=gen).to(torch.bfloat16)}
    return SimpleNamespace(projections=[SimpleNamespace(name=n) for n in views],
                           pull_view=lambda layer, name: views[name])


def _scripted(views_seconds: list[float], plain_seconds: list[float]):
    """A timer that answers the trials in the order ``interleaved_trials`` runs them (views first in even rounds)."""
    order = []
    for rep in range(len(views_seconds)):
        pair = [views_seconds[rep], plain_seconds[rep]]
        order += pair if rep % 2 == 0 else pair[::-1]
    answers = iter(order)

    def timer(fn):
        fn()
        return next(answers)

    return timer


def test_grouped_ffn_ratio_reads_the_fastest_trials():
    """``bench store``'s grouped-FFN views/plain throughput ratio (part 2 of gpu_check.sh): the plain side
    preempted in most trials still reads 1.0 (its median ratio would read 5); a view side twice as slow in every
    trial reads 0.5."""
    out = ffn_views_vs_plain(_store(), 0, tokens=8, reps=7, timer=_scripted(CLEAN, PREEMPTED))
    assert out["outputs_equal"] is True and out["trials"] == 7
    assert out["views_over_plain_throughput"] == pytest.approx(1.0)
    assert out["views_over_plain_throughput_of_medians"] == pytest.approx(5.0)
    slow = ffn_views_vs_plain(_store(), 0, tokens=8, reps=7, timer=_scripted([2e-3] * 7, PREEMPTED))
    assert slow["views_over_plain_throughput"] == pytest.approx(0.5)

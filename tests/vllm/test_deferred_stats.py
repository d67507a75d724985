"""Prefetch statistics analysed off the MoE op (``vllm/observe/deferred.py``, issue 45).

The op keeps a snapshot (``Stats.defer_prefetch``) and reads no value; the same analysis runs later
(``Stats.drain``: at the end of a runner step, at a read of ``STATS.data``, at the bound). Shown here: the
deferred records equal the immediate ones figure for figure (every padding policy, the classification's
errors, push and quantized copies, hosts), also when the plan's table and the padding state change after the
op; the op makes no device→host read (``moonep_ep.testing.host_syncs``) where the immediate analysis makes
several (the control); the step hook, the bound, and the slot fill buffer's own block (``manager.py``, over
vLLM stand-ins in a child process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from moonep_ep.testing.host_syncs import HostSyncs
from moonep_ep.vllm.observe import deferred, stats as stats_module
from moonep_ep.vllm.observe.stats import LAST_PADDING, Stats
from tests.support import deferred_stats_check

S = deferred_stats_check.S
_calls = deferred_stats_check.prefetch_calls


@pytest.fixture
def stats_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    yield tmp_path
    LAST_PADDING.state = None


def _immediate(calls) -> Stats:
    stats = Stats()
    for plan, state, kw in calls:
        LAST_PADDING.state = state
        stats.record_prefetch(plan, **kw)
    return stats


def test_the_deferred_records_equal_the_immediate_analysis_figure_for_figure(stats_on):
    calls = _calls()
    want = _immediate(calls).data
    assert want["forward"]["remote_prefetched"] > 0 and want["forward"]["unclassified_fills"] > 0  # branches met
    assert "classification_error" in want["forward"] and want["forward"]["cross_host_fills"] > 0
    assert want["forward"]["pushed_bytes_by_tensor"] and want["forward"]["without_padding_by_owner_expert"]
    assert any(e["padding_only"] for o in want["forward"]["fills_by_owner_expert"].values() for e in o.values())

    stats = Stats()
    for plan, state, kw in calls:
        LAST_PADDING.state = state
        # vLLM's counts as the op keeps them: a tensor, read at the analysis
        kw = dict(kw, real_tokens=None if kw["real_tokens"] is None else torch.tensor(kw["real_tokens"]))
        stats.defer_prefetch(plan, **kw)
        # after the op: the buffer refills its table, the next prepare records another step's padding
        plan.experts_to_copy.fill_(-1)
        if state is not None and isinstance(state.get("pad"), torch.Tensor):
            state["pad"].zero_()
        LAST_PADDING.state = {"policy": "vllm", "real_tokens": None, "pad": None, "S": S}
    assert len(stats._pending) == len(calls) and stats._data["forward"]["prefetch_calls"] == 0  # nothing yet
    assert stats.data == want  # the read analyses them
    assert len(stats._pending) == 0
    written = [p for p in stats_on.iterdir() if p.name.startswith("rank")]
    assert len(written) == 1 and json.loads(written[0].read_text()) == json.loads(json.dumps(want, default=str))


def _reads(run) -> HostSyncs:
    with HostSyncs() as syncs:
        run()
    return syncs


def test_the_op_reads_no_value_and_the_immediate_analysis_is_caught(stats_on):
    calls = _calls()
    stats = Stats()
    for plan, state, kw in calls:
        LAST_PADDING.state = state
        kw = dict(kw, real_tokens=None if kw["real_tokens"] is None else torch.tensor(kw["real_tokens"]))
        syncs = _reads(lambda: stats.defer_prefetch(plan, **kw))
        assert syncs.total == 0, syncs.by_site()
    # control: today's analysis in the op, on the same calls, reads the plan back every time
    control = Stats()
    for plan, state, kw in calls:
        LAST_PADDING.state = state
        syncs = _reads(lambda: control.record_prefetch(plan, **kw))
        assert syncs.total > 0 and "tolist" in syncs.by_kind(), syncs.by_kind()
    assert stats.data == control.data


def test_a_read_inside_a_step_waits_for_its_end_which_analyses_and_writes(stats_on, monkeypatch):
    """The runner's step methods, wrapped by the plugin's patch: the snapshots are analysed once the outermost
    step returns, and the stats file written then (an engine may ``os._exit`` after its last step)."""
    from moonep_ep.vllm import hooks

    calls = _calls()[:3]
    stats = Stats()
    monkeypatch.setattr(stats_module, "STATS", stats)

    class Runner:
        def execute_model(self, n: int) -> int:
            for plan, state, kw in calls[:n]:
                LAST_PADDING.state = state
                stats.defer_prefetch(plan, **kw)
                assert stats.data["forward"]["prefetch_calls"] == 0  # a read inside the step: left waiting
            self._dummy_run()
            assert stats.data["forward"]["prefetch_calls"] == 0     # a nested step method: still inside
            return n

        def _dummy_run(self) -> None:
            pass

    module = types.SimpleNamespace(GPUModelRunner=Runner)
    labels = []
    deferred.drain_after_steps(module, install=lambda o, n, w, orig, label: (hooks.install(o, n, w, orig),
                                                                            labels.append(label)),
                               mark=labels.append, note={})
    assert labels == ["gpu_model_runner.GPUModelRunner.execute_model (deferred prefetch stats)",
                      "gpu_model_runner.GPUModelRunner._dummy_run (deferred prefetch stats)"]
    deferred.drain_after_steps(module, install=lambda *a: labels.append("again"), mark=labels.append, note={})
    assert "again" not in labels  # wrapped once
    assert Runner().execute_model(3) == 3
    assert len(stats._pending) == 0 and stats._data["forward"]["prefetch_calls"] == 3
    written = [p for p in stats_on.iterdir() if p.name.startswith("rank")]
    assert json.loads(written[0].read_text())["forward"]["prefetch_calls"] == 3
    assert stats.data == _immediate(calls).data


def test_the_bound_drains_at_the_next_prefetch(stats_on, monkeypatch):
    monkeypatch.setattr(stats_module, "BOUND", 3)
    plan, state, kw = _calls()[0]
    LAST_PADDING.state = state
    stats = Stats()
    for i in range(1, 7):
        stats.defer_prefetch(plan, **kw)
        assert len(stats._pending) == i % 3 and stats._data["forward"]["prefetch_calls"] == 3 * (i // 3)


def test_the_plugin_applies_the_step_hook_only_with_stats_on(monkeypatch, tmp_path):
    from moonep_ep.vllm import plugin

    monkeypatch.delenv("MOONEP_EP_VLLM_STATS_DIR", raising=False)
    assert deferred.PATCHES not in plugin._patch_tables()
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    assert deferred.PATCHES in plugin._patch_tables()


def test_the_slot_fill_buffer_snapshots_in_the_op_and_reads_its_slots_when_asked(tmp_path):
    """``SlotFillBuffer.prefetch_weight`` (``manager.py``) over vLLM's stand-ins, in a child process (the
    stand-ins must not leak into this one): no read in its stats block, ``last_slots`` read when asked, the
    counts equal the immediate analysis."""
    out = subprocess.run([sys.executable, "-m", "tests.support.deferred_stats_check", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reads_in_op"] == [0] * got["calls"] and got["calls"] >= 5
    assert got["control_reads_in_op"] and min(got["control_reads_in_op"]) > 0
    assert got["last_slots"] == got["last_slots_want"] and got["last_slots"]
    assert got["forward_equal"] is True and got["remote_prefetched"] > 0

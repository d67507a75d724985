"""Tools whose ranks measure one at a time: a rank waits in a barrier while its peer measures, and that wait is
bounded by the run's own deadline, not by ``MOONEP_EP_TIMEOUT_S`` (which bounds waits on a peer that is only
answering). On a slow or busy CPU a peer's measurement outlasts ``MOONEP_EP_TIMEOUT_S``; the waiting rank's
barrier then timed out and both ranks ended in PeerLostError (issue 48). ``bench store`` has its own test
(``test_gpu_check.py::test_perf_waits_for_a_measuring_peer_past_moonep_ep_timeout_s``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_prefetch(*extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONEP_EP_CUDA_EMULATOR")}
    env.update(MOONEP_EP_TIMEOUT_S="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "moonep_ep", "bench", "prefetch", "--driver", "host", "--json",
                           "--reps", "60", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return proc, json.loads(proc.stdout)


@pytest.mark.slow
def test_bench_prefetch_waits_for_a_measuring_peer_past_moonep_ep_timeout_s():
    proc, out = _bench_prefetch("--deadline-s", "120")
    assert proc.returncode == 0 and out["ok"] is True, (proc.stdout[-3000:], proc.stderr[-3000:])
    # The premise: some rank's turn lasted longer than MOONEP_EP_TIMEOUT_S, so its peer waited that long.
    longest = max(s for row in out["sizes"] for s in row["measure_seconds"])
    assert longest > 1 and out["deadline_s"] == 120, out["sizes"]
    # Control: the same run bounded at 1 s fails, naming the timeout, in words and not by hanging.
    proc, out = _bench_prefetch("--deadline-s", "1")
    assert proc.returncode == 1 and out["ok"] is False and out["errors"], proc.stdout[-3000:]

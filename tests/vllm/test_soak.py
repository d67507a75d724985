"""``make soak`` (issue: hours of load): the 3-minute version in CI, the planted faults in the engine tier.

The CI run is the same command ``make soak`` runs, shortened: ``python -m
checks.soak --minutes 3`` on the tiny DeepSeek-V3 (``moonep-ep serve``, DP=2,
``--all2all-backend moonep``, the CPU engine) under ``vllm bench serve``,
with every fault kind (every bad request of the catalogue, dropped streams,
never-read clients), the in-place update to checkpoint B and back, greedy
prompts every minute, the transformers oracle at start and end, every
rank's expert digests against the first load's, and the SIGKILL of one
engine core at the end. About 5 minutes on 2 cores.

The negative controls (``tests/support/soak_plants.py``: one fd leaked per
model step; one byte of one expert flipped mid-run) each fail their verdict;
they run with ``MOONEP_EP_ENGINE_TIER=1`` (about 3 minutes each).
"""

from __future__ import annotations

import json
import os

import pytest

from moonep_ep import envs
from tests.support.vllm_envs import run_in

pytestmark = pytest.mark.slow


def _result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(1200)
def test_three_minute_soak_passes_every_verdict_with_every_fault_kind(tmp_path, report):
    # RSS: the engines grow for minutes after start and after each in-place update (the reload's transient copy
    # stays with the allocator: measured +23 MB in the last minute of a 3-minute run, 1.39 GB/h for one worker),
    # so the short run's one judged minute can only catch a gross leak (bound 4 GiB/h, 68 MB a minute); the
    # 64 MiB/h bound after a 5-minute warm-up is `make soak`'s (SOAK_MIN=30), docs/design/reliability.md.
    proc = run_in("vllm-cpu", ["-m", "checks.soak", "--minutes", "3", "--seed", "7", "--json",
                               "--warmup", "120", "--rss-bound", "4096", "--fit-load", "--out", str(tmp_path)],
                  timeout=1100)
    out = _result(proc)
    verdicts = out["verdicts"]["verdicts"]
    failing = {k: v["failures"] for k, v in verdicts.items() if not v["ok"]}
    assert proc.returncode == 0 and out["ok"] and not failing, (failing, proc.stderr[-4000:])
    assert set(verdicts) == {"rss_slope", "fds_flat", "dev_shm_flat", "memfd_constant", "bad_requests_answered",
                             "valid_requests_served", "greedy_prompts_unchanged", "oracle_start", "oracle_end",
                             "expert_digests_equal_first_load", "updates_applied", "sigkill_contained"}
    # every bad request of the catalogue sent and answered as vLLM answers it; both client faults, twice
    assert sorted({b["case"] for b in out["bad_requests"]}) == sorted([
        "malformed JSON", "unknown model", "max_tokens past the context", "prompt longer than max_model_len",
        "n > 1 with best_of", "huge logprobs", "unknown fields"])
    assert all(b["ok"] for b in out["bad_requests"])
    kinds = [c["kind"] for c in out["client_faults"]]
    assert kinds.count("drop") >= 2 and kinds.count("never-read") >= 2
    # the update to B and back, greedy checks every minute on both weights, the oracle at both ends
    assert [u["ok"] for u in out["updates"]] == [True, True]
    assert {c["weights"] for c in out["greedy"]} == {"A", "B"} and len(out["greedy"]) >= 5
    assert out["oracle_start"]["ok"] and out["oracle_end"]["ok"]
    # both ranks' digests at start and end (positive control: two ranks reported)
    assert sorted(k for k in out["digests_end"] if k.startswith("rank")) == ["rank0", "rank1"]
    # load: vLLM's client completed requests; the SIGKILL's aftermath
    assert out["bench"]["completed"] > 0 and out["bench"]["failed"] == 0
    # the offered load was fitted to what the server served at start (half of it), so the client finishes on any
    # CPU: every request it was given completed
    fit = out["load_fit"]
    assert fit["statuses"] == [200] * 4 and fit["offered_rate"] <= 0.5 * fit["measured_requests_per_s"] + 1e-3
    assert out["bench"]["completed"] == out["offered"]["max_requests"] and not out.get("load_client_overran")
    kill = out["sigkill"]
    assert kill["request_after_kill_status"] != 200 and kill["request_in_flight_status"] not in (200, None) and \
        kill["server_exited_s"] is not None
    assert any("lost rank(s) [1]" in line or "EngineCore_DP1 died" in line for line in kill["dead_engine_named"]), kill
    assert out["after_exit"] == {"processes_alive": [], "dev_shm_left": [], "memfd_bytes_held": 0}
    assert os.path.getsize(out["png"]) > 10_000
    report(f"[soak 3 min] {out['bench']['completed']} load requests, {len(out['bad_requests'])} bad requests, "
           f"{len(out['client_faults'])} client faults, updates {[u['seconds'] for u in out['updates']]} s, "
           f"RSS slope {verdicts['rss_slope']['figures']}, fds {verdicts['fds_flat']['figures']}, "
           f"SIGKILL: server exited in {kill['server_exited_s']} s; load fitted: {fit}")


@pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER, reason="engine tier (about 3 min each): MOONEP_EP_ENGINE_TIER=1")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("plant, verdict", [("moonep_ep_plant_fd_leak", "fds_flat"),
                                            ("moonep_ep_plant_weight_flip", "expert_digests_equal_first_load")])
def test_a_planted_fault_fails_its_verdict(plant, verdict, tmp_path):
    out = _result(run_in("vllm-cpu", ["-m", "tests.support.soak_plants", "--plant", plant, "--out", str(tmp_path)],
                         timeout=1100))
    assert out["planted"]["method"] == plant and out["planted"]["status"] == 200
    assert not out["ok"] and not out["verdicts"]["verdicts"][verdict]["ok"], out["verdicts"]

"""``checks/soak/run.py`` without an engine: the fault plan of a run, and the run-level verdicts on results
built here (each with the failure it must name); ``python -m checks.soak``'s flags and its refusal outside the
engine's environment."""

from __future__ import annotations

import copy
import pathlib
import subprocess
import sys

import pytest

from checks.soak.run import SoakConfig, _verdicts, fault_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_three_minute_plan_has_every_fault_kind_between_the_start_and_the_kill_window():
    cfg = SoakConfig(minutes=3)
    plan = fault_plan(cfg, 7)
    kinds = [f.kind for f in plan]
    assert (kinds.count("bad"), kinds.count("drop"), kinds.count("never-read")) == (7, 2, 2)
    assert sorted(f.index for f in plan if f.kind == "bad") == list(range(7))  # each case of the catalogue once
    assert all(10.0 <= f.t_s < 160.0 for f in plan)
    assert plan == fault_plan(cfg, 7) and plan != fault_plan(cfg, 8)
    thirty = [f.kind for f in fault_plan(SoakConfig(minutes=30), 1)]
    assert (thirty.count("bad"), thirty.count("drop"), thirty.count("never-read")) == (21, 15, 15)
    assert SoakConfig(minutes=3).warmup == 120.0 and SoakConfig(minutes=30).warmup == 300.0
    assert SoakConfig(minutes=30, request_rate=1.5).max_requests == 2700


GOOD = {
    "bench": {"request_spans": [(5.0, 1.5, 1), (100.0, 1.2, 1)]},
    "greedy": [{"minute": 0, "weights": "A", "statuses": [200, 200], "same_as_first": True},
               {"minute": 1, "weights": "B", "statuses": [200, 200], "same_as_first": True}],
    "oracle_start": {"ok": True, "abs_logprob_diff": {"p50": 0.005}},
    "oracle_end": {"ok": True, "abs_logprob_diff": {"p50": 0.005}},
    "digests_start": {"status": 200, "rank0": {"l": {"weights": ["a"]}}, "rank1": {"l": {"weights": ["b"]}}},
    "digests_end": {"status": 200, "rank0": {"l": {"weights": ["a"]}}, "rank1": {"l": {"weights": ["b"]}}},
    "updates": [{"ok": True, "t_s": 72.0, "statuses": {}, "seconds": 2.0},
                {"ok": True, "t_s": 108.0, "statuses": {}, "seconds": 2.0}],
    "sigkill": {"killed": {"pid": 9, "title": "VLLM::EngineCore_DP1"}, "request_after_kill_status": 500,
                "server_exited_s": 3.0, "dead_engine_named": ["lost rank(s) [1] on host h"]},
    "after_exit": {"processes_alive": [], "dev_shm_left": [], "memfd_bytes_held": 0},
}


def _failures(result: dict) -> dict:
    out = _verdicts(SoakConfig(minutes=3), result, [], 0.0, {"bad": [], "client": []})
    return {k: v["failures"] for k, v in out["verdicts"].items() if not v["ok"]}


def test_a_clean_result_passes_and_each_broken_part_names_itself():
    assert _failures(GOOD) == {}
    bad = copy.deepcopy(GOOD)
    bad["digests_end"]["rank1"] = {"l": {"weights": ["x"]}}
    assert _failures(bad) == {"expert_digests_equal_first_load": ["ranks whose expert digests differ: ['rank1']"]}
    bad = copy.deepcopy(GOOD)
    bad["bench"]["request_spans"].append((130.0, 2.0, 0))
    assert list(_failures(bad)) == ["valid_requests_served"]
    bad = copy.deepcopy(GOOD)  # a client that measured nothing fails in words that say so (issue 48)
    bad["bench"] = {}
    assert _failures(bad) == {"valid_requests_served": [
        "the load client measured nothing: it wrote no result file (interrupted, or it overran the window; see "
        "bench.log), so no load request is known to have been served"]}
    bad = copy.deepcopy(GOOD)
    bad["greedy"][1]["same_as_first"] = False
    assert _failures(bad)["greedy_prompts_unchanged"] == ["greedy tokens changed or failed at [(1, 'B', None, None)]"]
    # a changed answer the oracle passes is a measured tie (vLLM is not batch-invariant); one it fails is not
    tie = copy.deepcopy(GOOD)
    tie["greedy"][1].update(same_as_first=False, first_change={"position": 1, "first_top2_gap": 0.0156},
                            oracle={"ok": True, "abs_logprob_diff": {"p90": 0.01}})
    out = _verdicts(SoakConfig(minutes=3), tie, [], 0.0, {"bad": [], "client": []})["verdicts"]
    assert out["greedy_prompts_unchanged"]["ok"]
    assert out["greedy_prompts_unchanged"]["figures"]["measured"]["changed_at_measured_ties"] == [
        (1, "B", {"position": 1, "first_top2_gap": 0.0156}, {"p90": 0.01})]
    tie["greedy"][1]["oracle"] = {"ok": False, "failed": ["p90"]}
    assert list(_failures(tie)) == ["greedy_prompts_unchanged"]
    bad = copy.deepcopy(GOOD)
    bad["after_exit"]["dev_shm_left"] = ["psm_1"]
    assert list(_failures(bad)) == ["sigkill_contained"]
    bad = copy.deepcopy(GOOD)
    bad["sigkill"]["dead_engine_named"] = []
    assert list(_failures(bad)) == ["sigkill_contained"]
    bad = copy.deepcopy(GOOD)
    bad["updates"][1]["ok"] = False
    assert list(_failures(bad)) == ["updates_applied"]


def test_a_warm_up_longer_than_the_run_is_refused_before_anything_starts(tmp_path):
    from moonep_ep.errors import ConfigError
    from checks.soak.run import run_soak

    with pytest.raises(ConfigError, match="leaves nothing of a 90 s run to judge. Fix: more minutes"):
        run_soak(SoakConfig(minutes=1.5, out_dir=str(tmp_path)), lambda m: None)
    assert list(tmp_path.iterdir()) == []


def _soak_command(*args: str) -> subprocess.CompletedProcess:
    """``python -m checks.soak`` as ``make soak`` runs it: from the repository root."""
    return subprocess.run([sys.executable, "-m", "checks.soak", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_soak_command_keeps_its_flags():
    """``make soak`` passes --minutes, --model and --replicated-minutes; the CI run adds --fit-load and the rest."""
    proc = _soak_command("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m checks.soak"), proc.stderr
    for flag in ("--minutes", "--model", "--seed", "--rate", "--concurrency", "--warmup", "--rss-bound",
                 "--replicated-minutes", "--fit-load", "--no-kill", "--out", "--json"):
        assert flag in proc.stdout, flag
    # Control: an unknown flag is refused, not ignored.
    assert _soak_command("--minutes", "3", "--no-such-flag").returncode == 2


def test_the_soak_command_outside_the_engine_environment_names_the_fix():
    """This interpreter has no vLLM or transformers (the main environment): one line with the fix, exit 2."""
    try:
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this interpreter has vLLM and transformers: the soak would start")
    proc = _soak_command("--minutes", "3")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip().startswith("python -m checks.soak: No module named")
    assert proc.stderr.strip().endswith("Fix: run it from the CPU engine's environment (`make soak`)")
    assert "Traceback" not in proc.stderr


def test_first_change_names_the_prompt_the_position_and_the_first_answers_margin():
    from checks.soak.run import first_change

    a = [{"token_ids": [1, 2]}, {"token_ids": [7, 8, 9], "top_logprobs": [
        {"token_id:7": -1.0}, {"token_id:8": -4.6730, "token_id:3": -4.6886}, {"token_id:9": -2.0}]}]
    b = [{"token_ids": [1, 2]}, {"token_ids": [7, 3, 5], "top_logprobs": [
        {"token_id:7": -1.0}, {"token_id:3": -4.6880, "token_id:8": -4.6878}, {"token_id:5": -2.0}]}]
    assert first_change(a, b) == {"prompt": 1, "position": 1, "first_token": 8, "now_token": 3,
                                  "first_top2_gap": 0.0156, "now_logprob_of_first_token": -4.6878}
    assert first_change(a, a) is None
    assert first_change(a, [a[0], {"token_ids": [7, 8]}]) == {"prompt": 1, "position": 2, "lengths": [3, 2]}


def test_a_replicated_side_that_cannot_start_is_recorded_and_the_soak_result_kept(tmp_path, monkeypatch):
    """vLLM's replicated layout may not start where the sharded one serves (a quantized model on the CPU engine:
    vLLM's MXFP4 path repacks for Marlin, CUDA only): the soak keeps its result, the error says what failed."""
    from checks.soak import run as soak_run

    log = tmp_path / "server-replicated.log"
    log.write_text("(Worker_DP0_EP0 pid=1) ERROR 12-07 22:07:29 [multiproc_executor.py:953] AttributeError: "
                   "'_OpNamespace' '_C' object has no attribute 'gptq_marlin_repack'\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")

    class NoStart:
        log_path = str(log)

        def __init__(self, *args, **kwargs):
            pass

        def wait_ready(self, *args):
            raise RuntimeError("the server exited (1) before it was ready; its log: ...\n"
                               "AttributeError: '_OpNamespace' '_C' object has no attribute 'gptq_marlin_repack'\n"
                               "RuntimeError: Engine core initialization failed.")

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(soak_run, "SoakServer", NoStart)
    out = soak_run._replicated_side_by_side(SoakConfig(minutes=3, replicated_minutes=2), None, 0)
    assert out["error"] == ("vLLM's replicated layout did not start: AttributeError: '_OpNamespace' '_C' object "
                            "has no attribute 'gptq_marlin_repack'") and out["minutes"] == 2
    verdicts = _verdicts(SoakConfig(minutes=3), {**GOOD, "replicated": out}, [], 0.0, {"bad": [], "client": []})
    assert verdicts["ok"] and "throughput_ratio_sharded_over_replicated" not in verdicts

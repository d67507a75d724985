"""The plugin's vLLM-free parts, in the project's main environment (no vLLM needed)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.vllm_envs import ROOT

from moonep_ep.vllm import compat, hooks
from moonep_ep.tools.engine_harness import EngineConfig, summarize


def test_entry_point_is_declared_and_installed():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    assert [line.strip() for line in section.strip().splitlines() if line.strip()
            and not line.startswith("#")] == ['moonep_ep = "moonep_ep.vllm:register"']
    installed = [ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                 if ep.name == "moonep_ep"]
    assert installed == ["moonep_ep.vllm:register"]


def test_register_without_vllm_is_harmless():
    code = textwrap.dedent("""
        import importlib.util, json, sys
        from moonep_ep.vllm import register, plugin
        register(); register()
        print(json.dumps({"vllm": importlib.util.find_spec("vllm") is not None, "state": plugin.state(),
                          "vllm_imported": "vllm" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert not out["vllm_imported"]  # loading the plugin never imports vLLM by itself
    if not out["vllm"]:
        assert out["state"]["active"] is False and out["state"]["patched"] == []
        assert "not importable" in out["state"]["message"]


def test_version_check_names_the_supported_version(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    for rel in compat.MOONEP_FILES_0_33_0:
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# some other MoonEP integration\n")
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compat, "_installed", lambda: ("vllm", "0.34.0"))
    monkeypatch.delenv("MOONEP_EP_VLLM_FORCE", raising=False)
    verdict = compat.check_vllm()
    assert not verdict.supported and not verdict.moonep_files_match
    assert "supports vLLM 0.33.0; found vllm 0.34.0" in verdict.message and "Fix:" in verdict.message
    monkeypatch.setenv("MOONEP_EP_VLLM_FORCE", "1")
    assert compat.check_vllm().supported


def test_post_import_hook_runs_once_on_first_import(tmp_path, monkeypatch):
    (tmp_path / "moonep_ep_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.when_imported("moonep_ep_hook_probe", lambda m: seen.append(m.VALUE))
    assert seen == [] and "moonep_ep_hook_probe" in hooks.pending()
    import moonep_ep_hook_probe  # noqa: F401

    assert seen == [1] and "moonep_ep_hook_probe" not in hooks.pending()
    hooks.when_imported("moonep_ep_hook_probe", lambda m: seen.append(2))  # already imported: runs now
    assert seen == [1, 2]
    sys.modules.pop("moonep_ep_hook_probe", None)


def test_hook_failure_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    (tmp_path / "moonep_ep_hook_probe2.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def bad(module):
        raise RuntimeError("boom")

    hooks.when_imported("moonep_ep_hook_probe2", bad)
    import moonep_ep_hook_probe2  # noqa: F401  (the import itself must succeed)

    assert "patching moonep_ep_hook_probe2 failed" in caplog.text
    sys.modules.pop("moonep_ep_hook_probe2", None)


def _fake_stats(rank, remote, weight_bytes=0, gathers=0, peak=None):
    row = 256 * 512 * 2
    final = 12 * 3 * row
    return {"ep_rank": rank, "buffer": "reference", "layout": "sharded",
            "store": {"layers": 2, "experts": 8, "slots": 4, "collective_rounds": {"handle_exchange": 1},
                      "physical_bytes": {"total_bytes": final}, "replicated_bytes": 24 * 3 * row,
                      "one_layer_local_bytes": 4 * 3 * row},
            "load": {"layers_converted": 2, "collectives": {}, "collective_weight_bytes": weight_bytes,
                     "vllm_gather_calls": gathers},
            "load_memory": {"peak_expert_bytes": final if peak is None else peak, "samples": 27},
            "forward": {"remote_prefetched": remote, "remote_experts": [0] if remote else [],
                        "prefetch_calls": 4, "slots_filled": remote}}


def _gen(tokens):
    return [{"index": i, "token_ids": t, "text": "x", "cumulative_logprob": -1.0} for i, t in tokens]


def test_summary_requires_every_claim():
    cfg = EngineConfig(model_dir="m", prompts=["a", "b", "c"])
    single = {"generated": _gen((i, [i, 1]) for i in range(3)), "startup_s": 1}
    dp = {0: {"generated": _gen([(0, [0, 1]), (2, [2, 1])])}, 1: {"generated": _gen([(1, [1, 1])])}}
    good = summarize(cfg, single, dp, [_fake_stats(0, 0), _fake_stats(1, 3)], {})
    assert good["ok"] and good["tokens_match_single_process"] and good["remote_prefetched_experts"] == 3
    assert good["expert_bytes_per_rank"] == [12 * 3 * 262144] * 2
    assert good["load_peak_expert_bytes_per_rank"] == [12 * 3 * 262144] * 2
    assert good["one_layer_local_expert_bytes"] == 4 * 3 * 262144
    assert not summarize(cfg, single, dp, [_fake_stats(0, 0), _fake_stats(1, 0)], {})["ok"]  # no remote prefetch
    assert not summarize(cfg, single, dp, [_fake_stats(0, 0, weight_bytes=8), _fake_stats(1, 3)], {})["ok"]
    assert not summarize(cfg, single, dp, [_fake_stats(0, 0, gathers=1), _fake_stats(1, 3)], {})["ok"]
    over = summarize(cfg, single, dp, [_fake_stats(0, 0, peak=16 * 3 * 262144 + 1), _fake_stats(1, 3)], {})
    assert not over["ok"] and over["load_peak_within_final_plus_one_layer_by_rank"] == [False, True]
    assert not summarize(cfg, single, dp, [_fake_stats(1, 3)], {})["ok"]  # a rank's stats missing
    dp_bad = {0: dp[0], 1: {"generated": _gen([(1, [1, 2])])}}
    bad = summarize(cfg, single, dp_bad, [_fake_stats(0, 0), _fake_stats(1, 3)], {})
    assert not bad["ok"] and bad["mismatched_prompts"] == [1]


def test_reload_summary_needs_a_changed_output_the_fresh_engine_and_a_refusal():
    cfg = EngineConfig(model_dir="m", prompts=["a", "b"], reload_model_dir="b", wrong_shape_model_dir="w")
    single = {"generated": _gen([(0, [1]), (1, [2])])}
    single_b = {"generated": _gen([(0, [7]), (1, [8])])}
    ptr = {"l0": {"w13_weight": 1}}

    def dp(b0=(7,), after=(7,), error="refused", ptr_b=ptr, b1=(8,)):
        seq = {"pointers_a": ptr, "pointers_b": ptr_b, "token_ids_b": [list(b0)], "wrong_shape_error": error,
               "pointers_after_wrong_shape": ptr, "token_ids_after_wrong_shape": [list(after)], "reload_s": 0.1}
        seq1 = dict(seq, token_ids_b=[list(b1)], token_ids_after_wrong_shape=[list(b1)], pointers_b=ptr)
        return {0: {"generated": _gen([(0, [1])]), "reload": seq}, 1: {"generated": _gen([(1, [2])]), "reload": seq1}}

    stats = [_fake_stats(0, 0), _fake_stats(1, 3)]
    good = summarize(cfg, single, dp(), stats, {}, single_b=single_b)
    assert good["ok"] and good["reload_tokens_match_fresh_engine"] and good["reload_changes_tokens"]
    assert good["wrong_shape_reload_refused"] and good["generation_after_wrong_shape_matches_b"]
    assert not summarize(cfg, single, dp(b0=(9,)), stats, {}, single_b=single_b)["ok"]       # B differs
    assert not summarize(cfg, single, dp(error=None), stats, {}, single_b=single_b)["ok"]    # not refused
    assert not summarize(cfg, single, dp(after=(1,)), stats, {}, single_b=single_b)["ok"]    # B stopped serving
    assert not summarize(cfg, single, dp(ptr_b={"l0": {"w13_weight": 2}}), stats, {}, single_b=single_b)["ok"]
    same_as_a = {"generated": _gen([(0, [1]), (1, [2])])}  # an update that changes nothing proves nothing
    unchanged = summarize(cfg, single, dp(b0=(1,), after=(1,), b1=(2,)), stats, {}, single_b=same_as_a)
    assert unchanged["reload_tokens_match_fresh_engine"] and not unchanged["reload_changes_tokens"]
    assert not unchanged["ok"]


def test_sleep_mode_is_refused_with_the_sharded_layout_only(monkeypatch):
    from types import SimpleNamespace

    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.loading import refuse_sleep_mode

    sleepy = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    monkeypatch.delenv("MOONEP_EP_LAYOUT", raising=False)
    with pytest.raises(ConfigError, match="enable-sleep-mode.*Fix:.*MOONEP_EP_LAYOUT=replicated"):
        refuse_sleep_mode(sleepy)
    refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))
    refuse_sleep_mode(None)
    monkeypatch.setenv("MOONEP_EP_LAYOUT", "replicated")
    refuse_sleep_mode(sleepy)  # vLLM's own layout: vLLM's sleep mode applies


@pytest.mark.parametrize("value", ["reference", "moonep", "auto", "bogus"])
def test_buffer_choice_on_cpu(value, monkeypatch):
    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.buffers import select_buffer

    monkeypatch.setenv("MOONEP_EP_BUFFER", value)
    if value in ("moonep", "bogus"):
        with pytest.raises(ConfigError, match="Fix:"):
            select_buffer("cpu")
        return
    choice = select_buffer("cpu")
    assert choice.kind == "reference" and choice.cls.__name__ == "ReferenceBuffer"


def _fake_moonep(monkeypatch, *, pull_api: bool, multicast: bool):
    import types

    pkg = types.ModuleType("moonep")
    if pull_api:
        class Buffer:  # noqa: D401 - signature only
            def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, B=None, group=None,
                         explicitly_destroy=False):
                pass
    else:
        class Buffer:
            def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, group=None):
                pass
    pkg.Buffer = Buffer
    c = types.ModuleType("moonep._C")
    c.nvl_multicast_supported = lambda: multicast
    pkg._C = c
    monkeypatch.setitem(sys.modules, "moonep", pkg)
    monkeypatch.setitem(sys.modules, "moonep._C", c)
    return Buffer


def test_auto_takes_the_real_moonep_only_when_it_can_serve_vllm_0_33(monkeypatch):
    from moonep_ep.vllm.buffers import select_buffer

    monkeypatch.setenv("MOONEP_EP_BUFFER", "auto")
    real = _fake_moonep(monkeypatch, pull_api=True, multicast=True)
    assert select_buffer("cuda").cls is real
    assert select_buffer("cpu").kind == "reference"  # the real library is CUDA-only
    _fake_moonep(monkeypatch, pull_api=False, multicast=True)
    choice = select_buffer("cuda")
    assert choice.kind == "reference" and "push API" in choice.reason
    _fake_moonep(monkeypatch, pull_api=True, multicast=False)
    choice = select_buffer("cuda")
    assert choice.kind == "reference" and "multicast" in choice.reason


def test_gpu_system_check_names_every_missing_capability(monkeypatch):
    import torch

    from moonep_ep.errors import ConfigError
    from moonep_ep.memory import cuda
    from moonep_ep.memory.driver import Capabilities
    from moonep_ep.vllm.buffers import system_check

    caps = Capabilities(driver="cuda", available=True, vmm=False, posix_fd=False, fabric=False, multicast=False,
                        peer_access=False, device="cuda:0 (fake)",
                        reasons={"vmm": "no VMM attribute", "posix_fd": "not supported", "fabric": "no IMEX",
                                 "multicast": "no NVSwitch", "peer_access": "no NVLink"})
    monkeypatch.setattr(cuda.CudaDriver, "capabilities", lambda self: caps)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError) as info:
        system_check("cuda", "moonep")
    msg = str(info.value)
    for needle in ("VMM (no VMM attribute)", "POSIX fd or fabric handles", "peer access (no NVLink)",
                   "multicast (no NVSwitch", "Fix:"):
        assert needle in msg, msg
    with pytest.raises(ConfigError) as info:
        system_check("cuda", "reference")
    assert "multicast" not in str(info.value)  # the reference buffer needs none
    good = Capabilities(driver="cuda", available=True, vmm=True, posix_fd=True, peer_access=True, device="cuda:0")
    monkeypatch.setattr(cuda.CudaDriver, "capabilities", lambda self: good)
    assert system_check("cuda", "reference")["vmm"] is True

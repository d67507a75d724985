"""The plugin installs every patch one way (``plugin.py``'s convention), in this process (no vLLM needed).

Each module that patches vLLM declares a ``PATCHES`` table of ``hooks.Patch``; ``plugin.install`` applies the
tables in one order, with the conditions of each. What each patch does to vLLM's code is tested beside it (and
at the kernel and engine tiers, where the patches land on vLLM's own modules).
"""

from __future__ import annotations

import inspect
import logging

import pytest

from moonep_ep.vllm import graphs, hooks, plugin
from moonep_ep.vllm.checkpoint import patches as checkpoint_patches
from moonep_ep.vllm.cpu import moe_graphs, patches as cpu_patches
from moonep_ep.vllm.experts import patches as experts_patches
from moonep_ep.vllm.observe import patches as observe_patches, peer_naming, routing_record, step_errors
from moonep_ep.vllm.prepare_finalize import patches as prepare_finalize_patches
from moonep_ep.vllm.quantized import hooks as quantized_hooks
from moonep_ep.vllm.store import patches as store_patches

MOONEP_PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"
ALL2ALL_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
RELOAD = "vllm.model_executor.model_loader.reload.inplace"
GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
VLLM_CONFIG = "vllm.config.vllm"
MODULAR_KERNEL = "vllm.model_executor.layers.fused_moe.modular_kernel"


def _order(monkeypatch, cpu: bool, record: bool) -> list[tuple[str | None, str]]:
    monkeypatch.setenv("MOONEP_EP_CPU", "1" if cpu else "0")
    if record:
        monkeypatch.setenv("MOONEP_EP_ROUTING_RECORD_DIR", "routing-record-dir-named-only")
    else:
        monkeypatch.delenv("MOONEP_EP_ROUTING_RECORD_DIR", raising=False)
    return [(p.target, p.apply.__name__) for table in plugin._patch_tables() for p in table]


def _on(order: list[tuple[str | None, str]], target: str | None) -> list[str]:
    return [name for t, name in order if t == target]


def test_every_patch_is_declared_one_way():
    """Every table entry is a Patch whose apply takes the module and the same three keywords."""
    every = [p for table in (plugin.PATCHES, store_patches.PATCHES, observe_patches.PATCHES, peer_naming.PATCHES,
                             step_errors.PATCHES, routing_record.PATCHES, prepare_finalize_patches.PATCHES,
                             checkpoint_patches.PATCHES, graphs.PATCHES, quantized_hooks.PATCHES, cpu_patches.PATCHES,
                             experts_patches.PATCHES) for p in table]
    assert len(every) == 39
    for patch in every:
        assert isinstance(patch, hooks.Patch) and (patch.target is None or patch.target.startswith("vllm."))
        params = inspect.signature(patch.apply).parameters
        assert list(params)[1:] == ["install", "mark", "note"], patch
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("install", "mark", "note")), patch


def test_the_tables_apply_in_an_order_that_keeps_each_modules_constraints(monkeypatch):
    order = _order(monkeypatch, cpu=True, record=True)
    assert order[0] == ("vllm.distributed.device_communicators.all2all", "patch_manager")
    # padding wraps the counted module; the prepare's expert counts on the device
    assert _on(order, MOONEP_PF) == ["count_gathers", "patch_padding", "count_experts_on_device"]
    assert _on(order, ALL2ALL_UTILS) == ["bind_pf_names", "bind_push_choice"]    # the names, then the choice
    assert _on(order, EXPERTS) == ["subclass_experts", "patch_overlap"]           # the overlap last, on vLLM's class
    assert order[-1] == (EXPERTS, "patch_overlap")
    assert _on(order, GPU_RUNNER) == ["patch_reload", "patch_model_memory", "raise_after_steps",
                                      "patch_runner"]
    assert order.index((RELOAD, "patch_reload")) < order.index((GPU_RUNNER, "patch_reload"))
    # set-up at install, in order: the cap first (it hides AMX from a capped process), the K3 default after
    assert _on(order, None) == ["cap_kernel_library", "request_amx_permission", "k3_engine_defaults",
                                "interpreted_triton_exit"]
    # the CUDA-graph lift wraps VllmConfig.__post_init__ over the quantized check's wrapper (each sees its own mark)
    assert _on(order, VLLM_CONFIG) == ["patch_config_check", "lift_eager_rule"]
    # the CPU engine's MoE step graphs before the host-read counter (which then wraps them)
    assert (MODULAR_KERNEL, "graph_moe_steps") in order
    assert len(order) == len(set(order)) == 40  # every table applied (the CPU engine's graphs too), each patch once


def test_the_cpu_engine_and_the_routing_record_patch_only_when_asked(monkeypatch):
    full = _order(monkeypatch, cpu=True, record=True)
    plain = _order(monkeypatch, cpu=False, record=False)
    cpu = [(p.target, p.apply.__name__) for p in (*cpu_patches.PATCHES, *moe_graphs.PATCHES)]
    assert [x for x in full if x not in cpu and x != (GPU_RUNNER, "patch_runner")] == plain
    assert _on(plain, None) == [] and _on(plain, EXPERTS) == ["patch_overlap"]
    assert _on(_order(monkeypatch, cpu=False, record=True), GPU_RUNNER)[-1] == "patch_runner"


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin not yet installed, on a supported vLLM, each registration recorded instead of hooked."""
    import types

    monkeypatch.setattr(plugin, "_state", {"installed": False, "active": False, "message": "", "patched": []})
    monkeypatch.setattr(plugin, "check_vllm", lambda: types.SimpleNamespace(
        supported=True, distribution="vllm", message="moonep_ep: vLLM 0.33.0 (stand-in)"))
    monkeypatch.setenv("MOONEP_EP_CPU", "0")
    monkeypatch.delenv("MOONEP_EP_ROUTING_RECORD_DIR", raising=False)
    registered: list[tuple[str, str, dict]] = []
    monkeypatch.setattr(plugin, "when_imported", lambda target, run: registered.append(
        (target, run.func.__name__, run.keywords)))
    return registered


def test_install_registers_every_table_once_with_the_same_keywords(fresh_plugin, monkeypatch):
    first = plugin.install()
    assert first["active"] and first["patched"] == []
    expected = _order(monkeypatch, cpu=False, record=False)
    assert [(t, name) for t, name, _ in fresh_plugin] == expected
    assert all(kw == {"install": plugin._install, "mark": plugin._mark, "note": plugin._state}
               for _, _, kw in fresh_plugin)
    assert plugin.install() == first and len(fresh_plugin) == len(expected)     # idempotent


def test_install_never_raises_a_failed_set_up_leaves_the_plugin_inactive(fresh_plugin, monkeypatch, caplog):
    def broken(module, *, install, mark, note):
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(plugin, "PATCHES", (hooks.Patch(None, broken),))
    with caplog.at_level(logging.ERROR, logger="vllm.moonep_ep"):
        out = plugin.install()
    assert out["active"] is False and fresh_plugin == []
    assert "installing the vLLM plugin failed" in caplog.text

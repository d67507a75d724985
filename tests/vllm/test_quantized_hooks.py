"""Where vLLM's quantized MoE methods are patched (``vllm/quantized/hooks.py``), in this process.

Each patch is applied to a stand-in of its vLLM module: a class with the method
class's name and an original ``create_weights`` / ``process_weights_after_loading``
(/ ``__init__``) that record their calls, and the module's backend selector. The
engine tier applies the same patches to vLLM 0.33.0's modules
(``test_quantized_checkpoints.py``, ``test_gpu_experts_engine.py``); here each
branch is reached on purpose: a MoonEP layer over more than one EP rank with the
sharded layout, and each of the three ways not to be one.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from moonep_ep.vllm import hooks
from moonep_ep.vllm.quantized import engine as quantized_engine
from moonep_ep.vllm.quantized import hooks as qh
from tests.support.vllm_stubs import Calls, install

ORACLE = "vllm.model_executor.layers.fused_moe.oracle"


class _Experts:
    """The experts class ``experts_class()`` hands back (a stand-in: the hooks only pass it on)."""


def _moe(moonep: bool = True, ep: int = 2) -> Any:
    return types.SimpleNamespace(moe_parallel_config=types.SimpleNamespace(use_moonep_kernels=moonep, ep_size=ep))


@pytest.fixture
def patching(monkeypatch):
    """The plugin's ``install`` (``hooks.install``, each label kept), vLLM's backend enums, and
    ``quantized_engine``'s entry points recorded."""
    labels: list[str] = []

    def plugin_install(owner: Any, name: str, wrapper: Any, original: Any, label: str) -> None:
        hooks.install(owner, name, wrapper, original)
        labels.append(label)

    install(monkeypatch, {
        f"{ORACLE}.int_wna16": {"WNA16MoEBackend": types.SimpleNamespace(EMULATION="WNA16 EMULATION")},
        f"{ORACLE}.fp8": {"Fp8MoeBackend": types.SimpleNamespace(CPU="FP8 CPU")},
    })
    monkeypatch.setenv("MOONEP_EP_LAYOUT", "sharded")
    monkeypatch.setattr(quantized_engine, "experts_class", lambda kind=None: _Experts)
    placeholders, bind = Calls(), Calls()
    monkeypatch.setattr(quantized_engine, "create_quantized_placeholders", placeholders)
    monkeypatch.setattr(quantized_engine, "bind_quantized_layer", bind)
    # the keywords every patch takes besides its note (``hooks.Patch``): the plugin's install and mark
    recorders = {"install": plugin_install, "mark": labels.append}
    return types.SimpleNamespace(install=plugin_install, recorders=recorders, labels=labels,
                                 placeholders=placeholders, bind=bind)


def _method_class(name: str, **attrs: Any) -> type:
    """A vLLM method class stand-in whose originals record ``(method name, args, kwargs)``."""
    calls: list[tuple] = []

    def create_weights(self, layer, *args, **kwargs):
        """vLLM's create_weights."""
        calls.append(("create_weights", self, layer, args, kwargs))

    def process_weights_after_loading(self, layer):
        calls.append(("process", self, layer))

    def __init__(self, moe, *args, **kwargs):
        calls.append(("__init__", moe, args, kwargs))
        self.use_cutlass_mxfp4, self.experts_cls = True, "vLLM's choice"

    originals = {"create_weights": create_weights, "process_weights_after_loading": process_weights_after_loading,
                 "__init__": __init__}
    return type(name, (), {**originals, "originals": originals, "calls": calls, **attrs})


def test_a_sharded_moonep_layer_is_one_with_moonep_kernels_the_sharded_layout_and_more_than_one_rank(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_LAYOUT", "sharded")
    assert qh._sharded_moonep(_moe()) is True
    assert qh._sharded_moonep(_moe(moonep=False)) is False
    assert qh._sharded_moonep(_moe(ep=1)) is False
    assert qh._sharded_moonep(_moe(moonep=1, ep=3)) is True                 # a truthy flag, as vLLM's bool
    monkeypatch.setenv("MOONEP_EP_LAYOUT", "replicated")
    assert qh._sharded_moonep(_moe()) is False


def test_wna16_gets_moonep_experts_for_moonep_layers_and_vllms_choice_for_the_rest(patching):
    select = Calls("vLLM's WNA16 backend")
    module = types.SimpleNamespace(CompressedTensorsWNA16MoEMethod=_method_class("CompressedTensorsWNA16MoEMethod"),
                                   select_wna16_moe_backend=select)
    qh.patch_wna16(module, **patching.recorders, note={})
    assert patching.labels == ["compressed_tensors_moe_wna16.select_wna16_moe_backend",
                               "CompressedTensorsWNA16MoEMethod.create_weights",
                               "CompressedTensorsWNA16MoEMethod.process_weights_after_loading"]
    assert module.select_wna16_moe_backend.__wrapped__ is select
    for name in ("create_weights", "process_weights_after_loading"):     # the originals stay reachable
        cls = module.CompressedTensorsWNA16MoEMethod
        assert getattr(cls, name).__wrapped__ is cls.originals[name]
    assert module.select_wna16_moe_backend(_moe(), "w", k=1) == ("WNA16 EMULATION", _Experts)
    assert select.calls == []
    assert module.select_wna16_moe_backend(_moe(ep=1), "w", k=1) == "vLLM's WNA16 backend"
    assert select.calls == [((_moe(ep=1), "w"), {"k": 1})]
    # a second install (the hook fires again) changes nothing
    wrapped = module.select_wna16_moe_backend
    qh.patch_wna16(module, **patching.recorders, note={})
    assert module.select_wna16_moe_backend is wrapped and len(patching.labels) == 3


def test_mxfp4_init_keeps_vllms_choice_except_on_moonep_layers_where_it_logs_once(patching, caplog):
    cls = _method_class("CompressedTensorsW4A4Mxfp4MoEMethod", group_size=32)
    module = types.SimpleNamespace(CompressedTensorsW4A4Mxfp4MoEMethod=cls)
    note: dict[str, Any] = {}
    qh.patch_mxfp4(module, **patching.recorders, note=note)
    assert patching.labels == ["CompressedTensorsW4A4Mxfp4MoEMethod.__init__",
                               "CompressedTensorsW4A4Mxfp4MoEMethod.create_weights",
                               "CompressedTensorsW4A4Mxfp4MoEMethod.process_weights_after_loading"]
    caplog.set_level(logging.INFO, logger="vllm.moonep_ep")
    other = cls(_moe(moonep=False), "quant", extra=2)
    assert (other.use_cutlass_mxfp4, other.experts_cls) == (True, "vLLM's choice") and note == {}
    first, second = cls(_moe(), "quant"), cls(_moe(), "quant")
    assert (first.use_cutlass_mxfp4, first.experts_cls) == (False, _Experts)
    assert second.experts_cls is _Experts and note == {"mxfp4 experts": True}
    assert cls.calls == [("__init__", _moe(moonep=False), ("quant",), {"extra": 2}),
                         ("__init__", _moe(), ("quant",), {}),
                         ("__init__", _moe(), ("quant",), {})]
    assert cls.__init__.__wrapped__ is cls.originals["__init__"]
    assert [r.getMessage() for r in caplog.records] == [
        "moonep_ep: MXFP4 MoE on the sharded store: _Experts (the MarlinExperts/CUTLASS choice logged above is "
        "replaced)"]
    qh.patch_mxfp4(module, **patching.recorders, note=note)  # installed once
    assert len(patching.labels) == 3


def test_fp8_block_128_is_a_static_128x128_block_weight_key():
    key = lambda **scale: types.SimpleNamespace(scale=types.SimpleNamespace(**scale))  # noqa: E731
    assert qh._fp8_block_128(key(static=True, group_shape=(128, 128))) is True
    assert qh._fp8_block_128(key(static=True, group_shape=[128, 128])) is True
    for weight_key in (key(static=False, group_shape=(128, 128)), key(static=True, group_shape=(1, 128)),
                       key(static=True, group_shape=None), key(static=True), key(group_shape=(128, 128)),
                       types.SimpleNamespace(), None):
        assert qh._fp8_block_128(weight_key) is False, weight_key


def test_fp8_gets_moonep_experts_for_moonep_block_layers_only_and_logs_once(patching, caplog):
    select = Calls("vLLM's FP8 backend")
    module = types.SimpleNamespace(Fp8MoEMethod=_method_class("Fp8MoEMethod"), select_fp8_moe_backend=select)
    note: dict[str, Any] = {}
    qh.patch_fp8(module, **patching.recorders, note=note)
    assert module.select_fp8_moe_backend.__wrapped__ is select
    assert patching.labels == ["fp8.select_fp8_moe_backend", "Fp8MoEMethod.create_weights",
                               "Fp8MoEMethod.process_weights_after_loading"]
    caplog.set_level(logging.INFO, logger="vllm.moonep_ep")
    block = types.SimpleNamespace(scale=types.SimpleNamespace(static=True, group_shape=(128, 128)))
    channel = types.SimpleNamespace(scale=types.SimpleNamespace(static=True, group_shape=(1, -1)))
    assert module.select_fp8_moe_backend(_moe(), block, "act", 1, x=2) == ("FP8 CPU", _Experts)
    assert module.select_fp8_moe_backend(_moe(), block, "act") == ("FP8 CPU", _Experts)
    assert select.calls == [] and note == {"fp8 experts": True}
    assert module.select_fp8_moe_backend(_moe(), channel, "act", 1, x=2) == "vLLM's FP8 backend"
    assert module.select_fp8_moe_backend(_moe(ep=1), block, "act") == "vLLM's FP8 backend"
    assert select.calls == [((_moe(), channel, "act", 1), {"x": 2}), ((_moe(ep=1), block, "act"), {})]
    assert [r.getMessage() for r in caplog.records] == [
        "moonep_ep: FP8-block MoE on the sharded store: _Experts (vLLM's FP8 backend selection is not used for "
        "these layers)"]
    qh.patch_fp8(module, **patching.recorders, note=note)
    assert len(patching.labels) == 3


def test_create_weights_and_process_go_to_the_store_only_for_layers_moonep_experts_serve(patching):
    cls = _method_class("Fp8MoEMethod", block_quant=True, weight_block_size=[128, 128])
    qh._wrap_quantized_method(cls, "Fp8MoEMethod", patching.install)
    assert patching.labels == ["Fp8MoEMethod.create_weights", "Fp8MoEMethod.process_weights_after_loading"]
    assert cls.create_weights.__doc__ == "vLLM's create_weights." and hooks.is_wrapped(cls.create_weights)
    method, layer = cls(_moe()), object()
    method.experts_cls = _Experts                                       # moonep_ep's experts were selected
    method.create_weights(layer, 8, 64, params_dtype="bf16")
    (args, kwargs), = patching.placeholders.calls
    assert args[1:] == (method, layer, "fp8-block", 8, 64) and kwargs == {"params_dtype": "bf16"}
    assert [c[0] for c in cls.calls] == ["__init__"]                    # vLLM's own create_weights did not run
    assert args[0] is cls.create_weights.__wrapped__
    # vLLM's experts were selected (not a MoonEP layer): vLLM's create_weights
    method.experts_cls = "vLLM's choice"
    method.create_weights(layer, 8, 64, params_dtype="bf16")
    assert cls.calls[-1] == ("create_weights", method, layer, (8, 64), {"params_dtype": "bf16"})
    del method.experts_cls                                              # none chosen at all: vLLM's
    method.create_weights(layer)
    assert cls.calls[-1] == ("create_weights", method, layer, (), {}) and len(patching.placeholders.calls) == 1
    method.experts_cls = _Experts
    # a method moonep_ep does not bind (another format), even with its experts: vLLM's create_weights
    plain = _method_class("Fp8MoEMethod", block_quant=False)
    qh._wrap_quantized_method(plain, "Fp8MoEMethod", patching.install)
    unbound = plain(_moe())
    unbound.experts_cls = _Experts
    unbound.create_weights(layer)
    assert plain.calls[-1] == ("create_weights", unbound, layer, (), {}) and len(patching.placeholders.calls) == 1
    # process: the binding for a layer the placeholders marked, vLLM's conversion otherwise
    marked = types.SimpleNamespace(**{quantized_engine.FORMAT_ATTR: "fp8-block"})
    method.process_weights_after_loading(marked)
    assert patching.bind.calls == [((method, marked), {})] and cls.calls[-1][0] == "create_weights"
    unmarked = types.SimpleNamespace()
    method.process_weights_after_loading(unmarked)
    assert cls.calls[-1] == ("process", method, unmarked) and len(patching.bind.calls) == 1
    marked_none = types.SimpleNamespace(**{quantized_engine.FORMAT_ATTR: None})
    method.process_weights_after_loading(marked_none)
    assert cls.calls[-1] == ("process", method, marked_none) and len(patching.bind.calls) == 1
    assert cls.process_weights_after_loading.__wrapped__ is cls.originals["process_weights_after_loading"]


def test_every_patch_is_registered_for_its_vllm_module():
    assert qh.PATCHES == (
        hooks.Patch("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                    "compressed_tensors_moe_wna16", qh.patch_wna16),
        hooks.Patch("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                    "compressed_tensors_moe_w4a4_mxfp4", qh.patch_mxfp4),
        hooks.Patch("vllm.model_executor.layers.quantization.fp8", qh.patch_fp8),
        hooks.Patch("vllm.v1.worker.gpu_worker", qh.patch_gpu_worker))   # the experts' warm-up (test_experts_warmup)

"""The quantized engine's decisions in this process (``vllm/quantized/engine.py``): which methods it binds,
the loader's routing of each checkpoint tensor, the binding of the store's views, the experts classes and
their ``apply``, and the quantized slot fill.

The engine tier runs all of it inside vLLM (``test_quantized_checkpoints.py``,
``test_gpu_experts_engine.py``, ``test_slot_fill_waits.py``), in subprocesses
where mutation testing cannot see which function ran. Here vLLM's few
imported names are stand-ins (``tests/support/vllm_stubs.py``) written after
vLLM 0.33.0's: ``MoonEPExperts`` (``experts/moonep_experts.py``: ``__init__(moe_config,
quant_config)``, ``process_weights_after_loading`` keeps ``layer._moonep_weight_layout``),
``MoonEPExpertWeightLayout`` (``prepare_finalize/moonep.py``: a NamedTuple of the three
``full_*_weight`` views and ``num_prefetch_slots``; ``MOONEP_DEFAULT_TOKEN_PADDING`` 128), and
records of ``maybe_make_prepare_finalize`` and ``FusedMoEKernel``. The store is a stand-in that
records what the loader hands it. Expected values are written out by hand.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.ops.experts.activation import SILU, GatedActivation
from moonep_ep.ops.moonep.prefetch import wait_for_slots
from moonep_ep.vllm.quantized import engine as qe
from moonep_ep.vllm.store.loading import BINDING_ATTR, TARGET_DEVICE_ATTR, ZERO_COPY_FLAG
from moonep_ep.vllm.observe.stats import STATS
from tests.support.vllm_stubs import Calls, install

PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"


def _refusal(call, kind=ConfigError) -> str:
    with pytest.raises(kind) as e:
        call()
    return str(e.value)


def _method(cls_name: str, **attrs: Any) -> Any:
    return type(cls_name, (), {})() if not attrs else type(cls_name, (), attrs)()


# -- which vLLM methods are bound, in which format ----------------------------------------------------------

def test_method_format_names_the_three_bound_methods_and_nothing_else():
    sym, asym = types.SimpleNamespace(symmetric=True), types.SimpleNamespace(symmetric=False)
    wna16 = "CompressedTensorsWNA16MoEMethod"
    assert qe.method_format(_method(wna16, num_bits=4, group_size=32, weight_quant=sym)) == "int4-g32"
    for attrs in ({"num_bits": 8, "group_size": 32, "weight_quant": sym},
                  {"num_bits": 4, "group_size": 128, "weight_quant": sym},
                  {"num_bits": 4, "group_size": 32, "weight_quant": asym},
                  {"num_bits": 4, "group_size": 32},                        # no weight_quant: not symmetric
                  {"group_size": 32, "weight_quant": sym}, {"num_bits": 4, "weight_quant": sym}):
        assert qe.method_format(_method(wna16, **attrs)) is None, attrs
    mx = "CompressedTensorsW4A4Mxfp4MoEMethod"
    assert qe.method_format(_method(mx, group_size=32)) == "mxfp4"
    assert qe.method_format(_method(mx, group_size=16)) is None and qe.method_format(_method(mx)) is None
    fp8 = "Fp8MoEMethod"
    assert qe.method_format(_method(fp8, block_quant=True, weight_block_size=[128, 128])) == "fp8-block"
    assert qe.method_format(_method(fp8, block_quant=True, weight_block_size=(128, 128))) == "fp8-block"
    for attrs in ({"block_quant": False, "weight_block_size": [128, 128]}, {"weight_block_size": [128, 128]},
                  {"block_quant": True, "weight_block_size": None}, {"block_quant": True},
                  {"block_quant": True, "weight_block_size": [64, 64]}):
        assert qe.method_format(_method(fp8, **attrs)) is None, attrs
    # the same attributes on another method class: not bound
    assert qe.method_format(_method("UnquantizedFusedMoEMethod", num_bits=4, group_size=32, weight_quant=sym,
                                    block_quant=True, weight_block_size=[128, 128])) is None


# -- create_weights on meta, and the loader -------------------------------------------------------------------

class _Layer(torch.nn.Module):
    layer_name = "model.layers.3.mlp.experts"

    def __init__(self, local_of: dict[int, int] | None = None):
        super().__init__()
        self._local_of = local_of or {}

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return self._local_of.get(expert_id, -1)


def test_create_weights_runs_on_meta_and_routes_every_expert_tensor_to_the_store_loader():
    seen = []

    def create_weights(method, layer, num_experts, hidden_size, **extra):
        seen.append((method, num_experts, hidden_size, extra, torch.empty(1).device.type))
        for name in ("w13_weight_packed", "w2_weight_scale", "bias"):
            layer.register_parameter(name, torch.nn.Parameter(torch.empty(4, 8), requires_grad=False))
        layer.w2_input_quant = torch.nn.Module()                       # a submodule: its tensors are not experts'
        layer.w2_input_quant.register_parameter("scale", torch.nn.Parameter(torch.empty(1), requires_grad=False))

    method, layer = object(), _Layer()
    qe.create_quantized_placeholders(create_weights, method, layer, "mxfp4", 8, 64, params_dtype=torch.bfloat16)
    assert seen == [(method, 8, 64, {"params_dtype": torch.bfloat16}, "meta")]
    assert all(p.is_meta for p in layer.parameters())
    for name in ("w13_weight_packed", "w2_weight_scale"):
        loader = getattr(layer, name).weight_loader
        assert loader.__self__ is layer and loader.__func__ is qe.load_quantized_expert
    assert not hasattr(layer.bias, "weight_loader")                 # not an expert tensor: vLLM's own loader
    assert not hasattr(layer.w2_input_quant.scale, "weight_loader")  # the layer's own parameters only
    assert getattr(layer, ZERO_COPY_FLAG) is True and getattr(layer, qe.FORMAT_ATTR) == "mxfp4"
    assert getattr(layer, TARGET_DEVICE_ATTR) == torch.device("cpu")  # the default device before meta


class _Store:
    """What the loader and the binding read of ``vllm/store.py``'s store; writes and refusals recorded."""

    def __init__(self, fmt: str = "int4-g32", ready: bool = True):
        self.rank, self.format, self.hidden, self.intermediate = 2, fmt, 64, 32
        self.shapes = {"w13_weight_packed": (64, 8), "w13_weight_scale": (64, 2), "w2_weight_packed": (64, 4),
                       "w2_weight_scale": (64, 1)}
        self.ready, self.num_slots, self.num_experts = ready, 3, 8
        self.api = "pull"  # the pull layout: vLLM's fused names are the store's (sharded.py's store_target)
        self.writes: list[tuple] = []
        self.refusals: list[str] = []
        self._views = {n: torch.zeros(11, *s) for n, s in self.shapes.items()}

    def named_views(self, idx: int) -> dict[str, torch.Tensor]:
        assert idx == 5
        return self._views

    def refuse(self, message: str) -> None:
        self.refusals.append(message)

    def store_target(self, name: str, part):
        return name, part

    def write_expert(self, idx, name, local, tensor, *, where, part):
        self.writes.append((idx, name, local, tensor, where, part))


def _bound_layer(store: _Store) -> _Layer:
    layer = _Layer({40: 1, 41: 0})
    for name in store.shapes:
        layer.register_parameter(name, torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    setattr(layer, BINDING_ATTR, (store, 5))
    return layer


def test_the_loader_writes_each_part_into_its_row_half_and_refuses_what_the_store_has_no_tensor_for():
    store = _Store()
    layer = _bound_layer(store)
    w = torch.ones(32, 8)
    load = qe.load_quantized_expert
    assert load(layer, layer.w13_weight_packed, w, "experts.40.gate_proj.weight_packed", "w1", 40, True) is True
    assert load(layer, layer.w13_weight_packed, w, "experts.40.up_proj.weight_packed", "w3", 40) is None
    assert load(layer, layer.w2_weight_scale, w, "experts.41.down_proj.weight_scale", "w2", 41, True) is True
    assert [(i, n, loc, t is w, where, part) for i, n, loc, t, where, part in store.writes] == [
        (5, "w13_weight_packed", 1, True, "experts.40.gate_proj.weight_packed", 0),
        (5, "w13_weight_packed", 1, True, "experts.40.up_proj.weight_packed", 1),
        (5, "w2_weight_scale", 0, True, "experts.41.down_proj.weight_scale", None)]
    # an expert another rank owns: skipped, False only when vLLM asks for a result
    assert load(layer, layer.w13_weight_packed, w, "experts.7.gate_proj.weight_packed", "w1", 7, True) is False
    assert load(layer, layer.w13_weight_packed, w, "experts.7.gate_proj.weight_packed", "w1", 7) is None
    # a parameter the layer does not hold is named by the checkpoint name's last part
    other = torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    assert load(layer, other, w, "experts.40.gate_proj.weight_zero_point", "w1", 40, True) is True
    assert load(layer, layer.w2_weight_scale, w, "experts.40.down_proj.weight_scale", "w4", 40, True) is True
    assert store.refusals == [
        "[rank 2] experts.40.gate_proj.weight_zero_point: parameter 'weight_zero_point' (shard 'w1') is not one of "
        "the int4-g32 store's tensors ['w13_weight_packed', 'w13_weight_scale', 'w2_weight_packed', "
        "'w2_weight_scale']. Fix: serve a checkpoint in one of the formats moonep_ep binds, or another "
        "--all2all-backend",
        "[rank 2] experts.40.down_proj.weight_scale: parameter 'w2_weight_scale' (shard 'w4') is not one of the "
        "int4-g32 store's tensors ['w13_weight_packed', 'w13_weight_scale', 'w2_weight_packed', "
        "'w2_weight_scale']. Fix: serve a checkpoint in one of the formats moonep_ep binds, or another "
        "--all2all-backend"]
    assert len(store.writes) == 3
    # a checkpoint name without a dot is the name itself
    assert load(layer, other, w, "weight_zero_point", "w1", 40, True) is True
    assert "[rank 2] weight_zero_point: parameter 'weight_zero_point' (shard 'w1')" in store.refusals[-1]


def test_the_loader_names_a_parameter_by_the_layers_own_parameters_only(monkeypatch):
    """A submodule's parameter is not the layer's: it is named from the checkpoint name (here a store tensor,
    so it is written), not as ``child.<name>`` (which the store would refuse). Each written tensor is registered
    with the load's collective recorder (a collective carrying its bytes would be counted)."""
    store = _Store()
    layer = _bound_layer(store)
    layer.child = torch.nn.Module()
    layer.child.register_parameter("w13_weight_packed", torch.nn.Parameter(torch.empty(0, device="meta"),
                                                                           requires_grad=False))
    registered = Calls()
    monkeypatch.setattr(STATS, "_recorder", types.SimpleNamespace(register=registered))
    monkeypatch.setattr(STATS, "data", {"load": {"expert_tensors_loaded": 0}})
    w = torch.ones(32, 8)
    qe.load_quantized_expert(layer, layer.child.w13_weight_packed, w, "e.40.up_proj.w13_weight_packed", "w3", 40)
    assert store.refusals == [] and [(n, part) for _, n, _, _, _, part in store.writes] == [("w13_weight_packed", 1)]
    assert registered.calls == [((w,), {})] and STATS.data["load"]["expert_tensors_loaded"] == 1


def test_weight_shape_tensors_are_checked_against_the_served_shapes_and_never_stored():
    store = _Store()
    layer = _bound_layer(store)
    for name in ("w13_weight_shape", "w2_weight_shape"):
        layer.register_parameter(name, torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    load = qe.load_quantized_expert
    # compressed-tensors' [out, in] of the unpacked weight: gate/up [I 32, H 64], down [H 64, I 32]
    assert load(layer, layer.w13_weight_shape, torch.tensor([32, 64]), "e.40.gate_proj.weight_shape", "w1", 40, True)
    assert load(layer, layer.w2_weight_shape, torch.tensor([64, 32]), "e.40.down_proj.weight_shape", "w2", 40) is None
    assert store.refusals == [] and store.writes == []
    load(layer, layer.w13_weight_shape, torch.tensor([64, 32]), "e.40.up_proj.weight_shape", "w3", 40)
    load(layer, layer.w2_weight_shape, torch.tensor([32, 64]), "e.41.down_proj.weight_shape", "w2", 41)
    assert store.refusals == [
        "[rank 2] e.40.up_proj.weight_shape (expert 40, w3): weight_shape [64, 32] differs from the served [32, 64]. "
        "Fix: load a checkpoint of the served model's shapes",
        "[rank 2] e.41.down_proj.weight_shape (expert 41, w2): weight_shape [32, 64] differs from the served "
        "[64, 32]. Fix: load a checkpoint of the served model's shapes"]
    assert store.writes == []


def test_the_loader_refuses_an_unbound_layer_and_skips_vllms_reload_replay():
    layer = _Layer({40: 0})
    param = torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    assert _refusal(lambda: qe.load_quantized_expert(layer, param, torch.ones(1), "w", "w1", 40)) == (
        "moonep_ep: MoE layer model.layers.3.mlp.experts was built for the sharded MoonEP layout but no store was "
        "allocated for it. Fix: load the model with vLLM's default loader")
    store = _Store()
    layer = _bound_layer(store)
    copy = torch.nn.Parameter(torch.zeros(64, 8), requires_grad=False)      # a materialized copy: replayed
    assert qe.load_quantized_expert(layer, copy, torch.ones(32, 8), "e.40.gate_proj.weight_packed", "w1", 40,
                                    True) is True
    assert qe.load_quantized_expert(layer, copy, torch.ones(32, 8), "e.40.gate_proj.weight_packed", "w1", 40) is None
    assert store.writes == [] and store.refusals == []
    # the store's own view (a layerwise reload's first call after binding): written
    view = torch.nn.Parameter(store.named_views(5)["w13_weight_packed"], requires_grad=False)
    layer.register_parameter("w13_weight_packed", view)
    qe.load_quantized_expert(layer, view, torch.ones(32, 8), "e.40.gate_proj.weight_packed", "w1", 40)
    assert [(n, part) for _, n, _, _, _, part in store.writes] == [("w13_weight_packed", 0)]


# -- binding the store's views --------------------------------------------------------------------------------

class _Layout(NamedTuple):
    full_gate_weight: torch.Tensor
    full_up_weight: torch.Tensor
    full_down_weight: torch.Tensor
    num_prefetch_slots: int


class _MoonEPExperts:
    def __init__(self, moe_config: Any, quant_config: Any, max_num_tokens: Any = None, num_dispatchers: Any = None):
        self.moe_config, self.quant_config = moe_config, quant_config
        self._weight_layout = None

    def process_weights_after_loading(self, layer: Any) -> None:
        layout = getattr(layer, "_moonep_weight_layout", None)
        assert layout is not None
        self._weight_layout = layout


class _PrepareAndFinalize:
    pass


@pytest.fixture
def vllm(monkeypatch, tmp_path):
    """vLLM's names the binding and the experts classes import; fresh class caches; stats into tmp_path."""
    monkeypatch.setattr(qe, "_EXPERTS_CLS", {})
    monkeypatch.setattr(qe, "_LAYOUT_CLS", [])
    monkeypatch.setattr(qe, "_LAYOUTS", {})
    monkeypatch.setattr(STATS, "data", {"ep_rank": None})
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    monkeypatch.setenv("MOONEP_EP_QUANTIZED_EXPERTS", "dequant")
    prepare = Calls(_PrepareAndFinalize())
    kernel = Calls(compute=True, result=lambda pf, experts: types.SimpleNamespace(prepare_finalize=pf,
                                                                                   fused_experts=experts))
    platform = types.SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False, device_name="cpu")
    install(monkeypatch, {
        "vllm.model_executor.layers.fused_moe": {},
        "vllm.model_executor.layers.fused_moe.modular_kernel": {"FusedMoEKernel": kernel},
        "vllm.model_executor.layers.fused_moe.all2all_utils": {"maybe_make_prepare_finalize": prepare},
        "vllm.model_executor.layers.fused_moe.prepare_finalize": {},
        "vllm.model_executor.layers.fused_moe.experts": {},
        PF: {"MoonEPPrepareAndFinalize": _PrepareAndFinalize, "MoonEPExpertWeightLayout": _Layout,
             "MOONEP_DEFAULT_TOKEN_PADDING": 128},
        "vllm.model_executor.layers.fused_moe.experts.moonep_experts": {"MoonEPExperts": _MoonEPExperts},
        "vllm.platforms": {"current_platform": platform},
        "vllm.triton_utils": {"HAS_TRITON": True},
    })
    return types.SimpleNamespace(prepare=prepare, kernel=kernel, platform=platform)


class _QuantMethod:
    def __init__(self) -> None:
        self.moe = types.SimpleNamespace(name="moe config")
        self.moe_kernel = None
        self.quant_config_calls: list[Any] = []

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        self.quant_config_calls.append(layer)
        return "weight-only quant config"


def _binding(fmt: str) -> tuple[_Store, _Layer]:
    store = _Store(fmt)
    if fmt == "fp8-block":
        store.shapes = {"w13_weight": (64, 64), "w13_weight_scale_inv": (1, 1), "w2_weight": (64, 32),
                        "w2_weight_scale_inv": (1, 1)}
        store._views = {n: torch.zeros(11, *s) for n, s in store.shapes.items()}
    layer = _bound_layer(store)
    layer._expert_routing_tables = lambda: "routing tables"
    return store, layer


def test_binding_makes_the_store_views_the_parameters_and_builds_moonep_kernel_once(vllm):
    store, layer = _binding("int4-g32")
    method = _QuantMethod()
    qe.bind_quantized_layer(method, layer)
    views = store.named_views(5)
    for name, view in views.items():
        p = getattr(layer, name)
        assert isinstance(p, torch.nn.Parameter) and not p.requires_grad and p.data_ptr() == view.data_ptr()
    assert layer.w13_weight is layer.w13_weight_packed and layer.w2_weight is layer.w2_weight_packed
    layout = layer._moonep_weight_layout
    assert isinstance(layout, _Layout) and layout.num_prefetch_slots == 3
    assert (layout.full_gate_weight is views["w13_weight_packed"], layout.full_up_weight is views["w13_weight_scale"],
            layout.full_down_weight is views["w2_weight_packed"]) == (True, True, True)
    assert layout.format == "int4-g32" and layout.views is views
    assert qe.quantized_views_for(views["w13_weight_packed"]) == ("int4-g32", views, 8)
    (args, kwargs), = vllm.prepare.calls
    assert args == () and kwargs == {"moe": method.moe, "quant_config": "weight-only quant config",
                                     "routing_tables": "routing tables", "allow_new_interface": True,
                                     "use_monolithic": False}
    assert method.quant_config_calls == [layer] and method.moe_quant_config == "weight-only quant config"
    experts = method.moe_kernel.fused_experts
    assert type(experts).__name__ == "MoonEPQuantizedExperts" and experts.moe_config is method.moe
    assert experts.quant_config == "weight-only quant config" and experts._weight_layout is layout
    assert method.moe_kernel.prepare_finalize is vllm.prepare.result
    assert STATS.data["quantized_experts"] == {"class": "MoonEPQuantizedExperts", "format": "int4-g32",
                                               "kernel": "moonep_ep dequantize + grouped GEMM",
                                               "triton_interpreter": False}
    # a reload binds again: the same view objects, the kernel kept, the experts given the layout again
    kernel = method.moe_kernel
    experts._weight_layout = None
    qe.bind_quantized_layer(method, layer)
    assert method.moe_kernel is kernel and len(vllm.prepare.calls) == 1
    assert experts._weight_layout is layer._moonep_weight_layout and layer._moonep_weight_layout.views is views


def test_a_reload_keeps_the_views_the_prepare_holds_and_fp8_binds_its_own_names(vllm):
    store, layer = _binding("fp8-block")
    method = _QuantMethod()
    kept = {n: torch.zeros(11, *s) for n, s in store.shapes.items()}     # the views a first binding made
    layer._moonep_weight_layout = types.SimpleNamespace(views=kept)
    qe.bind_quantized_layer(method, layer)
    assert layer._moonep_weight_layout.views is kept and layer.w13_weight.data_ptr() == kept["w13_weight"].data_ptr()
    layout = layer._moonep_weight_layout
    assert layout.full_up_weight is kept["w13_weight_scale_inv"] and layout.full_down_weight is kept["w2_weight"]
    assert layer.w2_weight.data_ptr() == kept["w2_weight"].data_ptr()
    # a previous layout without views (vLLM's own): the store's views
    store2, layer2 = _binding("fp8-block")
    layer2._moonep_weight_layout = types.SimpleNamespace(views=None)
    qe.bind_quantized_layer(_QuantMethod(), layer2)
    assert layer2._moonep_weight_layout.views is store2.named_views(5)


def test_binding_refuses_a_layer_without_store_before_loading_or_with_another_prepare(vllm):
    layer = _Layer()
    assert _refusal(lambda: qe.bind_quantized_layer(_QuantMethod(), layer)) == (
        "moonep_ep: quantized MoE layer model.layers.3.mlp.experts has no sharded store. Fix: build the model "
        "through vLLM's model loader")
    bare = types.SimpleNamespace()                                      # no layer_name either
    assert "quantized MoE layer ? has no sharded store" in _refusal(lambda: qe.bind_quantized_layer(_QuantMethod(),
                                                                                                     bare))
    store, layer = _binding("mxfp4")
    store.ready = False
    assert _refusal(lambda: qe.bind_quantized_layer(_QuantMethod(), layer)) == (
        "[rank 2] moonep_ep: quantized MoE layer model.layers.3.mlp.experts is converted before its expert weights "
        "were loaded. Fix: load a real checkpoint")
    store.ready = True
    vllm.prepare.result = object()
    assert _refusal(lambda: qe.bind_quantized_layer(_QuantMethod(), layer)) == (
        "moonep_ep: quantized MoE layer model.layers.3.mlp.experts got object, not MoonEP's prepare/finalize. Fix: "
        "--all2all-backend moonep with expert parallelism over more than one rank")


def test_a_method_without_a_kernel_and_a_layer_without_some_parameters_are_bound(vllm):
    store, layer = _binding("int4-g32")
    del layer._parameters["w2_weight_scale"]                            # vLLM made no such parameter
    method = types.SimpleNamespace(moe=None, get_fused_moe_quant_config=lambda layer: None)   # no moe_kernel at all
    qe.bind_quantized_layer(method, layer)
    assert layer.w2_weight_scale.data_ptr() == store.named_views(5)["w2_weight_scale"].data_ptr()
    assert type(method.moe_kernel.fused_experts).__name__ == "MoonEPQuantizedExperts"


def test_a_kernel_with_other_experts_is_replaced_by_moonep_one(vllm):
    store, layer = _binding("mxfp4")
    method = _QuantMethod()
    method.moe_kernel = types.SimpleNamespace(fused_experts=object())   # vLLM's own experts
    qe.bind_quantized_layer(method, layer)
    assert type(method.moe_kernel.fused_experts).__name__ == "MoonEPQuantizedExperts"
    assert len(vllm.prepare.calls) == 1


def test_residency_names_every_parameter_that_does_not_alias_its_view():
    views = {"w13_weight": torch.zeros(4, 8), "w2_weight": torch.zeros(4, 8), "w2_weight_scale": torch.zeros(4, 2)}
    layer = _Layer()
    layer.w13_weight = views["w13_weight"]                              # the view itself
    layer.w2_weight = views["w2_weight"].clone()                        # a private copy
    layer.w2_weight_scale = views["w2_weight_scale"][:2]                # same start, another shape
    assert _refusal(lambda: qe.check_residency(layer, views)) == (
        "moonep_ep: MoE layer model.layers.3.mlp.experts: ['w2_weight', 'w2_weight_scale'] were re-bound to private "
        "memory, not the sharded store's rows: prefetched slots would never be read. Fix: report this (a vLLM "
        "conversion re-bound the parameters)")
    layer.w2_weight, layer.w2_weight_scale = views["w2_weight"], views["w2_weight_scale"]
    qe.check_residency(layer, views)                                    # the control: all aliases


def test_the_layout_class_is_made_once(vllm):
    a = qe.QuantizedWeightLayout(torch.zeros(1), torch.zeros(2), torch.zeros(3), 4)
    b = qe.QuantizedWeightLayout(torch.zeros(1), torch.zeros(2), torch.zeros(3), 5)
    assert type(a) is type(b) and isinstance(a, _Layout) and len(qe._LAYOUT_CLS) == 1
    assert (a.full_up_weight.numel(), a.full_down_weight.numel(), a.num_prefetch_slots, b.num_prefetch_slots) == (
        2, 3, 4, 5)


# -- the experts classes --------------------------------------------------------------------------------------

def test_the_experts_kind_follows_the_variable_and_auto_follows_the_platform(vllm, monkeypatch):
    for kind in ("triton", "dequant"):
        monkeypatch.setenv("MOONEP_EP_QUANTIZED_EXPERTS", kind)
        assert qe.experts_kind() == kind
    monkeypatch.setenv("MOONEP_EP_QUANTIZED_EXPERTS", "auto")
    assert qe.experts_kind() == "dequant"
    vllm.platform.is_cuda = lambda: True
    assert qe.experts_kind() == "triton"
    assert qe.experts_class() is qe._EXPERTS_CLS["triton"]
    assert qe.experts_class("triton") is qe.experts_class()              # built once per kind
    assert qe.experts_class("dequant").__name__ == "MoonEPQuantizedExperts"
    assert qe.experts_class().__name__ == "MoonEPTritonQuantizedExperts"
    assert _refusal(lambda: qe.experts_class("cutlass")) == (
        "moonep_ep: no quantized experts of kind 'cutlass'. Fix: triton or dequant")


def test_triton_is_refused_where_vllm_has_none_and_the_interpreter_is_mended_where_it_runs(vllm, monkeypatch):
    mended = Calls()
    import moonep_ep.testing.triton_interpreter as ti

    monkeypatch.setattr(ti, "mend_interpreter", mended)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    refused = ("moonep_ep: MOONEP_EP_QUANTIZED_EXPERTS=triton, but vLLM has no usable Triton in this process "
               "(HAS_TRITON={}, TRITON_INTERPRET={}, platform cpu). Fix: on GPUs install vLLM's Triton; on the CPU "
               "engine start through `moonep-ep vllm-demo` or `moonep-ep serve` (they run the kernels in Triton's "
               "interpreter), or set MOONEP_EP_QUANTIZED_EXPERTS=dequant")
    assert _refusal(qe._check_triton_here) == refused.format(True, None)          # CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _refusal(qe._check_triton_here) == refused.format(True, "'0'")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qe._check_triton_here() is True and len(mended.calls) == 1
    import sys

    sys.modules["vllm.triton_utils"].HAS_TRITON = False
    assert _refusal(qe._check_triton_here) == refused.format(False, "'1'")
    sys.modules["vllm.triton_utils"].HAS_TRITON = True
    vllm.platform.is_cpu = lambda: False                                # a GPU: compiled kernels, nothing mended
    monkeypatch.delenv("TRITON_INTERPRET")
    assert qe._check_triton_here() is False and len(mended.calls) == 1


def _meta(counts: list[int]) -> Any:
    return types.SimpleNamespace(expert_num_tokens=torch.tensor(counts))


def test_apply_computes_the_own_groups_waits_for_the_slot_fills_then_the_slot_groups(vllm, monkeypatch):
    from moonep_ep.ops.experts import quantized as quantized_experts
    from moonep_ep.vllm.experts import overlap

    order: list[str] = []
    ffn = Calls(compute=True, result=lambda hidden, *a, **k: (order.append("ffn"),
                                                              torch.full((hidden.shape[0], 4), 7.0))[1])
    monkeypatch.setattr(quantized_experts, "quantized_grouped_ffn", ffn)
    cls = qe.experts_class("dequant")
    assert getattr(cls, overlap.WAITS_ATTR) is True and cls.__module__ == "moonep_ep.vllm.quantized.engine"
    assert cls.experts_kind == "dequant" and cls._supports_current_device()
    assert cls._supports_quant_scheme("any weight key", None) and not cls._supports_quant_scheme("w", "a")
    experts = cls(moe_config=types.SimpleNamespace(intermediate_size_per_partition=48), quant_config=None)
    # [E+B] = 2 experts and 1 slot; every view's row g holds g
    views = {name: torch.arange(3.0)[:, None].expand(3, k).contiguous()
             for name, k in (("w13_weight_packed", 1), ("w13_weight_scale", 2), ("w2_weight_packed", 3),
                             ("w2_weight_scale", 4))}
    experts._weight_layout = types.SimpleNamespace(format="int4-g32", views=views)
    hidden = torch.arange(8.0)[:, None].expand(8, 4).contiguous()        # row i holds i; 6 and 7: past the groups
    topk_weights, topk_ids = torch.arange(8.0), torch.zeros(3, 2, dtype=torch.int64)
    assert experts.moe_problem_size(hidden, torch.zeros(5, 1), torch.zeros(1), topk_ids) == (5, 8, 48, 4, 2)

    class Event:
        def wait(self):
            order.append("wait")

    overlap.SLOT_FILL_HANDOFF.put((Event(), Event()))
    output = torch.full((8, 4), -1.0)
    experts.apply(output, hidden, None, None, topk_weights, topk_ids, None, 2, None, None, None, None, None,
                  _meta([2, 0, 4]), False)
    assert order == ["ffn", "wait", "wait", "ffn"]                        # own groups, the fill, the slot group
    assert output[:6].eq(7).all() and output[6:].eq(-1).all()            # past the last group: not written
    (own, own_kw), (slot, slot_kw) = ffn.calls
    # own part: rows [0, 2), weight rows [0, 2) of every view, its cu_seqlens, its route weights
    assert own[0][:, 0].tolist() == [0.0, 1.0] and own[1] == "int4-g32"
    assert [a[:, 0].tolist() for a in own[2:6]] == [[0.0, 1.0]] * 4
    assert own[6].dtype == torch.int32 and own[6].tolist() == [2, 2] and own[7].tolist() == [0.0, 1.0]
    # slot part: rows [2, 6), weight row 2 (the slot), cu_seqlens from its first row
    assert slot[0][:, 0].tolist() == [2.0, 3.0, 4.0, 5.0] and slot[1] == "int4-g32"
    assert [a[:, 0].tolist() for a in slot[2:6]] == [[2.0]] * 4
    assert slot[6].dtype == torch.int32 and slot[6].tolist() == [4] and slot[7].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert own_kw == slot_kw == {"activation": SILU}                     # vLLM's None: SiLU
    assert overlap.take_slot_fill() is None                              # taken once
    experts.apply(output, hidden, None, None, topk_weights, topk_ids, None, 2, None, None, None, None, None,
                  _meta([6, 0, 0]), True)                                # own rows only; route weights applied
    assert ffn.calls[2][0][7] is None and ffn.calls[2][0][0].shape[0] == 6 and order.count("wait") == 2
    assert STATS.data["experts_compute"]["calls"] == 2 and STATS.data["experts_compute"]["rows"] == 16
    assert 0 <= STATS.data["experts_compute"]["seconds"] < 10          # two calls of a stand-in: milliseconds
    with pytest.raises(AssertionError):                                 # vLLM's expert_tokens_meta is required
        experts.apply(output, hidden, None, None, topk_weights, topk_ids, None, 2, None, None, None, None, None,
                      None, False)
    experts._weight_layout = None
    with pytest.raises(AssertionError):
        experts.apply(output, hidden, None, None, topk_weights, topk_ids, None, 2, None, None, None, None, None,
                      _meta([6, 0, 0]), False)
    # FP8's views go by their own names; built positionally, as vLLM may build an experts class
    fp8 = {name: torch.full((3, 1), float(v)) for name, v in (("w13_weight", 5), ("w13_weight_scale_inv", 6),
                                                               ("w2_weight", 7), ("w2_weight_scale_inv", 8))}
    positional = cls(types.SimpleNamespace(intermediate_size_per_partition=48), "quant config")
    assert positional.quant_config == "quant config"
    positional._weight_layout = types.SimpleNamespace(format="fp8-block", views=fp8)
    positional.apply(output, hidden, None, None, topk_weights, topk_ids, None, 2, None, None, None, None, None,
                     _meta([6, 0, 0]), False)
    assert ffn.calls[3][0][1] == "fp8-block" and [float(a[0, 0]) for a in ffn.calls[3][0][2:6]] == [5, 6, 7, 8]
    # the layer's activation, with its betas from the experts' moe_config; anything else refused by name
    positional.moe_config = types.SimpleNamespace(activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    positional.apply(output, hidden, None, None, topk_weights, topk_ids, types.SimpleNamespace(value="situ"), 2,
                     None, None, None, None, None, _meta([6, 0, 0]), False)
    assert ffn.calls[4][1] == {"activation": GatedActivation("situ", beta=4.0, linear_beta=25.0)}
    assert cls._supports_activation(types.SimpleNamespace(value="situ")) and cls._supports_activation(None)
    assert not cls._supports_activation(types.SimpleNamespace(value="gelu"))
    assert "'gelu'" in _refusal(lambda: positional.apply(output, hidden, None, None, topk_weights, topk_ids, "gelu",
                                                          2, None, None, None, None, None, _meta([6, 0, 0]), False))
    assert len(ffn.calls) == 5
    vllm.platform.is_cpu = lambda: False
    assert not cls._supports_current_device()
    vllm.platform.is_cuda = lambda: True
    assert cls._supports_current_device()


def test_triton_experts_pick_tiles_from_the_steps_real_tokens_once_per_shape(vllm, monkeypatch):
    from moonep_ep.vllm.experts import gpu as gpu_experts

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import moonep_ep.testing.triton_interpreter as ti

    monkeypatch.setattr(ti, "mend_interpreter", Calls())
    configs = Calls(compute=True, result=lambda fmt, **kw: {"BLOCK_SIZE_M": 16, "asked": kw})
    ffn = Calls(torch.full((4, 8), 3.0))
    monkeypatch.setattr(gpu_experts, "kernel_config", configs)
    monkeypatch.setattr(gpu_experts, "gpu_grouped_ffn", ffn)
    cls = qe.experts_class("triton")
    moe = types.SimpleNamespace(num_local_experts=6, intermediate_size_per_partition=32)
    experts = cls(moe_config=moe, quant_config=None)
    assert experts.interpreter is True and experts.token_padding == 128 and experts._configs == {}
    positional = cls(moe, "quant config")                               # as vLLM may build an experts class
    assert positional.moe_config is moe and positional.quant_config == "quant config"
    layout = types.SimpleNamespace(format="fp8-block", views={"w13_weight": torch.zeros(1)})
    hidden, cu, route = torch.zeros(4, 8), torch.tensor([4], dtype=torch.int32), torch.ones(4)
    out = experts.grouped_ffn(layout, hidden, cu, route, torch.zeros(5, 2, dtype=torch.int64))
    assert out is ffn.result
    experts.grouped_ffn(layout, hidden, cu, route, torch.zeros(5, 2, dtype=torch.int64))       # the same shape
    experts.grouped_ffn(layout, hidden, cu, None, torch.zeros(9, 0, dtype=torch.int64))        # top_k 0 -> 1
    assert [(a, kw) for a, kw in configs.calls] == [
        (("fp8-block",), {"local_experts": 6, "hidden": 8, "intermediate": 32, "tokens": 5, "top_k": 2,
                          "token_padding": 128, "interpreter": True}),
        (("fp8-block",), {"local_experts": 6, "hidden": 8, "intermediate": 32, "tokens": 9, "top_k": 1,
                          "token_padding": 128, "interpreter": True})]
    assert set(experts._configs) == {("fp8-block", 5, 2), ("fp8-block", 9, 1)}
    args, kwargs = ffn.calls[0]
    assert args[:3] == ("fp8-block", hidden, layout.views) and args[3] is cu and args[4] is route
    assert kwargs == {"token_padding": 128, "native_act_quant": True, "activation": SILU,
                      "config": {"BLOCK_SIZE_M": 16, "asked": configs.calls[0][1]}}
    assert kwargs["config"] is experts._configs[("fp8-block", 5, 2)] and ffn.calls[1][1]["config"] is kwargs["config"]
    assert ffn.calls[2][0][4] is None
    # through apply: the tokens are topk_ids' rows (7 tokens, top-2 here)
    experts._weight_layout = layout
    out7 = torch.zeros(4, 8)
    experts.apply(out7, hidden, None, None, torch.ones(7, 2), torch.zeros(7, 2, dtype=torch.int64), None, 1, None,
                  None, None, None, None, _meta([4]), False)
    assert configs.calls[-1][1]["tokens"] == 7 and bool((out7 == 3).all())
    assert qe.experts_class("triton").experts_kind == "triton"
    # _record_experts for Triton experts: vLLM's kernel name and whether it is interpreted
    qe._record_experts(experts, "fp8-block")
    assert STATS.data["quantized_experts"] == {"class": "MoonEPTritonQuantizedExperts", "format": "fp8-block",
                                               "kernel": "vllm fused_moe_kernel (block 128x128)",
                                               "triton_interpreter": True}
    experts.interpreter = False
    qe._record_experts(experts, "mxfp4")
    assert STATS.data["quantized_experts"]["kernel"] == "moonep_ep mxfp4_grouped_gemm_kernel"
    assert STATS.data["quantized_experts"]["triton_interpreter"] is False


# -- the views a prefetch is for, and the quantized slot fill -------------------------------------------------

def test_quantized_views_are_found_by_the_w13_view_itself_only(vllm):
    view = torch.zeros(4, 2, dtype=torch.uint8)
    views = {"w13_weight_packed": view}
    qe._LAYOUTS[id(view)] = ("mxfp4", views, 3)
    assert qe.quantized_views_for(view) == ("mxfp4", views, 3)
    assert qe.quantized_views_for(view.clone()) is None                 # another tensor
    assert qe.quantized_views_for("not a tensor") is None
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    qe._LAYOUTS[id(bf16)] = ("bf16", {"w": bf16}, 1)
    assert qe.quantized_views_for(bf16) is None                         # the BF16 path's weights
    stale = torch.zeros(1, dtype=torch.uint8)                           # an id reused by another tensor
    qe._LAYOUTS[id(stale)] = ("mxfp4", {"w13_weight_packed": torch.zeros(1)}, 3)
    assert qe.quantized_views_for(stale) is None
    qe.forget_layouts()
    assert qe._LAYOUTS == {} and qe.quantized_views_for(view) is None


def test_the_quantized_fill_pulls_weights_and_scales_and_counts_their_bytes_apart():
    """E 4 experts over 2 ranks (epn 2), rank 1; slots copy experts [3, -1, 0]: 3 is rank 1's own, 0 rank 0's.
    Per row: w13 packed 4 x 8 uint8 = 32 B, w13 scale 4 x 2 fp32 = 32 B, w2 packed 8 x 2 = 16 B, w2 scale_inv
    8 x 1 fp32 = 32 B: weights 48 B and scales 64 B a row."""
    E, B = 4, 3
    views = {"w13_weight_packed": torch.zeros(E + B, 4, 8, dtype=torch.uint8),
             "w13_weight_scale": torch.zeros(E + B, 4, 2), "w2_weight_packed": torch.zeros(E + B, 8, 2,
                                                                                           dtype=torch.uint8),
             "w2_weight_scale_inv": torch.zeros(E + B, 8, 1)}
    for e in range(E):
        for v in views.values():
            v[e] = e + 1
    out = qe.prefetch_quantized(views, [3, -1, 0], E, 1, 2)
    assert {k: v for k, v in out.items() if k != "event"} == {
        "bytes_by_expert": {3: 112, 0: 112}, "weight_bytes": 96, "scale_bytes": 128,
        "remote_weight_bytes": 48, "remote_scale_bytes": 64}
    w_event, s_event = out["event"]
    wait_for_slots(w_event)                                             # the weights' copies only
    assert views["w13_weight_packed"][E].unique().tolist() == [4]
    assert views["w2_weight_packed"][E + 2].unique().tolist() == [1]
    wait_for_slots(s_event)
    assert views["w13_weight_scale"][E].unique().tolist() == [4.0]
    assert views["w2_weight_scale_inv"][E + 2].unique().tolist() == [1.0]
    assert views["w13_weight_packed"][E + 1].unique().tolist() == [0]   # the unused slot untouched
    # rank 0 filling experts [3, 1, 2]: 2 and 3 are rank 1's (remote), 1 its own; expert 0 is not copied
    views0 = {n: v.clone() for n, v in views.items()}
    out0 = qe.prefetch_quantized(views0, [3, 1, 2], E, 0, 2)
    assert {k: v for k, v in out0.items() if k != "event"} == {
        "bytes_by_expert": {3: 112, 1: 112, 2: 112}, "weight_bytes": 144, "scale_bytes": 192,
        "remote_weight_bytes": 96, "remote_scale_bytes": 128}
    wait_for_slots(out0["event"])
    assert [views0["w2_weight_scale_inv"][E + b].unique().tolist() for b in range(B)] == [[4.0], [2.0], [3.0]]

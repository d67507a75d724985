"""The push API (MoonEP's release) through vLLM 0.33.0's modular kernel, kernel tier (CPU, gloo ranks).

``python -m tests.support.push_kernel_check`` in the ``vllm==0.33.0`` environment
builds vLLM's own MoE layers twice over the plugin's sharded store, pull
(vLLM's ``MoonEPPrepareAndFinalize``, ``[E+B]``) and push
(``MOONEP_EP_MOONEP_API=push``: ``prepare_finalize/push.py``'s prepare/finalize, the
release-contract ``PushReferenceBuffer``, ``[2*epn]`` views), and runs both on
the same skewed routing (docs/design/vllm_prepare_finalize.md, "Push API path").
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ranks", [2, 4])
def test_push_path_equals_pull_and_dense_with_remote_fills(ranks, report):
    out = run_json("vllm", ["-m", "tests.support.push_kernel_check", "--ranks", str(ranks), "--json"], timeout=280)
    assert out["ok"], out["failed"]
    E, H, I = out["case"]["experts"], out["case"]["hidden"], out["case"]["intermediate"]
    epn = E // ranks
    for r in out["ranks"]:
        assert r["buffers"] == {"pull": "ReferenceBuffer", "push": "PushReferenceBuffer"}
        assert r["push_store_slots"] == epn  # the release has E/R slots, not vLLM's B=4
        assert r["push_view_shapes"] == [[2 * epn, I, H], [2 * epn, I, H], [2 * epn, H, I]]
        assert r["push_w13_is_compute_view"] and r["own_rows_ok"]
        for layer in r["layers"]:
            assert layer["push_pf_class"] == "MoonEPPushPrepareAndFinalize"
            assert layer["pull_pf_class"] == "MoonEPPrepareAndFinalize"
            assert (layer["push_groups"], layer["pull_groups"]) == (2 * epn, E + 4)  # cu_seqlens [2*epn] vs [E+B]
            assert layer["push_capacity"] == 128  # vLLM's pool: the smallest power of two >= 128 tokens
            assert layer["within_tolerance"] and layer["push_equals_pull"], layer
            assert layer["push_trace"] == ["own", "waited", "slots"]
            assert layer["slot_contents_ok"] is (True if layer["push_slots"] else None)
            # the push is counted at the pusher: one [I, H] bf16 gate/up and [H, I] down per pushed expert
            pushed = layer["push_bytes_by_tensor"]
            assert not pushed or set(pushed.values()) <= {n * I * H * 2 for n in range(1, epn + 1)}
    fills = [(r["rank"], l["layer"], b, e, o) for r in out["ranks"] for l in r["layers"] for b, e, o in l["push_slots"]]
    assert any(o != rank for rank, _, _, _, o in fills)
    # every slot filled on a receiver was pushed by its owner in the same layer: bytes appear at the owner
    for rank, l, _, e, owner in fills:
        assert out["ranks"][owner]["layers"][l]["push_bytes_by_tensor"]["gate"] >= I * H * 2
        assert e // epn == owner
    # the control: skipping the push on every rank with poisoned slots puts NaN in an output exactly where a
    # slot was used (verdict checks every layer)
    assert any(c["has_nan"] for r in out["ranks"] for c in r["control"])
    report(f"[push kernel tier, {ranks} ranks] fills (rank, layer, slot, expert, owner): {fills}; "
           f"push == pull bit for bit, max |push - dense fp32| = "
           f"{max(l['max_abs_err'] for r in out['ranks'] for l in r['layers']):.4f}")


def test_push_verdict_fails_when_any_check_fails():
    """Positive control of push_kernel_check's verdict."""
    from tests.support.push_kernel_check import verdict

    def rank(r: int, slots: list) -> dict:
        layer = {"push_pf_class": "MoonEPPushPrepareAndFinalize", "pull_pf_class": "MoonEPPrepareAndFinalize",
                 "push_groups": 4, "push_trace": ["own", "waited", "slots"], "within_tolerance": True,
                 "push_equals_pull": True, "slot_contents_ok": True if slots else None, "push_slots": slots}
        return {"rank": r, "buffers": {"pull": "ReferenceBuffer", "push": "PushReferenceBuffer"},
                "push_store_slots": 2, "push_w13_is_compute_view": True,
                "push_view_shapes": [[4, 128, 256], [4, 128, 256], [4, 256, 128]], "own_rows_ok": True,
                "layers": [layer], "control": [{"layer": 0, "has_nan": bool(slots), "slots_used": bool(slots)}]}

    good = [rank(0, [[0, 3, 1]]), rank(1, [])]
    assert verdict(good, 2) == []
    differs = [rank(0, [[0, 3, 1]]), rank(1, [])]
    differs[1]["layers"][0]["push_equals_pull"] = False
    assert verdict(differs, 2) == ["rank 1: push output equals pull output"]
    unwaited = [rank(0, [[0, 3, 1]]), rank(1, [])]
    unwaited[0]["layers"][0]["push_trace"] = ["own", "slots"]
    assert verdict(unwaited, 2) == ["rank 0: the experts computed the own groups, waited on the push's event, "
                                    "then the slot groups"]
    local = [rank(0, [[0, 1, 0]]), rank(1, [])]
    assert verdict(local, 2) == ["no slot was filled from a remote owner through the push"]
    blind = [rank(0, [[0, 3, 1]]), rank(1, [])]
    blind[0]["control"][0]["has_nan"] = False
    assert verdict(blind, 2) == ["control layer 0: slots used True but NaN reached an output False"]

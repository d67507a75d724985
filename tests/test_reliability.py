"""Reliability of the symmetric-memory path: collective fall-backs, peer loss, leaks,
fd-exchange security (issue: reliability and security)."""

from __future__ import annotations

import pytest

import mp_scenarios as sc
from moonep_ep.launch import run_ranks

pytestmark = pytest.mark.slow


def test_fabric_refused_on_one_rank_falls_back_to_posix_fds_on_every_rank():
    results = run_ranks(sc.cuda_fabric_fallback, 2, args=(1, "cuMemCreate", 1))
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["handle_type"] == "fd" and "fell back to POSIX fds" in res["reason"]
        assert "[1]" in res["reason"]                          # names the refusing rank
        # First attempt asked for fabric on every rank; the retry for POSIX fds only.
        assert "FABRIC" in res["creates"][0] and "POSIX" in res["creates"][-1]
        assert all(v == 0 for v in res["live"].values()), res["live"]


def test_fabric_refused_for_good_fails_every_rank_without_leaks():
    # NOT_PERMITTED on the fd export too: nothing left to fall back to.
    results = run_ranks(sc.cuda_fabric_fallback, 2, args=(0, "cuMemExportToShareableHandle", 5))
    for res in results:
        assert "error" in res and "NOT_PERMITTED" in res["error"] and "rank 0" in res["error"]
        assert all(v == 0 for v in res["live"].values()), res["live"]


@pytest.mark.parametrize("point", sc.KILL_POINTS)
def test_sigkilled_rank_makes_every_survivor_raise_in_bounded_time_without_leaks(point):
    from moonep_ep.launch import RankFailure

    timeout = 10.0
    with pytest.raises(RankFailure) as info:
        run_ranks(sc.killed_peer, 3, args=(point, 1), env={"MOONEP_EP_TIMEOUT_S": str(timeout)},
                  group_timeout_s=timeout, timeout_s=120)
    failure = info.value
    assert set(failure.errors) == {1} and "-9" in failure.errors[1]  # the victim, SIGKILLed
    for rank in (0, 2):
        res = failure.results[rank]
        assert res["error"], (point, rank, res)
        assert "lost contact with a peer" in res["error"] or "rank 1" in res["error"], res["error"]
        assert f"[rank {rank}]" in res["error"]
        assert res["seconds_to_error"] <= 2 * timeout + 5, res
        assert res["leaks"] == {}, (point, rank, res["leaks"])


def test_fd_exchange_rejects_foreign_sender_sweeps_stale_dirs_and_hands_out_sealed_cloexec_fds():
    r0, r1 = run_ranks(sc.exchange_security, 2)
    assert r0["dir_mode"] == "0o700" and r0["fresh_dir"]
    assert r0["foreign"] in ("sent", "cut off")          # it connected (and sent, unless cut off)
    assert len(r1["rejected"]) == 1 and "not a member" in r1["rejected"][0]
    for res in (r0, r1):
        assert res["peer_inode_ok"]                      # the member's fd, not the foreign one
        assert res["cloexec"] and res["sealed"] and res["dir_removed"]
    assert r0["stale_swept"] and r0["live_kept"]         # dead run's directory gone, live run's kept


def test_cuda_multicast_bind_not_ready_is_retried_then_fails_collectively():
    ok = run_ranks(sc.cuda_bind_retry, 2, args=(2,))
    for res in ok:
        assert "error" not in res and res["multicast"]
        assert all(v == 0 for v in res["live"].values())
    assert ok[1]["binds"] == 3 and ok[0]["binds"] == 1   # rank 1 retried twice, rank 0 bound once
    failed = run_ranks(sc.cuda_bind_retry, 2, args=(100,))
    for res in failed:
        assert "SYSTEM_NOT_READY" in res["error"] and "rank 1" in res["error"]
        assert all(v == 0 for v in res["live"].values()), res["live"]
        names = res["calls"]
        # A member that did bind unbinds before its memory is released.
        if "cuMulticastUnbind" in names:
            assert names.index("cuMulticastUnbind") < len(names) - names[::-1].index("cuMemRelease") - 1


BAD_INPUTS = {
    "alloc_negative_size": ("rank 1", "chunk sizes must be >= 0"),
    "alloc_disagree_handle_type": ("disagree on MOONEP_EP_HANDLE_TYPE", "Fix"),
    "alloc_disagree_granularity": ("different granularities", "MOONEP_EP_HOST_GRANULARITY"),
    "tensor_too_big": ("does not fit", "Fix"),
    "load_wrong_dtype": ("rank 1", "wrong dtype"),
    "load_wrong_shape": ("rank 0", "wrong shape"),
    "load_layer_wrong_shape": ("rank 1", "wrong shape"),
    "view_unknown_layer": ("rank 0", "layers are 0..1"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_on_every_rank_with_rank_value_and_fix(case):
    needles = BAD_INPUTS[case]
    for rank, res in enumerate(run_ranks(sc.bad_input, 2, args=(case,), timeout_s=120)):
        assert res["raised"] in ("CollectiveError", "ConfigError"), (case, rank, res)
        for needle in needles:
            assert needle in res["message"], (case, rank, res["message"])
        assert "Fix" in res["message"] and f"[rank {rank}]" in res["message"]
        assert res["leaks"] == {}, (case, rank, res["leaks"])


@pytest.mark.timeout(1500)
def test_selftest_soak_200_cycles_leaks_nothing():
    from clitools import moonep_ep_json

    out = moonep_ep_json("selftest", "--ranks", "4", "--driver", "host", "--cycles", "200", timeout=1200)
    assert out["ok"] and out["cycles"] == 200
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0 and out["leaked_shm_bytes"] == 0
    assert out["rss_growth_bytes"] < 1 << 20

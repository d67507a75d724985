"""The pure decisions of a group's set-up: the NVLink-domain check (memory/domain.py) and the handle vote
(memory/exchange.py), each against hand-worked expected values."""

from __future__ import annotations

from typing import Any

import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.memory.domain import check_domain, placement, refusal
from moonep_ep.memory.driver import HandleType
from moonep_ep.memory.exchange import vote


def _peer(host: str, clique: str = "", *, fd: bool = True, fabric: bool = True, multicast: bool = True,
          device: str | None = None, driver: str = "cuda", prefs: tuple = (None, None)) -> dict[str, Any]:
    return {"host": host, "clique": clique, "fd": fd, "fabric": fabric, "multicast": multicast,
            "device": device or f"GPU-{host}-{clique}", "driver": driver, "prefs": prefs}


def test_placement_groups_ranks_by_host_and_clique_in_spans():
    peers = [_peer("a", "X"), _peer("a", "X"), _peer("a", "X"), _peer("b", "Y"), _peer("a", "X"), _peer("b", "")]
    assert placement(peers) == ("rank(s) 0-2,4 on host a (clique X); rank(s) 3 on host b (clique Y); "
                                "rank(s) 5 on host b (clique unknown)")
    # More than 12 groups: the first 12 and a count.
    many = [_peer(f"h{r}", "c") for r in range(14)]
    assert placement(many).endswith("rank(s) 11 on host h11 (clique c); ... 2 more group(s)")
    assert placement(many).count("on host") == 12
    # Exactly 12 groups: all named, no count; 13: one more.
    assert "more group" not in placement(many[:12]) and placement(many[:12]).endswith("rank(s) 11 on host h11 (clique c)")
    assert placement(many[:13]).endswith("; ... 1 more group(s)")


def test_one_host_needs_no_clique_and_several_hosts_need_one():
    # One host: never refused, never a trial, whatever the cliques say.
    assert check_domain([_peer("a", "X"), _peer("a", "Y")], 0) is False
    assert check_domain([_peer("a", "")], 0) is False
    # Two hosts, one clique reported by all: no trial. One clique with an unknown rank: the trial decides.
    assert check_domain([_peer("a", "X"), _peer("b", "X")], 0) is False
    assert check_domain([_peer("a", "X"), _peer("b", "")], 1) is True
    assert check_domain([_peer("a", ""), _peer("b", "")], 1) is True
    with pytest.raises(ConfigError) as info:
        check_domain([_peer("a", "X"), _peer("b", "Y")], 1)
    assert str(info.value).startswith("[rank 1] ranks on several hosts are not all in one NVLink clique")
    assert "rank(s) 0 on host a (clique X); rank(s) 1 on host b (clique Y)" in str(info.value)


def test_a_failed_fabric_trial_names_the_first_failing_rank():
    peers = [_peer("a"), _peer("b"), _peer("c")]
    err = refusal(peers, {2: "CUDA_ERROR_INVALID_HANDLE\nmore", 1: "boom"}, 0)
    msg = str(err)
    assert msg.startswith("[rank 0] ranks on several hosts could not share fabric memory")
    assert "the trial failed on rank(s) [1, 2], e.g. rank 1: boom." in msg
    # The first line of the failure, cut at 300 characters.
    long = refusal(peers, {0: "x" * 400}, 0)
    assert "e.g. rank 0: " + "x" * 300 + ". Fix:" in str(long)


@pytest.mark.parametrize("hosts, fd, fabric, expect, fallback, verify", [
    # auto on one host, every rank fabric and fd: fabric with a collective fall-back to fds.
    (["a", "a"], [True, True], [True, True], HandleType.FABRIC, HandleType.POSIX_FD, False),
    # one rank without fabric on one host: fds, no fall-back.
    (["a", "a"], [True, True], [True, False], HandleType.POSIX_FD, None, False),
    # two hosts, cliques unknown: fabric, proven by a trial.
    (["a", "b"], [True, True], [True, True], HandleType.FABRIC, None, True),
])
def test_the_auto_vote(hosts, fd, fabric, expect, fallback, verify):
    peers = [_peer(h, fd=f, fabric=fb, device=f"GPU-{i}") for i, (h, f, fb) in enumerate(zip(hosts, fd, fabric))]
    d = vote(peers, 0)
    assert (d.handle_type, d.fallback, d.verify_domain, d.multicast) == (expect, fallback, verify, True)


def test_the_vote_refuses_what_no_rank_can_honour_on_every_rank():
    with pytest.raises(ConfigError, match=r"^\[rank 1\] FABRIC handles needed \(ranks span several hosts\) "
                                          r"but rank\(s\) \[1\] lack fabric support"):
        vote([_peer("a", "X"), _peer("b", "X", fabric=False)], 1)
    forced = ("fabric", None)
    with pytest.raises(ConfigError, match=r"forced by MOONEP_EP_HANDLE_TYPE=fabric\) but rank\(s\) \[0\]"):
        vote([_peer("a", fabric=False, prefs=forced), _peer("a", prefs=forced)], 0)
    with pytest.raises(ConfigError, match=r"^\[rank 0\] rank\(s\) \[1\] cannot export POSIX fds"):
        vote([_peer("a", fabric=False), _peer("a", fd=False, fabric=False)], 0)
    fd = ("fd", None)
    with pytest.raises(ConfigError, match=r"POSIX fds cannot cross hosts \(\['a', 'b'\]\)"):
        vote([_peer("a", prefs=fd), _peer("b", prefs=fd)], 0)
    with pytest.raises(ConfigError, match="ranks disagree on MOONEP_EP_HANDLE_TYPE"):
        vote([_peer("a", prefs=fd), _peer("a", prefs=(None, None))], 0)
    d = vote([_peer("a", prefs=fd, device="g0"), _peer("a", prefs=fd, device="g1")], 0)
    assert (d.handle_type, d.reason, d.fallback) == (HandleType.POSIX_FD, "forced", None)
    d = vote([_peer("a", prefs=forced, device="g0"), _peer("a", prefs=forced, device="g1")], 0)
    assert (d.handle_type, d.reason, d.fallback) == (HandleType.FABRIC, "forced", None)


def test_multicast_needs_every_rank_and_one_gpu_per_rank():
    two = [_peer("a", device="g0"), _peer("a", device="g1")]
    d = vote(two, 0)
    assert d.multicast is True and d.reason == "all ranks support fabric"
    assert vote(two, 0, want_multicast=False).reason == "all ranks support fabric; multicast off"
    lacking = [_peer("a", device="g0"), _peer("a", device="g1", multicast=False)]
    d = vote(lacking, 0)
    assert d.multicast is False and d.reason == "all ranks support fabric; multicast off (rank(s) [1] lack it)"
    # Two ranks on one GPU (same UUID on one host) cannot form a multicast team; on the host driver they may.
    shared = [_peer("a", device="g0"), _peer("a", device="g0"), _peer("a", device="g1")]
    assert vote(shared, 0).reason == "all ranks support fabric; multicast off (rank(s) [0, 1] lack it)"
    host = [_peer("a", device="g0", driver="host"), _peer("a", device="g0", driver="host")]
    assert vote(host, 0).multicast is True
    on = (None, "on")
    with pytest.raises(ConfigError, match=r"MOONEP_EP_MULTICAST=on but rank\(s\) \[1\] lack multicast"):
        vote([_peer("a", device="g0", prefs=on), _peer("a", device="g1", multicast=False, prefs=on)], 0)
    off = (None, "off")
    assert vote([_peer("a", device="g0", prefs=off), _peer("a", device="g1", prefs=off)], 0).multicast is False


def test_local_vote_carries_host_clique_capabilities_device_and_raw_settings(monkeypatch):
    from moonep_ep.memory.driver import Capabilities
    from moonep_ep.memory.exchange import local_vote

    monkeypatch.setenv("MOONEP_EP_HANDLE_TYPE", "fd")
    monkeypatch.delenv("MOONEP_EP_MULTICAST", raising=False)
    caps = Capabilities(driver="cuda", available=True, posix_fd=True, fabric=False, multicast=True,
                        device="cuda:0", device_id="GPU-1234", host="", clique="c/7", multicast_clique="m/3")
    assert local_vote(caps, "node-a") == {"host": "node-a", "clique": "c/7", "mc_clique": "m/3", "fd": True,
                                          "fabric": False,
                                          "multicast": True, "device": "GPU-1234", "driver": "cuda",
                                          "prefs": ("fd", "")}   # unset: the empty text
    # The emulator names its own host; a driver without a stable id falls back to its device name.
    emulated = Capabilities(driver="host", available=True, device="cpu:3", host="emu-host-1")
    v = local_vote(emulated, "node-a")
    assert (v["host"], v["device"], v["fd"], v["clique"]) == ("emu-host-1", "cpu:3", False, "")


def test_every_refusal_and_reason_of_the_vote_word_for_word():
    def refused(peers, rank=0):
        with pytest.raises(ConfigError) as info:
            vote(peers, rank)
        return str(info.value)

    assert refused([_peer("a", "X"), _peer("b", "X", fabric=False)], 1) == (
        "[rank 1] FABRIC handles needed (ranks span several hosts) but rank(s) [1] lack fabric support. Fix: run "
        "all ranks on one host with MOONEP_EP_HANDLE_TYPE=fd, or enable IMEX channels on every node")
    assert refused([_peer("a", fabric=False), _peer("a", fd=False, fabric=False)]) == (
        "[rank 0] rank(s) [1] cannot export POSIX fds. Fix: MOONEP_EP_HANDLE_TYPE=fabric on hardware that "
        "supports it")
    fd = ("fd", None)
    assert refused([_peer("a", prefs=fd), _peer("b", prefs=fd)]) == (
        "[rank 0] POSIX fds cannot cross hosts (['a', 'b']). Fix: MOONEP_EP_HANDLE_TYPE=fabric on an NVLink/IMEX "
        "domain, or keep the EP group on one host")
    on = (None, "on")
    assert refused([_peer("a", device="g0", prefs=on), _peer("a", device="g1", multicast=False, prefs=on)]) == (
        "[rank 0] MOONEP_EP_MULTICAST=on but rank(s) [1] lack multicast. Fix: MOONEP_EP_MULTICAST=auto or off, "
        "or run on NVSwitch GPUs with Fabric Manager")
    # The domain check speaks for the voting rank.
    assert refused([_peer("a", "X"), _peer("b", "Y")], 3).startswith(
        "[rank 3] ranks on several hosts are not all in one NVLink clique")
    # Reasons.
    assert vote([_peer("a", "X", device="g0"), _peer("b", "X", device="g1")], 0).reason == "ranks span hosts"
    one_host_fd = vote([_peer("a", fabric=False, device="g0"), _peer("a", fabric=False, device="g1")], 0)
    assert (one_host_fd.handle_type, one_host_fd.reason) == (HandleType.POSIX_FD, "all ranks on one host")
    # A group of one rank votes alone.
    alone = vote([_peer("a", fabric=False, device="g0")], 0)
    assert (alone.handle_type, alone.multicast, alone.reason) == (HandleType.POSIX_FD, True, "all ranks on one host")
    assert vote([_peer("a", device="g0", driver="host")], 0).multicast is True


def test_multicast_stays_inside_one_multicast_clique_across_hosts():
    """Ranks on two hosts of one NVLink clique (X) whose multicast cliques differ: the ranks outside the first known
    one (rank 0's, else the first reported) lack multicast; an unreported one ("" or absent) is not judged; on one
    host the labels are not compared."""
    hosts = ["a", "a", "b", "b"]

    def group(cliques, prefs=(None, None)):
        peers = [_peer(h, "X", device=f"g{r}", prefs=prefs) for r, h in enumerate(hosts)]
        for p, c in zip(peers, cliques):
            if c is not None:
                p["mc_clique"] = c
        return peers

    for cliques, lacking in ((["A", "A", "B", "B"], [2, 3]), (["A", "B", "A", "B"], [1, 3]),
                             (["", "A", "B", "B"], [2, 3]), ([None, "A", "B", "A"], [2])):
        d = vote(group(cliques), 0)
        assert (d.multicast, d.reason) == (False, f"ranks span hosts; multicast off (rank(s) {lacking} lack it)")
    for cliques in (["A"] * 4, ["", "A", None, "A"], [None] * 4):   # one clique, or none reported
        d = vote(group(cliques), 0)
        assert (d.multicast, d.reason, d.multicast_forced) == (True, "ranks span hosts", False)
    one_host = [_peer("a", device="g0"), _peer("a", device="g1")]
    one_host[0]["mc_clique"], one_host[1]["mc_clique"] = "A", "B"
    assert vote(one_host, 0).multicast is True
    with pytest.raises(ConfigError) as info:
        vote(group(["A", "A", "B", "B"], prefs=(None, "on")), 1)
    assert str(info.value) == ("[rank 1] MOONEP_EP_MULTICAST=on but rank(s) [2, 3] lack multicast. Fix: "
                               "MOONEP_EP_MULTICAST=auto or off, or run on NVSwitch GPUs with Fabric Manager")
    forced = vote(group(["A"] * 4, prefs=(None, "on")), 0)
    assert (forced.multicast, forced.multicast_forced) == (True, True)

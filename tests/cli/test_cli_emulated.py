"""The moonep-ep commands with ``--driver cuda`` over the CUDA driver emulator
(``MOONEP_EP_CUDA_EMULATOR=1``): the CUDA driver's code, run as a user runs it, on CPU."""

from __future__ import annotations

import pytest

from tests.support.cli import moonep_ep, moonep_ep_json

MiB = 1 << 20


@pytest.fixture
def emulator(monkeypatch):
    """Subprocesses inherit the environment: the CUDA driver runs over the emulator of an 8xH100 node."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "1")
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "H100x8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]


def test_selftest_four_ranks_cuda_over_the_emulator(emulator):
    out = moonep_ep_json("selftest", "--ranks", "4", "--driver", "cuda")
    assert out["ok"] is True and out["driver"] == "cuda" and out["emulated"] is True
    # Leak figures are the emulator's own live handles and mappings+reservations, not memfds.
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0 and out["leaked_device_bytes"] == 0
    assert "CUDA emulator" in out["leak_measure"]
    # Physical bytes per rank from the driver's handles: 4 MiB chunks, odd ranks one 2 MiB page more.
    assert out["physical_bytes_per_rank"] == [4 * MiB + (r % 2) * 2 * MiB for r in range(4)]
    assert out["visible_bytes_per_rank"] == [sum(out["physical_bytes_per_rank"])] * 4
    # Multicast through multimem.st reached every member (4 distinct GPUs by UUID).
    assert out["multicast"]["used"] and out["multicast"]["members_updated"] == 4
    # The default node has no IMEX channel: the fabric trial failed, every rank fell back to fds.
    assert out["handle_type"] == "fd" and "fabric trial" in out["multicast"]["reason"]
    assert out["rss_growth_bytes"] is None and "warm-up" in out["rss_growth_note"]


@pytest.mark.parametrize("leak,field,per_rank", [("handle", "leaked_fds", 1), ("mapping", "leaked_mappings", 2)])
def test_selftest_leak_counters_report_an_injected_leak_over_the_emulator(emulator, leak, field, per_rank):
    """Positive control: a handle (or a mapping in its reservation) left behind on purpose is counted."""
    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda", "--inject-leak", leak, "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    import json

    out = json.loads(proc.stdout)
    assert out["ok"] is False and out[field] == 2 * per_rank
    assert out["leaked_device_bytes"] == 2 * 2 * MiB  # one 2 MiB allocation per rank
    for rank in ("0", "1"):
        assert out["leaked_below_library"][rank]["handles"] == 1
        assert out["leaked_driver_objects"][rank]["context"] == 1  # a driver with live objects keeps it


def test_selftest_reports_a_driver_never_closed(emulator):
    """Positive control for finding 9: the context retain of an unclosed CudaDriver is reported."""
    import json

    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda", "--inject-leak", "context", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["ok"] is False
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0
    assert all(out["leaked_below_library"][r]["contexts"] == 1 for r in ("0", "1"))


def test_footprint_measure_over_the_emulator_matches_the_prediction(emulator):
    out = moonep_ep_json("footprint", "--measure", "--ranks", "4", "--model", "tiny", "--layers", "8",
                         "--driver", "cuda")
    assert out["ok"] and out["driver"] == "cuda" and out["emulated"]
    assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"]
    assert all(r["measured_bytes"] > 0 and r["emulated"] for r in out["per_rank"])
    # Which measure: the store's own handles; cross-checked device-wide (cuMemGetInfo, every process on
    # the GPU, after warm-up) and by the emulator's own count of what was created, both exact here.
    assert out["measure"] == "the store's own cuMemCreate handles' sizes" and "cuMemGetInfo" in out["device_wide_measure"]
    assert out["device_wide_drift_bytes_per_rank"] == [0] * 4
    assert [r["emulator_created_bytes"] for r in out["per_rank"]] == out["predicted_bytes_per_rank"]


@pytest.mark.parametrize("node,drift,ok", [("H100x8", [2 * MiB] * 2, False), ("H100x8,lazy=0", [0, 0], True)])
def test_footprint_measure_without_the_warm_up_counts_the_lazy_load_control(monkeypatch, emulator, node, drift, ok):
    """Negative control of footprint's warm-up: read before any kernel ran, every rank's device-wide figure
    grows by the store's first fill (torch's fill kernel lazily loaded: the emulator's stated 2 MiB, ``lazy=``)
    and the measure fails. With ``lazy=0`` the same reading is flat: the failure is the lazy load's. The store's
    own bytes still equal the prediction either way."""
    import json

    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", node)
    proc = moonep_ep("footprint", "--measure", "--ranks", "2", "--model", "tiny", "--layers", "2", "--driver", "cuda",
                     "--skip-warm-up", "--json")
    out = json.loads(proc.stdout)
    assert out["device_wide_drift_bytes_per_rank"] == drift and out["ok"] is ok and proc.returncode == (0 if ok else 1)
    assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"]


def test_bench_prefetch_over_the_emulator(emulator):
    # 3 trials a side: the ratio compares each side's fastest, which one preempted trial cannot push out
    out = moonep_ep_json("bench", "prefetch", "--ranks", "2", "--reps", "3", "--driver", "cuda", timeout=400)
    assert out["ok"] and out["driver"] == "cuda" and out["emulated"] and out["backend"] == "gloo"
    for row in out["sizes"]:
        # Every trial pulls both slots' worth of a peer's rows, all three projections (bf16).
        assert row["bytes_per_trial"] == [out["experts_per_rank"] * 3 * row["H"] * row["I"] * 2] * 2, row
        # Both sides are CPU memcpy over the emulator: neither can be free nor beyond a machine's DRAM.
        assert all(0 < v < 1000 for v in row["remote_gbps"] + row["local_gbps"]), row
        assert all(0.05 < v < 20 for v in row["remote_over_local"]), row


def test_check_names_a_driver_older_than_the_bindings_and_the_fix(monkeypatch, emulator):
    """Finding 7: a driver one CUDA major older than the installed bindings (R570, CUDA 12.8,
    under cuda-bindings 13.x)."""
    from cuda.bindings import driver

    from moonep_ep.memory.cuda_calls import bindings_fix

    major = int(driver.CUDA_VERSION) // 1000
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", f"H100x8,cuda={major - 1}.8")
    report = moonep_ep_json("check")
    cuda = report["cuda"]
    assert cuda["emulated"] and not cuda["available"]
    assert cuda["versions"]["driver_cuda"] == f"{major - 1}.8" and cuda["versions"]["bindings_cuda_major"] == major
    assert cuda["versions"]["compatible"] is False
    assert bindings_fix(major - 1) in cuda["reasons"]["versions"]
    text = moonep_ep("check").stdout
    assert f"driver CUDA {major - 1}.8 / bindings {major}.x" in text and bindings_fix(major - 1) in text


def test_check_over_the_emulator_reports_the_gpu_by_uuid(emulator):
    cuda = moonep_ep_json("check")["cuda"]
    assert cuda["available"] and cuda["emulated"] and cuda["device_id"].startswith("GPU-")
    assert cuda["versions"]["compatible"] is True and cuda["granularity"] == 2 * MiB


@pytest.mark.parametrize("imex,handle_type,why", [("channel", "fd", "CUDA_ERROR_INVALID_HANDLE"),
                                                  ("domain", "fabric", "all ranks support fabric")])
def test_selftest_fabric_trial_per_imex_mode(monkeypatch, emulator, imex, handle_type, why):
    """Finding 4: an IMEX channel without a domain (x86 HGX, no IMEX daemon) fails a peer's import with a
    code the old NOT_PERMITTED/NOT_SUPPORTED fall-back did not know; the trial falls back on any failure.
    With an IMEX domain, fabric handles are used."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", f"H200x4,imex={imex}")
    out = moonep_ep_json("selftest", "--ranks", "2", "--driver", "cuda")
    assert out["ok"] and out["handle_type"] == handle_type and why in out["multicast"]["reason"]
    if imex == "channel":  # the trial (a peer's import) decided, not the allocation's own fall-back
        assert "fabric failed in the fabric trial on rank(s) [0, 1]" in out["multicast"]["reason"]


def test_selftest_keeps_fabric_on_a_node_whose_fabric_granularity_is_larger(monkeypatch, emulator):
    """FABRIC memory's granularity (4 MiB here) differs from POSIX fds' (2 MiB): chunks are planned with
    the voted handle type's granularity, so fabric stays in use (no silent fall-back to fds), and a
    2 MiB chunk becomes one 4 MiB page."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "H100x2,imex=domain,fabric_min=4MiB,fabric_rec=4MiB")
    out = moonep_ep_json("selftest", "--ranks", "2", "--driver", "cuda", "--chunk-mib", "2")
    assert out["ok"] and out["handle_type"] == "fabric", out["multicast"]["reason"]
    assert "fell back" not in out["multicast"]["reason"]
    assert out["physical_bytes_per_rank"] == [4 * MiB, 8 * MiB]


def test_selftest_eight_ranks_on_two_hosts_of_an_nvl72_domain_over_fabric(monkeypatch, emulator):
    """A 72-GPU, 18-host emulated GB200 NVL72 domain: 8 ranks fill hosts 0 and 1 (4 GPUs each), the vote
    picks FABRIC because the ranks span hosts (POSIX fds cannot), both hosts report one NVLink clique,
    multicast reaches all 8 GPUs, and nothing leaks on any rank."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "GB200x72,hosts=18,imex=domain,cuda=13.4")
    out = moonep_ep_json("selftest", "--ranks", "8", "--driver", "cuda", "--chunk-mib", "2")
    assert out["ok"] is True and out["emulated"] is True and out["errors"] == []
    assert out["host_per_rank"] == ["node0-host0"] * 4 + ["node0-host1"] * 4
    assert out["handle_type"] == "fabric" and out["multicast"]["reason"].startswith("ranks span hosts")
    assert out["multicast"]["used"] and out["multicast"]["members_updated"] == 8
    assert (out["leaked_fds"], out["leaked_mappings"], out["leaked_device_bytes"]) == (0, 0, 0)
    assert out["leaked_below_library"] == {} and out["leaked_driver_objects"] == {} and out["leaked_shm_bytes"] == 0


BIND_FULL = "H100x8,mc_fail=bind:MULTICAST_RESOURCE_FULL"  # every GPU's cuMulticastBindMem answers RESOURCE_FULL


def test_auto_multicast_failure_at_bind_degrades_on_every_rank_and_on_fails_naming_the_fix(monkeypatch, emulator):
    """Issue 27, as a user meets it: a node whose multicast binds fail (MULTICAST_RESOURCE_FULL).

    ``selftest`` is the command whose allocation requests multicast. With ``MOONEP_EP_MULTICAST=auto`` every rank
    allocates without it (one reason, naming the failing rank, the step and the driver's error), the byte checks
    pass and nothing leaks; with ``on`` every rank fails with one error naming the fix. The sharded store requests
    no multicast, so ``demo`` on the same node passes its dense oracle either way (the injected node does not
    reach the store). Control: on the healthy node the same selftest uses multicast (see the first test here)."""
    import json

    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", BIND_FULL)
    monkeypatch.setenv("MOONEP_EP_MULTICAST", "auto")
    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"] is True and out["errors"] == [], out
    reason = out["multicast"]["reason"]
    assert out["multicast"]["used"] is False
    assert "multicast: off (rank 0 failed at 'multicast bind (attempt 1)'" in reason, reason
    assert "CUDA_ERROR_MULTICAST_RESOURCE_FULL" in reason and "rank(s) [0, 1] failed" in reason, reason
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0 and out["leaked_device_bytes"] == 0
    # The warning, once per rank and allocation (a warm-up allocation, then the measured one), on stderr.
    for rank in (0, 1):
        logged = [line for line in proc.stderr.splitlines()
                  if line.startswith(f"[rank {rank}] multicast: off on every rank (MOONEP_EP_MULTICAST=auto)")]
        assert logged and all("CUDA_ERROR_MULTICAST_RESOURCE_FULL" in line for line in logged), proc.stderr

    demo = moonep_ep_json("demo", "--driver", "cuda", "--ranks", "2")
    assert demo["ok"] is True and demo["tokens_over_tolerance"] == 0 and demo["entries_over_tolerance"] == 0

    monkeypatch.setenv("MOONEP_EP_MULTICAST", "on")
    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["ok"] is False and sorted(out["errors"]) == ["0", "1"], out
    for rank, error in out["errors"].items():
        last = error.strip().splitlines()
        assert f"[rank {rank}] collective step 'multicast bind (attempt 1)' failed on rank(s) [0, 1]" in error
        assert "CUDA_ERROR_MULTICAST_RESOURCE_FULL" in error
        assert last[-1].count("Fix: MOONEP_EP_MULTICAST=auto") == 1 and error.count("Fix:") == 1, error

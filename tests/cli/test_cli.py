"""The moonep-ep command as a user runs it (subprocesses, real output)."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.cli import moonep_ep, moonep_ep_json


def test_check_json_reports_host_available_and_cuda_reason():
    report = moonep_ep_json("check")
    assert report["host"]["available"] and report["host"]["vmm"] and report["host"]["multicast"]
    assert report["host"]["reasons"]["fabric"]
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    if not has_gpu:
        assert report["cuda"]["available"] is False
        assert report["cuda"]["reasons"]["driver"]  # says why, e.g. no libcuda
    assert "importable" in report["moonep"] and "version" in report["vllm"]


def test_check_text_exits_zero():
    proc = moonep_ep("check")
    assert proc.returncode == 0 and "host driver" in proc.stdout


@pytest.mark.slow
def test_selftest_four_ranks_host_json():
    out = moonep_ep_json("selftest", "--ranks", "4", "--driver", "host")
    assert out["ok"] is True and out["ranks"] == 4
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0
    gran = 2 << 20
    chunk = 4 << 20
    # Measured by the OS (memfd st_size): each rank only its own (unequal) chunk...
    assert out["physical_bytes_per_rank"] == [chunk + (r % 2) * gran for r in range(4)]
    # ...while every rank sees all four chunks.
    assert out["visible_bytes_per_rank"] == [sum(out["physical_bytes_per_rank"])] * 4
    assert out["multicast"]["used"] and out["multicast"]["members_updated"] == 4


@pytest.mark.parametrize("command", [("selftest",), ("demo",), ("bench", "layout"), ("bench", "prefetch")])
@pytest.mark.parametrize("ranks", ["0", "200"])
def test_rank_counts_beyond_moonep_fail_at_once_with_the_limit_and_the_fix(command, ranks):
    t0 = time.monotonic()
    proc = moonep_ep(*command, "--ranks", ranks)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert f"--ranks {ranks} is outside MoonEP's supported range 1..128" in lines[0]
    assert "Fix: pass --ranks between 1 and 128" in lines[0]
    assert time.monotonic() - t0 < 20  # refused before any rank starts


def test_more_ranks_than_cores_warn_and_report_progress(monkeypatch):
    """Progress is reported every few seconds while ranks start; more ranks than cores warn."""
    from moonep_ep import launch

    monkeypatch.setattr(launch, "PROGRESS_INTERVAL_S", 0.5)
    cores = len(os.sched_getaffinity(0))
    assert any(f"{cores + 1} ranks on {cores} core(s)" in w for w in launch.check_rank_count(cores + 1, "x"))
    assert launch.check_rank_count(1, "x") == [] or "GiB is available" in launch.check_rank_count(1, "x")[0]
    lines: list[str] = []
    launch.run_ranks(_rank_sleeps, 2, progress=lines.append)
    assert lines[0].startswith("started 2 ranks")
    assert any(line.startswith("ranks up: ") and "processes running" in line for line in lines), lines
    assert any(line.startswith("all 2 ranks up after") for line in lines), lines


def _rank_sleeps(ctx) -> int:
    time.sleep(1.0)
    return ctx.rank


def test_selftest_cuda_without_gpu_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the CUDA selftest runs in scripts/gpu_check.sh")
    import os

    env_emulated = os.environ.pop("MOONEP_EP_CUDA_EMULATOR", None)
    try:
        proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda")
    finally:
        if env_emulated is not None:
            os.environ["MOONEP_EP_CUDA_EMULATOR"] = env_emulated
    assert proc.returncode == 2 and "--driver host" in proc.stderr and "MOONEP_EP_CUDA_EMULATOR=1" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("leak,field", [("handle", "leaked_fds"), ("mapping", "leaked_mappings")])
def test_selftest_host_leak_counters_report_an_injected_leak(leak, field):
    """Positive control of the OS-measured counters: a memfd (or its mapping) left behind on purpose."""
    import json

    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "host", "--inject-leak", leak, "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["ok"] is False
    assert out[field] == 2  # one per rank, from /proc/self/fd or /proc/self/maps


@pytest.mark.slow
def test_selftest_rss_growth_is_measured_only_after_the_warm_up():
    one = moonep_ep_json("selftest", "--ranks", "2", "--driver", "host", "--cycles", "1")
    assert one["rss_growth_bytes"] is None and "warm-up" in one["rss_growth_note"]
    three = moonep_ep_json("selftest", "--ranks", "2", "--driver", "host", "--cycles", "3")
    assert isinstance(three["rss_growth_bytes"], int) and "cycle 1" in three["rss_growth_note"]

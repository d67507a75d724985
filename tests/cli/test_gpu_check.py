"""scripts/gpu_check.sh: planned in parts that fit one command of a GPU loan, installing and fetching
nothing, and runnable end to end on CPU over the CUDA driver emulator (MOONEP_EP_CUDA_EMULATOR=1, which
the GPU run never sets)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.vllm_envs import python_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, env: dict[str, str] | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOONEP_EP_CUDA_EMULATOR")}
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_plan_lists_each_parts_steps_and_limits_within_one_command():
    proc = _run("--plan")
    assert proc.returncode == 0, proc.stderr
    parts = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [p["part"] for p in parts] == [1, 2, 3, 4, 5, 6, 7]
    for p in parts:
        assert p["limit_s"] == sum(s["limit_s"] for s in p["steps"]) <= 480, p   # a command gets 600 s at most
        assert f"part {p['part']}: {p['limit_s']} s of limits" in proc.stdout
        for s in p["steps"]:
            assert re.search(rf"^  {s['step']}\s+{s['limit_s']} s ", proc.stdout, re.M), s
    # The first part alone answers the first question: the CUDA path with 0 leaks on the real driver.
    assert {"check", "selftest", "gpu_tests", "footprint"} <= {s["step"] for s in parts[0]["steps"]}
    assert _run("--part", "9").returncode == 2 and _run().returncode == 2


def test_the_script_installs_and_fetches_nothing():
    """What the lent machine lacks (a registry, vLLM) must not be reached for: no pip/uv/make install,
    no downloads, no venv; make only in question mode (-q) to see whether environments are up to date."""
    texts = {p.name: p.read_text() for p in [SCRIPT, *sorted((ROOT / "scripts" / "gpu_checks").iterdir())]}
    forbidden = re.compile(r"pip install|\buv\b|make install|curl |wget |git clone|--index-url|snapshot_download"
                           r"|huggingface-cli|-m venv|\.venv/bin/python -m pytest")
    for name, text in texts.items():
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not forbidden.search(code), (name, forbidden.search(code).group(0))
        # make named in a message or in the plan's text is no command: drop here-documents and strings.
        commands = re.sub(r"<<'(\w+)'\n.*?\n\1\n", "\n", code, flags=re.S)
        commands = re.sub(r'"[^"\n]*"|\'[^\'\n]*\'', '""', commands)
        for make in re.findall(r"\bmake\s+(\S+)", commands):
            assert make == "-q", (name, make)
    assert 'PY="${PYTHON:-python3}"' in texts["gpu_check.sh"] and "PYTHONPATH=" in texts["gpu_check.sh"]


@pytest.mark.cuda_emulated
@pytest.mark.slow
def test_every_part_runs_on_cpu_over_the_emulator_and_ends_in_one_json_line(tmp_path):
    """Parts 1 and 2 on an emulated one-H200 machine (the loan's): every step that can run passes; the
    GPU-marked pytest step says why it cannot run here. Parts 3-5 (vLLM's CUDA engine), 6 and 7 (Triton kernels
    on the GPU) report what they need and "ok": null. Negative control: a driver older than the bindings
    fails part 1."""
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1", "PYTHON": sys.executable,
           "OUT": str(tmp_path)}
    for part in (1, 2):
        proc = _run("--part", str(part), env=env, timeout=480)
        summary = _last_json(proc.stdout)
        assert proc.returncode == 0 and summary["ok"] is True, (proc.stdout[-3000:], proc.stderr[-2000:])
        assert summary["part"] == part and summary["emulated"] is True and summary["gpus"] == 1
        ran = {k: v for k, v in summary["steps"].items() if v != "not_applicable"}
        assert ran and set(ran.values()) == {"passed"}
        assert set(summary["not_applicable"]) == ({"gpu_tests"} if part == 1 else set())
    assert summary["figures"]["perf"]["device"] == "cpu"
    # Both ratios compare each side's fastest trial (tools/bench/timing.py), so load on the other core cannot
    # push them out: both sides are CPU memcpy / matmul over the same DRAM here.
    assert all(0.2 < r < 5 for r in summary["figures"]["perf"]["slot_fill_imported_over_local"])
    assert all(0.2 < r < 5 for r in summary["figures"]["perf"]["ffn_views_over_plain"])
    for part in (3, 4, 5, 6, 7):
        proc = _run("--part", str(part), env=env, timeout=60)
        summary = _last_json(proc.stdout)
        assert proc.returncode == 0 and summary["ok"] is None and summary["failed"] == []
        assert all("GPU" in why for why in summary["not_applicable"].values()), summary
    old = _run("--part", "1", env={**env, "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1,cuda=12.8"}, timeout=480)
    summary = _last_json(old.stdout)
    assert old.returncode == 1 and summary["ok"] is False
    assert {"check", "selftest"} <= {s["step"] for s in summary["failed"]}


def test_plan_states_each_steps_needs_against_the_lent_machine():
    """The lent GPU machine's python3 (3.12) has torch, Triton, numpy, hypothesis, pytest, transformers and
    safetensors, and no vLLM and no compressed-tensors: the plan says up front which steps cannot run
    there and which depend on a module not on that list (cuda-bindings), checked before the step runs."""
    proc = _run("--plan")
    steps = {s["step"]: s for line in proc.stdout.splitlines() if line.startswith("{")
             for s in json.loads(line)["steps"]}
    assert "without compressed_tensors, vllm" in proc.stdout
    assert steps["env"]["lent_machine"] == "runs"
    for name in ("check", "selftest", "footprint", "perf", "ops_demo", "selftest_soak", "gpu_tests"):
        assert "cuda.bindings" in steps[name]["modules"], name
        assert steps[name]["lent_machine"].startswith("runs if python3 has cuda.bindings"), steps[name]
    assert "hypothesis" in steps["gpu_tests"]["modules"]
    assert steps["make_demo"]["lent_machine"] == "cannot run: it has no vllm, compressed_tensors"
    assert all(steps[n]["lent_machine"] == "cannot run: it has no vllm" for n in ("kv_accounting", "serve"))
    # Parts 6 and 7 need nothing the lent machine lacks: one GPU, torch and Triton (no vLLM, no cuda-bindings).
    for name in ("mxfp4_experts", "mxfp4_kernel", "mxfp4_race", "k3_moe_layer"):
        assert steps[name]["modules"] == ["torch", "triton"] and steps[name]["lent_machine"] == "runs", steps[name]
        assert re.search(rf"^  {name}\s+\d+ s  \[gpu\] ", proc.stdout, re.M), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU part 6 runs; this checks what a CPU answers")
def test_a_step_that_finds_a_precondition_missing_itself_is_not_applicable(tmp_path):
    """Part 6 under a python3 that has Triton (the vLLM environment's) but no GPU, without the emulator: the
    script's own checks let the steps run, and each step's module answers {"not_applicable": why}; the part
    reports each step so, with "ok": null and nothing failed."""
    env = {"PYTHON": python_of("vllm"), "OUT": str(tmp_path)}
    proc = _run("--part", "6", env=env, timeout=180)
    summary = _last_json(proc.stdout)
    assert proc.returncode == 0 and summary["ok"] is None and summary["failed"] == [], proc.stdout[-3000:]
    assert summary["not_applicable"] == {name: "torch sees no CUDA GPU"
                                         for name in ("mxfp4_experts", "mxfp4_kernel", "mxfp4_race")}
    # the step ran (its output is kept), unlike a step the script itself found not applicable
    assert json.loads((tmp_path / "mxfp4_race.out").read_text()) == {
        "check": "race", "not_applicable": "torch sees no CUDA GPU", "ok": None}
    # Part 7 (the K3 layer, gpu_k3.py) answers the same way.
    proc = _run("--part", "7", env=env, timeout=120)
    summary = _last_json(proc.stdout)
    assert proc.returncode == 0 and summary["ok"] is None and summary["failed"] == [], proc.stdout[-3000:]
    assert summary["not_applicable"] == {"k3_moe_layer": "torch sees no CUDA GPU"}
    assert json.loads((tmp_path / "k3_moe_layer.out").read_text()) == {
        "check": "k3_moe_layer", "not_applicable": "torch sees no CUDA GPU", "ok": None}

"""scripts/gpu_check.sh: planned in parts that fit one command on a GPU machine, plus one command for a machine
with one GPU within a stated total limit, installing and fetching nothing, and runnable end to end on CPU over
the CUDA driver emulator (MOONEP_EP_CUDA_EMULATOR=1, which the GPU run never sets)."""

from __future__ import annotations

import json
import math
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
    # the emulator's settings are the test's own, except which emulated machine: each pytest worker keeps its
    # own (tests/conftest.py), else two workers' selftests share one emulated GPU and its fabric trial
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("MOONEP_EP_CUDA_EMULATOR") or k == "MOONEP_EP_CUDA_EMULATOR_MACHINE"}
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _plan_lines(stdout: str, key: str) -> list[dict]:
    """--plan's JSON lines that carry ``key`` ("part": one per part; "command": the one-GPU command)."""
    return [obj for obj in (json.loads(line) for line in stdout.splitlines() if line.startswith("{")) if key in obj]


def _failed_steps(summary: dict, out_dir: Path) -> str:
    """Every failed step's whole record and whole output (the step's stdout and stderr kept in OUT), uncut."""
    parts = []
    for step in summary.get("failed", []):
        name = step["step"] if isinstance(step, dict) else step
        parts.append(f"--- {name}: {json.dumps(step) if isinstance(step, dict) else summary['results'][name]}")
        for suffix in ("out", "err"):
            path = out_dir / f"{name}.{suffix}"
            if path.exists():
                parts.append(f"--- {path.name}:\n{path.read_text()}")
    return "\n".join(parts) or "no failed step"


def _one_gpu_table() -> list[tuple[str, int]]:
    """(step, limit_s) of the ONE_GPU table as the script's text holds it."""
    text = SCRIPT.read_text()
    table = re.search(r"^ONE_GPU=\$\(cat <<'EOF'\n(.*?)\nEOF\n", text, re.S | re.M).group(1)
    return [(row.split("|")[0], int(row.split("|")[1])) for row in table.splitlines() if row.strip()]


def test_plan_lists_each_parts_steps_and_limits_within_one_command():
    proc = _run("--plan")
    assert proc.returncode == 0, proc.stderr
    parts = _plan_lines(proc.stdout, "part")
    assert [p["part"] for p in parts] == [1, 2, 3, 4, 5, 6, 7, 8]
    for p in parts:
        assert p["limit_s"] == sum(s["limit_s"] for s in p["steps"]) <= 480, p   # a command gets 600 s at most
        assert f"part {p['part']}: {p['limit_s']} s of limits" in proc.stdout
        for s in p["steps"]:
            assert re.search(rf"^  {s['step']}\s+{s['limit_s']} s ", proc.stdout, re.M), s
    # The first part alone answers the first question: the CUDA path with 0 leaks on the real driver.
    assert {"check", "selftest", "gpu_tests", "footprint"} <= {s["step"] for s in parts[0]["steps"]}
    assert _run("--part", "9").returncode == 2 and _run().returncode == 2


def test_the_script_installs_and_fetches_nothing():
    """What the GPU machine lacks (a registry, vLLM) must not be reached for: no pip/uv/make install,
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
    """Parts 1 and 2 on an emulated machine with one GPU (an H200): every step that can run passes; the
    GPU-marked pytest step says why it cannot run here. Parts 3-5 (vLLM's CUDA engine), 6 and 7 (Triton kernels
    on the GPU) report what they need and "ok": null. Negative control: a driver older than the bindings
    fails part 1."""
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1", "PYTHON": sys.executable,
           "OUT": str(tmp_path)}
    for part in (1, 2):
        proc = _run("--part", str(part), env=env, timeout=480)
        summary = _last_json(proc.stdout)
        assert proc.returncode == 0 and summary["ok"] is True, (_failed_steps(summary, tmp_path), proc.stderr)
        assert summary["part"] == part and summary["emulated"] is True and summary["gpus"] == 1
        ran = {k: v for k, v in summary["steps"].items() if v != "not_applicable"}
        assert ran and set(ran.values()) == {"passed"}
        assert set(summary["not_applicable"]) == ({"gpu_tests"} if part == 1 else set())
    assert summary["figures"]["perf"]["device"] == "cpu"
    # Both ratios compare each side's fastest trial (tools/bench/timing.py), so load on the other core cannot
    # push them out: both sides are CPU memcpy / matmul over the same DRAM here.
    assert all(0.2 < r < 5 for r in summary["figures"]["perf"]["slot_fill_imported_over_local"])
    assert all(0.2 < r < 5 for r in summary["figures"]["perf"]["ffn_views_over_plain"])
    for part in (3, 4, 5, 6, 7, 8):
        proc = _run("--part", str(part), env=env, timeout=60)
        summary = _last_json(proc.stdout)
        assert proc.returncode == 0 and summary["ok"] is None and summary["failed"] == []
        assert all("GPU" in why for why in summary["not_applicable"].values()), summary
    old = _run("--part", "1", env={**env, "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1,cuda=12.8"}, timeout=480)
    summary = _last_json(old.stdout)
    assert old.returncode == 1 and summary["ok"] is False
    assert {"check", "selftest"} <= {s["step"] for s in summary["failed"]}


def test_plan_states_each_steps_needs_against_the_gpu_machine():
    """The GPU machine's python3 (3.12) has torch, Triton, numpy, hypothesis, pytest, transformers and
    safetensors, and no vLLM and no compressed-tensors: the plan says up front which steps cannot run
    there and which depend on a module not on that list (cuda-bindings), checked before the step runs."""
    proc = _run("--plan")
    steps = {s["step"]: s for part in _plan_lines(proc.stdout, "part") for s in part["steps"]}
    assert "without compressed_tensors, vllm" in proc.stdout
    assert steps["env"]["gpu_machine"] == "runs"
    for name in ("check", "selftest", "footprint", "perf", "ops_demo", "selftest_soak", "gpu_tests"):
        assert "cuda.bindings" in steps[name]["modules"], name
        assert steps[name]["gpu_machine"].startswith("runs if python3 has cuda.bindings"), steps[name]
    assert "hypothesis" in steps["gpu_tests"]["modules"]
    assert steps["make_demo"]["gpu_machine"] == "cannot run: it has no vllm, compressed_tensors"
    assert all(steps[n]["gpu_machine"] == "cannot run: it has no vllm" for n in ("kv_accounting", "serve"))
    # Parts 6-8 need nothing the GPU machine lacks: one GPU, torch and Triton (no vLLM; part 8's VMM store
    # uses cuda-bindings where present and says so where not).
    for name in ("mxfp4_experts", "mxfp4_kernel", "mxfp4_race", "k3_moe_layer", "moe_step_graphs"):
        assert steps[name]["modules"] == ["torch", "triton"] and steps[name]["gpu_machine"] == "runs", steps[name]
        assert re.search(rf"^  {name}\s+\d+ s  \[gpu\] ", proc.stdout, re.M), name


def test_plan_shows_the_one_command_for_a_machine_with_one_gpu_and_its_total_limit():
    """--plan names one command (--one-gpu) and its total limit: the sum of its steps' limits in the script's
    ONE_GPU table, under 12 minutes and within one command's 600 s. It holds parts 6-8, the one-GPU steps of
    parts 1-2, the push layout and INT4/FP8 over CUDA VMM, and states what it cannot run (vLLM's kernels)."""
    proc = _run("--plan")
    assert proc.returncode == 0, proc.stderr
    [one] = _plan_lines(proc.stdout, "command")
    table = _one_gpu_table()
    assert one["command"] == "bash scripts/gpu_check.sh --one-gpu"
    assert [(s["step"], s["limit_s"]) for s in one["steps"]] == table
    total = sum(limit for _, limit in table)
    assert one["limit_s"] == total < 720 and total <= one["max_limit_s"] == 600, one
    assert f"one command for a machine with one GPU: {one['command']}" in proc.stdout
    assert f"total limit {total} s = the sum of its steps' limits" in proc.stdout
    for name, limit in table:
        assert re.search(rf"^  {name}\s+{limit} s ", proc.stdout, re.M), name
    steps = {s["step"]: s for s in one["steps"]}
    parts = {s["step"]: p["part"] for p in _plan_lines(proc.stdout, "part") for s in p["steps"]}
    assert {n for n, p in parts.items() if p in (6, 7, 8)} <= set(steps)         # parts 6-8 whole
    assert {"env", "check", "selftest", "push_layout", "quantized_vmm"} <= set(steps)
    assert steps["vllm_int4_fp8"]["gpu_machine"] == "cannot run: it has no vllm"
    assert steps["moe_step_graphs"]["gpu_machine"] == "runs" and steps["moe_step_graphs"]["limit_s"] > 0
    assert steps["vllm_int4_fp8"]["limit_s"] == 0   # it never runs
    # steps taken from a part keep that part's needs and modules, with a tighter limit
    for s in one["steps"]:
        if s["step"] in parts and s["step"] != "env":
            [row] = [r for p in _plan_lines(proc.stdout, "part") for r in p["steps"] if r["step"] == s["step"]]
            assert (s["needs"], s["modules"]) == (row["needs"], row["modules"]) and s["limit_s"] <= row["limit_s"]


@pytest.mark.cuda_emulated
@pytest.mark.slow
def test_the_one_command_runs_on_cpu_over_the_emulator_and_ends_in_one_json_line(tmp_path):
    """--one-gpu on an emulated one-H200 machine: env, check and selftest run and pass; every step that needs
    real hardware (the Triton kernels, the graph capture, the cuda-marked tests) or vLLM says why not; the
    last line holds every step's result, within the total limit."""
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1", "PYTHON": sys.executable,
           "OUT": str(tmp_path)}
    proc = _run("--one-gpu", env=env, timeout=300)
    summary = _last_json(proc.stdout)
    assert proc.returncode == 0 and summary["ok"] is True, (_failed_steps(summary, tmp_path), proc.stderr)
    table = _one_gpu_table()
    assert summary["command"] == "bash scripts/gpu_check.sh --one-gpu" and summary["emulated"] is True
    assert summary["limit_s"] == sum(limit for _, limit in table) and summary["wall_seconds"] <= summary["limit_s"]
    assert list(summary["results"]) == list(summary["steps"]) == [name for name, _ in table]
    assert {k for k, v in summary["steps"].items() if v == "passed"} == {"env", "check", "selftest"}
    assert set(summary["not_applicable"]) == {name for name, _ in table} - {"env", "check", "selftest"}
    for name in ("mxfp4_experts", "mxfp4_kernel", "mxfp4_race", "k3_moe_layer", "moe_step_graphs", "push_layout",
                 "quantized_vmm"):
        assert "needs a real GPU" in summary["not_applicable"][name], name
    assert "vLLM" in summary["not_applicable"]["vllm_int4_fp8"]
    for name in ("env", "check", "selftest"):
        res = summary["results"][name]
        assert res["rc"] == 0 and res["seconds"] <= res["limit_s"] == dict(table)[name], res
    assert summary["figures"]["selftest"]["leaked_fds"] == 0 and summary["figures"]["env"]["gpu"] is None


@pytest.mark.slow
def test_perf_waits_for_a_measuring_peer_past_moonep_ep_timeout_s():
    """``bench store`` (part 2) measures one rank at a time; the other waits in the store's barrier. That wait is
    bounded by the run's own deadline, not MOONEP_EP_TIMEOUT_S: with the latter at 1 s and a measurement longer
    than that, both ranks finish (before, the waiting rank's barrier timed out and both ranks ended in PeerLostError)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONEP_EP_CUDA_EMULATOR")}
    env.update(PYTHONPATH=str(ROOT / "src"))

    def bench(reps: int, timeout_s: str | None) -> dict:
        run_env = dict(env, **({"MOONEP_EP_TIMEOUT_S": timeout_s} if timeout_s else {}))
        proc = subprocess.run([sys.executable, "-m", "moonep_ep", "bench", "store", "--driver", "host", "--json",
                               "--reps", str(reps), "--deadline-s", "600"], cwd=ROOT, env=run_env,
                              capture_output=True, text=True, timeout=660)
        out = _last_json(proc.stdout)
        assert proc.returncode == 0 and out["ok"] is True, (proc.stdout, proc.stderr[-3000:])
        return out

    # Turns of about 2.5 s on any CPU (a rep costs 0.1 s with AMX and 3 s on the AVX2 path here): the reps
    # from a short calibration run at the default timeout, so the premise holds without a slow machine's run
    # outgrowing a fixed deadline.
    calibration = bench(3, None)
    reps = max(3, math.ceil(2.5 / (calibration["measure_seconds"][0] / 3)))
    out = bench(reps, "1")
    # the premise: rank 1 waited longer than MOONEP_EP_TIMEOUT_S while rank 0 measured
    assert out["measure_seconds"][0] > 1 and out["deadline_s"] == 600, (reps, out["measure_seconds"])


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
    # Part 7 (the K3 layer, checks/gpu/k3.py) answers the same way.
    proc = _run("--part", "7", env=env, timeout=120)
    summary = _last_json(proc.stdout)
    assert proc.returncode == 0 and summary["ok"] is None and summary["failed"] == [], proc.stdout[-3000:]
    assert summary["not_applicable"] == {"k3_moe_layer": "torch sees no CUDA GPU"}
    assert json.loads((tmp_path / "k3_moe_layer.out").read_text()) == {
        "check": "k3_moe_layer", "not_applicable": "torch sees no CUDA GPU", "ok": None}

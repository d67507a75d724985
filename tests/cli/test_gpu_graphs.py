"""``gpu_check.sh`` part 8 (``checks/gpu/graphs.py``): the MoE step's slot fill, wait and experts captured in a
CUDA graph. Without a GPU the part says so; its functions run on CPU with the capture-and-replay emulator in
place of ``torch.cuda.graph`` and Triton's interpreter (``tests/support/gpu_graphs_interpreted.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.vllm_envs import ROOT, run_json

pytestmark = pytest.mark.slow


def test_without_a_gpu_the_part_is_not_applicable_and_says_why():
    proc = subprocess.run([sys.executable, "-m", "checks.gpu.graphs", "--json"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["check"] == "moe_step_graphs" and out["ok"] is None
    assert "torch sees no CUDA GPU" in out["not_applicable"]


def test_the_parts_functions_replay_equal_to_eager_and_catch_both_controls_on_cpu(report):
    out = run_json("vllm", ["-m", "tests.support.gpu_graphs_interpreted", "--json"], timeout=300)
    assert out["ok"], out
    for fmt in ("bf16", "mxfp4"):
        res = out["formats"][fmt]
        for act in ("silu", "situ"):
            for size in ("1", "8"):
                case = res[act][size]
                assert case["replays_equal_eager"] == [True, True, True] and case["replays_differ"], (fmt, act, size)
                assert case["finite"]
        # the fill never joined is refused at capture's end; the table baked on the host is refused at the copy
        assert res["control_without_wait"]["refused"]
        assert "a side stream not joined" in res["control_without_wait"]["error"]
        assert res["control_baked_table"]["caught"] and "host_to_device_copy" in res["control_baked_table"]["how"]
    report(f"[gpu_check part 8 on CPU] BF16 and MXFP4, SiLU and SiTU, 1 and 8 tokens: 3 replays each equal "
           f"eager; both controls caught ({out['seconds']} s)")

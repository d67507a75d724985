"""``footprint --config`` on configs whose ``quantization_config`` compressed-tensors itself wrote.

The vLLM environment has compressed-tensors (0.17): its ``ModelCompressor``
writes each preset's ``quantization_config`` into a DeepSeek-style
config.json, exactly as a compressed checkpoint carries it; the footprint in
the main environment then reads those files. No engine starts (a few seconds).
"""

from __future__ import annotations

import json
import subprocess

from tests.support.vllm_envs import run_json

WRITE = r'''
import json, os, sys
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
root, base = sys.argv[1], json.loads(sys.argv[2])
cases = {"W4A16-g32": ("W4A16", "pack-quantized", {"group_size": 32}), "W4A16": ("W4A16", "pack-quantized", {}),
         "MXFP4A16": ("MXFP4A16", "mxfp4-pack-quantized", {}), "FP8_BLOCK": ("FP8_BLOCK", "float-quantized", {}),
         "NVFP4": ("NVFP4", "nvfp4-pack-quantized", {}),
         "W4A16_ASYM-g32": ("W4A16_ASYM", "pack-quantized", {"group_size": 32})}
for name, (preset, fmt, overrides) in cases.items():
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, value in overrides.items():
        setattr(scheme.weights, key, value)
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                              ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"])
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(base, f)
    ModelCompressor(quantization_config=qcfg).update_config(d)  # what save_pretrained writes
print(json.dumps(sorted(cases)))
'''

K2_SHAPE = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
            "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_routed_experts": 384,
            "num_experts_per_tok": 8, "num_hidden_layers": 61, "first_k_dense_replace": 1}


def _footprint(*argv: str) -> subprocess.CompletedProcess:
    """``moonep-ep footprint ... --ep 64 --json`` in this process (the main environment)."""
    import argparse
    import contextlib
    import io

    from moonep_ep.cli import footprint as cli

    parser = argparse.ArgumentParser(prog="moonep-ep")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["footprint", *argv, "--ep", "64", "--json"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = args.run(args)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def test_compressed_tensors_presets_set_the_expert_format(tmp_path):
    written = run_json("vllm", ["-c", WRITE, str(tmp_path), json.dumps(K2_SHAPE)], timeout=180)
    assert len(written) == 6
    expected = {"W4A16-g32": ("int4-g32", 24_772_608), "W4A16": ("int4-g128", 22_708_224),
                "MXFP4A16": ("mxfp4", 23_396_352), "FP8_BLOCK": ("fp8-block", 44_050_944)}
    for name, (fmt, per_expert) in expected.items():
        proc = _footprint("--config", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
        cfg = next(iter(json.loads(proc.stdout)["models"].values()))["config"]
        assert (cfg["format"], cfg["expert_bytes"], cfg["format_source"]) == (fmt, per_expert, "checkpoint"), name
        assert cfg["quantization"].startswith("compressed-tensors")
    # Schemes outside the three: refused with the scheme and the fix, sized once a format is given.
    for name, needle in (("NVFP4", "tensor_group 16"), ("W4A16_ASYM-g32", "zero points")):
        proc = _footprint("--config", str(tmp_path / name))
        assert proc.returncode == 2 and needle in proc.stderr and "Fix: pass --format" in proc.stderr, proc.stderr
        assert _footprint("--config", str(tmp_path / name), "--format", "bf16").returncode == 0

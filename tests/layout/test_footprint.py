"""``moonep-ep footprint``: model shapes, HF config parsing, per-scheme arithmetic, CLI, plot.

Expected numbers are recomputed here from the formulas (not from the code under
test) and, for page-aligned shapes, checked against the derived table in
docs/design/models.md §2.2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types

import pytest

from moonep_ep.cli import footprint as cli
from moonep_ep.errors import ConfigError
from moonep_ep.layout.footprint import (GPU_CAPACITY_GB, SCHEMES, FootprintOptions, footprint_report,
                                 scheme_bytes)
from moonep_ep.models import (DEFAULT_MODELS, MODELS, expert_bytes, get_model, load_hf_config,
                              lookup_model)

MiB = 1 << 20
GRAN = 2 * MiB


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moonep-ep")
    sub = ap.add_subparsers(dest="command")
    cli.add_parser(sub)
    return ap


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    args = _parser().parse_args(["footprint", *argv])
    rc = args.run(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _run_json(capsys, *argv: str) -> dict:
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def _row(H: int, I: int, dtype_bytes: int = 2) -> int:
    return H * I * dtype_bytes


# ----------------------------------------------------------------------------- models

def test_builtin_shapes_match_reference():
    # (H, I, E, K, L) from docs/design/models.md §1.
    expected = {
        "kimi-k3": (3584, 3072, 896, 16, 92),
        "kimi-k2": (7168, 2048, 384, 8, 60),
        "deepseek-v3": (7168, 2048, 256, 8, 58),
        "qwen3-235b-a22b": (4096, 1536, 128, 8, 94),
        "qwen3-30b-a3b": (2048, 768, 128, 8, 48),
        "glm-4.5": (5120, 1536, 160, 8, 89),
        "gpt-oss-120b": (2880, 2880, 128, 4, 36),
        "olmoe-1b-7b": (2048, 1024, 64, 8, 16),
        "mixtral-8x22b": (6144, 16384, 8, 2, 56),
        "tiny": (512, 256, 16, 4, 4),
    }
    for name, (H, I, E, K, L) in expected.items():
        m = MODELS[name]
        assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k,
                m.num_moe_layers) == (H, I, E, K, L), name
        assert m.dtype_bytes == 2
        assert m.expert_bytes == expert_bytes(m) == 3 * H * I * 2
        assert m.row_bytes == (H * I * 2,) * 3
    assert "tiny" not in DEFAULT_MODELS
    # Per-expert MB: 3*H*I*2 bytes of the §1 shapes.
    assert MODELS["kimi-k3"].expert_bytes / 1e6 == pytest.approx(66.1, abs=0.05)
    assert MODELS["kimi-k2"].expert_bytes / 1e6 == pytest.approx(88.1, abs=0.05)
    assert MODELS["kimi-k2"].routed_bytes / 1e9 == pytest.approx(2029.4, abs=0.05)


@pytest.mark.parametrize("alias,name", [
    ("Kimi_K2", "kimi-k2"), ("KIMI-K3", "kimi-k3"), ("deepseek_v3", "deepseek-v3"),
    ("DeepSeek-R1", "deepseek-v3"), ("Qwen3_30B_A3B", "qwen3-30b-a3b"),
    ("qwen3-235b", "qwen3-235b-a22b"), ("GLM_4.6", "glm-4.5"), ("gpt_oss_120b", "gpt-oss-120b"),
    ("OLMoE", "olmoe-1b-7b"), ("Mixtral_8x22B", "mixtral-8x22b"), ("TINY", "tiny"),
])
def test_aliases(alias, name):
    assert lookup_model(alias) is MODELS[name]
    assert get_model(alias) is MODELS[name]


def test_unknown_model_names_the_choices():
    with pytest.raises(ConfigError, match="kimi-k2.*config.json"):
        get_model("no-such-model")


# ----------------------------------------------------------------------------- HF config.json

def _write(tmp_path, name: str, cfg: dict) -> str:
    p = tmp_path / name
    p.mkdir()
    (p / "config.json").write_text(json.dumps(cfg))
    return str(p / "config.json")


DEEPSEEK_STYLE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}

QWEN3_STYLE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}


def test_hf_deepseek_style(tmp_path):
    path = _write(tmp_path, "dsv3", DEEPSEEK_STYLE)
    m = load_hf_config(path)
    ref = MODELS["deepseek-v3"]
    # moe_intermediate_size, not the dense intermediate_size; 61 - 3 dense = 58 MoE layers,
    # the MTP layer is outside num_hidden_layers.
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == \
        (ref.hidden_size, ref.moe_intermediate_size, ref.num_experts, ref.top_k, ref.num_moe_layers)
    assert m.native_dtype == "fp8"
    # a directory works too, and get_model falls back to paths
    assert load_hf_config(tmp_path / "dsv3") == m
    assert get_model(str(tmp_path / "dsv3")) == m


def test_hf_kimi_k3_latent_width_in_text_config(tmp_path):
    cfg = {"model_type": "kimi_k3", "text_config": {
        "hidden_size": 7168, "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072,
        "n_routed_experts": 896, "num_experts_per_tok": 16, "num_hidden_layers": 93,
        "first_k_dense_replace": 1}}
    m = load_hf_config(_write(tmp_path, "k3", cfg))
    ref = MODELS["kimi-k3"]
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == \
        (ref.hidden_size, ref.moe_intermediate_size, ref.num_experts, ref.top_k, ref.num_moe_layers)


def test_hf_qwen3_style(tmp_path):
    m = load_hf_config(_write(tmp_path, "qwen", QWEN3_STYLE))
    ref = MODELS["qwen3-30b-a3b"]
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == \
        (ref.hidden_size, ref.moe_intermediate_size, ref.num_experts, ref.top_k, ref.num_moe_layers)
    # Qwen rule: layer i is MoE iff i not in mlp_only_layers and (i+1) % decoder_sparse_step == 0.
    sparse = dict(QWEN3_STYLE, decoder_sparse_step=2, mlp_only_layers=[1, 2, 3])
    m2 = load_hf_config(_write(tmp_path, "qwen_sparse", sparse))
    assert m2.num_moe_layers == sum(1 for i in range(48) if i not in (1, 2, 3) and (i + 1) % 2 == 0)


def test_hf_mixtral_and_llama4_styles(tmp_path):
    mixtral = {"model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384,
               "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 56}
    m = load_hf_config(_write(tmp_path, "mixtral", mixtral))
    assert (m.moe_intermediate_size, m.num_experts, m.num_moe_layers) == (16384, 8, 56)
    llama4 = {"model_type": "llama4", "text_config": {
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_local_experts": 128, "num_experts_per_tok": 1, "num_hidden_layers": 48,
        "interleave_moe_layer_step": 2}}
    m = load_hf_config(_write(tmp_path, "llama4", llama4))
    assert (m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_moe_layers) == \
        (5120, 8192, 128, 1, 24)


def test_hf_missing_keys_name_the_key_and_fix(tmp_path):
    no_moe_inter = {k: v for k, v in DEEPSEEK_STYLE.items() if k != "moe_intermediate_size"}
    with pytest.raises(ConfigError, match=r"missing key moe_intermediate_size.*Fix:"):
        load_hf_config(_write(tmp_path, "a", no_moe_inter))
    no_topk = {k: v for k, v in QWEN3_STYLE.items() if k != "num_experts_per_tok"}
    with pytest.raises(ConfigError, match=r"missing key num_experts_per_tok.*Fix:"):
        load_hf_config(_write(tmp_path, "b", no_topk))
    dense = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32}
    with pytest.raises(ConfigError, match=r"n_routed_experts.*Fix:"):
        load_hf_config(_write(tmp_path, "c", dense))
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- arithmetic

def _moonep_expected(model, ep: int, B: int) -> int:
    """Data bytes of one rank under moonep_ep: own rows of every layer + B shared slot rows."""
    epn = model.num_experts // ep
    return (model.num_moe_layers * epn + B) * model.expert_bytes


def test_cli_qwen3_30b_ep4_json(capsys):
    report = _run_json(capsys, "--model", "qwen3-30b-a3b", "--ep", "4")
    entry = report["models"]["qwen3-30b-a3b"]["ep"]["4"]
    assert entry["supported"] and entry["epn"] == 32
    s = entry["schemes"]
    assert set(s) == set(SCHEMES) == {"replicated", "per_layer_slots", "eplb", "moonep_ep"}
    H, I, E, L = 2048, 768, 128, 48
    row = _row(H, I)
    assert row == 3 * MiB                      # page-aligned: no padding expected
    epn = E // 4
    expected = {
        "replicated": L * (E + 4) * 3 * row,                  # vLLM 0.33.0, B = 4 per layer
        "per_layer_slots": L * (epn + epn) * 3 * row,         # SGLang, B = epn per layer
        "eplb": L * math.ceil((E + 4) / 4) * 3 * row,         # N = R = 4 redundant
        "moonep_ep": (L * epn + epn) * 3 * row,               # one shared pool of epn slots
    }
    for scheme, want in expected.items():
        d = s[scheme]
        assert isinstance(d["bytes"], int) and d["bytes"] == want, scheme
        assert d["gb"] == pytest.approx(want / 1e9)
        assert d["bytes"] == d["expert_bytes"] + d["slot_bytes"]
        assert set(d["fits"]) == set(GPU_CAPACITY_GB)
    assert s["moonep_ep"]["padding_bytes"] == 0
    assert s["replicated"]["bytes"] > s["per_layer_slots"]["bytes"] > s["eplb"]["bytes"] \
        > s["moonep_ep"]["bytes"]
    assert entry["ratio_replicated_over_moonep_ep"] == pytest.approx(
        expected["replicated"] / expected["moonep_ep"])
    # 59.8 GB replicated + 20 GB reserve does not fit an 80 GB H100 — only just.
    assert s["replicated"]["gb"] == pytest.approx(59.79, abs=0.01)
    assert s["replicated"]["fits"]["H100"] is True
    assert s["moonep_ep"]["smallest_gpu"] == "H100"


def test_cli_kimi_k2_ep64_json(capsys):
    report = _run_json(capsys, "--model", "kimi-k2", "--ep", "64", "--format", "bf16")
    entry = report["models"]["kimi-k2"]["ep"]["64"]
    s = entry["schemes"]
    H, I, E, L, R = 7168, 2048, 384, 60, 64
    row = _row(H, I)
    assert row == 28 * MiB
    epn = E // R
    assert s["replicated"]["bytes"] == L * (E + 4) * 3 * I * H * 2 == 2_050_511_339_520
    assert s["per_layer_slots"]["bytes"] == L * 2 * epn * 3 * row
    assert s["eplb"]["bytes"] == L * (epn + 1) * 3 * row
    assert s["moonep_ep"]["bytes"] == _moonep_expected(MODELS["kimi-k2"], R, epn)
    assert s["moonep_ep"]["slot_bytes"] == epn * 3 * row
    assert s["moonep_ep"]["gb"] < 40
    assert s["replicated"]["bytes"] > s["per_layer_slots"]["bytes"] > s["moonep_ep"]["bytes"]
    assert s["eplb"]["bytes"] > s["moonep_ep"]["bytes"]       # epn (6) < L (60)
    assert not any(s["replicated"]["fits"].values())
    assert all(s["moonep_ep"]["fits"].values())
    assert s["per_layer_slots"]["fits"]["H100"] is False       # 63.4 + 20 > 80
    assert entry["ratio_replicated_over_moonep_ep"] > 60


# docs/design/models.md §2.2 (BF16, GB): (a) replicated; (c) per-layer slots, (d) shared pool,
# (e) EPLB N=R at EP8/16/32/64. Only page-aligned shapes: the table ignores padding.
REFERENCE_GB = {
    "kimi-k3": (5469.8, (1361.4, 680.7, 340.3, 170.2), (688.1, 344.0, 172.0, 86.0),
                (686.8, 346.4, 176.2, 91.2)),
    "kimi-k2": (2050.5, (507.3, 253.7, 126.8, 63.4), (257.9, 128.9, 64.5, 32.2),
                (259.0, 132.1, 68.7, 37.0)),
    "deepseek-v3": (1328.3, (327.0, 163.5, 81.7, 40.9), (166.3, 83.1, 41.6, 20.8),
                    (168.6, 86.8, 46.0, 25.5)),
    "qwen3-235b-a22b": (468.4, (113.5, 56.8, 28.4, 14.2), (57.4, 28.7, 14.3, 7.17),
                        (60.3, 31.9, 17.7, 10.6)),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_GB))
def test_matches_reference_table(name):
    repl, per_layer, shared, eplb = REFERENCE_GB[name]
    report = footprint_report([MODELS[name]], [8, 16, 32, 64], FootprintOptions(expert_format="bf16"))
    for i, ep in enumerate(("8", "16", "32", "64")):
        s = report["models"][name]["ep"][ep]["schemes"]
        tol = dict(rel=2e-3, abs=0.06)
        assert s["replicated"]["gb"] == pytest.approx(repl, **tol)
        assert s["per_layer_slots"]["gb"] == pytest.approx(per_layer[i], **tol)
        assert s["moonep_ep"]["gb"] == pytest.approx(shared[i], **tol)
        assert s["eplb"]["gb"] == pytest.approx(eplb[i], **tol)


def test_eplb_fixed_32_redundant_matches_reference_variant(capsys):
    # docs/design/models.md §2.2 variant: N = 32 at EP8 = +4 experts/rank/layer: K2 274.8, DSV3 183.9 GB.
    report = _run_json(capsys, "--model", "kimi-k2,deepseek-v3", "--ep", "8",
                       "--eplb-redundant", "32", "--format", "bf16")
    k2 = report["models"]["kimi-k2"]["ep"]["8"]["schemes"]["eplb"]
    ds = report["models"]["deepseek-v3"]["ep"]["8"]["schemes"]["eplb"]
    assert k2["experts_per_rank_per_layer"] == (384 + 32) // 8
    assert k2["gb"] == pytest.approx(274.8, abs=0.06)
    assert ds["gb"] == pytest.approx(183.9, abs=0.06)


def test_explicit_slots_and_pools_and_padding():
    tiny = MODELS["tiny"]
    row = _row(512, 256)                                      # 256 KiB: not page-sized
    opts = FootprintOptions(num_slots=3, slot_pools=2)
    d = scheme_bytes(tiny, 4, "moonep_ep", opts)
    pool = math.ceil(3 * row / GRAN) * GRAN                   # one pool per projection, page-rounded
    assert d["num_slots"] == 3
    assert d["slot_bytes"] == 2 * 3 * pool
    assert d["bytes"] == d["expert_bytes"] + d["slot_bytes"]
    # the largest rank holds at least the mean data (own rows + two pools of 3 slot rows)
    assert d["bytes"] >= (tiny.num_moe_layers * 4 + 2 * 3) * 3 * row
    assert d["padding_bytes"] > 0
    r = scheme_bytes(tiny, 4, "replicated", opts)
    assert r["bytes"] == tiny.num_moe_layers * (16 + 3) * 3 * row
    with pytest.raises(ConfigError, match="not a multiple"):
        scheme_bytes(tiny, 5, "moonep_ep")


def test_reserve_changes_fits(capsys):
    report = _run_json(capsys, "--model", "kimi-k2", "--ep", "64", "--reserve-gb", "50", "--format", "bf16")
    ours = report["models"]["kimi-k2"]["ep"]["64"]["schemes"]["moonep_ep"]
    assert ours["fits"]["H100"] is False and ours["fits"]["H200"] is True   # 32.2 + 50 > 80
    assert ours["smallest_gpu"] == "H200"
    assert report["assumptions"]["reserve_gb"] == 50


def test_unsupported_ep_is_reported_not_raised(capsys):
    report = _run_json(capsys, "--model", "glm-4.5", "--ep", "32,64")
    assert report["models"]["glm-4.5"]["ep"]["32"]["supported"] is True
    e64 = report["models"]["glm-4.5"]["ep"]["64"]
    assert e64["supported"] is False and e64["schemes"] is None
    assert "160" in e64["reason"]


# ----------------------------------------------------------------------------- CLI

def test_table_output_default_models(capsys):
    rc, out, _ = _run(capsys, "--ep", "8,64")
    assert rc == 0
    for name in DEFAULT_MODELS:
        assert f"\n{name}: " in out
    assert "\ntiny: " not in out
    for scheme in SCHEMES:
        assert scheme in out
    assert "n/a" in out                                         # mixtral at EP64


def test_cli_config_path(tmp_path, capsys):
    path = _write(tmp_path, "qwen", QWEN3_STYLE)
    report = _run_json(capsys, "--config", path, "--ep", "4")
    (name, mf), = report["models"].items()
    ours = mf["ep"]["4"]["schemes"]["moonep_ep"]["bytes"]
    assert ours == (48 * 32 + 32) * 3 * _row(2048, 768)


def test_cli_errors_exit_2(tmp_path, capsys):
    rc, out, err = _run(capsys, "--model", "nope", "--json")
    assert rc == 2 and out == "" and "unknown model" in err
    bad = _write(tmp_path, "bad", {k: v for k, v in DEEPSEEK_STYLE.items()
                                   if k != "moe_intermediate_size"})
    rc, _, err = _run(capsys, "--config", bad)
    assert rc == 2 and "moe_intermediate_size" in err
    with pytest.raises(SystemExit):
        _parser().parse_args(["footprint", "--ep", "8,x"])


def test_parser_options():
    args = _parser().parse_args(["footprint", "--model", "kimi-k2", "--model", "tiny,olmoe",
                                 "--granularity", "64KiB", "--slots", "auto",
                                 "--eplb-redundant", "32", "--measure", "--ranks", "4",
                                 "--layers", "2"])
    assert args.model == ["kimi-k2", "tiny,olmoe"]
    assert args.granularity == 64 * 1024 and args.slots is None and args.eplb_redundant == 32
    assert args.measure and args.ranks == 4 and args.layers == 2
    assert args.run is cli.run
    assert cli.parse_size("2097152") == cli.parse_size("2MiB") == cli.parse_size("2M") == GRAN


def test_measure_is_delegated(monkeypatch):
    seen = {}

    def fake_measure(args):
        seen["args"] = args
        return 7

    fake = types.ModuleType("moonep_ep.tools.commands.measure")
    fake.measure_footprint = fake_measure
    monkeypatch.setitem(sys.modules, "moonep_ep.tools.commands.measure", fake)
    args = _parser().parse_args(["footprint", "--measure", "--ranks", "2", "--layers", "3"])
    assert cli.run(args) == 7
    assert seen["args"].ranks == 2 and seen["args"].layers == 3


def test_plot_writes_png(tmp_path, capsys):
    out = tmp_path / "footprint.png"
    rc, stdout, _ = _run(capsys, "--model", "kimi-k2,qwen3-30b-a3b,mixtral-8x22b", "--plot",
                         str(out))
    assert rc == 0 and str(out) in stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_plot_has_one_panel_per_model_with_every_scheme_and_gpu_line(tmp_path):
    import matplotlib.image

    report = footprint_report([MODELS[n] for n in ("kimi-k2", "qwen3-30b-a3b")], [8, 16, 32, 64])
    drawn = cli.write_plot(report, str(tmp_path / "p.png"))
    assert [t.split(",")[0] for t in drawn["panels"]] == ["kimi-k2", "qwen3-30b-a3b"]
    assert "fp8-block" in drawn["panels"][0] and "bf16" in drawn["panels"][1]  # each figure's format
    for labels in drawn["series"]:
        assert set(cli._SCHEME_LABEL[s] for s in SCHEMES) <= set(labels)  # one bar series per scheme
        assert [g for g in GPU_CAPACITY_GB if any(lab.startswith(f"{g} HBM") for lab in labels)] == \
            list(GPU_CAPACITY_GB)
    height, width = matplotlib.image.imread(str(tmp_path / "p.png")).shape[:2]
    assert width > 600 and height > 300


def test_wired_into_moonep_ep_command():
    """The real entry point (``moonep_ep.cli.main``) runs the subcommand in a fresh process."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", "footprint", "--model",
                           "kimi-k2", "--ep", "64", "--json", "--format", "bf16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)["models"]["kimi-k2"]["ep"]["64"]["schemes"]
    assert s["moonep_ep"]["bytes"] == _moonep_expected(MODELS["kimi-k2"], 64, 6)


# ----------------------------------------------------------------------------- load peak

def test_load_peak_per_scheme_kimi_k3_ep64(capsys):
    """The issue's figure: Kimi K3 BF16 at EP64 is 86 GB final; copying in at the first layer peaked at ~2x."""
    report = _run_json(capsys, "--model", "kimi-k3", "--ep", "64", "--format", "bf16")
    s = report["models"]["kimi-k3"]["ep"]["64"]["schemes"]
    H, I, E, L, R = 3584, 3072, 896, 92, 64
    per_expert, epn = 3 * H * I * 2, E // R
    assert s["replicated"]["load_peak_bytes"] == (L * (E + 4) + E + epn) * per_expert
    assert s["per_layer_slots"]["load_peak_bytes"] == s["per_layer_slots"]["bytes"] + epn * per_expert
    assert s["eplb"]["load_peak_bytes"] == s["eplb"]["bytes"]
    ours = s["moonep_ep"]
    assert ours["load_peak_bytes"] == ours["bytes"] and ours["load_peak_gb"] == pytest.approx(86.0, abs=0.06)
    assert ours["copy_in_load_peak_bytes"] == ours["bytes"] + L * epn * per_expert
    assert ours["copy_in_load_peak_bytes"] / 1e9 == pytest.approx(171.1, abs=0.1)  # "about 172 GB transient"
    assert ours["load_peak_fits"]["H200"] is True and ours["load_peak_smallest_gpu"] == "H200"
    assert ours["copy_in_load_peak_bytes"] + 20e9 > 141e9  # the old sequence did not fit an H200
    for scheme in SCHEMES:
        assert s[scheme]["load_peak_bytes"] >= s[scheme]["bytes"] and s[scheme]["load_peak_formula"]


def test_load_peak_table_is_printed(capsys):
    rc, out, _ = _run(capsys, "--model", "kimi-k3", "--ep", "64", "--format", "bf16")
    assert rc == 0 and "load peak, GB per GPU" in out
    peak_lines = out.split("load peak, GB per GPU", 1)[1].splitlines()
    row = next(l for l in peak_lines if l.strip().startswith("64 "))
    assert row.split()[-2:] == ["86.01", "[H200]"] and "5,529.9" in row


def test_eplb_rounds_a_rank_that_holds_one_more_expert_up(capsys):
    """(E + N) % R != 0: the most-loaded rank holds ceil((E + N) / R) experts per layer, one more than the
    floor (qwen3-30b-a3b, E = 128, N = 3 at EP4: 131 / 4 -> 33 per rank, not 32)."""
    report = _run_json(capsys, "--model", "qwen3-30b-a3b", "--ep", "4", "--eplb-redundant", "3")
    eplb = report["models"]["qwen3-30b-a3b"]["ep"]["4"]["schemes"]["eplb"]
    assert eplb["experts_per_rank_per_layer"] == 33
    assert eplb["bytes"] == 48 * 33 * 3 * _row(2048, 768)


# ----------------------------------------------------------------------------- expert formats

# One expert, weights + scales, in vLLM's in-memory layout (issue 17's table; K3 latent H 3584, I 3072).
PER_EXPERT = {"kimi-k3": ("mxfp4", 16_515_072, 1_032_192), "kimi-k2": ("fp8-block", 44_040_192, 10_752),
              "kimi-k2-thinking": ("int4-g32", 22_020_096, 2_752_512)}
# docs/design/models.md §2.3 (derived, data only, GB, 3 significant digits; FP8 at ~1 B/param): shared pool.
NATIVE_REFERENCE_GB = {"kimi-k3": (182.8, 91.4, 45.7, 22.8), "kimi-k2": (128.9, 64.5, 32.2, 16.1),
                       "kimi-k2-thinking": (72.5, 36.3, 18.1, 9.07), "deepseek-v3": (83.1, 41.6, 20.8, 10.4),
                       "gpt-oss-120b": (7.83, 3.91, 1.96, 0.98)}


def test_each_model_is_sized_in_its_published_format_by_default():
    want = {"kimi-k3": "mxfp4", "kimi-k2": "fp8-block", "kimi-k2-thinking": "int4-g32",
            "deepseek-v3": "fp8-block", "gpt-oss-120b": "mxfp4", "qwen3-30b-a3b": "bf16", "glm-4.5": "bf16"}
    report = footprint_report([MODELS[n] for n in want], [8])
    for name, fmt in want.items():
        cfg = report["models"][name]["config"]
        assert (cfg["format"], cfg["format_source"]) == (fmt, "checkpoint"), name
        assert cfg["expert_bytes"] == cfg["expert_weight_bytes"] + cfg["expert_scale_bytes"]
        assert (cfg["expert_scale_bytes"] > 0) == (fmt != "bf16")
        assert report["models"][name]["ep"]["8"]["schemes"]["moonep_ep"]["format"] == fmt
    assert lookup_model("Kimi-K2-Thinking") is MODELS["kimi-k2-thinking"]
    assert lookup_model("kimi-k2.5") is MODELS["kimi-k2-thinking"]
    assert lookup_model("Kimi-K2-Instruct") is MODELS["kimi-k2"]


def test_must_show_kimi_real_formats_per_gpu_with_scales_apart(capsys):
    """``footprint --model kimi-k3,kimi-k2,kimi-k2-thinking --ep 8,16,32,64 --json``."""
    from moonep_ep.layout.footprint import rank_bytes_closed_form
    from moonep_ep.layout.formats import store_projections

    report = _run_json(capsys, "--model", "kimi-k3,kimi-k2,kimi-k2-thinking", "--ep", "8,16,32,64")
    assert "counted apart from weights" in report["assumptions"]["scales"]
    for name, (fmt, weight, scale) in PER_EXPERT.items():
        m, mf = MODELS[name], report["models"][name]
        cfg = mf["config"]
        assert (cfg["format"], cfg["expert_weight_bytes"], cfg["expert_scale_bytes"]) == (fmt, weight, scale)
        tensors = store_projections(fmt, m.hidden_size, m.moe_intermediate_size)
        for i, ep in enumerate((8, 16, 32, 64)):
            s = mf["ep"][str(ep)]["schemes"]
            ours = s["moonep_ep"]
            epn, L, E = m.num_experts // ep, m.num_moe_layers, m.num_experts
            # Scales apart from weights, in every scheme's figure.
            for d in s.values():
                assert d["bytes"] == d["weight_bytes"] + d["scale_bytes"] and d["scale_bytes"] > 0
                assert d["format"] == fmt
            assert s["replicated"]["scale_bytes"] == L * (E + 4) * scale
            # Closed form without pages: (L*epn + B)*(weights + scales); the plan is within one page per boundary.
            data = (L * epn + epn) * (weight + scale)
            assert ours["data_bytes"] == data
            assert ours["page_boundaries"] == (2 * L + 1) * len(tensors)  # start and end of each run, pool tails
            assert abs(ours["bytes"] - data) <= ours["page_boundaries"] * GRAN
            assert ours["within_one_page_per_boundary"] is True
            # ... and equals the exact closed form of the largest rank (independent of the page loop).
            closed = [rank_bytes_closed_form(num_layers=L, num_experts=E, ep_size=ep, num_slots=epn,
                                             row_bytes=[p.row_bytes for p in tensors], granularity=GRAN, rank=r,
                                             roles=[p.role for p in tensors]) for r in range(ep)]
            top = max(closed, key=lambda c: c["total_bytes"])
            assert (ours["bytes"], ours["weight_bytes"], ours["scale_bytes"]) == \
                (top["total_bytes"], top["weight_bytes"], top["scale_bytes"])
            assert data / 1e9 == pytest.approx(NATIVE_REFERENCE_GB[name][i], abs=_rounding(NATIVE_REFERENCE_GB[name][i]))
            assert set(ours["fits"]) >= {"H200", "B200", "GB200"}
    # What fits (20 GB reserve): K3 MXFP4 EP8 fits nowhere below GB300, EP16 fits an H200.
    k3 = report["models"]["kimi-k3"]["ep"]
    assert k3["8"]["schemes"]["moonep_ep"]["fits"]["GB200"] is False
    assert k3["16"]["schemes"]["moonep_ep"]["smallest_gpu"] == "H200"


def _rounding(x: float) -> float:
    """Half a unit of the reference figure's last printed digit, plus 0.1%."""
    text = repr(x)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return 0.5 * 10 ** -decimals + 1e-3 * x


@pytest.mark.parametrize("name", sorted(NATIVE_REFERENCE_GB))
def test_native_format_data_matches_the_reference_table(name):
    report = footprint_report([MODELS[name]], [8, 16, 32, 64])
    for i, ep in enumerate(("8", "16", "32", "64")):
        ours = report["models"][name]["ep"][ep]["schemes"]["moonep_ep"]
        assert ours["data_bytes"] / 1e9 == pytest.approx(NATIVE_REFERENCE_GB[name][i], abs=_rounding(NATIVE_REFERENCE_GB[name][i]))
        assert ours["within_one_page_per_boundary"]


def test_format_flag_overrides_every_model(capsys):
    report = _run_json(capsys, "--model", "kimi-k2,qwen3-30b-a3b", "--ep", "8", "--format", "mxfp4")
    k2 = report["models"]["kimi-k2"]["config"]
    assert (k2["format"], k2["format_source"], k2["expert_bytes"]) == ("mxfp4", "--format", 23_396_352)
    assert report["assumptions"]["format"] == "mxfp4"
    assert report["models"]["qwen3-30b-a3b"]["config"]["expert_scale_bytes"] == 3 * 2048 * 768 // 32
    rc, out, _ = _run(capsys, "--model", "kimi-k2", "--ep", "64", "--format", "int4-g32")
    assert rc == 0 and "format: int4-g32 = INT4 W4A16, group 32 (bf16 scales) (from --format)" in out
    assert "ours fits H200/B200/GB200" in out
    with pytest.raises(SystemExit):
        _parser().parse_args(["footprint", "--format", "nvfp4"])


K2_THINKING_QUANT = {  # the shape compressed-tensors serializes (K2-Thinking's config.json)
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                              "symmetric": True, "dynamic": False, "actorder": None,
                                              "block_structure": None, "observer": "minmax"}}}}


def _quant(group_weights: dict, fmt: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": group_weights}}}


@pytest.mark.parametrize("quant,fmt", [
    (K2_THINKING_QUANT, "int4-g32"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
     "fp8-block"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}, "mxfp4"),
    (_quant({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
             "scale_dtype": "torch.uint8"}, "mxfp4-pack-quantized"), "mxfp4"),
    (_quant({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
             "symmetric": True}, "float-quantized"), "fp8-block"),
    (_quant({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
            "pack-quantized"), "int4-g128"),
    (None, "bf16"),
])
def test_config_quantization_sets_the_format(tmp_path, capsys, quant, fmt):
    cfg = dict(DEEPSEEK_STYLE, n_routed_experts=384, num_hidden_layers=61, first_k_dense_replace=1)
    cfg.pop("quantization_config")
    if quant is not None:
        cfg["quantization_config"] = quant
    report = _run_json(capsys, "--config", _write(tmp_path, "m", cfg), "--ep", "64")
    (mf,) = report["models"].values()
    assert mf["config"]["format"] == fmt and mf["config"]["format_source"] == "checkpoint"
    from moonep_ep.layout.formats import expert_format_bytes
    assert mf["config"]["expert_bytes"] == expert_format_bytes(fmt, 7168, 2048)["total_bytes"]


@pytest.mark.parametrize("weights,needle", [
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}, "zero points"),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": "group"}, "act-order"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "not one of"),  # NVFP4
])
def test_unsupported_quantization_needs_an_explicit_format(tmp_path, capsys, weights, needle):
    cfg = dict(DEEPSEEK_STYLE, quantization_config=_quant(weights, "pack-quantized"))
    path = _write(tmp_path, "m", cfg)
    rc, out, err = _run(capsys, "--config", path, "--ep", "8", "--json")
    assert rc == 2 and out == "" and needle in err and "Fix: pass --format" in err
    report = _run_json(capsys, "--config", path, "--ep", "8", "--format", "bf16")
    assert next(iter(report["models"].values()))["config"]["format"] == "bf16"
    per_tensor = dict(DEEPSEEK_STYLE, quantization_config={"quant_method": "fp8", "activation_scheme": "static"})
    rc, _, err = _run(capsys, "--config", _write(tmp_path, "pt", per_tensor), "--ep", "8")
    assert rc == 2 and "only 128x128 block FP8" in err


@pytest.mark.parametrize("weights,native", [
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
     "compressed-tensors int4"),
    ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
     "compressed-tensors fp4"),  # MXFP4: fp4 e2m1 values, not int4
])
def test_native_dtype_of_a_compressed_tensors_checkpoint_names_int_or_float(weights, native):
    from moonep_ep.models import parse_hf_config

    cfg = dict(DEEPSEEK_STYLE, quantization_config=_quant(weights, "pack-quantized"))
    assert parse_hf_config(cfg).native_dtype == native

"""``layout.graph_buffers`` and ``moonep-ep footprint --capture-sizes``: MoonEP dispatch-buffer bytes per CUDA graph
capture size (issue 46).

Expected numbers are worked out by hand here from moonep.md §1.2 (``NvS = S*K + (tp-1)*2*epn``, push rounds up to
a multiple of ``tp``; a row is ``H`` bf16 values plus one fp32 route weight) and vLLM 0.33.0's
``MoonEPBufferPool.capacity_for``, not from the code under test.
"""

from __future__ import annotations

import argparse
import json

import pytest

from moonep_ep.cli import footprint as cli
from moonep_ep.errors import ConfigError
from moonep_ep.layout.graph_buffers import (DEFAULT_CAPTURE_SIZES, capacity_per_size, capacity_vllm,
                                            capture_size_report, capture_size_rows, receive_rows, shard_bytes)
from moonep_ep.models import get_model
from tests.support.cli import moonep_ep

K3 = get_model("kimi-k3")   # E 896, K 16, latent H 3584
K2 = get_model("kimi-k2")   # E 384, K 8, H 7168
K3_ROW = 3584 * 2 + 4       # bytes of one K3 receive row: 3584 bf16 + one fp32 route weight
K2_ROW = 7168 * 2 + 4


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    ap = argparse.ArgumentParser(prog="moonep-ep")
    cli.add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["footprint", *argv])
    rc = args.run(args)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- arithmetic

def test_model_shapes_the_table_reads():
    assert (K3.num_experts, K3.top_k, K3.hidden_size) == (896, 16, 3584)
    assert (K2.num_experts, K2.top_k, K2.hidden_size) == (384, 8, 7168)


def test_k3_ep64_rows_at_one_token():
    # epn = 896 / 64 = 14: NvS = 1*16 + 127*2*14 = 16 + 3556 at tp 128, 16 + 15*28 at tp 16.
    assert receive_rows(1, 16, 14, 128) == 3572
    assert receive_rows(1, 16, 14, 16) == 436
    assert shard_bytes(3572, 3584) == 3572 * 7172 == 25_618_384
    assert shard_bytes(436, 3584) == 3_126_992
    row = capture_size_rows(K3, 64, [1])["rows"][0]
    assert row["per_size"]["rows"] == 3572 and row["per_size"]["S"] == 1
    assert row["per_size"]["padding_fraction"] == pytest.approx(1 - 16 / 3572)
    assert row["per_size"]["padding_fraction"] > 0.99  # at tp 128 nearly every row is padding
    assert row["per_size_small_tp"]["rows"] == 436
    assert row["per_size_small_tp"]["padding_fraction"] == pytest.approx(1 - 16 / 436)
    # vLLM's pool serves one token with its S = 128 buffer: 128*16 + 3556 rows.
    assert row["vllm_pool"]["S"] == 128 and row["vllm_pool"]["rows"] == 5604
    assert row["vllm_pool"]["bytes"] == 5604 * K3_ROW
    assert row["vllm_pool"]["padding_fraction"] == pytest.approx(1 - 2048 / 5604)


def test_k2_ep8_rows():
    # epn = 384 / 8 = 48: (tp-1)*2*48 = 12192 at tp 128, 1440 at tp 16.
    rows = {r["capture_size"]: r for r in capture_size_rows(K2, 8, [1, 512])["rows"]}
    assert rows[1]["per_size"]["rows"] == 8 + 12192 == 12200
    assert rows[1]["per_size_small_tp"]["rows"] == 8 + 1440 == 1448
    assert rows[1]["per_size_small_tp"]["bytes"] == 1448 * K2_ROW == 20_764_320
    assert rows[512]["per_size"]["rows"] == rows[512]["vllm_pool"]["rows"] == 4096 + 12192 == 16288
    assert rows[512]["vllm_pool"]["bytes"] == 16288 * K2_ROW


def test_vllm_capacity_rule():
    # max_tokens_per_rank 256: the floor 128, powers of two between, the cap at 256.
    assert [capacity_vllm(n, 256) for n in (1, 100, 128, 129, 300)] == [128, 128, 128, 256, 256]
    assert capacity_vllm(256, 256) == 256
    assert capacity_vllm(200, 8192) == 256 and capacity_vllm(9000, 8192) == 8192
    assert capacity_vllm(1, 64) == 64  # a pool smaller than the floor keeps its own size


def test_per_size_capacity_is_the_next_power_of_two():
    assert [capacity_per_size(n) for n in (1, 2, 3, 8, 9, 24, 512)] == [1, 2, 4, 8, 16, 32, 512]


def test_push_rounds_up_to_a_multiple_of_the_token_padding():
    assert receive_rows(1, 16, 14, 128, "push") == 3584            # 3572 -> 28 * 128
    assert receive_rows(1, 16, 14, 16, "push") == 448              # 436 -> 28 * 16
    assert receive_rows(1, 16, 112, 16, "push") == receive_rows(1, 16, 112, 16) == 3376  # 211 * 16: unchanged
    row = capture_size_rows(K3, 64, [1], api="push")["rows"][0]
    assert row["per_size"]["rows"] == 3584 and row["per_size_small_tp"]["rows"] == 448


def test_totals_sum_the_distinct_buffers():
    entry = capture_size_rows(K3, 64, [1, 8, 64])
    t = entry["totals"]
    # vLLM: every size shares S = 128; per size: S 1, 8, 64 with 16 + 3556, 128 + 3556, 1024 + 3556 rows.
    assert t["vllm_pool"] == {"S": [128], "bytes": 5604 * K3_ROW}
    assert t["per_size"] == {"S": [1, 8, 64], "bytes": (3572 + 3684 + 4580) * K3_ROW}
    assert t["per_size_small_tp"] == {"S": [1, 8, 64], "bytes": (436 + 548 + 1444) * K3_ROW}
    assert entry["epn"] == 14


def test_unsupported_ep_and_bad_input():
    assert capture_size_rows(K3, 3, [1])["supported"] is False   # 896 % 3 != 0
    for bad in (lambda: capacity_vllm(0, 256), lambda: capacity_per_size(0),
                lambda: receive_rows(1, 16, 14, 128, "pushed"), lambda: receive_rows(1, 16, 14, 0),
                lambda: capture_size_report([K3], [64], [1], tp_small=0)):
        with pytest.raises(ConfigError, match="Fix:"):
            bad()


def test_report_says_the_figures_are_derived_and_names_the_formulas():
    report = capture_size_report([K3], [64], [1])
    assert report["figures"].startswith("derived")
    assert report["formulas"]["rows_pull"] == "NvS = S*K + (tp-1)*2*epn"
    assert report["models"]["kimi-k3"]["ep"]["64"]["rows"][0]["per_size"]["rows"] == 3572


# ----------------------------------------------------------------------------- CLI

def test_cli_prints_the_table_with_the_numbers():
    proc = moonep_ep("footprint", "--model", "kimi-k3", "--ep", "64", "--capture-sizes", "1,8,64", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "derived" in out and "NvS = S*K + (tp-1)*2*epn" in out and "NvS*H*2 + NvS*4" in out
    assert "kimi-k3 EP64: E=896 K=16 H=3584 epn=14" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("1", "8", "64") and "%" in line}
    # n, vLLM S, NvS, MB, pad | own S, NvS tp128, MB, pad | NvS tp16, MB, pad
    assert rows["1"] == ["1", "128", "5604", f"{5604 * K3_ROW / 1e6:.2f}", f"{100 * (1 - 2048 / 5604):.1f}%",
                         "1", "3572", "25.62", f"{100 * (1 - 16 / 3572):.1f}%",
                         "436", "3.13", f"{100 * (1 - 16 / 436):.1f}%"]
    assert rows["64"][5:7] == ["64", "4580"] and rows["64"][9] == "1444"
    assert f"{(3572 + 3684 + 4580) * K3_ROW:,} B" in out


def test_without_the_flag_nothing_changes(capsys):
    rc, before, _ = _run(capsys, "--model", "kimi-k3", "--ep", "64")
    assert rc == 0 and "capture size" not in before
    rc, after, _ = _run(capsys, "--model", "kimi-k3", "--ep", "64", "--capture-sizes", "1")
    assert rc == 0 and after.startswith(before.rstrip("\n")) and "capture size" in after
    assert "capture_size_buffers" not in json.loads(_run(capsys, "--model", "kimi-k3", "--ep", "64", "--json")[1])


def test_json_bare_flag_small_padding_and_both_models(capsys):
    rc, out, err = _run(capsys, "--model", "kimi-k2", "--model", "kimi-k3", "--ep", "8,64", "--capture-sizes",
                        "--token-padding-small", "8", "--json")
    assert rc == 0, err
    cap = json.loads(out)["capture_size_buffers"]
    assert cap["assumptions"]["capture_sizes"] == list(DEFAULT_CAPTURE_SIZES) == [1, 2, 4, 8, 16, 32, 64, 128,
                                                                                  256, 512]
    assert set(cap["models"]) == {"kimi-k2", "kimi-k3"} and set(cap["models"]["kimi-k2"]["ep"]) == {"8", "64"}
    k3 = cap["models"]["kimi-k3"]["ep"]["64"]["rows"][0]
    assert k3["per_size_small_tp"]["tp"] == 8 and k3["per_size_small_tp"]["rows"] == 16 + 7 * 28 == 212
    k2 = cap["models"]["kimi-k2"]["ep"]["8"]["rows"]
    assert [r["vllm_pool"]["S"] for r in k2] == [128] * 8 + [256, 512]


def test_cli_refuses_a_bad_small_padding(capsys):
    rc, _, err = _run(capsys, "--model", "kimi-k3", "--ep", "64", "--capture-sizes", "1", "--token-padding-small", "0")
    assert rc == 2 and "Fix:" in err

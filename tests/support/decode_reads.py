"""What ``vllm-demo --json`` must say of the host reads in the MoE ops at decode (issue 45).

None at all, except where the CPU engine's dequantizing experts run (``MOONEP_EP_QUANTIZED_EXPERTS=dequant``,
its default for the quantized formats): they read ``cu_seqlens`` once per layer to dequantize only the rows a
step uses, a CPU-only path no GPU runs (docs/design/decode.md §8). The counter sees reads where there are
some: ``tests/ops/test_host_syncs.py`` (the lockstep buffer) is its control.
"""

from __future__ import annotations

from typing import Any

#: ``file function`` of the one read the CPU dequantizing experts make per layer
DEQUANT_READ = ("moonep_ep/ops/experts/grouped.py:", " group_bounds")


def check_decode_reads(out: dict[str, Any], dequantizing: bool = False) -> None:
    ranks = out["decode_host_syncs_by_rank"]
    assert ranks and all(r["moe_calls"] > 0 and r["steps"] > 0 for r in ranks), ranks   # decode was counted
    if not dequantizing:
        assert out["decode_host_syncs"] == 0 and all(r["by_site"] == {} for r in ranks), ranks
        return
    assert out["decode_host_syncs"] <= 1, ranks
    sites = {site for r in ranks for site in r["by_site"]}
    assert all(site.startswith(DEQUANT_READ[0]) and site.endswith(DEQUANT_READ[1]) for site in sites), sites

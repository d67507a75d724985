"""What ``vllm-demo --json`` must say of the host reads in the MoE ops at decode (issue 45), and of the MoE
steps captured and replayed under ``--moe-graphs`` (issue 46, :func:`check_moe_graphs`).

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


def check_moe_graphs(out: dict[str, Any], reload: bool = True) -> dict[str, Any]:
    """``--moe-graphs``: every decode-sized MoE step after the first of its capacity replayed, with no host read;
    one capture per layer, rank and capacity (layers: MoE calls per decode step); with ``--reload``, the updates'
    steps replayed the same captures. Returns the ``moe_graph`` entry."""
    checks = out["runs"]["dp_sharded"]["checks"]
    assert checks["moe_steps_replayed_from_graphs"] and checks["no_host_read_in_a_replay"], checks
    graph = out["moe_graph"]
    assert graph["mode"].startswith("emulated full decode graph") and graph["replays"] > 0
    assert graph["host_syncs"] == 0 and all(r["host_syncs"] == 0 and r["replays"] > 0 for r in graph["by_rank"])
    decode = out["decode_host_syncs_by_rank"]
    layers = {r["moe_calls"] // r["steps"] for r in decode}
    assert len(layers) == 1 and all(r["moe_calls"] % r["steps"] == 0 for r in decode), decode
    assert graph["captures"] == len(decode) * layers.pop() * len(graph["capacities"]), graph
    if reload:  # the update to B and back rewrote the captured pages in place: replayed, nothing captured again
        after = graph["after_reload"]
        assert after["captures"] == graph["captures"] and after["replays"] > graph["replays"], graph
        assert after["host_syncs"] == 0 and checks["graphs_replayed_after_the_updates_without_a_new_capture"]
    return graph

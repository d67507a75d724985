"""``moonep-ep selftest``: spawn N local ranks, map a symmetric allocation, verify, tear down, count leaks."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..tools.args import add_run_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("selftest", help="map symmetric memory across N local ranks and verify it")
    p.add_argument("--ranks", type=int, default=4, help="number of local ranks (default 4)")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size per rank in MiB (default 4)")
    p.add_argument("--cycles", type=int, default=1, help="allocate/verify/teardown cycles (leak soak)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before unfinished ranks are killed (default 120 + 3 per cycle)")
    add_run_arguments(p, driver_help="host (memfd, CPU), cuda (VMM), or auto (cuda when a GPU is visible)")
    # Positive control of the leak counters (tests): leave one object behind on every rank.
    p.add_argument("--inject-leak", choices=("handle", "mapping", "context"), default=None,
                   help=argparse.SUPPRESS)
    # Negative control of the warm-up (tests): read the device-wide figure before any kernel ran.
    p.add_argument("--skip-warm-up", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _leaks_ok(r: dict[str, Any]) -> bool:
    """Every leak figure measured and zero; on a GPU (no handle list) device bytes below one page."""
    if r["leaked_driver_objects"] or r["leaked_below_library"] or r["leaked_shm_bytes"]:
        return False
    if r["leaked_fds"] is None:  # real GPU: cuMemGetInfo is the measure; page tables may move < 2 MiB
        return abs(r["leaked_device_bytes"]) < (2 << 20)
    # Emulator: cuMemGetInfo (device-wide, lazily loaded modules included) must not move either.
    return (r["leaked_fds"] == 0 and r["leaked_mappings"] == 0 and r["leaked_device_bytes"] == 0
            and r["device_wide_drift_bytes"] in (None, 0))


def run(args: argparse.Namespace) -> int:
    from ..launch import RankFailure, admit_ranks, plan_launch, run_ranks
    from ..tools.commands.selftest import selftest_rank

    if not admit_ranks(args.ranks, "moonep-ep selftest"):
        return 2
    plan = plan_launch(args.driver, args.ranks)
    driver = plan.driver
    if driver == "cuda" and not plan.emulated:
        import torch

        if not torch.cuda.is_available():
            print("moonep-ep selftest: --driver cuda needs a CUDA GPU visible to torch (or "
                  "MOONEP_EP_CUDA_EMULATOR=1 for the CPU emulator); use --driver host", file=sys.stderr)
            return 2
    def progress(msg: str) -> None:  # stderr, so --json output stays one clean object
        print(f"[selftest] {msg}", file=sys.stderr, flush=True)

    chunk = int(args.chunk_mib * (1 << 20))
    try:
        per_rank = run_ranks(selftest_rank, args.ranks, args=(driver, chunk, args.cycles, args.inject_leak,
                                                                  args.skip_warm_up),
                             backend=plan.backend, use_cuda=plan.use_cuda, rank_envs=plan.rank_envs,
                             timeout_s=args.timeout or 120.0 + 3.0 * args.cycles, progress=progress)
    except RankFailure as exc:
        summary = {"ok": False, "ranks": args.ranks, "driver": driver, "emulated": plan.emulated,
                   "errors": exc.errors}
        print(json.dumps(summary, indent=2) if args.json else str(exc))
        return 1
    errors = [e for r in per_rank for e in r["errors"]]
    firsts = [r["first_cycle"] for r in per_rank]
    rss = [r["rss_growth_bytes"] for r in per_rank if r["rss_growth_bytes"] is not None]

    def total(key: str) -> int | None:
        values = [r[key] for r in per_rank]
        return None if any(v is None for v in values) else sum(values)

    summary = {
        "ok": not errors and all(_leaks_ok(r) for r in per_rank),
        "ranks": args.ranks,
        "driver": driver,
        "emulated": all(r["emulated"] for r in per_rank),
        "backend": plan.backend,
        "handle_type": firsts[0]["handle_type"],
        "multicast": firsts[0]["multicast"],
        "cycles": args.cycles,
        "host_per_rank": [r["host"] for r in per_rank],
        "physical_bytes_per_rank": [f["physical_bytes"] for f in firsts],
        "resident_bytes_per_rank": [f["resident_bytes"] for f in firsts],
        "visible_bytes_per_rank": [f["visible_bytes"] for f in firsts],
        "map_ms_per_rank": [f["map_ms"] for f in firsts],
        "leaked_fds": total("leaked_fds"),
        "leaked_mappings": total("leaked_mappings"),
        "leaked_device_bytes": total("leaked_device_bytes"),
        "device_wide_drift_bytes_per_rank": [r["device_wide_drift_bytes"] for r in per_rank],
        "warm_up": per_rank[0]["warm_up"],
        "leak_measure": per_rank[0]["leak_measure"],
        "leaked_below_library": {r["rank"]: r["leaked_below_library"] for r in per_rank
                                 if r["leaked_below_library"]},
        "leaked_driver_objects": {r["rank"]: r["leaked_driver_objects"] for r in per_rank
                                  if r["leaked_driver_objects"]},
        "leaked_shm_bytes": sum(r["leaked_shm_bytes"] for r in per_rank),
        "system_shmem_delta_bytes": per_rank[0]["system_shmem_delta_bytes"],
        "rss_growth_bytes": max(rss) if rss else None,
        "rss_growth_note": per_rank[0]["rss_growth_note"],
        "seconds_per_rank": [r["seconds"] for r in per_rank],
        "errors": errors,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        status = "OK" if summary["ok"] else "FAILED"
        print(f"selftest {status}: {args.ranks} ranks, {driver} driver"
              f"{' (emulated)' if summary['emulated'] else ''}, {summary['handle_type']} handles, "
              f"multicast {'on' if summary['multicast']['used'] else 'off'} ({summary['multicast']['reason']})")
        for r, f in enumerate(firsts):
            print(f"  rank {r}: physical {f['physical_bytes'] / 2**20:.1f} MiB (OS), "
                  f"visible {f['visible_bytes'] / 2**20:.1f} MiB, map {f['map_ms']} ms")
        print(f"  leaked fds {summary['leaked_fds']}, leaked mappings {summary['leaked_mappings']}, "
              f"leaked device bytes {summary['leaked_device_bytes']}, leaked shared memory "
              f"{summary['leaked_shm_bytes']} B ({summary['leak_measure']})")
        print(f"  RSS growth: {summary['rss_growth_bytes']} B ({summary['rss_growth_note']})")
        for e in errors:
            print(f"  error: {e}")
    return 0 if summary["ok"] else 1

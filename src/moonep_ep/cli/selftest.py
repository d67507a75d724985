"""``moonep-ep selftest``: spawn N local ranks, map a symmetric allocation, verify, tear down, count leaks."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("selftest", help="map symmetric memory across N local ranks and verify it")
    p.add_argument("--ranks", type=int, default=4, help="number of local ranks (default 4)")
    p.add_argument("--driver", choices=("host", "cuda", "auto"), default="auto",
                   help="host (memfd, CPU), cuda (VMM), or auto (cuda when a GPU is visible)")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size per rank in MiB (default 4)")
    p.add_argument("--cycles", type=int, default=1, help="allocate/verify/teardown cycles (leak soak)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before unfinished ranks are killed (default 120 + 3 per cycle)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _resolve_driver(name: str, ranks: int) -> tuple[str, str]:
    """Driver and process-group backend. NCCL needs one GPU per rank; with fewer
    GPUs (e.g. 2 ranks on 1 GPU to test fd export/import) gloo carries the metadata."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "host"
    if name == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
        return name, "nccl"
    return name, "gloo"


def run(args: argparse.Namespace) -> int:
    from ..tools.launch import RankFailure, admit_ranks, run_ranks
    from ..tools.selftest import selftest_rank

    if not admit_ranks(args.ranks, "moonep-ep selftest"):
        return 2
    driver, backend = _resolve_driver(args.driver, args.ranks)
    if driver == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("moonep-ep selftest: --driver cuda needs a CUDA GPU visible to torch; use --driver host",
                  file=sys.stderr)
            return 2
    def progress(msg: str) -> None:  # stderr, so --json output stays one clean object
        print(f"[selftest] {msg}", file=sys.stderr, flush=True)

    chunk = int(args.chunk_mib * (1 << 20))
    try:
        per_rank = run_ranks(selftest_rank, args.ranks, args=(driver, chunk, args.cycles), backend=backend,
                             use_cuda=driver == "cuda",
                             timeout_s=args.timeout or 120.0 + 3.0 * args.cycles, progress=progress)
    except RankFailure as exc:
        summary = {"ok": False, "ranks": args.ranks, "driver": driver, "errors": exc.errors}
        print(json.dumps(summary, indent=2) if args.json else str(exc))
        return 1
    errors = [e for r in per_rank for e in r["errors"]]
    firsts = [r["first_cycle"] for r in per_rank]
    summary = {
        "ok": not errors and all(r["leaked_fds"] == 0 and r["leaked_mappings"] == 0 and
                                 not r["leaked_driver_objects"] for r in per_rank)
              and sum(r["leaked_shm_bytes"] for r in per_rank) == 0,
        "ranks": args.ranks,
        "driver": driver,
        "handle_type": firsts[0]["handle_type"],
        "multicast": firsts[0]["multicast"],
        "cycles": args.cycles,
        "physical_bytes_per_rank": [f["physical_bytes"] for f in firsts],
        "resident_bytes_per_rank": [f["resident_bytes"] for f in firsts],
        "visible_bytes_per_rank": [f["visible_bytes"] for f in firsts],
        "map_ms_per_rank": [f["map_ms"] for f in firsts],
        "leaked_fds": sum(r["leaked_fds"] for r in per_rank),
        "leaked_mappings": sum(r["leaked_mappings"] for r in per_rank),
        "leaked_driver_objects": {r["rank"]: r["leaked_driver_objects"] for r in per_rank
                                  if r["leaked_driver_objects"]},
        "leaked_shm_bytes": sum(r["leaked_shm_bytes"] for r in per_rank),
        "system_shmem_delta_bytes": per_rank[0]["system_shmem_delta_bytes"],
        "rss_growth_bytes": max(r["rss_growth_bytes"] for r in per_rank),
        "seconds_per_rank": [r["seconds"] for r in per_rank],
        "errors": errors,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        status = "OK" if summary["ok"] else "FAILED"
        print(f"selftest {status}: {args.ranks} ranks, {driver} driver, {summary['handle_type']} handles, "
              f"multicast {'on' if summary['multicast']['used'] else 'off'} ({summary['multicast']['reason']})")
        for r, f in enumerate(firsts):
            print(f"  rank {r}: physical {f['physical_bytes'] / 2**20:.1f} MiB (OS), "
                  f"visible {f['visible_bytes'] / 2**20:.1f} MiB, map {f['map_ms']} ms")
        print(f"  leaked fds {summary['leaked_fds']}, leaked mappings {summary['leaked_mappings']}, "
              f"leaked shared memory {summary['leaked_shm_bytes']} B, RSS growth over "
              f"{args.cycles} cycles {summary['rss_growth_bytes']} B")
        for e in errors:
            print(f"  error: {e}")
    return 0 if summary["ok"] else 1

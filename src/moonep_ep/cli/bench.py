"""``moonep-ep bench``: benchmarks that print measured figures, side by side in one run.

Each benchmark lives with the layer it measures and exposes
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCHMARKS = {
    "layout": ("moonep_ep.tools.bench.layout", "map a Kimi-K2-shaped sharded layout; per-rank mapping time, collective rounds"),
    "prefetch": ("moonep_ep.tools.bench.prefetch", "pull-prefetch bandwidth from remote shards vs a local copy"),
    "decode": ("moonep_ep.tools.bench.decode", "experts and bytes MoonEP's planner moves per layer at decode, "
               "per padding policy; cost-model crossover per GPU profile"),
    "store": ("moonep_ep.tools.bench.store", "the sharded store's own costs, two ranks: a slot fill through an imported "
              "mapping over a local copy, the grouped FFN over the store's views over plain tensors"),
}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (measured figures)")
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    sub.required = True
    for name, (module_name, help_text) in BENCHMARKS.items():
        bp = sub.add_parser(name, help=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a benchmark still being built must not break the CLI
            bp.set_defaults(run=lambda args, exc=exc: _missing(exc))
            continue
        module.add_arguments(bp)
        bp.set_defaults(run=module.run)


def _missing(exc: Exception) -> int:
    print(f"moonep-ep bench: this benchmark is unavailable: {exc}")
    return 2


def run(args: argparse.Namespace) -> int:  # pragma: no cover - dispatch happens via set_defaults
    return args.run(args)

"""``moonep-ep``: command-line entry point. Each subcommand lives in its own module
with ``add_parser(subparsers)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand name -> module under moonep_ep.cli; imported lazily so that
# `moonep-ep check` works even when an optional dependency of another is broken.
SUBCOMMANDS = {
    "check": "check",
    "selftest": "selftest",
    "footprint": "footprint",
    "bench": "bench",
    "demo": "demo",
    "vllm-demo": "vllm_demo",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moonep-ep",
        description="Sharded symmetric memory for MoonEP expert parallelism: checks, self-tests, "
                    "footprint and benchmarks.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in SUBCOMMANDS.values():
        module = importlib.import_module(f"moonep_ep.cli.{module_name}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

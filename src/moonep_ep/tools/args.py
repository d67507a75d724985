"""Argument blocks that several commands share, each written once.

``--driver/--granularity/--json`` (demo, selftest, footprint, bench layout, bench prefetch, bench store) and
the shape of a tiny MoE (``--hidden/--intermediate/--experts``: the engine harness, bench store, the tests'
KV accounting). Defaults and help stay each command's own.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Leave this argument out.
OMIT: Any = object()
DRIVERS = ("auto", "host", "cuda")
HOST_GRANULARITY_HELP = "host driver page size in bytes (default MOONEP_EP_HOST_GRANULARITY or 2 MiB)"


def add_run_arguments(p: argparse.ArgumentParser, *, driver_help: Any = OMIT, driver_default: str = "auto",
                      granularity_help: Any = OMIT, granularity_default: Any = None,
                      json_help: Any = "print one JSON object") -> None:
    """``--driver`` and ``--granularity`` (each only when its help is given; None: no help text), ``--json``."""
    if driver_help is not OMIT:
        p.add_argument("--driver", choices=DRIVERS, default=driver_default, help=driver_help)
    if granularity_help is not OMIT:
        p.add_argument("--granularity", type=int, default=granularity_default, help=granularity_help)
    if json_help is not OMIT:
        p.add_argument("--json", action="store_true", help=json_help)


#: Bound on a whole run of ranks that take turns measuring, and on a rank's wait while a peer measures (the
#: launcher's default run bound); not MOONEP_EP_TIMEOUT_S, which bounds waits on a peer that is only answering.
DEFAULT_DEADLINE_S = 600.0


def add_deadline_argument(p: argparse.ArgumentParser) -> None:
    """``--deadline-s``: for tools whose ranks measure one at a time while the others wait in a barrier."""
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help="bound on the whole run in seconds, and on a rank's wait while its peer measures "
                        f"(default {DEFAULT_DEADLINE_S:.0f}; not MOONEP_EP_TIMEOUT_S)")


def add_moe_shape_arguments(p: argparse.ArgumentParser, *, hidden: int, intermediate: int,
                            experts: Any = OMIT) -> None:
    """``--hidden``, ``--intermediate`` (also spelled ``--inter``) and, when a default is given, ``--experts``."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--intermediate", "--inter", type=int, default=intermediate)
    if experts is not OMIT:
        p.add_argument("--experts", type=int, default=experts)

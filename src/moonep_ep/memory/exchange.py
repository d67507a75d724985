"""Shareable-handle exchange and the capability vote.

* POSIX fds travel with ``SCM_RIGHTS`` over Unix stream sockets in one private
  directory (``mkdtemp``: mode 0700, a fresh random name per exchange, so a
  socket left by a crashed run is never reused). Each rank listens on its own
  socket; every peer connects and sends all of its fds in one round (batched
  under the kernel's 253-fds-per-message limit). The receiver checks the
  sender's ``SO_PEERCRED`` (uid and pid must belong to the group) before taking
  any fd, and receives with ``MSG_CMSG_CLOEXEC``. The caller owns every
  returned fd and closes it after import.
* FABRIC handles (64 bytes each) ride the process group's ``all_gather_object``.
* ``vote`` decides the handle type and whether to use multicast once, from
  every rank's capabilities, so all ranks take the same path (a split decision
  would deadlock the collective). ``MOONEP_EP_HANDLE_TYPE=auto|fd|fabric`` and
  ``MOONEP_EP_MULTICAST=auto|on|off`` force a choice.
"""

from __future__ import annotations

import array
import dataclasses
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Sequence

from ..errors import ConfigError
from .. import envs
from .domain import check_domain
from .driver import Capabilities, HandleType, Shareable
from .group import GroupComm

_SCM_MAX_FD = 253
_HEADER = struct.Struct("<iii")  # sender rank, fds in this batch, fds in total
_ABORT = -1  # "total" of a header that cancels the exchange
#: Name prefix of every exchange's socket directory (leak scans look for it).
SOCKET_DIR_PREFIX = "moonep-ep-fds-"


@dataclasses.dataclass(frozen=True)
class ExchangeDecision:
    """The group-wide choice every rank follows."""

    handle_type: HandleType
    multicast: bool
    reason: str
    #: Handle type every rank switches to if the first one is refused collectively
    #: (fabric → POSIX fds on one host); None when there is no fallback.
    fallback: HandleType | None = None
    #: Ranks span hosts and some cannot report their NVLink clique: a fabric trial must
    #: prove the domain before any handle moves (``domain.py``).
    verify_domain: bool = False
    #: ``MOONEP_EP_MULTICAST=on``: a multicast failure fails the allocation; with ``auto`` every
    #: rank goes on without multicast, in lockstep (``SymmetricMemory``).
    multicast_forced: bool = False


def local_vote(caps: Capabilities, hostname: str) -> dict:
    """What this rank contributes to :func:`vote`: host, capabilities, device identity and
    the raw ``MOONEP_EP_HANDLE_TYPE`` / ``MOONEP_EP_MULTICAST`` strings (parsed after the
    gather, so a bad value on one rank fails every rank at the same point)."""
    return {"host": caps.host or hostname, "clique": caps.clique, "mc_clique": caps.multicast_clique,
            "fd": caps.posix_fd, "fabric": caps.fabric, "multicast": caps.multicast,
            "device": caps.device_id or caps.device, "driver": caps.driver,
            "prefs": (envs.raw("MOONEP_EP_HANDLE_TYPE"), envs.raw("MOONEP_EP_MULTICAST"))}


def vote(peers: Sequence[dict], rank: int, *, want_multicast: bool = True) -> ExchangeDecision:
    """Choose the handle type and multicast use from every rank's :func:`local_vote`.

    Pure: every rank passes the same gathered list, so every rank decides the
    same (a split decision would deadlock the collective) and raises the same
    error. ``auto`` handle type: FABRIC when every rank supports it -- with a
    collective fall-back to POSIX fds when ranks share one host and the system
    refuses fabric (no IMEX channel) -- else POSIX fds on one host; ranks on
    several hosts need fabric. ``auto`` multicast: on iff every rank supports
    it. A forced choice that some rank cannot honour raises on every rank,
    naming the ranks and the fix.
    """
    prefs = {p["prefs"] for p in peers}
    if len(prefs) != 1:
        raise ConfigError(f"[rank {rank}] ranks disagree on MOONEP_EP_HANDLE_TYPE/MOONEP_EP_MULTICAST: "
                          f"{[p['prefs'] for p in peers]}. Fix: set the same values on every rank")
    raw_handle, raw_mc = peers[0]["prefs"]
    handle_pref = envs.VARIABLES["MOONEP_EP_HANDLE_TYPE"].parse(raw_handle)
    mc_pref = envs.VARIABLES["MOONEP_EP_MULTICAST"].parse(raw_mc)

    one_host = len({p["host"] for p in peers}) == 1
    no_fd = [r for r, p in enumerate(peers) if not p["fd"]]
    no_fabric = [r for r, p in enumerate(peers) if not p["fabric"]]
    fallback = None
    verify_domain = False
    if handle_pref == "fabric" or (handle_pref == "auto" and not one_host):
        verify_domain = check_domain(peers, rank)  # before anything else: the most specific refusal
        if no_fabric:
            why = "forced by MOONEP_EP_HANDLE_TYPE=fabric" if handle_pref == "fabric" else "ranks span several hosts"
            raise ConfigError(f"[rank {rank}] FABRIC handles needed ({why}) but rank(s) {no_fabric} lack "
                              "fabric support. Fix: run all ranks on one host with MOONEP_EP_HANDLE_TYPE=fd, "
                              "or enable IMEX channels on every node")
        handle_type, reason = HandleType.FABRIC, ("forced" if handle_pref == "fabric" else "ranks span hosts")
    elif handle_pref == "auto" and not no_fabric and not no_fd:
        # Every rank reports fabric support: try it (it also spans hosts later), and
        # fall back to POSIX fds on every rank if the system refuses it (no IMEX).
        handle_type, reason, fallback = HandleType.FABRIC, "all ranks support fabric", HandleType.POSIX_FD
    else:
        if not one_host:
            raise ConfigError(f"[rank {rank}] POSIX fds cannot cross hosts "
                              f"({sorted({p['host'] for p in peers})}). Fix: MOONEP_EP_HANDLE_TYPE=fabric "
                              "on an NVLink/IMEX domain, or keep the EP group on one host")
        if no_fd:
            raise ConfigError(f"[rank {rank}] rank(s) {no_fd} cannot export POSIX fds. "
                              "Fix: MOONEP_EP_HANDLE_TYPE=fabric on hardware that supports it")
        handle_type, reason = HandleType.POSIX_FD, ("forced" if handle_pref == "fd" else "all ranks on one host")

    no_mc = [r for r, p in enumerate(peers) if not p["multicast"]]
    # A multicast team has one member per GPU: ranks sharing a GPU cannot form one. "device" is
    # the GPU's UUID: ordinals repeat across processes (CUDA_VISIBLE_DEVICES renumbers them).
    devices = [(p["host"], p["device"]) for p in peers]
    if peers[0]["driver"] == "cuda" and len(set(devices)) != len(devices):
        no_mc = sorted(set(no_mc) | {r for r, d in enumerate(devices) if devices.count(d) > 1})
    # A team stays inside one multicast pointer clique, which may be smaller than the unicast one:
    # ranks on several hosts whose reported multicast cliques differ cannot form one team.
    mc_cliques = [p.get("mc_clique") or "" for p in peers]
    known = [c for c in mc_cliques if c]
    if not one_host and len(set(known)) > 1:
        first = mc_cliques[0] or known[0]
        no_mc = sorted(set(no_mc) | {r for r, c in enumerate(mc_cliques) if c and c != first})
    if mc_pref == "on" and no_mc:
        raise ConfigError(f"[rank {rank}] MOONEP_EP_MULTICAST=on but rank(s) {no_mc} lack multicast. "
                          "Fix: MOONEP_EP_MULTICAST=auto or off, or run on NVSwitch GPUs with Fabric Manager")
    multicast = want_multicast and mc_pref != "off" and not no_mc
    if not multicast:
        reason += "; multicast off" + (f" (rank(s) {no_mc} lack it)" if no_mc else "")
    return ExchangeDecision(handle_type, multicast, reason, fallback, verify_domain,
                            multicast_forced=mc_pref == "on")


class HandleExchanger:
    """Moves shareable handles between the ranks of a group, in one round.

    ``exchange(local, handle_type)`` takes this rank's list of shareables (fds
    or 64-byte fabric handles) and returns ``result[r]`` = rank ``r``'s list.
    For POSIX fds, ``result[self]`` holds *duplicates* of the local fds, so the
    caller can close every returned fd uniformly after import.
    """

    def __init__(self, comm: GroupComm):
        self.comm = comm
        #: Connections refused because the peer was not a group member (pid/uid).
        self.rejected: list[str] = []
        #: Socket directory of the latest fd exchange (removed when it ends).
        self.last_directory: str | None = None

    def exchange(self, local: Sequence[Shareable], handle_type: HandleType) -> list[list[Shareable]]:
        self.comm.rounds["handle_exchange"] += 1
        if handle_type == HandleType.FABRIC:
            payload = [bytes(h) for h in local]
            if any(len(h) != 64 for h in payload):
                raise ConfigError(f"[rank {self.comm.rank}] fabric handles must be 64 bytes each")
            return [list(p) for p in self.comm.all_gather_object(payload, "fabric handle exchange")]
        return self.exchange_fds([int(fd) for fd in local])

    # -- POSIX fds ---------------------------------------------------------------
    def exchange_fds(self, local_fds: Sequence[int]) -> list[list[int]]:
        comm = self.comm
        rank, world = comm.rank, comm.world_size
        with comm.step("fd exchange: directory") as made:
            if rank == 0:
                _sweep_stale_dirs()
                # Fresh random name (0700): sockets of a crashed run are never reused.
                made.share(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-"))
        directory = made.gathered[0]
        self.last_directory = directory
        received: dict[int, list[int]] = {}
        listener = None
        error: BaseException | None = None
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(directory, f"rank{rank}.sock"))
            listener.listen(world + 16)  # members, plus room for strays we reject
            listener.settimeout(comm.timeout_s)
        except OSError as exc:
            error = exc
        # Everyone listens (and reports pid/uid) before anyone connects.
        try:
            with comm.step("fd exchange: listen") as listening:
                if error is not None:
                    raise error
                listening.share((comm.pid, os.getuid()))
            pid_to_rank = {pid: r for r, (pid, _uid) in enumerate(listening.gathered)}
            uid = os.getuid()

            # Send first, then receive, in one thread: a connection, its bytes and its
            # in-flight fds wait in the receiver's kernel queue until accepted, so
            # nothing blocks (and no thread, hence no per-thread heap arena, per call).
            send_error: BaseException | None = None
            peers = [(rank + step) % world for step in range(1, world)]
            for i, peer in enumerate(peers):
                try:
                    _send_fds(os.path.join(directory, f"rank{peer}.sock"), rank, list(local_fds),
                              comm.timeout_s)
                except BaseException as exc:
                    send_error = exc
                    # Tell the peers still waiting on us, so they fail now, not at their timeout.
                    for other in peers[i:]:
                        _send_abort(os.path.join(directory, f"rank{other}.sock"), rank)
                    break
            recv_error: list[BaseException] = []
            deadline = time.monotonic() + comm.timeout_s
            answered: set[int] = set()
            while len(answered) < world - 1:
                try:
                    listener.settimeout(max(0.01, deadline - time.monotonic()))
                    conn, _ = listener.accept()
                except (TimeoutError, socket.timeout):
                    missing = sorted(set(range(world)) - answered - {rank})
                    recv_error.append(TimeoutError(f"no fds from rank(s) {missing} within "
                                                   f"{comm.timeout_s:.0f}s"))
                    break
                with conn:
                    try:
                        conn.settimeout(max(0.01, deadline - time.monotonic()))
                        sender = _check_peer(conn, pid_to_rank, uid, rank)
                    except PermissionError as exc:
                        # Not a member: take nothing from it, and keep waiting for members.
                        self.rejected.append(str(exc))
                        continue
                    answered.add(sender)
                    try:
                        received[sender] = _recv_fds(conn, sender, rank)
                    except (OSError, ConnectionError, PermissionError) as exc:
                        recv_error.append(exc)
            local_error = send_error or (recv_error[0] if recv_error else None)
            with comm.step("fd exchange"):
                if local_error is not None:
                    raise RuntimeError(f"[rank {rank}] fd exchange failed: "
                                       f"{type(local_error).__name__}: {local_error}") from local_error
            received[rank] = [os.dup(fd) for fd in local_fds]
            return [received[r] for r in range(world)]
        except BaseException:
            for fds in received.values():
                for fd in fds:
                    os.close(fd)
            raise
        finally:
            if listener is not None:
                listener.close()
            # Everyone is past its socket use once agree() returned (or raised).
            if rank == 0 and directory:
                shutil.rmtree(directory, ignore_errors=True)


def _sweep_stale_dirs() -> None:
    """Remove socket directories of ours whose creating process is gone (a crashed run)."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith(SOCKET_DIR_PREFIX):
            continue
        path = os.path.join(base, name)
        try:
            pid = int(name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0])
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(pid, 0)  # raises if no such process
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, OSError):
            continue


def _check_peer(conn: socket.socket, pid_to_rank: dict[int, int], uid: int, rank: int) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, peer_uid, _gid = struct.unpack("3i", creds)
    if peer_uid != uid or pid not in pid_to_rank:
        raise PermissionError(f"[rank {rank}] rejected a connection from pid {pid} uid {peer_uid}: "
                              "not a member of this process group")
    return pid_to_rank[pid]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection mid-message")
        data += chunk
    return data


def _recv_fds(conn: socket.socket, sender: int, rank: int) -> list[int]:
    fds: list[int] = []
    try:
        while True:
            msg, ancdata, _flags, _ = conn.recvmsg(_HEADER.size, socket.CMSG_SPACE(_SCM_MAX_FD * 4),
                                                   socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(data[: len(data) - len(data) % got.itemsize])
                    fds.extend(got)
            if not msg:
                raise ConnectionError(f"rank {sender} closed the connection before sending its fds")
            if len(msg) < _HEADER.size:
                msg += _recv_exact(conn, _HEADER.size - len(msg))
            claimed, _batch, total = _HEADER.unpack(msg)
            if claimed != sender:
                raise PermissionError(f"[rank {rank}] peer with rank {sender}'s credentials claimed rank {claimed}")
            if total == _ABORT:
                raise ConnectionAbortedError(f"rank {sender} aborted the exchange (its send failed)")
            if len(fds) >= total:
                if len(fds) != total:
                    raise ConnectionError(f"rank {sender} sent {len(fds)} fds, announced {total}")
                return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _send_fds(path: str, rank: int, fds: list[int], timeout_s: float) -> None:
    """Connect and queue every fd (batches of at most 253) with a header each; the
    receiver takes them when it accepts. Returns once the kernel holds them."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        batches = [fds[i:i + _SCM_MAX_FD] for i in range(0, len(fds), _SCM_MAX_FD)] or [[]]
        for batch in batches:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch))] if batch else []
            sock.sendmsg([_HEADER.pack(rank, len(batch), len(fds))], anc)


def _send_abort(path: str, rank: int) -> None:
    """Best effort: a peer that is gone simply times out instead."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(path)
            sock.sendall(_HEADER.pack(rank, 0, _ABORT))
    except OSError:
        pass

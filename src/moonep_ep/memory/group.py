"""Lockstep over a ``torch.distributed`` process group.

Symmetric memory is collective: if one rank fails a step while the others go
on to the next collective, the others hang. So every collective step is a
*lockstep*: each rank runs its local part, then one metadata collective
carries every rank's outcome -- ``None`` or its error message -- and, on
success, a payload. If any rank failed, *every* rank raises the same
:class:`CollectiveError` listing all failures; otherwise every rank gets every
rank's payload::

    with comm.step("compare chunk sizes") as st:
        sizes = local_sizes()          # may raise: every rank then raises
        st.share(sizes)
    everyone = st.gathered             # [rank 0's sizes, rank 1's sizes, ...]

A decision taken from ``st.gathered`` is the same on every rank (they all
see the same data), so raising from it needs no further round. The rule
"never start a collective inside a step body" keeps ranks aligned: a rank
that fails before such a call would meet its peers' collective with its own
failure report. Every collective names its step, so a peer-loss error says
where it happened. Metadata rides ``all_gather_object`` (gloo or NCCL); bulk
data never goes through the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import socket
import struct
from typing import Any, Iterator

import torch.distributed as dist

from .. import envs
from ..errors import CollectiveError, PeerLostError


def default_timeout_s() -> float:
    """``MOONEP_EP_TIMEOUT_S`` (read when used, so a rank can set it after import)."""
    return envs.MOONEP_EP_TIMEOUT_S


@dataclasses.dataclass
class Lockstep:
    """One lockstep step: what this rank shares, and afterwards what every rank shared."""

    name: str
    payload: Any = None
    #: Every rank's payload in rank order; set once the step succeeded on every rank.
    gathered: list[Any] | None = None

    def share(self, payload: Any) -> None:
        """Set the payload this rank contributes when the step ends."""
        self.payload = payload


class GroupComm:
    """Rank, size and lockstep collectives of one process group.

    ``group`` is a ``torch.distributed`` ProcessGroup (``None`` = the default
    group). ``timeout_s`` bounds every wait on a peer outside the process
    group (socket exchanges); the group's own timeout is set at init.
    """

    def __init__(self, group: Any = None, timeout_s: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moonep_ep needs an initialized torch.distributed process group "
                               "(call torch.distributed.init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.pid = os.getpid()
        self.hostname = socket.gethostname()
        #: Collective rounds issued through this object (benchmarks report them).
        self.rounds = {"metadata": 0, "handle_exchange": 0}

    def all_gather_object(self, obj: Any, step: str) -> list[Any]:
        """``all_gather_object`` over the group; a dead or silent peer becomes a
        :class:`PeerLostError` naming this rank and ``step`` (not a bare backend error)."""
        out: list[Any] = [None] * self.world_size
        self.rounds["metadata"] += 1
        with self.peer_loss_named(step):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_to_all_single(self, step: str, output: Any, input: Any, output_splits: list[int] | None = None,
                          input_splits: list[int] | None = None) -> None:
        """``all_to_all_single`` over the group (a payload exchange: dispatch and combine rows); a dead
        peer becomes a :class:`PeerLostError` naming this rank, ``step`` and the lost rank and host."""
        with self.peer_loss_named(step):
            dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)

    @contextlib.contextmanager
    def peer_loss_named(self, step: str) -> Iterator[None]:
        """A transport error inside becomes a :class:`PeerLostError` naming this rank, ``step`` and, when the
        error names a registered peer's address, the lost rank and host."""
        try:
            yield
        except TRANSPORT_ERRORS as exc:
            raise peer_lost_error(step, self.rank, self.group, exc, self.timeout_s) from exc

    def barrier(self, step: str) -> None:
        """Wait for every rank at ``step`` (one metadata round)."""
        self._gather_at(step, None)

    def device_barrier(self, step: str, device: Any) -> None:
        """Every rank at ``step`` in stream order: a one-element ``all_reduce`` on ``device`` over the group.
        NCCL: queued after the current stream's work, which then waits for it; the host does not. Gloo on the
        CPU: the host waits, a real barrier. A lost peer: :class:`PeerLostError` naming this rank and ``step``.
        Unlike :meth:`barrier` it carries no step name (that would be a host read): ranks at different steps
        are not told apart."""
        import torch

        with self.peer_loss_named(step):
            dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=device), group=self.group)

    def _gather_at(self, step: str, obj: Any) -> list[Any]:
        """One metadata round that every rank must reach at the same ``step``: a rank that meets its peers from
        another step (a faulted rank's teardown while they wait in a barrier of the work it never finished)
        fails every rank alike, instead of completing a round it was never part of."""
        gathered = self.all_gather_object((step, obj), step)
        steps = [s for s, _ in gathered]
        if any(s != step for s in steps):
            raise CollectiveError(step, {r: f"was at step {s!r}, not {step!r}: the ranks are out of step (a rank "
                                            "left the step its peers are in, e.g. after a failure of its own)"
                                         for r, s in enumerate(steps) if s != step}, rank=self.rank)
        return [o for _, o in gathered]

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Lockstep]:
        """Run a local step, then settle it on every rank (see the module docstring).

        An ``Exception`` inside the body is reported to every rank, and every
        rank raises :class:`CollectiveError` naming each failing rank's error.
        """
        state = Lockstep(name)
        try:
            yield state
        except Exception as exc:  # noqa: BLE001 - re-raised collectively by _settle
            self._settle(state, exc)
            raise  # unreachable: _settle raises when an error is given
        self._settle(state, None)

    def _settle(self, state: Lockstep, error: BaseException | None) -> None:
        message = None if error is None else f"{type(error).__name__}: {error}"
        gathered = self._gather_at(state.name, (message, None if error else state.payload))
        failures = {r: m for r, (m, _) in enumerate(gathered) if m is not None}
        if failures:
            raise CollectiveError(state.name, failures, rank=self.rank) from error
        state.gathered = [payload for _, payload in gathered]


# -- naming a lost peer ----------------------------------------------------------------------
#: Per process group (by identity): every rank's ``(host, transport address)``, registered by
#: whoever gathered them (the vLLM plugin's expert store), so that a transport error naming only
#: an address ("Read error [10.0.0.2]:9446") can name the rank and host that went away.
_PEERS: dict[int, list[tuple[str, str]]] = {}
#: What a lost peer looks like to a collective (gloo: RuntimeError naming the peer's address).
TRANSPORT_ERRORS = (RuntimeError, ConnectionError, OSError)


def register_peers(group: Any, peers: list[tuple[str, str]]) -> None:
    _PEERS[id(group)] = [(str(h), str(a)) for h, a in peers]


def peer_lost_error(step: str, rank: int | None, group: Any, exc: BaseException,
                    timeout_s: float | None = None) -> PeerLostError:
    """The :class:`PeerLostError` for a transport error ``exc`` met at ``step``: the lost rank(s) and host
    named when ``exc`` names a registered peer's address (``group`` None: any registered group's table)."""
    detail = f"{type(exc).__name__}: {exc}"
    named = lost_peers(group, detail, -1 if rank is None else rank)
    return PeerLostError(step, rank, named + detail, default_timeout_s() if timeout_s is None else timeout_s)


def lost_peers(group: Any, detail: str, rank: int) -> str:
    """``"lost rank(s) [1] on host b (10.0.0.2): "`` when ``detail`` names a registered peer's address, else ''.

    Ranks sharing that address (one host) are all named: the transport names the host, not the process.
    ``group`` None: any registered group's table (a collective of another group over the same processes)."""
    table = _PEERS.get(id(group)) if group is not None else next(iter(_PEERS.values()), None)
    addresses = set(re.findall(r"\[([0-9A-Fa-f:.]+)\]:\d+", detail))
    if not table or not addresses:
        return ""
    ranks = [r for r, (_, a) in enumerate(table) if a in addresses and r != rank]
    if not ranks:
        return ""
    hosts = sorted({f"{table[r][0]} ({table[r][1]})" for r in ranks})
    return f"lost rank(s) {ranks} on host {', '.join(hosts)}: "


def transport_address() -> str:
    """The IPv4 address this process's gloo group uses: ``GLOO_SOCKET_IFNAME``'s address, else
    ``VLLM_HOST_IP``, else what the hostname resolves to ('' if none)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""

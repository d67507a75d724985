"""Lockstep helpers over a ``torch.distributed`` process group.

Symmetric memory is collective: if one rank fails a step while the others go
on to the next collective, the others hang. Every collective step here ends
with ``agree``: each rank contributes ``None`` or its error message, and if any
rank failed, *every* rank raises the same ``CollectiveError`` listing all
failures. Metadata rides ``all_gather_object`` (gloo or NCCL); bulk data never
goes through the group.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

import torch.distributed as dist

from ..errors import CollectiveError, PeerLostError

DEFAULT_TIMEOUT_S = 60.0


def default_timeout_s() -> float:
    """``MOONEP_EP_TIMEOUT_S`` (read when used, so a rank can set it after import), else 60 s."""
    return float(os.environ.get("MOONEP_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


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

    def all_gather_object(self, obj: Any, step: str = "") -> list[Any]:
        """``all_gather_object`` over the group; a dead or silent peer becomes a
        :class:`PeerLostError` naming this rank and the step (not a bare backend error)."""
        out: list[Any] = [None] * self.world_size
        self.rounds["metadata"] += 1
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ConnectionError, OSError) as exc:
            raise PeerLostError(step or "all_gather", self.rank, f"{type(exc).__name__}: {exc}",
                                self.timeout_s) from exc
        return out

    def barrier(self, step: str = "barrier") -> None:
        self.all_gather_object(None, step)

    def agree(self, step: str, error: BaseException | str | None) -> None:
        """Collective: raise on every rank if ``error`` is set on any rank."""
        message = None if error is None else (error if isinstance(error, str) else
                                              f"{type(error).__name__}: {error}")
        gathered = self.all_gather_object(message, step)
        failures = {r: m for r, m in enumerate(gathered) if m is not None}
        if failures:
            exc = CollectiveError(step, failures, rank=self.rank)
            if isinstance(error, BaseException):
                raise exc from error
            raise exc

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a local step, then ``agree`` on its outcome (errors raised everywhere)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - re-raised collectively below
            self.agree(name, exc)
            raise  # unreachable: agree raises when an error is given
        self.agree(name, None)


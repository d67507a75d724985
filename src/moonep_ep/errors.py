"""Error types shared by every layer.

Every error that a user can cause names the rank that saw it, the offending
value and the fix, so a failure read from any rank's log is actionable.
"""

from __future__ import annotations


class MoonEPError(RuntimeError):
    """Base class of every error raised by moonep_ep."""


class ConfigError(MoonEPError, ValueError):
    """Bad input: a shape, dtype, size or option that cannot work."""


class DriverError(MoonEPError):
    """A memory-driver call failed (CUDA driver or host syscalls)."""

    def __init__(self, message: str, *, call: str = "", code: str = "", rank: int | None = None):
        super().__init__(message)
        self.call = call
        self.code = code
        self.rank = rank


class CollectiveError(MoonEPError):
    """A collective step failed on one or more ranks.

    Raised on *every* rank of the group, carrying each failing rank's message,
    so no rank is left waiting for a peer that already gave up.
    """

    def __init__(self, step: str, failures: dict[int, str], *, rank: int | None = None):
        self.step = step
        self.failures = dict(failures)
        self.rank = rank
        lines = [f"[rank {rank}] collective step '{step}' failed on rank(s) {sorted(failures)}:"]
        for r in sorted(failures):
            lines.append(f"  rank {r}: {failures[r]}")
        super().__init__("\n".join(lines))


class PeerLostError(CollectiveError):
    """A peer died or stopped answering within the configured timeout.

    Raised by every surviving rank at its next collective step; local
    resources are still released (see ``SymmetricMemory.close``).
    """

    def __init__(self, step: str, rank: int | None, detail: str, timeout_s: float):
        MoonEPError.__init__(
            self, f"[rank {rank}] lost contact with a peer during '{step}' (a rank was killed, crashed or "
                  f"stopped answering within MOONEP_EP_TIMEOUT_S={timeout_s:.0f}s): {detail}. Fix: read the "
                  "other ranks' logs for the first failure, then restart all ranks")
        self.step, self.rank, self.failures = step, rank, {-1: detail}


def config_error(rank: int | None, what: str, value: object, fix: str) -> ConfigError:
    """Build a ConfigError in the house format: who, what, which value, how to fix."""
    who = f"[rank {rank}] " if rank is not None else ""
    return ConfigError(f"{who}{what}: got {value!r}. Fix: {fix}")
